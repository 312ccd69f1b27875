"""Chapter 11: the DFA lifted to tokens — which tokens may come next, and a sequence's place in the automaton.

A model emits tokens, not bytes. For a DFA state, the allowed tokens are those whose bytes keep the DFA
alive (vocabulary.token_states walks the vocabulary's trie from the state, one gather per depth). That
costs milliseconds, so each state's mask is computed once and cached: after that a step costs a dictionary
lookup, and the sequence's advance is a walk over one token's few bytes. The stop tokens (EOS) are allowed
only in accepting states: the output may end exactly when it is complete.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.engine.structured.dfa import DEAD, DFA
from tinyvllm.engine.structured.vocabulary import Vocabulary, token_states
from tinyvllm.errors import TinyVLLMError


class TokenDFA:
    """One compiled constraint over one vocabulary; its masks are shared by every request that uses it."""

    def __init__(self, dfa: DFA, vocab: Vocabulary):
        self.dfa, self.vocab = dfa, vocab
        self._masks: dict[int, np.ndarray] = {}                        # state -> its tokens, stop tokens aside
        self._with_stops: dict[tuple[int, frozenset[int]], np.ndarray] = {}   # accepting state, stops -> mask

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
    """One sequence's place in a constraint: advanced on every sampled token, asked for the next mask."""

    def __init__(self, token_dfa: TokenDFA, stop_ids: set[int]):
        self.token_dfa, self.stop_ids = token_dfa, frozenset(stop_ids)
        self.state = token_dfa.dfa.start

    @property
    def accepting(self) -> bool:
        return bool(self.token_dfa.dfa.accepting[self.state])

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the sampler may draw next. Never empty: a live state always continues."""
        mask = self.token_dfa.allowed(self.state, self.stop_ids)
        if not self.accepting and not self.token_dfa.token_mask(self.state).any():
            raise TinyVLLMError("no token of this vocabulary can continue the structured output here "
                                "(the constraint needs bytes that no token spells)")
        return mask

    def must_stop(self) -> bool:
        """The output is complete and no token but a stop token could follow: end it now ("stop")."""
        return self.accepting and not self.token_dfa.token_mask(self.state).any()

    def advance(self, token: int) -> None:
        """Move past a sampled token; a token the mask did not allow is a bug, and raises."""
        if token in self.stop_ids and self.accepting:
            return
        data = self.token_dfa.vocab.tokens[token] if token < self.token_dfa.vocab.size else None
        following = DEAD if data is None else self.token_dfa.dfa.walk(self.state, data)
        if following == DEAD:
            raise TinyVLLMError(f"token {token} breaks the structured output: the sampler drew a token its mask "
                                "did not allow")
        self.state = following
