"""Chapter 5: the contiguous KV cache — every sequence owns max_len slots in a row, in every layer.

Decode produces one token per step, and its attention needs the K and V of every earlier token.
Recomputing them costs a whole prefill per token; keeping them costs memory:

    2 (K and V) x layers x kv_heads x head_dim x bytes  per token
    = 2 x 16 x 8 x 64 x 2 = 32 KiB per token for Llama 3.2 1B in bf16

Layout, per layer: (num_seqs * max_len, kv_heads, head_dim) — a flat list of token *slots*; sequence s
owns slots s * max_len .. s * max_len + max_len - 1. The kernels only ever see slot numbers, which is
what lets chapter 6 swap this layout for a paged one without touching them.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.config import LlamaConfig
from tinyvllm.errors import TinyVLLMError


class ContiguousKVCache:
    def __init__(self, cfg: LlamaConfig, ops, num_seqs: int, max_len: int):
        self.ops, self.num_seqs, self.max_len = ops, num_seqs, max_len
        shape = (cfg.num_hidden_layers, num_seqs * max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k, self.v = ops.xp.zeros(shape, ops.DTYPE), ops.xp.zeros(shape, ops.DTYPE)
        self.lengths = {seq: 0 for seq in range(num_seqs)}  # tokens cached so far, per sequence

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    attention = "decode_attention"  # the backend op that reads this layout (chapter 6's reads blocks)

    def append(self, seq: int, count: int) -> np.ndarray:
        """Room for `count` more tokens of sequence `seq`: their slots (positions lengths[seq] onwards)."""
        start = self.lengths[seq]
        if start + count > self.max_len:
            raise TinyVLLMError(f"sequence {seq} needs {start + count} tokens of KV cache but holds "
                                f"{self.max_len}; ask for fewer tokens")
        self.lengths[seq] += count
        return seq * self.max_len + np.arange(start, start + count, dtype=np.int32)

    def append_token(self, seq: int) -> int:
        """The slot of one more token of a running sequence (decode's fast path)."""
        return int(self.append(seq, 1)[0])

    def lookup(self, seqs: list[int], lengths=None) -> tuple:
        """Where each decoding sequence's keys are, uploaded once per step and read by every layer:
        row b's token t sits in slot starts[b] + t, for t < lengths[b]."""
        starts = np.asarray(seqs, dtype=np.int32) * self.max_len
        lengths = np.asarray([self.lengths[s] for s in seqs] if lengths is None else lengths, dtype=np.int32)
        return self.ops.to_device(starts), self.ops.to_device(lengths)

    def view(self, seq: int, layer: int):
        """(K, V) of one sequence in one layer: (lengths[seq], kv_heads, head_dim) each."""
        rows = slice(seq * self.max_len, seq * self.max_len + self.lengths[seq])
        return self.k[layer, rows], self.v[layer, rows]
