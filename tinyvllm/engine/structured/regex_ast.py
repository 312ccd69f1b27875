"""Chapter 11: the little language every constraint compiles to — regular expressions over BYTES.

A regex, a JSON schema, a list of choices: each becomes a tree of four node kinds, and one compiler
(nfa.py, then dfa.py) turns any tree into an automaton. Working on UTF-8 bytes, not characters, is what
lets a token that holds half a character (byte-level BPE has many) be judged like any other token.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ByteSet:
    """One byte out of `values`."""
    values: frozenset[int]


@dataclass(frozen=True)
class Seq:
    """Each item in turn (no items: the empty string)."""
    items: tuple


@dataclass(frozen=True)
class Alt:
    """Any one of the items."""
    items: tuple


@dataclass(frozen=True)
class Repeat:
    """item, from low to high times (high None: no limit), with `separator` between two items (JSON's
    commas: one copy of the item in the automaton, where `item (, item)*` would build two)."""
    item: object
    low: int
    high: int | None
    separator: object = None


@dataclass(frozen=True)
class Call:
    """A text that rule number `rule` of a Grammar matches: how a rule refers to a recursive rule (pda.py).
    On an automaton's edge it is the symbol CALL_BASE + rule, after the 256 bytes."""
    rule: int


@dataclass(frozen=True)
class Grammar:
    """Rules that call each other, for a constraint that is recursive (it nests without a bound): rules[0] is
    the root, Call(i) in any rule matches rules[i]. names[i] says which rule it is, for error messages."""
    rules: tuple
    names: tuple


Node = ByteSet | Seq | Alt | Repeat | Call
EMPTY = Seq(())
CALL_BASE = 256              # edge symbols 0..255 are bytes; CALL_BASE + i calls rule i


def literal(text: str | bytes) -> Node:
    """Exactly these bytes (a str is taken as its UTF-8)."""
    data = text.encode() if isinstance(text, str) else text
    return Seq(tuple(ByteSet(frozenset([b])) for b in data))


def byte_range(low: int, high: int) -> ByteSet:
    return ByteSet(frozenset(range(low, high + 1)))


def seq(*items: Node) -> Node:
    return items[0] if len(items) == 1 else Seq(items)


def alt(*items: Node) -> Node:
    return items[0] if len(items) == 1 else Alt(items)


def optional(item: Node) -> Node:
    return Repeat(item, 0, 1)
