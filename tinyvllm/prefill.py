"""Chapter 3: prefill — the whole prompt through every layer at once.

T tokens make every projection a real matrix multiply (T x hidden times hidden x out), which is
what GPUs are built for; decode (chapter 5) is the GEMV-shaped opposite. One layer, in buffers:

    residual --add_rms_norm--> normed --gemm--> qkv --rope--> qkv --attention--> attn_out
    --gemm--> delta --add_rms_norm (residual += delta)--> normed --gemm--> gate_up --swiglu-->
    mlp_act --gemm--> delta  (added to the residual by the next layer's first norm)

Only the last position's logits are computed: the others would be thrown away.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.errors import TinyVLLMError
from tinyvllm.kv_cache import ContiguousKVCache
from tinyvllm.model import Model


def prefill(model: Model, token_ids, all_logits: bool = False, on_layer=None, cache=None, seq: int = 0):
    """Run a prompt; returns (logits, kv): logits (vocab,) fp32 for the last position — (T, vocab) with
    all_logits — on the model's device, and per layer the (k, v) it computed, each (T, kv_heads, head_dim).

    The K/V go into sequence `seq` of `cache` (chapter 5), which must be empty; without a cache, into a
    fresh one just big enough. kv holds views of the cache, not copies.

    on_layer(residual, delta), if given, is called after each layer; the stream is then residual + delta
    (the add is deferred to the next norm)."""
    cfg, ops, T = model.cfg, model.ops, len(token_ids)
    if not 0 < T <= model.max_tokens:
        raise TinyVLLMError(f"the prompt has {T} tokens; this engine's prefill takes 1 to {model.max_tokens}")
    b = {name: buf[:T] for name, buf in model.buffers.items()}
    residual, normed, qkv, attn, delta = b["residual"], b["normed"], b["qkv"], b["attn_out"], b["delta"]
    if cache is None:
        cache, seq = ContiguousKVCache(cfg, ops, num_seqs=1, max_len=T), 0
    if cache.lengths.get(seq, 0):
        raise TinyVLLMError(f"prefill needs an empty sequence; {seq} holds {cache.lengths[seq]} tokens")
    slots = ops.to_device(cache.append(seq, T))
    ids = ops.to_device(np.asarray(token_ids, dtype=np.int32))
    positions = ops.to_device(np.arange(T, dtype=np.int32))
    H, KVH, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    ops.embedding(ids, model.embed, residual)
    pending = None  # the previous MLP's output, not yet added to the residual
    for i, layer in enumerate(model.layers):
        ops.add_rms_norm(residual, pending, layer.input_norm, normed, eps)
        ops.gemm(normed, layer.qkv, qkv)
        ops.rope(qkv, positions, model.cos, model.sin, H + KVH, D)  # Q and K heads, V untouched
        ops.store_kv(qkv, cache.k[i], cache.v[i], slots, H)  # decode reads them instead of recomputing
        ops.prefill_attention(qkv, attn, H, KVH, D)
        ops.gemm(attn, layer.o_proj, delta)
        ops.add_rms_norm(residual, delta, layer.post_norm, normed, eps)
        ops.gemm(normed, layer.gate_up, b["gate_up"])
        ops.swiglu(b["gate_up"], b["mlp_act"])
        ops.gemm(b["mlp_act"], layer.down, delta)
        pending = delta
        if on_layer is not None:
            on_layer(residual, delta)

    rows = slice(0, T) if all_logits else slice(T - 1, T)
    ops.add_rms_norm(residual[rows], delta[rows], model.final_norm, normed[rows], eps)
    logits = ops.xp.empty((rows.stop - rows.start, cfg.vocab_size), dtype=np.float32)
    ops.gemm(normed[rows], model.lm_head, logits)
    kv = [cache.view(seq, i) for i in range(cfg.num_hidden_layers)]
    return (logits if all_logits else logits[0]), kv
