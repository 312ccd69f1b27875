"""Chapter 11: recursion — a pushdown automaton: one automaton per grammar rule, and a stack of the rules open.

A DFA has finitely many states, so it cannot count brackets: after n "[" it must remember n, and once n is
larger than its number of states two different counts share a state, and the DFA accepts one "]" too many
or too few. A pushdown automaton (PDA) adds a stack:
  - each rule compiles to its own DFA (dfa.py) whose edges read a byte or CALL a rule (regex_ast.Call);
  - the parser's state is a stack of automaton states, bottom first: the top is where the current rule has
    got to, and each entry below is the state its rule returns to when the rule above it is done;
  - a call replaces the top by the caller's return state and pushes the called rule's start; at an
    accepting state the rule may end: pop, and go on from the return state below.
The rules' automata are deterministic, the PDA is not: in one state a byte may be read directly or by a
rule called there, and a rule at an accepting state may end or go on. So the parser keeps a SET of stacks
(every way the text so far can be read), as running an NFA keeps a set of states. For JSON and the
grammars structured outputs use it holds one or two.

All the rules' states share one numbering (DEAD = 0 for all), so a stack is a tuple of ints. Two bounds:
MAX_NESTING stack entries (each frame must leave room to finish its rule, so the bound never dead-ends a
text: at the bound, only what closes the rules open is allowed), and MAX_STACKS ways of reading a text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tinyvllm.engine.structured.dfa import DEAD, compile_dfa
from tinyvllm.engine.structured.regex_ast import CALL_BASE, Alt, ByteSet, Call, Grammar, Node, Repeat, Seq
from tinyvllm.errors import TinyVLLMError

MAX_NESTING = 128            # stack entries (rules open at once): a text nested deeper is not allowed
MAX_STACKS = 1000            # ways to read the text so far: more means a hopelessly ambiguous grammar
NEVER = 1 << 20              # the `need` of a state from which no text finishes its rule

Stack = tuple[int, ...]      # automaton states, bottom first; () means the root rule is done
Config = frozenset           # of Stacks: every way the text so far can be read (the parser's state)


@dataclass
class PDA:
    transitions: np.ndarray  # (states, 256) int32: byte moves inside a rule (DEAD: no move)
    accepting: np.ndarray    # (states,) bool: the state's rule may end here
    calls: list[list[tuple[int, int]]]   # state -> [(the called rule's start, the state to return to)]
    start: int               # the root rule's start state
    need: np.ndarray = field(init=False)   # (states,) int: stack entries above this one that finishing its rule takes

    def __post_init__(self):
        self.readable = (self.transitions != DEAD).any(axis=1).tolist()   # a byte can come next
        # returning to such a state would only return again (it accepts and has no moves): a call that would
        # come back to it does not push it at all, so a rule that calls itself last (items ::= item ("," items)?)
        # loops instead of growing the stack (a tail call)
        self.returns_only = [bool(a) and not r and not c for a, r, c in zip(self.accepting, self.readable, self.calls)]
        self.need = needs(self)

    @property
    def num_states(self) -> int:
        return len(self.accepting)


def compile_pda(grammar: Grammar) -> PDA:
    """Each rule's DFA over bytes and call symbols, renumbered into one table (after check_grammar: every rule
    matches some text, and none calls itself before reading a byte, so the parser terminates)."""
    check_grammar(grammar)
    dfas = [compile_dfa(rule, alphabet=CALL_BASE + len(grammar.rules)) for rule in grammar.rules]
    first = np.cumsum([1] + [dfa.num_states - 1 for dfa in dfas])   # rule i's state k >= 1 is first[i] + k - 1
    numbered = [np.where(dfa.transitions == DEAD, DEAD, dfa.transitions + first[i] - 1) for i, dfa in enumerate(dfas)]
    starts = [int(first[i] + dfa.start - 1) for i, dfa in enumerate(dfas)]
    transitions = np.vstack([np.zeros((1, 256), dtype=np.int32)] + [table[1:, :CALL_BASE] for table in numbered])
    accepting = np.concatenate([[False]] + [dfa.accepting[1:] for dfa in dfas])
    calls: list[list[tuple[int, int]]] = [[] for _ in accepting]
    for i, table in enumerate(numbered):
        for local, rule in zip(*np.nonzero(table[1:, CALL_BASE:])):
            calls[first[i] + local].append((starts[rule], int(table[local + 1, CALL_BASE + rule])))
    return PDA(transitions.astype(np.int32), accepting, calls, starts[0])


def needs(pda: PDA) -> np.ndarray:
    """need[s]: the fewest stack entries above s that finishing s's rule takes (0: bytes alone can). A fixed
    point: a state needs what its cheapest way on needs; a call costs the callee's frame and what it needs."""
    need = np.where(pda.accepting, 0, NEVER)
    while True:
        new = np.minimum(need, need[pda.transitions].min(axis=1))
        for state, calls in enumerate(pda.calls):
            for callee, back in calls:
                cost = need[callee] if pda.returns_only[back] else max(1 + need[callee], need[back])
                new[state] = min(new[state], cost)
        if (new == need).all():
            return np.minimum(need, NEVER)
        need = new


