"""Chapter 11: regex text -> our byte-level tree. Python's own parser reads the syntax; the tree is ours.

re._parser (sre_parse) turns a pattern into (opcode, argument) pairs; we translate each into regex_ast
nodes over UTF-8 bytes. The whole pattern must match (fullmatch): ^ and $ at its ends are accepted and
mean nothing more. \\d, \\w and \\s are the ASCII classes (as with re.ASCII, and as JSON Schema's ECMA
regexes read \\d). What a finite automaton cannot do (backreferences, lookaround) is refused by name.
"""
from __future__ import annotations

import re
import re._constants as c
import re._parser as sre

from tinyvllm.engine.structured.regex_ast import EMPTY, Node, Repeat, alt, seq
from tinyvllm.engine.structured.utf8 import characters, complement
from tinyvllm.errors import TinyVLLMError

ASCII_CLASSES = {                                  # the category codes re._parser gives \d \w \s
    c.CATEGORY_DIGIT: [(0x30, 0x39)],
    c.CATEGORY_WORD: [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    c.CATEGORY_SPACE: [(0x09, 0x0D), (0x20, 0x20)],
}
NEGATED_CLASSES = {c.CATEGORY_NOT_DIGIT: c.CATEGORY_DIGIT, c.CATEGORY_NOT_WORD: c.CATEGORY_WORD,
                   c.CATEGORY_NOT_SPACE: c.CATEGORY_SPACE}
NEWLINE = 0x0A


def parse_regex(pattern: str) -> Node:
    """The byte-level tree of a regex that the whole output must match."""
    if not isinstance(pattern, str):
        raise TinyVLLMError(f"regex must be a string, got {pattern!r:.80}")
    try:
        parsed = sre.parse(pattern)
    except re.error as e:
        raise TinyVLLMError(f"regex {pattern!r:.80} does not parse: {e}") from None
    if parsed.state.flags & (re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE):
        raise TinyVLLMError(f"regex {pattern!r:.80}: inline flags such as (?i) are not supported")
    items = list(parsed)
    items = items[1:] if items[:1] == [(c.AT, c.AT_BEGINNING)] else items   # ^ at the start: fullmatch anyway
    items = items[:-1] if items[-1:] == [(c.AT, c.AT_END)] else items
    return translate(items, pattern)


def translate(items, pattern: str) -> Node:
    return seq(*(node(op, arg, pattern) for op, arg in items)) if items else EMPTY


def node(op, arg, pattern: str) -> Node:
    if op is c.LITERAL:
        return characters([(arg, arg)])
    if op is c.NOT_LITERAL:
        return characters(complement([(arg, arg)]))
    if op is c.ANY:                                # . : any character but a newline (Python's default)
        return characters(complement([(NEWLINE, NEWLINE)]))
    if op is c.IN:
        return characters(class_ranges(arg, pattern))
    if op is c.BRANCH:
        return alt(*(translate(branch, pattern) for branch in arg[1]))
    if op is c.SUBPATTERN:                         # (...) or (?:...): grouping only; captures mean nothing here
        _, add_flags, del_flags, body = arg
        if add_flags or del_flags:
            raise TinyVLLMError(f"regex {pattern!r:.80}: inline flags such as (?i:...) are not supported")
        return translate(body, pattern)
    if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):   # greediness does not change the language
        low, high, body = arg
        return Repeat(translate(body, pattern), low, None if high is c.MAXREPEAT else high)
    if op is c.ATOMIC_GROUP:
        return translate(arg, pattern)
    raise TinyVLLMError(f"regex {pattern!r:.80}: {str(op).lower()} (anchors inside, lookaround, backreferences) "
                        "is not supported by a finite automaton")


def class_ranges(items, pattern: str) -> list[tuple[int, int]]:
    """The code point ranges of a [...] class."""
    ranges, negate = [], False
    for op, arg in items:
        if op is c.NEGATE:
            negate = True
        elif op is c.LITERAL:
            ranges.append((arg, arg))
        elif op is c.RANGE:
            ranges.append(arg)
        elif op is c.CATEGORY:
            ranges += category_ranges(arg, pattern)
        else:
            raise TinyVLLMError(f"regex {pattern!r:.80}: {op} inside [...] is not supported")
    return complement(ranges) if negate else ranges


def category_ranges(category, pattern: str) -> list[tuple[int, int]]:
    if category in ASCII_CLASSES:
        return ASCII_CLASSES[category]
    if category in NEGATED_CLASSES:
        return complement(ASCII_CLASSES[NEGATED_CLASSES[category]])
    raise TinyVLLMError(f"regex {pattern!r:.80}: the class {category} is not supported")

