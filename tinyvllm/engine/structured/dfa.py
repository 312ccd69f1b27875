"""Chapter 11: subset construction — the NFA becomes a deterministic automaton (DFA), pruned and minimised.

A DFA state is the set of NFA states the input so far could have reached. Bytes that no move tells apart
share a class, so a state has one transition per class instead of per byte. Then:
  - pruning: a state from which no accepting state can be reached is DEAD (state 0, which loops on itself),
    so "alive" means "this prefix can still become a match" — what a token mask needs;
  - minimisation (Moore's partition refinement): states that accept the same suffixes merge, so there are
    fewer states to compute token masks for.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.engine.structured.nfa import NFA, build_nfa
from tinyvllm.engine.structured.regex_ast import Node
from tinyvllm.errors import TinyVLLMError

DEAD = 0                     # the state every impossible byte leads to; it never leaves
MAX_DFA_STATES = 20_000      # subset construction can blow up exponentially: refuse past this


@dataclass
class DFA:
    transitions: np.ndarray  # (states, 256) int32: the next state for each byte (and call symbol); row DEAD all DEAD
    accepting: np.ndarray    # (states,) bool
    start: int

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def walk(self, state: int, data: bytes) -> int:
        """The state after `data` (DEAD once a byte has no way to a match)."""
        for byte in data:
            state = int(self.transitions[state, byte])
        return state

    def matches(self, data: bytes) -> bool:
        return bool(self.accepting[self.walk(self.start, data)])


def compile_dfa(tree: Node, alphabet: int = 256) -> DFA:
    """Regex tree -> NFA -> DFA over byte classes -> pruned -> minimised -> DFA over bytes.
    alphabet: 256 bytes, plus one symbol per rule when the tree is a grammar rule that calls others (pda.py)."""
    nfa = build_nfa(tree)
    class_of, classes_of_move = byte_classes(nfa, alphabet)
    table, accepting = subsets(nfa, classes_of_move, int(class_of.max()) + 1)
    table, accepting, start = minimise(*prune(table, accepting))
    return DFA(np.ascontiguousarray(table[:, class_of]).astype(np.int32), accepting, start)


def byte_classes(nfa: NFA, alphabet: int = 256) -> tuple[np.ndarray, list[list[tuple[list[int], int]]]]:
    """class_of[byte]: bytes in exactly the same move sets share a class. And every move as (classes, target)."""
    sets = list({values for moves in nfa.moves for values, _ in moves})
    member = np.zeros((len(sets) + 1, alphabet), dtype=bool)   # + 1: no moves at all still gives one class
    for i, values in enumerate(sets):
        member[i, list(values)] = True
    _, class_of = np.unique(member.T, axis=0, return_inverse=True)
    class_of = class_of.reshape(-1)
    classes = {values: sorted(set(class_of[list(values)].tolist())) for values in sets}
    return class_of, [[(classes[values], target) for values, target in moves] for moves in nfa.moves]


def subsets(nfa: NFA, moves: list, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Subset construction. Row 0 is the empty set (DEAD); returns (table (states, classes), accepting)."""
    closures: dict[int, frozenset[int]] = {}
    start = closure(nfa, [nfa.start], closures)
    index = {frozenset(): DEAD, start: 1}
    order, rows = [frozenset(), start], [[DEAD] * num_classes]
    for current in growing(order, 1):
        targets: list[set[int]] = [set() for _ in range(num_classes)]
        for s in current:
            for classes, target in moves[s]:
                for k in classes:
                    targets[k].add(target)
        row = []
        for reached in targets:
            following = closure(nfa, reached, closures)
            if following not in index:
                if len(order) >= MAX_DFA_STATES:
                    raise TinyVLLMError(f"the constraint needs over {MAX_DFA_STATES} automaton states; simplify it")
                index[following] = len(order)
                order.append(following)
            row.append(index[following])
        rows.append(row)
    accepting = np.array([nfa.accept in states for states in order])
    return np.array(rows, dtype=np.int64), accepting


def growing(items: list, start: int):
    """items[start:], including what is appended while iterating (the work list of subset construction)."""
    i = start
    while i < len(items):
        yield items[i]
        i += 1


def closure(nfa: NFA, states, cache: dict[int, frozenset[int]]) -> frozenset[int]:
    """Every NFA state reachable from `states` by empty moves (each state's closure computed once)."""
    out: set[int] = set()
    for s in states:
        if s not in cache:
            seen, stack = {s}, [s]
            while stack:
                for t in nfa.epsilons[stack.pop()]:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
            cache[s] = frozenset(seen)
        out |= cache[s]
    return frozenset(out)


def prune(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mark the live states: those from which an accepting state can be reached (backwards from them)."""
    live = accepting.copy()
    while True:
        grown = live | live[table].any(axis=1)
        if (grown == live).all():
            break
        live = grown
    if not live[1]:
        raise TinyVLLMError("the constraint matches no text at all")
    return table, accepting, live


def minimise(table: np.ndarray, accepting: np.ndarray, live: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Moore's algorithm: start from {dead}, {live, not accepting}, {accepting}; split the blocks whose states
    go to different blocks on some byte class; stop when nothing splits. The dead block becomes DEAD."""
    block = np.where(accepting, 2, np.where(live, 1, 0))
    count = len(np.unique(block))
    while True:
        _, refined = np.unique(np.column_stack([block, block[table]]), axis=0, return_inverse=True)
        block, stable = refined.reshape(-1), refined.max() + 1 == count
        count = int(block.max()) + 1
        if stable:
            break
    swap = np.arange(count)
    swap[[DEAD, block[DEAD]]] = swap[[block[DEAD], DEAD]]   # the empty set's block gets number DEAD
    block = swap[block]
    representative = np.unique(block, return_index=True)[1]  # the first state of each block
    return block[table[representative]], accepting[representative], int(block[1])