def check_grammar(grammar: Grammar) -> None:
    """Refuse, by name, the rules the parser could not run: one that matches no finite text (every way
    through it calls it again: the stack would grow forever), and one that can call itself before reading a
    byte (left recursion, expr ::= expr "+" term: calls would push forever, reading nothing)."""
    rules = range(len(grammar.rules))
    productive = fixed_point(lambda found: {i for i in rules if can_match(grammar.rules[i], found, empty=False)})
    for i in rules:
        if i not in productive:
            raise TinyVLLMError(f"{grammar.names[i]!r} matches no finite text: every way through it refers to it again")
    nullable = fixed_point(lambda found: {i for i in rules if can_match(grammar.rules[i], found, empty=True)})
    first = [first_calls(rule, nullable) for rule in grammar.rules]
    for i in rules:
        reached, todo = set(), list(first[i])
        while todo:
            j = todo.pop()
            if j == i:
                raise TinyVLLMError(f"{grammar.names[i]!r} is left-recursive: it can refer to itself before any byte "
                                    "is read; write the repetition with * or + instead")
            if j not in reached:
                reached.add(j)
                todo += first[j]


def fixed_point(grow) -> set[int]:
    """Grow a set from empty until it stops growing."""
    found: set[int] = set()
    while (grown := grow(found)) != found:
        found = grown
    return found


def can_match(node: Node, rules: set[int], empty: bool) -> bool:
    """Can `node` match some text (empty=False), or the empty text (empty=True), when the rules numbered in
    `rules` can?"""
    if isinstance(node, ByteSet):
        return not empty
    if isinstance(node, Call):
        return node.rule in rules
    if isinstance(node, Seq):
        return all(can_match(item, rules, empty) for item in node.items)
    if isinstance(node, Alt):
        return any(can_match(item, rules, empty) for item in node.items)
    return node.low == 0 or (can_match(node.item, rules, empty) and
                             (node.low < 2 or node.separator is None or can_match(node.separator, rules, empty)))


def first_calls(node: Node, nullable: set[int]) -> set[int]:
    """The rules `node` can call before it reads a byte."""
    if isinstance(node, ByteSet):
        return set()
    if isinstance(node, Call):
        return {node.rule}
    if isinstance(node, Alt):
        return set().union(*(first_calls(item, nullable) for item in node.items))
    items = node.items if isinstance(node, Seq) else (node.item, node.separator) if node.separator else (node.item,)
    if isinstance(node, Repeat) and node.high == 0:
        return set()
    out: set[int] = set()
    for item in items:                     # each item until one that must read a byte
        out |= first_calls(item, nullable)
        if not can_match(item, nullable, empty=True):
            break
    return out


def initial(pda: PDA) -> Config:
    """Nothing read yet: the root rule at its start."""
    return closure(pda, [(pda.start,)])


def fits(pda: PDA, stack: Stack) -> bool:
    """The top entry leaves room under MAX_NESTING to finish its rule (each entry below was checked when it
    was put there). Keeping every stack this way, any stack the parser holds can still finish."""
    return len(stack) + pda.need[stack[-1]] <= MAX_NESTING


def closure(pda: PDA, stacks) -> Config:
    """Everything the stacks can become without reading a byte: calls (push) and ends of rules (pop). Kept: the
    stacks whose top can read a byte, and () when the root rule may end."""
    out, seen, todo = set(), set(), list(stacks)
    while todo:
        stack = todo.pop()
        if stack in seen:
            continue
        seen.add(stack)
        if not stack:
            out.add(stack)
            continue
        top, below = stack[-1], stack[:-1]
        if pda.readable[top]:
            out.add(stack)
        if pda.accepting[top]:
            todo.append(below)                         # the rule is done: its caller goes on from its return state
        for callee, back in pda.calls[top]:
            caller = below if pda.returns_only[back] else below + (back,)
            if (pda.returns_only[back] or fits(pda, caller)) and fits(pda, caller + (callee,)):
                todo.append(caller + (callee,))
    if len(out) > MAX_STACKS:
        raise TinyVLLMError(f"the grammar is too ambiguous: over {MAX_STACKS} ways to read the text so far")
    return frozenset(out)


def step(pda: PDA, config: Config, byte: int) -> Config:
    """The parser's state after one more byte (empty: the byte cannot come next)."""
    moved = []
    for stack in config:
        if stack:
            following = int(pda.transitions[stack[-1], byte])
            if following != DEAD:
                moved.append(stack[:-1] + (following,))
    moved = [stack for stack in moved if fits(pda, stack)]
    return closure(pda, moved)


def walk(pda: PDA, config: Config, data: bytes) -> Config:
    for byte in data:
        config = step(pda, config, byte)
        if not config:
            break
    return config


def matches(pda: PDA, data: bytes) -> bool:
    return () in walk(pda, initial(pda), data)
