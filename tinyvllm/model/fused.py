"""Chapter 8: decode at the memory-bandwidth floor — the layer in fewer, fatter kernels.

At batch 1 a decode step must read every weight once: 2.49 GB for Llama 3.2 1B in bf16, 0.60 ms at an H200's
~4.1 TB/s. With CUDA graphs (chapter 7) the host no longer launches the kernels one by one, yet the step takes
~1.5 ms. The weights are not the problem; the activations are tiny (a few KB per layer at batch 1). What costs is
that the unfused layer is ten kernels, and every kernel boundary is paid in time, not bytes:

  - a launch gap: even inside a graph, the next kernel starts a few microseconds after the last block of the
    previous one ends;
  - a ramp-up: a new kernel's first loads wait a full memory latency before any byte arrives, and nothing
    else is in flight meanwhile;
  - a tail: the last blocks run on a few SMs while the rest of the GPU idles;
  - kernels too small to fill the GPU: add_rms_norm, rope, store_kv and swiglu run one block per row — at
    batch 1 a single block, on one SM of 132, bound by latency (add_rms_norm alone was 0.32 ms of the step).

So the fused layer keeps the same arithmetic and folds each small op into the projection next to it, leaving
the GEMVs (which stream the weights, kernels/gemv.cuh) and attention as the kernels. Per layer, 6 launches
instead of 10 (kernels/fused_decode.cu; bytes for Llama 3.2 1B at T rows):

    rms_norm_gemv         reads residual (T x 8 KB, from L2) + W_qkv (12.6 MB); writes qkv (T x 6 KB)
                          — was add_rms_norm (writes normed, which gemm read back) + gemm
    rope_store_kv         reads and writes the Q and K heads of qkv (T x 5 KB); writes K and V to the cache
                          — was rope + store_kv (which read back what rope wrote)
    attention             unchanged (decode_attention, or paged_attention)
    gemv_add              reads attn_out (T x 4 KB) + W_o (8.4 MB); adds to the residual (T x 8 KB)
                          — was gemm (writes delta) + the next add_rms_norm's add (reads it back)
    rms_norm_gemv_swiglu  reads residual + W_gate_up (67 MB); writes act (T x 16 KB)
                          — was add_rms_norm + gemm (writes gate_up, T x 32 KB) + swiglu (reads it back)
    gemv_add              reads act + W_down (33.5 MB); adds to the residual

and the final norm with the lm_head is one rms_norm_gemv with fp32 logits. Every block of a norm kernel
recomputes the norm of the rows it needs (T x 8 KB from L2) rather than wait for another kernel to write it.

The fused kernels take up to GEMV_MAX_ROWS rows, and the engine runs them for up to GEMV_DECODE_ROWS (gemv's
range: above it cuBLAS's tensor cores make the weights' reads count for many rows, and the unfused layer
stays). Each one rounds exactly as the ops it replaces, so the fused layer gives the unfused layer's logits (on the CPU bit for bit: the twins in numpy_ops.py are those
ops, in that order). The batch-invariant mode (batch_invariant.py) does not offer these ops and keeps the
unfused layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # model.py imports batch_invariant.py, which imports FUSED_OPS from here
    from tinyvllm.model.model import Model

FUSED_OPS = ("rms_norm_gemv", "rms_norm_gemv_swiglu", "gemv_add", "rope_store_kv")  # what a backend must offer


def offers_fused_ops(ops) -> bool:
    """Whether this backend (module, BatchInvariantOps or OpTimer) has chapter 8's fused kernels."""
    return all(hasattr(ops, name) for name in FUSED_OPS)


def run_layers_fused(model: Model, ids, positions, slots, pool, attend, num_layers: int | None = None, ops=None):
    """run_layers (model.py) for a decode step of up to GEMV_MAX_ROWS rows, with the fused kernels: token ids[r] at
    position positions[r], its K/V stored to pool slot slots[r], attention by attend(layer, qkv, attn_out), through
    the first num_layers layers (None: all). Returns the residual stream with every layer's output already added.
    ops: the backend that runs the ops (None: the model's; persistent.py passes one that writes them down instead)."""
    cfg, ops, T = model.cfg, model.ops if ops is None else ops, len(ids)
    b = {name: buf[:T] for name, buf in model.buffers.items()}
    residual, qkv, attn, act = b["residual"], b["qkv"], b["attn_out"], b["mlp_act"]
    H, KVH, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    ops.embedding(ids, model.embed, residual)
    for i, layer in enumerate(model.layers[:num_layers]):
        ops.rms_norm_gemv(residual, layer.input_norm, layer.qkv, qkv, eps)
        ops.rope_store_kv(qkv, positions, model.cos, model.sin, pool.k[i], pool.v[i], slots, H, KVH, D)
        attend(i, qkv, attn)
        ops.gemv_add(attn, layer.o_proj, residual)                  # residual += o_proj(attention)
        ops.rms_norm_gemv_swiglu(residual, layer.post_norm, layer.gate_up, act, eps)
        ops.gemv_add(act, layer.down, residual)                     # residual += down(act)
    return residual


def final_logits_fused(model: Model, residual, rows: slice, out=None, ops=None):
    """final_logits (model.py) for the rows of a slice: the final norm and the lm_head in one rms_norm_gemv, fp32
    logits (rows, vocab), into `out` if given (a CUDA graph's static output), else a new array. ops: as run_layers_fused."""
    ops = model.ops if ops is None else ops
    residual = residual[rows]
    logits = ops.xp.empty((len(residual), model.cfg.vocab_size), dtype=np.float32) if out is None else out
    ops.rms_norm_gemv(residual, model.final_norm, model.lm_head, logits, model.cfg.rms_norm_eps)
    return logits
