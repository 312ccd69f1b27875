"""Chapter 5: one decode step — the next token of every running sequence, from the KV pool.

Each sequence contributes ONE row, so the projections are (n x hidden) x (hidden x out) with n the
number of sequences: at n = 1 a matrix-vector product that reads every weight once to do 2 FLOPs per
weight. Decode is bound by memory bandwidth, not FLOPs; the floor for a step is

    weight bytes / bandwidth  (2.5 GB / ~4.2 TB/s = 0.6 ms for Llama 3.2 1B in bf16 on an H200)

The layer is prefill's (run_layers in model.py), with two changes: RoPE rotates each row at its own
sequence's position, and attention reads the new query against the pool instead of the prompt:

    residual --add_rms_norm--> normed --gemm--> qkv --rope(positions)--> qkv --store_kv--> pool
    --decode_attention(pool)--> attn_out --gemm--> delta ... (the MLP as in prefill)

Chapter 8: a step of up to GEMV_DECODE_ROWS rows runs the same layer in fewer, fatter kernels instead
(fused.py), unless model.fused_decode is off or the backend does not offer them (the batch-invariant mode).
"""
from __future__ import annotations

from tinyvllm.model.backend.constants import GEMV_DECODE_ROWS
from tinyvllm.model.fused import final_logits_fused, offers_fused_ops, run_layers_fused
from tinyvllm.model.model import Model, final_logits, run_layers
from tinyvllm.model.step_plan import SeqStep, step_inputs


def decode_batch(model: Model, pool, steps: list[SeqStep], num_layers: int | None = None):
    """One new token per sequence, as planned (steps[b]: its token, position, slot and block table);
    returns the next-token logits, (n, vocab) fp32 on the model's device. num_layers: through the first
    layers only, then the final norm and the LM head (chapter 10's early-exit draft); None: the whole model."""
    ops, H = model.ops, model.cfg.num_attention_heads
    ids, positions, slots = (ops.to_device(c) for c in step_inputs(steps))
    where = pool.where(steps, [s.end for s in steps])   # where each sequence's keys are: once per step
    attention = getattr(ops, pool.attention)            # decode_attention, or paged_attention (chapter 6)

    def attend(layer: int, qkv, attn) -> None:
        attention(qkv, pool.k[layer], pool.v[layer], *where, attn, H)

    return decode_rows(model, ids, positions, slots, pool, attend, num_layers=num_layers)


def uses_fused_layer(model: Model, rows: int) -> bool:
    """Whether a decode step of `rows` rows runs chapter 8's fused layer: up to GEMV_DECODE_ROWS rows (gemv's range),
    model.fused_decode on, and a backend that offers the fused kernels (the batch-invariant mode does not)."""
    return model.fused_decode and rows <= GEMV_DECODE_ROWS and offers_fused_ops(model.ops)


def decode_rows(model: Model, ids, positions, slots, pool, attend, out=None, fused: bool | None = None,
                num_layers: int | None = None):
    """The forward pass of a decode step's rows (device arrays ids, positions, slots), fused or not (None: as
    uses_fused_layer says), through the first num_layers layers (None: all); returns the logits (rows, vocab)
    fp32, into `out` if given. decode_batch and the CUDA graphs (cuda_graphs.py, which time both and keep the
    faster) run it."""
    rows = slice(0, len(ids))
    if uses_fused_layer(model, len(ids)) if fused is None else fused:
        residual = run_layers_fused(model, ids, positions, slots, pool, attend, num_layers)
        return final_logits_fused(model, residual, rows, out)
    residual, delta = run_layers(model, ids, positions, slots, pool, attend, num_layers=num_layers)
    return final_logits(model, residual, delta, rows, out=out)


def decode_step(model: Model, tokens: list[int], cache, seqs: list[int]):
    """Chapter 5's form: append tokens[b] (the newest, not yet cached) to sequence seqs[b] of a contiguous
    cache, which hands out the slots, and return the next-token logits, (n, vocab) fp32."""
    return decode_batch(model, cache, cache.plan_decode(seqs, tokens))
