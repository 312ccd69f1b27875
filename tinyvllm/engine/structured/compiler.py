"""Chapter 11: the engine's side — constraints compiled into token automata over its vocabulary, cached.

The vocabulary trie is built once per engine (the first structured request pays for it). A constraint's
automaton (a DFA; a pushdown automaton for a recursive one) is built once per distinct constraint (many
requests share a schema) and kept for the last CACHE_SIZE constraints; each keeps the token masks of the
states its requests have visited.
"""
from __future__ import annotations

from collections import OrderedDict

from tinyvllm.engine.structured.dfa import compile_dfa
from tinyvllm.engine.structured.params import StructuredOutputsParams
from tinyvllm.engine.structured.pda import compile_pda
from tinyvllm.engine.structured.regex_ast import Grammar
from tinyvllm.engine.structured.token_dfa import TokenDFA
from tinyvllm.engine.structured.token_pda import TokenPDA
from tinyvllm.engine.structured.vocabulary import Vocabulary, build_vocabulary

CACHE_SIZE = 32              # distinct constraints kept compiled (with their cached masks)


class StructuredOutputCompiler:
    def __init__(self, token_bytes, vocab_size: int):
        """token_bytes(id) -> bytes or None (special tokens); vocab_size: the model's (its logits' width)."""
        self._token_bytes, self._vocab_size = token_bytes, vocab_size
        self._vocab: Vocabulary | None = None
        self._compiled: OrderedDict[str, TokenDFA | TokenPDA] = OrderedDict()

    @property
    def vocab(self) -> Vocabulary:
        if self._vocab is None:
            self._vocab = build_vocabulary([self._token_bytes(i) for i in range(self._vocab_size)])
        return self._vocab

    def compile(self, params: StructuredOutputsParams) -> TokenDFA | TokenPDA:
        key = params.key()
        compiled = self._compiled.pop(key, None) or self.build(params)
        self._compiled[key] = compiled           # the most recently used last
        while len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def build(self, params: StructuredOutputsParams) -> TokenDFA | TokenPDA:
        """A regular constraint becomes a DFA (fast: a mask per state); only a recursive one, which params.tree()
        returns as a Grammar of rules, needs the pushdown automaton."""
        tree = params.tree()
        if isinstance(tree, Grammar):
            return TokenPDA(compile_pda(tree), self.vocab)
        return TokenDFA(compile_dfa(tree), self.vocab)
