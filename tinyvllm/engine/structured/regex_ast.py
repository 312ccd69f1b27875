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


Node = ByteSet | Seq | Alt | Repeat
EMPTY = Seq(())


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
