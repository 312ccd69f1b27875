"""Chapter 11: the pushdown automaton lifted to tokens — masks that depend on the stack, cached where they do not.

A token is allowed when its bytes, fed to the PDA (pda.step) from the parser's state, leave some stack alive.
Walking 49,152 tokens through a set of stacks in Python at every step would cost far more than a model step,
so a mask is put together from two parts, per stack of the parser's state (XGrammar's split):
  - context-independent tokens: those that stay inside the top rule — they never end it and never call
    another rule before their last byte. For them only the top state matters (and the room left under
    MAX_NESTING, which `need` answers), and their walk is token_states' vectorised walk over the trie with
    the rule's byte table. Computed once per top state, cached.
  - context-dependent tokens: those that may leave the top rule before their last byte — at a junction (a
    state where the rule may end, or may call another rule), a byte that the caller or the callee could
    read. Which of them are allowed depends on the stack, so they are walked byte by byte through the PDA.
    There are few: tokens such as "}," or "[{" that cross the edge of a rule.
Most steps have one stack, far from the bound, whose top has no context-dependent token (inside a string,
say): the mask is the top state's, as cached. Other masks are cached per parser state (MASKS_KEPT of them,
least recently used out): nested JSON comes back to the same stacks again and again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tinyvllm.engine.structured.dfa import DEAD
from tinyvllm.engine.structured.pda import MAX_NESTING, PDA, Config, Stack, closure, initial, walk
from tinyvllm.engine.structured.vocabulary import Vocabulary, token_states

MASKS_KEPT = 256             # parser states whose masks stay cached, per constraint (48 KB each for 49k tokens)


@dataclass
class Top:
    """What a stack's top state alone says about the tokens (computed once per state)."""
    mask: np.ndarray         # (vocab,) bool: the context-independent tokens allowed where there is room to spare
    deepest: int             # the most stack entries one of them needs above this one (0: none)
    crossing: np.ndarray     # the context-dependent tokens, walked through the whole stack


class TokenPDA:
    """One compiled recursive constraint over one vocabulary; its masks are shared by every request using it.
    The same interface as TokenDFA, with a parser state (a set of stacks) for a DFA state."""

    def __init__(self, pda: PDA, vocab: Vocabulary):
        self.pda, self.vocab = pda, vocab
        self.start = initial(pda)
        self._table, self._entry, self._crossing = junction_table(pda)
        self._need = np.minimum(np.append(pda.need, MAX_NESTING + 1), MAX_NESTING + 1)   # + the crossing state
        self._tops: dict[int, Top] = {}
        self._masks: OrderedDict[Config, np.ndarray] = OrderedDict()

    @property
    def num_states(self) -> int:
        return self.pda.num_states

    def accepts(self, config: Config) -> bool:
        return () in config

    def after(self, config: Config, data: bytes) -> Config | None:
        """The parser's state after `data`; None when no stack survives it."""
        return walk(self.pda, config, data) or None

    def ends(self, state: int) -> np.ndarray:
        """(vocab,): where each token's vectorised walk from `state` ends: a state of the top rule, DEAD, or
        CROSSING (context-dependent). need[end] is the room the token needs (DEAD's need is NEVER)."""
        return token_states(self.vocab, self._table, int(self._entry[state]), DEAD)

    def top(self, state: int) -> Top:
        if state not in self._tops:
            ends = self.ends(state)
            rooms = self._need[ends]
            mask = rooms <= MAX_NESTING
            self._tops[state] = Top(mask, int(rooms[mask].max(initial=0)), np.flatnonzero(ends == self._crossing))
        return self._tops[state]

    def token_mask(self, config: Config) -> np.ndarray:
        """(vocab,) bool: the tokens that leave some stack alive. Most steps have one stack, far from the bound,
        with no context-dependent token: its top's mask, as it is. Otherwise cached per parser state."""
        if len(config) == 1:
            stack = next(iter(config))
            top = self.top(stack[-1]) if stack else None
            if top is not None and not len(top.crossing) and len(stack) + top.deepest <= MAX_NESTING:
                return top.mask
        mask = self._masks.get(config)
        if mask is None:
            mask = self._masks[config] = np.zeros(self.vocab.size, dtype=bool)
            for stack in config:
                if stack:
                    self.add_tokens(mask, stack)
            if len(self._masks) > MASKS_KEPT:
                self._masks.popitem(last=False)
        self._masks.move_to_end(config)
        return mask

    def add_tokens(self, mask: np.ndarray, stack: Stack) -> None:
        """Allow the tokens that keep this one stack alive: the top state's context-independent ones that fit
        in the room left, and the context-dependent ones that the walk through the whole stack lets through."""
        top = self.top(stack[-1])
        if len(stack) + top.deepest <= MAX_NESTING:
            mask |= top.mask
        else:                                     # near the bound: which tokens still fit (rare, not cached)
            mask |= self._need[self.ends(stack[-1])] <= MAX_NESTING - len(stack)
        for token in top.crossing:
            if not mask[token] and walk(self.pda, frozenset([stack]), self.vocab.tokens[token]):
                mask[token] = True

    def continues(self, config: Config) -> bool:
        """Whether some token leaves a stack alive (its mask is cached, so this is one pass over it)."""
        return bool(self.token_mask(config).any())

    def allowed(self, config: Config, stop_ids: frozenset[int]) -> np.ndarray:
        """token_mask, and the stop tokens when the root rule may end here."""
        if not self.accepts(config):
            return self.token_mask(config)
        mask = self.token_mask(config).copy()
        mask[[i for i in stop_ids if i < len(mask)]] = True
        return mask


def junction_table(pda: PDA) -> tuple[np.ndarray, np.ndarray, int]:
    """The byte table of the vectorised walk. At a junction (a state that may end its rule or call another), a
    byte that something besides the rule's own moves could read (risky_bytes) goes to one extra state,
    CROSSING, which keeps it: a token found there is context-dependent. A walk may start at a junction, with
    the rule's own moves only (the parser's state holds the calls and returns as stacks of their own), so each
    junction also gets an entry row. Returns (table, entry row of each state, CROSSING)."""
    junctions = np.flatnonzero(pda.accepting | np.array([bool(c) for c in pda.calls]))
    crossing = pda.num_states
    inside = pda.transitions.copy()
    for j in junctions:
        inside[j] = np.where(risky_bytes(pda, j), crossing, pda.transitions[j])
    entry = np.arange(pda.num_states)
    entry[junctions] = crossing + 1 + np.arange(len(junctions))
    table = np.vstack([inside, np.full((1, 256), crossing), pda.transitions[junctions]]).astype(np.int32)
    return table, entry, crossing


def risky_bytes(pda: PDA, state: int) -> np.ndarray:
    """(256,) bool: the bytes that, at `state`, a rule it calls may read, and every byte where its rule may end
    (what follows is up to the caller, below on the stack)."""
    risky = np.full(256, bool(pda.accepting[state]))
    for callee, _ in pda.calls[state]:
        entered = closure(pda, [(callee,)])
        if () in entered:                  # the callee may match nothing: the bytes after the call could come
            return np.ones(256, dtype=bool)
        for stack in entered:
            risky |= pda.transitions[stack[-1]] != DEAD
    return risky
