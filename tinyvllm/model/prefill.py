"""Chapter 3: prefill — the whole prompt through every layer at once.

T tokens make every projection a real matrix multiply (T x hidden times hidden x out), which is
what GPUs are built for; decode (chapter 5) is the GEMV-shaped opposite. The layer loop is the model's
one forward pass (run_layers in model.py); prefill only decides how attention reads K and V: a fresh
prompt attends to itself (the prefill attention kernel); a chunk that follows tokens already in the pool
(a cached prefix, or the earlier chunks of a long prompt: chapter 7) reads the pool, each of its tokens
a query whose context ends at its own position.

Only each prompt's last position gets logits: the others would be thrown away.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.kv_pool import ContiguousKVCache
from tinyvllm.model.model import Model, final_logits, run_layers
from tinyvllm.model.step_plan import SeqStep, step_inputs


def prefill(model: Model, token_ids, all_logits: bool = False, on_layer=None, cache=None, seq: int = 0):
    """Run one prompt; returns (logits, kv): logits (vocab,) fp32 for the last position — (T, vocab) with
    all_logits — on the model's device, and per layer the (k, v) of the sequence, each (T, kv_heads, head_dim).

    The K/V go into sequence `seq` of a contiguous cache (chapter 5); without one, into a fresh one just
    big enough. kv holds views of the cache, not copies. on_layer(residual, delta), if given, is called
    after each layer; the stream is then residual + delta (the add is deferred to the next norm)."""
    if cache is None:
        cache, seq = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=len(token_ids)), 0
    logits = prefill_batch(model, cache, [cache.plan_prefill(seq, token_ids)], all_logits, on_layer)
    kv = [cache.view(seq, i) for i in range(model.cfg.num_hidden_layers)]
    return (logits if all_logits else logits[0]), kv


def prefill_batch(model: Model, pool, steps: list[SeqStep], all_logits: bool = False, on_layer=None,
                  decodes: list[SeqStep] = (), logits: bool = True):
    """Several prompts in one pass (chapter 7): their tokens side by side as the rows of every GEMM, as
    the plan says (steps[j]: sequence j's tokens, first position, slots and block table). Returns the
    logits of each prompt's last token, (n, vocab) fp32 — of every token with all_logits. A step that
    verifies proposals (chapter 10: its newest token and the guesses after it, a chunk like any other)
    gets the logits of its last proposed + 1 tokens, in order: the target's view of every guess.

    decodes: the step's decoding sequences ride along as one more row each, after the prompts' rows,
    attending through the pool as decode_batch's rows do; their logits follow the prompts'. One pass
    for the whole step (vLLM v1's rule): a step that would otherwise run a prefill pass AND a decode
    pass reads every weight once instead of twice.

    logits=False: the K/V writes only, no final norm and LM head; returns None (chapter 10's draft model
    following a step of the target: model/draft_model.py)."""
    cfg, ops = model.cfg, model.ops
    P = sum(len(s.token_ids) for s in steps)
    T = P + len(decodes)
    if not all(s.token_ids for s in steps) or T > model.max_num_batched_tokens:
        raise TinyVLLMError(f"a step of {T} tokens; this model's step buffers hold 1 to "
                            f"{model.max_num_batched_tokens}")
    ends = np.cumsum([len(s.token_ids) for s in steps])
    H, KVH, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # each chunk's rows, and where it reads keys from the pool: uploaded once, read by every layer
    rows = [(end - len(s.token_ids), end, pool.chunk_where(s) if s.start else None) for s, end in zip(steps, ends)]
    read_pool = getattr(ops, pool.chunk_attention)
    decode_where = pool.where(decodes, [s.end for s in decodes]) if decodes else None
    decode_attention = getattr(ops, pool.attention)

    def attend(layer: int, qkv, attn) -> None:
        for a, b, where in rows:
            if where is None:   # a fresh prompt attends to itself: the prefill kernel
                ops.prefill_attention(qkv[a:b], attn[a:b], H, KVH, D)
            else:               # after cached tokens or earlier chunks: its keys are in the pool
                read_pool(qkv[a:b], pool.k[layer], pool.v[layer], *where, attn[a:b], H)
        if decodes:             # one query per decoding sequence, its keys in the pool
            decode_attention(qkv[P:T], pool.k[layer], pool.v[layer], *decode_where, attn[P:T], H)

    ids, positions, slots = (ops.to_device(c) for c in step_inputs([*steps, *decodes]))  # prompts' rows, then decodes
    residual, delta = run_layers(model, ids, positions, slots, pool, attend, on_layer)
    if not logits:
        return None
    if all_logits:
        return final_logits(model, residual, delta, slice(0, T))
    sampled = [row for s, end in zip(steps, ends) for row in range(end - 1 - s.proposed, end)]
    return final_logits(model, residual, delta, [*sampled, *range(P, T)])
