"""Chapter 11: a small EBNF grammar (llama.cpp's GBNF style) -> a regex tree.

    root   ::= answer ("," ws answer)*
    answer ::= "yes" | "no" | [0-9]+
    ws     ::= " "?

Rules are `name ::= body`; a body has "literals", [character classes], rule names, ( groups ), | and the
postfix * + ? {m,n}; # starts a comment. The output must match `root`. Rules are expanded in place, so a
grammar without recursion is one regex tree, and runs as a DFA. A rule that reaches itself
    value ::= "[" (value ("," value)*)? "]" | [0-9]+
nests without a bound, which no DFA can follow: there the reference becomes a Call of the rule, the rule
is compiled on its own, and the result is a Grammar of rules for the pushdown automaton (pda.py).
"""
from __future__ import annotations

import ast
import re

from tinyvllm.engine.structured.regex_ast import EMPTY, Call, Grammar, Node, Repeat, alt, literal, seq
from tinyvllm.engine.structured.regex_parser import parse_regex
from tinyvllm.errors import TinyVLLMError

TOKEN = re.compile(r'''\s+|\#[^\n]*|(?P<define>::=)|(?P<name>[A-Za-z][\w-]*)|(?P<string>"(?:[^"\\]|\\.)*")
                       |(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<op>[()|*+?])|(?P<count>\{\d+(?:,\d*)?\})''', re.VERBOSE)
POSTFIX = {"*": (0, None), "+": (1, None), "?": (0, 1)}


def grammar_tree(text: str) -> Node | Grammar:
    """The regex tree of the texts the grammar's root rule matches; a Grammar (rules[0] the root) when a rule
    is recursive."""
    if not isinstance(text, str):
        raise TinyVLLMError(f"structured_outputs.grammar must be a string, got {text!r:.60}")
    rules = split_rules(tokenize(text))
    if "root" not in rules:
        raise TinyVLLMError("the grammar has no `root ::= ...` rule; the output must match root")
    expander = Expander(rules)
    trees = [expander.rule("root")]
    if not expander.recursive:
        return trees[0]
    while len(trees) < len(expander.called):   # each rule called recursively gets its own tree; one may call more
        trees.append(expander.rule(expander.called[len(trees)]))
    return Grammar(tuple(trees), tuple(expander.called))


def tokenize(text: str) -> list[tuple[str, str]]:
    tokens, at = [], 0
    while at < len(text):
        found = TOKEN.match(text, at)
        if found is None:
            raise TinyVLLMError(f"the grammar cannot be read at {text[at:at + 20]!r}")
        if found.lastgroup:
            tokens.append((found.lastgroup, found.group()))
        at = found.end()
    return tokens


def split_rules(tokens: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """name ::= body ...: each rule's body tokens (a body ends where the next `name ::=` starts)."""
    rules: dict[str, list] = {}
    current = None
    for i, (kind, value) in enumerate(tokens):
        if kind == "name" and i + 1 < len(tokens) and tokens[i + 1][0] == "define":
            if value in rules:
                raise TinyVLLMError(f"the grammar defines the rule {value!r} twice")
            current = rules[value] = []
        elif kind == "define" or current is None:
            if kind != "define":
                raise TinyVLLMError(f"the grammar must start with a rule (`name ::= ...`), got {value!r}")
        else:
            current.append((kind, value))
    return rules


class Expander:
    """Recursive descent over a rule's tokens; rule names are expanded in place, except a rule already being
    expanded (recursion): that becomes a Call, and the rule joins `called`, Call(i) matching called[i]."""

    def __init__(self, rules: dict[str, list]):
        self.rules, self.open = rules, []
        self.tokens, self.at = [], 0
        self.called, self.recursive = ["root"], False   # rule 0 is the root

    def rule(self, name: str) -> Node:
        if name not in self.rules:
            raise TinyVLLMError(f"the grammar uses the rule {name!r} but does not define it")
        if name in self.open:
            self.recursive = True
            if name not in self.called:
                self.called.append(name)
            return Call(self.called.index(name))
        saved, self.tokens, self.at = (self.tokens, self.at), self.rules[name], 0
        self.open.append(name)
        tree = self.alternation()
        if self.at < len(self.tokens):
            raise TinyVLLMError(f"the grammar rule {name!r} has an unexpected {self.tokens[self.at][1]!r}")
        self.open.pop()
        self.tokens, self.at = saved
        return tree

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def alternation(self) -> Node:
        options = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.at += 1
            options.append(self.sequence())
        return alt(*options)

    def sequence(self) -> Node:
        items = []
        while self.peek() is not None and self.peek()[1] not in ("|", ")"):
            items.append(self.postfix())
        return seq(*items) if items else EMPTY

    def postfix(self) -> Node:
        tree = self.atom()
        while self.peek() is not None and (self.peek()[1] in POSTFIX or self.peek()[0] == "count"):
            kind, value = self.tokens[self.at]
            self.at += 1
            low, high = POSTFIX[value] if kind == "op" else counts(value)
            tree = Repeat(tree, low, high)
        return tree

    def atom(self) -> Node:
        kind, value = self.tokens[self.at]
        self.at += 1
        if kind == "name":
            return self.rule(value)
        if kind == "string":
            return literal(ast.literal_eval(value))
        if kind == "cls":
            return parse_regex(value)
        if value == "(":
            tree = self.alternation()
            if self.peek() != ("op", ")"):
                raise TinyVLLMError(f"the grammar rule {self.open[-1]!r} has a ( without its )")
            self.at += 1
            return tree
        raise TinyVLLMError(f"the grammar rule {self.open[-1]!r} has an unexpected {value!r}")


def counts(text: str) -> tuple[int, int | None]:
    """{m}, {m,} or {m,n}."""
    low, _, high = text[1:-1].partition(",")
    if "," not in text:
        return int(low), int(low)
    return int(low), int(high) if high else None
