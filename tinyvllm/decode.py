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


def decode_step(model: Model, tokens: list[int], cache, seqs: list[int]):
    """Append one token to each sequence seqs[b] (tokens[b] is its newest token, not yet cached) and
    return the next-token logits, (n, vocab) fp32 on the model's device."""
    cfg, ops, n = model.cfg, model.ops, len(tokens)
    b = {name: buf[:n] for name, buf in model.buffers.items()}
    residual, normed, qkv, attn, delta = b["residual"], b["normed"], b["qkv"], b["attn_out"], b["delta"]
    H, eps = cfg.num_attention_heads, cfg.rms_norm_eps

    positions = [cache.lengths[s] for s in seqs]          # the new token's position = tokens cached so far
    slots = np.concatenate([cache.append(s, 1) for s in seqs])  # attention below sees the new token too
    ids, positions, slots = (ops.to_device(np.asarray(a, dtype=np.int32)) for a in (tokens, positions, slots))
    where = cache.lookup(seqs)                            # where each sequence's keys are: once per step
    attention = getattr(ops, cache.attention)             # decode_attention, or paged_attention (chapter 6)

    ops.embedding(ids, model.embed, residual)
    pending = None
    for i, layer in enumerate(model.layers):
        ops.add_rms_norm(residual, pending, layer.input_norm, normed, eps)
        ops.gemm(normed, layer.qkv, qkv)
        ops.rope(qkv, positions, model.cos, model.sin, H + cfg.num_key_value_heads, cfg.head_dim)
        ops.store_kv(qkv, cache.k[i], cache.v[i], slots, H)
        attention(qkv, cache.k[i], cache.v[i], *where, attn, H)
        ops.gemm(attn, layer.o_proj, delta)
        ops.add_rms_norm(residual, delta, layer.post_norm, normed, eps)
        ops.gemm(normed, layer.gate_up, b["gate_up"])
        ops.swiglu(b["gate_up"], b["mlp_act"])
        ops.gemm(b["mlp_act"], layer.down, delta)
        pending = delta

    ops.add_rms_norm(residual, delta, model.final_norm, normed, eps)
    logits = ops.xp.empty((n, cfg.vocab_size), dtype=np.float32)
    ops.gemm(normed, model.lm_head, logits)
    return logits
