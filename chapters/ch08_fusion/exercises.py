"""Chapter 8 exercises: the bytes and the floor of a decode step, the fused kernels' thread blocks in NumPy,
and the residual-add epilogue in CUDA C.

Exercises 8.1 to 8.4 are NumPy and graded anywhere; Exercise 8.5 is CUDA C and graded on a GPU only
(elsewhere its grader is skipped with "Exercise 8.5 is graded on a GPU"). Fill them in, then:

    make grade CH=8                   # the graders: a score table
    make chapter-8 IMPL=student       # the chapter's checkpoint, with your functions in the fused decode step
    .venv/bin/python -m pytest tests/test_ch08_exercises.py --impl=student -x
                                      # the graders alone: the first failure, with its traceback

`--impl student` replaces the functions of chapters/ch08_fusion/fusion.py with yours: the checkpoint then
counts a step's bytes with your step_bytes and floor_ms, and every layer of its fused decode step runs
your thread blocks. Keep 8.3 and 8.4 in float32, as the kernels are: a np.float64 value (np.sqrt of a
Python float, a float64 array) turns float32 arithmetic into float64.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.formats.config import LlamaConfig

REFERENCE = {
    "step_bytes": "chapters.ch08_fusion.fusion:step_bytes",
    "floor_ms": "chapters.ch08_fusion.fusion:floor_ms",
    "rms_norm_gemv_block": "chapters.ch08_fusion.fusion:rms_norm_gemv_block",
    "rms_norm_gemv_swiglu_block": "chapters.ch08_fusion.fusion:rms_norm_gemv_swiglu_block",
}
# Exercises written in CUDA C: {the string you fill in: the kernel file it re-implements}.
GPU_EXERCISES = {
    "GEMV_ADD_KERNEL_SOURCE": "chapters/ch08_fusion/gemv_add.cu",
}


def step_bytes(cfg: LlamaConfig, batch: int, context_len: int) -> int:
    """Bytes one decode step must read from GPU memory: `batch` sequences, one new token each, each
    sequence's attention reading `context_len` tokens of K and V. Everything is bf16 (2 bytes).

    Exercise 8.1. With h = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size,
    L = cfg.num_hidden_layers, q = cfg.q_size (heads x head_dim) and kv = cfg.kv_size (K/V heads x
    head_dim), count:
      - the weights, ONCE for the whole batch (that is what makes a batch cheap): per layer the fused
        qkv (q + 2 kv, h), o_proj (h, q), gate_up (2 I, h), down (h, I) and the two norms (h,); then the
        final norm (h,) and one (V, h) table for the LM head. The embedding is only looked up, one row per
        token, so it is not counted again: a tied model (cfg.tie_word_embeddings) reads the table once, as
        its LM head, and an untied one reads its separate lm_head the same way.
      - the KV cache, per sequence: context_len tokens x L layers x K and V x kv values.
    Llama 3.2 1B at batch 1 and context 512 reads 2,488,406,016 bytes: the number bench/decode.py
    recorded on an H200. Return an int.
    """
    raise NotImplementedError("Exercise 8.1: step_bytes")


def floor_ms(nbytes: int, bandwidth_gbps: float) -> float:
    """The floor of a step: how many milliseconds moving `nbytes` takes at `bandwidth_gbps`, in GB/s
    (10^9 bytes per second, as bandwidths are quoted).

    Exercise 8.2. Llama 3.2 1B's 2,488,406,016 bytes at the 4,230 GB/s measured on an H200: 0.588 ms.
    """
    raise NotImplementedError("Exercise 8.2: floor_ms")


def rms_norm_gemv_block(residual: np.ndarray, norm_weight: np.ndarray, w: np.ndarray, out: np.ndarray, eps: float,
                        block: int, cols_per_block: int) -> None:
    """What thread block `block` of the fused RMSNorm + GEMV kernel computes: its columns of
    out = rms_norm(residual) @ w.T, written into `out` in place (return nothing).

    Exercise 8.3. residual (T, h) float32, the residual stream (T <= 8 rows: one per sequence);
    norm_weight (h,); w (N, h), stored (out, in) like every engine weight; out (T, N) float32.
    The grid has ceil(N / cols_per_block) blocks; block b owns output columns
    b * cols_per_block .. min((b + 1) * cols_per_block, N) - 1 (the last block may own fewer).
      1. Normalize every row of the residual, as add_rms_norm does, in this order:
         normed = residual * (1 / sqrt(mean(residual^2 over the row) + eps)) * norm_weight.
         Every block does this itself: there is no `normed` buffer and no other block to wait for.
      2. out[:, its columns] = normed @ (the weight rows of its columns).T
    The graders call the blocks in a random order with `out` full of NaN, and check after each call that
    it wrote its own columns and nothing else. Do not change residual or the weights.
    """
    raise NotImplementedError("Exercise 8.3: rms_norm_gemv_block")


def rms_norm_gemv_swiglu_block(residual: np.ndarray, norm_weight: np.ndarray, w_gate_up: np.ndarray,
                               act: np.ndarray, eps: float, block: int, cols_per_block: int) -> None:
    """What thread block `block` of the fused RMSNorm + gate_up + SwiGLU kernel computes: its columns of
    act = silu(gate) * up, written into `act` in place (return nothing).

    Exercise 8.4. residual (T, h) float32; norm_weight (h,); w_gate_up (2 I, h), the fused weight, rows
    [gate | up]: row j computes gate column j and row I + j computes up column j; act (T, I) float32.
    The grid has ceil(I / cols_per_block) blocks; block b owns act columns
    j = b * cols_per_block .. min((b + 1) * cols_per_block, I) - 1. For those j:
      normed = rms_norm(residual) as in Exercise 8.3
      gate_j = normed @ w_gate_up[j],  up_j = normed @ w_gate_up[I + j]
      act[:, j] = silu(gate_j) * up_j,  silu(g) = g / (1 + exp(-g))
    A block's columns of act need both halves of the weight: rows j of gate AND rows I + j of up. That
    pairing is what lets SwiGLU run in the GEMV's epilogue, with no (T, 2 I) gate_up buffer in between.
    For g < -88, exp(-g) overflows float32 to inf and silu(g) is -0: that is fine (silence the warning
    with np.errstate(over="ignore") if you like), but it must not become NaN.
    The graders check as for 8.3: random block order, NaN-filled act, only the block's own columns written.
    """
    raise NotImplementedError("Exercise 8.4: rms_norm_gemv_swiglu_block")


# Exercise 8.5 (graded on a GPU): gemv_add, o_proj and down with the residual add in the epilogue:
#   residual[b, j] += sum_k x[b, k] * w[j, k]   for the NB rows b and the N columns j.
# Compiled with cupy.RawModule(code=..., options=cuda_ops.NVRTC_OPTIONS (C++17, -I<repo>/tinyvllm/model/kernels
#   and the -D constants of tinyvllm/model/backend/constants.py: GEMV_THREADS, GEMV_COLUMNS_PER_BLOCK, ...),
#   name_expressions=["gemv_add<1>"]) and fetched with get_function("gemv_add<1>") (also <2>, <5> and <8>).
# Launch: grid (ceil(N / GEMV_COLUMNS_PER_BLOCK)), block (GEMV_THREADS): warp w of block i owns output
#   column j = i * GEMV_COLUMNS_PER_BLOCK + w, as in the engine's gemv (tinyvllm/model/kernels/gemv.cu).
# Layout: x bf16 (NB, K) row-major; w bf16 (N, K) row-major; residual fp32 (NB, N) row-major, read AND
#   written; K % 8 == 0.
# Given below: the main loop. Each lane of the warp holds, in acc[b], its partial sum of row b's dot product
#   with weight row j (its k = 8 lane, 8 lane + 256, ...). Write the epilogue:
#   1. add up the 32 lanes' partial sums of every row (warp_sum from common.cuh: __shfl_xor_sync);
#   2. one lane adds each row's sum into residual[b * N + j].
# No atomics are needed: exactly one warp owns column j, so its read-modify-write of residual[b, j] cannot
#   meet another's. (The engine's gemv_add, in tinyvllm/model/kernels/fused_decode.cu, rounds each sum to
#   bf16 before adding it, as the unfused layer's delta buffer held it; the graders accept that or no rounding.)
# The graders fill the memory after the last row with a marker that must survive, and check every residual
#   value against the NumPy twin (fusion.gemv_add).
GEMV_ADD_KERNEL_SOURCE = r"""
#include "common.cuh"

template <int NB>
__global__ void __launch_bounds__(GEMV_THREADS) gemv_add(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                                         float* residual, int K, int N) {
    const int j = blockIdx.x * GEMV_COLUMNS_PER_BLOCK + threadIdx.x / 32;  // this warp's output column
    if (j >= N) return;  // the whole warp leaves together
    const int lane = threadIdx.x % 32;
    float acc[NB] = {};
    for (int k = lane * 8; k < K; k += 32 * 8) {  // a warp reads 512 contiguous bytes of weight row j
        float wf[8];
        bf16x8_to_float(*reinterpret_cast<const uint4*>(w + (long long)j * K + k), wf);
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            float xf[8];
            bf16x8_to_float(*reinterpret_cast<const uint4*>(x + (long long)b * K + k), xf);
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc[b] += wf[i] * xf[i];
        }
    }
    // Exercise 8.5: your epilogue here
}
"""
