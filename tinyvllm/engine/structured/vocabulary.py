"""Chapter 11: the vocabulary as a trie of byte strings, laid out level by level for NumPy.

Tokens that share a prefix share the trie's path for it: " the", " then", " there" walk " the" once.
Node 0 is the root (the empty prefix); the nodes of depth d come after those of depth d - 1, each with
its parent and its last byte. So running a DFA over every token at once is one gather per depth:
    state[level] = transitions[state[parent[level]], byte[level]]
and a token keeps the DFA alive when the state at its node is not DEAD. Special tokens have no bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Vocabulary:
    tokens: list[bytes | None]   # token id -> its bytes (None: special, or no such token)
    parent: np.ndarray           # (nodes,) int32: the node of the prefix one byte shorter
    byte: np.ndarray             # (nodes,) uint8: the last byte of the node's prefix
    levels: list[slice]          # levels[d - 1]: the nodes of depth d
    token_node: np.ndarray       # (vocab,) int32: each token's node (0 for a token without bytes)
    regular: np.ndarray          # (vocab,) bool: the token has bytes (a mask may allow it)

    @property
    def size(self) -> int:
        return len(self.tokens)


def build_vocabulary(tokens: list[bytes | None]) -> Vocabulary:
    """The trie of the tokens' byte strings (empty ones count as having none)."""
    tokens = [t or None for t in tokens]
    node_of: dict[bytes, int] = {b"": 0}
    parent, last_byte, levels = [0], [0], []
    longest_first = sorted((t for t in tokens if t), key=len, reverse=True)
    for depth in range(1, len(longest_first[0]) + 1 if longest_first else 1):
        first = len(parent)
        for token in longest_first:
            if len(token) < depth:
                break                  # sorted: every later token is shorter too
            prefix = token[:depth]
            if prefix not in node_of:
                node_of[prefix] = len(parent)
                parent.append(node_of[prefix[:-1]])
                last_byte.append(prefix[-1])
        levels.append(slice(first, len(parent)))
    token_node = np.array([node_of[t] if t else 0 for t in tokens], dtype=np.int32)
    return Vocabulary(tokens, np.array(parent, dtype=np.int32), np.array(last_byte, dtype=np.uint8), levels,
                      token_node, np.array([t is not None for t in tokens], dtype=bool))


def token_states(vocab: Vocabulary, transitions: np.ndarray, state: int, dead: int) -> np.ndarray:
    """(vocab,): the DFA's state after each token's bytes, fed from `state` (`dead` for a token without bytes)."""
    states = np.empty(len(vocab.parent), dtype=transitions.dtype)
    states[0] = state
    for level in vocab.levels:   # one gather per depth: a node's state is its parent's state moved by its byte
        states[level] = transitions[states[vocab.parent[level]], vocab.byte[level]]
    return np.where(vocab.regular, states[vocab.token_node], dead)
