"""Chapter 11: the DFA lifted to tokens — which tokens may come next, and a sequence's place in the automaton.

A model emits tokens, not bytes. For a DFA state, the allowed tokens are those whose bytes keep the DFA
alive (vocabulary.token_states walks the vocabulary's trie from the state, one gather per depth). That
costs milliseconds, so each state's mask is computed once and cached: after that a step costs a dictionary
lookup, and the sequence's advance is a walk over one token's few bytes. The stop tokens (EOS) are allowed
only in accepting states: the output may end exactly when it is complete.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tinyvllm.engine.structured.dfa import DEAD, DFA
from tinyvllm.engine.structured.vocabulary import Vocabulary, token_states
from tinyvllm.errors import TinyVLLMError

if TYPE_CHECKING:
    from tinyvllm.engine.structured.token_pda import TokenPDA


class TokenDFA:
    """One compiled constraint over one vocabulary; its masks are shared by every request that uses it."""

    def __init__(self, dfa: DFA, vocab: Vocabulary):
        self.dfa, self.vocab = dfa, vocab
        self._masks: dict[int, np.ndarray] = {}                        # state -> its tokens, stop tokens aside
        self._continues: dict[int, bool] = {}                          # state -> whether any token continues it
        self._with_stops: dict[tuple[int, frozenset[int]], np.ndarray] = {}   # accepting state, stops -> mask

    @property
    def start(self) -> int:
        return self.dfa.start

    @property
    def num_states(self) -> int:
        return self.dfa.num_states

    def accepts(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])

    def after(self, state: int, data: bytes) -> int | None:
        """The state after `data`; None when the bytes leave the language."""
        following = self.dfa.walk(state, data)
        return None if following == DEAD else following

    def continues(self, state: int) -> bool:
        """Whether some token continues from `state` (asked every step: kept, not re-counted over the vocabulary)."""
        if state not in self._continues:
            self._continues[state] = bool(self.token_mask(state).any())
        return self._continues[state]

    def token_mask(self, state: int) -> np.ndarray:
        """(vocab,) bool: the tokens whose bytes keep the DFA alive from `state` (computed once per state)."""
        mask = self._masks.get(state)
        if mask is None:
            mask = self._masks[state] = token_states(self.vocab, self.dfa.transitions, state, DEAD) != DEAD
        return mask

    def allowed(self, state: int, stop_ids: frozenset[int]) -> np.ndarray:
        """The tokens that may come next: those of token_mask, and the stop tokens where the DFA accepts."""
        if not self.dfa.accepting[state]:
            return self.token_mask(state)
        key = (state, stop_ids)
        if key not in self._with_stops:
            mask = self.token_mask(state).copy()
            mask[[i for i in stop_ids if i < len(mask)]] = True
            self._with_stops[key] = mask
        return self._with_stops[key]


class Matcher:
    """One sequence's place in a constraint: advanced on every sampled token, asked for the next mask. The
    constraint is a TokenDFA (its state: a DFA state) or a TokenPDA (token_pda.py; its state: a set of stacks)."""

    def __init__(self, constraint: TokenDFA | TokenPDA, stop_ids: set[int]):
        self.constraint, self.stop_ids = constraint, frozenset(stop_ids)
        self.state = constraint.start

    @property
    def accepting(self) -> bool:
        return self.constraint.accepts(self.state)

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the sampler may draw next. Never empty: a live state always continues."""
        mask = self.constraint.allowed(self.state, self.stop_ids)
        if not self.accepting and not self.constraint.continues(self.state):
            raise TinyVLLMError("no token of this vocabulary can continue the structured output here "
                                "(the constraint needs bytes that no token spells)")
        return mask

    def must_stop(self) -> bool:
        """The output is complete and no token but a stop token could follow: end it now ("stop")."""
        return self.accepting and not self.constraint.continues(self.state)

    def advance(self, token: int) -> None:
        """Move past a sampled token; a token the mask did not allow is a bug, and raises."""
        if token in self.stop_ids and self.accepting:
            return
        data = self.constraint.vocab.tokens[token] if token < self.constraint.vocab.size else None
        following = None if data is None else self.constraint.after(self.state, data)
        if following is None:
            raise TinyVLLMError(f"token {token} breaks the structured output: the sampler drew a token its mask "
                                "did not allow")
        self.state = following
