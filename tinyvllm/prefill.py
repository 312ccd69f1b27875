"""Chapter 3: prefill — the whole prompt through every layer at once.

T tokens make every projection a real matrix multiply (T x hidden times hidden x out), which is
what GPUs are built for; decode (chapter 5) is the GEMV-shaped opposite. One layer, in buffers:

    residual --add_rms_norm--> normed --gemm--> qkv --rope--> qkv --attention--> attn_out
    --gemm--> delta --add_rms_norm (residual += delta)--> normed --gemm--> gate_up --swiglu-->
    mlp_act --gemm--> delta  (added to the residual by the next layer's first norm)

Only the last position's logits are computed: the others would be thrown away. The layer loop itself
(run_layers) is shared with decode (chapter 5), which differs only in how attention reads K and V.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.errors import TinyVLLMError
from tinyvllm.kv_cache import ContiguousKVCache
from tinyvllm.model import Model


def prefill(model: Model, token_ids, all_logits: bool = False, on_layer=None, cache=None, seq: int = 0):
    """Run a prompt; returns (logits, kv): logits (vocab,) fp32 for the last position — (T, vocab) with
    all_logits — on the model's device, and per layer the (k, v) of the sequence, each (T, kv_heads, head_dim).

    The K/V go into sequence `seq` of `cache` (chapter 5); without a cache, into a fresh one just big
    enough. kv holds views of the cache, not copies.

    on_layer(residual, delta), if given, is called after each layer; the stream is then residual + delta
    (the add is deferred to the next norm)."""
    if cache is None:
        cache, seq = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=len(token_ids)), 0
    logits = prefill_batch(model, [list(token_ids)], cache, [seq], all_logits, on_layer)
    kv = [cache.view(seq, i) for i in range(model.cfg.num_hidden_layers)]
    return (logits if all_logits else logits[0]), kv


def prefill_batch(model: Model, prompts: list[list[int]], cache, seqs: list[int], all_logits: bool = False,
                  on_layer=None):
    """Several prompts in one pass (chapter 7): their tokens side by side as the rows of every GEMM.

    prompts[j] are the new tokens of sequence seqs[j]; tokens the cache already holds for it (a cached
    prefix, chapter 7) come first. Returns the logits of each prompt's last token, (n, vocab) fp32 —
    of every token with all_logits."""
    cfg, ops = model.cfg, model.ops
    T = sum(len(p) for p in prompts)
    if not all(prompts) or T > model.max_tokens:
        raise TinyVLLMError(f"a prefill of {T} tokens; this engine's prefill takes 1 to {model.max_tokens}")
    cached = [cache.lengths.get(s, 0) for s in seqs]     # tokens each sequence has in the cache already
    slots = np.concatenate([cache.append(s, len(p)) for s, p in zip(seqs, prompts)])
    positions = np.concatenate([np.arange(c, c + len(p)) for c, p in zip(cached, prompts)])
    ends = np.cumsum([len(p) for p in prompts])
    H, KVH, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # a fresh prompt attends to itself (the prefill kernel); a prompt after a cached prefix reads the
    # cache too: each of its tokens is then a decode query whose context ends at its own position
    rows = [(end - len(p), end, c, cache.lookup([s] * len(p), positions[end - len(p):end] + 1) if c else None)
            for s, p, c, end in zip(seqs, prompts, cached, ends)]
    attention = getattr(ops, cache.attention)

    def attend(layer: int, qkv, attn) -> None:
        for start, end, c, where in rows:
            if c == 0:
                ops.prefill_attention(qkv[start:end], attn[start:end], H, KVH, D)
            else:
                attention(qkv[start:end], cache.k[layer], cache.v[layer], *where, attn[start:end], H)

    ids, positions, slots = (ops.to_device(np.asarray(a, dtype=np.int32))
                             for a in (np.concatenate(prompts), positions, slots))
    residual, delta = run_layers(model, ids, positions, slots, cache, attend, on_layer)
    return final_logits(model, residual, delta, slice(0, T) if all_logits else ends - 1)


def run_layers(model: Model, ids, positions, slots, cache, attend, on_layer=None):
    """Every layer over len(ids) rows of the buffers; shared by prefill and decode (chapter 5), which
    differ only in attend(layer, qkv, attn_out). Returns (residual, delta): the stream is their sum."""
    cfg, ops, T = model.cfg, model.ops, len(ids)
    b = {name: buf[:T] for name, buf in model.buffers.items()}
    residual, normed, qkv, attn, delta = b["residual"], b["normed"], b["qkv"], b["attn_out"], b["delta"]
    H, KVH, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    ops.embedding(ids, model.embed, residual)
    pending = None  # the previous MLP's output, not yet added to the residual
    for i, layer in enumerate(model.layers):
        ops.add_rms_norm(residual, pending, layer.input_norm, normed, eps)
        ops.gemm(normed, layer.qkv, qkv)
        ops.rope(qkv, positions, model.cos, model.sin, H + KVH, D)  # Q and K heads, V untouched
        ops.store_kv(qkv, cache.k[i], cache.v[i], slots, H)  # later steps read them instead of recomputing
        attend(i, qkv, attn)
        ops.gemm(attn, layer.o_proj, delta)
        ops.add_rms_norm(residual, delta, layer.post_norm, normed, eps)
        ops.gemm(normed, layer.gate_up, b["gate_up"])
        ops.swiglu(b["gate_up"], b["mlp_act"])
        ops.gemm(b["mlp_act"], layer.down, delta)
        pending = delta
        if on_layer is not None:
            on_layer(residual, delta)
    return residual, delta


def final_logits(model: Model, residual, delta, rows, out=None):
    """Final norm and lm_head for the rows that sample (a slice, or the row index of each prompt's end);
    into `out` (rows, vocab) fp32 if given (a CUDA graph's static output), else a new array."""
    ops, eps = model.ops, model.cfg.rms_norm_eps
    if isinstance(rows, slice):
        residual, delta, normed = residual[rows], delta[rows], model.buffers["normed"][rows]
    else:  # gathered copies: the add below must not touch the real residual rows (nothing reads them after)
        index = ops.to_device(np.asarray(rows, dtype=np.int64))
        residual, delta, normed = residual[index], delta[index], model.buffers["normed"][:len(rows)]
    ops.add_rms_norm(residual, delta, model.final_norm, normed, eps)
    logits = ops.xp.empty((len(normed), model.cfg.vocab_size), dtype=np.float32) if out is None else out
    ops.gemm(normed, model.lm_head, logits)
    return logits
