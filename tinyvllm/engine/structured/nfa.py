"""Chapter 11: Thompson's construction — a regex tree becomes a nondeterministic automaton (NFA).

Every node becomes a fragment with one entry and one exit state, glued by empty moves (epsilons):
a sequence chains its fragments, an alternation fans out and back in, a repeat loops. States are
numbers; byte moves are labelled with a set of bytes, so [a-z] is one move, not 26. A grammar rule's
Call of another rule (pda.py) is a move too, labelled with a symbol past the 256 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tinyvllm.engine.structured.regex_ast import CALL_BASE, Alt, ByteSet, Call, Node, Repeat, Seq
from tinyvllm.errors import TinyVLLMError

MAX_NFA_STATES = 200_000     # a{1000}{1000} would build a million states: refuse it instead


@dataclass
class NFA:
    epsilons: list[list[int]] = field(default_factory=list)                   # state -> states reached free
    moves: list[list[tuple[frozenset[int], int]]] = field(default_factory=list)  # state -> (bytes, next state)
    start: int = 0
    accept: int = 0

    def new_state(self) -> int:
        if len(self.moves) >= MAX_NFA_STATES:
            raise TinyVLLMError(f"the constraint is too large (over {MAX_NFA_STATES} automaton states); "
                                "use smaller repetition counts or fewer alternatives")
        self.epsilons.append([])
        self.moves.append([])
        return len(self.moves) - 1


def build_nfa(tree: Node) -> NFA:
    nfa = NFA()
    nfa.start, nfa.accept = fragment(nfa, tree)
    return nfa


def fragment(nfa: NFA, node: Node) -> tuple[int, int]:
    """Add `node`'s states to nfa; returns its (entry, exit)."""
    entry, exit_ = nfa.new_state(), nfa.new_state()
    if isinstance(node, ByteSet):
        nfa.moves[entry].append((node.values, exit_))
    elif isinstance(node, Seq):
        at = entry
        for item in node.items:
            first, last = fragment(nfa, item)
            nfa.epsilons[at].append(first)
            at = last
        nfa.epsilons[at].append(exit_)
    elif isinstance(node, Alt):
        for item in node.items:
            first, last = fragment(nfa, item)
            nfa.epsilons[entry].append(first)
            nfa.epsilons[last].append(exit_)
    elif isinstance(node, Repeat):
        repeat(nfa, node, entry, exit_)
    elif isinstance(node, Call):              # a call of another rule is one more symbol, past the bytes
        nfa.moves[entry].append((frozenset([CALL_BASE + node.rule]), exit_))
    else:
        raise TypeError(f"not a regex node: {node!r}")
    return entry, exit_


def repeat(nfa: NFA, node: Repeat, entry: int, exit_: int) -> None:
    """item{low,high}: low copies in a row, then (high - low) optional copies, or one loop if unbounded."""
    at = entry
    for i in range(node.low):
        at = then_item(nfa, node, at, separated=i > 0)
    if node.high is None:                     # a loop: every round after the first item starts with the separator
        first, last = fragment(nfa, node.item)
        round_start = first
        if node.separator is not None:
            round_start, separator_end = fragment(nfa, node.separator)
            nfa.epsilons[separator_end].append(first)
        nfa.epsilons[last] += [exit_, round_start]
        nfa.epsilons[at] += [exit_, first if node.low == 0 else round_start]
        return
    for i in range(node.low, node.high):      # each optional copy may be the last
        nfa.epsilons[at].append(exit_)
        at = then_item(nfa, node, at, separated=i > 0)
    nfa.epsilons[at].append(exit_)


def then_item(nfa: NFA, node: Repeat, at: int, separated: bool) -> int:
    """After state `at`: the separator (when separated), then the item; returns the item's exit."""
    at = then_separator(nfa, node, at) if separated else at
    first, last = fragment(nfa, node.item)
    nfa.epsilons[at].append(first)
    return last


def then_separator(nfa: NFA, node: Repeat, at: int) -> int:
    if node.separator is None:
        return at
    first, last = fragment(nfa, node.separator)
    nfa.epsilons[at].append(first)
    return last
