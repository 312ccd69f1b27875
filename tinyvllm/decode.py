"""Chapter 5: one decode step — the next token of every running sequence, from its KV cache.

Each sequence contributes ONE row, so the projections are (n x hidden) x (hidden x out) with n the
number of sequences: at n = 1 a matrix-vector product that reads every weight once to do 2 FLOPs per
weight. Decode is bound by memory bandwidth, not FLOPs; the floor for a step is

    weight bytes / bandwidth  (2.5 GB / ~4.2 TB/s = 0.6 ms for Llama 3.2 1B in bf16 on an H200)

The layer is prefill's, with two changes: RoPE rotates each row at its own sequence's position, and
attention reads the new query against the cache instead of the prompt:

    residual --add_rms_norm--> normed --gemm--> qkv --rope(positions)--> qkv --store_kv--> cache
    --decode_attention(cache)--> attn_out --gemm--> delta ... (the MLP as in prefill)
"""
from __future__ import annotations

import numpy as np

from tinyvllm.model import Model
from tinyvllm.prefill import final_logits, run_layers


def decode_step(model: Model, tokens: list[int], cache, seqs: list[int]):
    """Append one token to each sequence seqs[b] (tokens[b] is its newest token, not yet cached) and
    return the next-token logits, (n, vocab) fp32 on the model's device."""
    ops, H = model.ops, model.cfg.num_attention_heads
    positions = [cache.lengths[s] for s in seqs]          # the new token's position = tokens cached so far
    slots = [cache.append_token(s) for s in seqs]         # attention below sees the new token too
    ids, positions, slots = (ops.to_device(np.asarray(a, dtype=np.int32)) for a in (tokens, positions, slots))
    where = cache.lookup(seqs)                            # where each sequence's keys are: once per step
    attention = getattr(ops, cache.attention)             # decode_attention, or paged_attention (chapter 6)

    def attend(layer: int, qkv, attn) -> None:
        attention(qkv, cache.k[layer], cache.v[layer], *where, attn, H)

    residual, delta = run_layers(model, ids, positions, slots, cache, attend)
    return final_logits(model, residual, delta, slice(0, len(tokens)))
