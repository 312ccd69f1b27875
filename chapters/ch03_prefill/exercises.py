"""Chapter 3 exercises: attention the way the prefill kernel computes it, and the RMSNorm kernel in CUDA C.

Exercise 3.1 is NumPy and graded anywhere; Exercise 3.2 is CUDA C and graded on a GPU only (elsewhere
its grader is skipped with "Exercise 3.2 is graded on a GPU"). Fill them in, then:

    make grade CH=3                   # the graders: a score table
    make chapter-3 IMPL=student       # the chapter's checkpoint, calling your online_softmax_attention
    .venv/bin/python -m pytest tests/test_ch03_exercises.py --impl=student -x
                                      # the graders alone: the first failure, with its traceback

Keep Exercise 3.1 in float32: NumPy 2 turns float32 * float64 into float64 (the graders check the dtype).
"""
from __future__ import annotations

import numpy as np

REFERENCE = {
    "online_softmax_attention": "tinyvllm.reference:online_softmax_attention",
}
# Exercises written in CUDA C: {the string you fill in: the engine's kernel file it re-implements}.
GPU_EXERCISES = {
    "RMS_NORM_KERNEL_SOURCE": "tinyvllm/model/kernels/rms_norm.cu",
}


def online_softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start_pos: int,
                             block: int) -> np.ndarray:
    """attention(), computed as the prefill kernel does: keys in tiles of `block`, a running max and sum.

    Same arguments and result as tinyvllm.reference.attention: causal GQA attention, q (T, H, d) at
    positions start_pos.., k and v (S, KVH, d) at positions 0..S-1, query head h reads K/V head
    h // (H / KVH), scores scaled by 1 / sqrt(d); returns (T, H * d) float32, heads side by side.

    But the (T, S) score matrix never exists whole. Walk the keys in tiles of `block` (the last tile
    may be shorter) and keep, for every (head, query), three running values:
      m      the largest score seen so far (start at -inf),
      denom  the sum of exp(score - m) over the keys seen so far (start at 0),
      o      the sum of exp(score - m) * v over the same keys, a (d,) vector (start at 0).
    For each tile: compute its scores (future keys masked to -inf), m_new = max(m, the tile's max),
    rescale the old denom and o by alpha = exp(m - m_new) (they were summed against the old max), then add
    the tile's exp(score - m_new) and exp(score - m_new) @ v. At the end, out = o / denom.

    Two details the kernel cares about, and the graders check:
      - a tile can hold no visible key for some rows (queries before the tile's first key): such a
        row's max over the tile is -inf, and exp(-inf - -inf) is NaN. Subtract the running max m_new,
        never the tile's own max: m_new is finite from the first tile on, since every query sees key 0;
      - keys at positions >= start_pos + T are in every query's future: never read them (the kernel
        skips those tiles; the graders fill them with NaN).
    Vectorize over heads and queries; the only Python loop is the one over key tiles.
    """
    raise NotImplementedError("Exercise 3.1: online_softmax_attention")


# Exercise 3.2 (graded on a GPU): the engine's RMSNorm kernel, tinyvllm/model/kernels/rms_norm.cu, in your words.
#   residual[t] += delta[t]            (skip the add when delta is a null pointer)
#   out[t] = residual[t] / sqrt(mean(residual[t]^2) + eps) * weight
# Launch: grid (T), block (256): one block per row t = blockIdx.x; threads stride over the hidden dim.
# Layout: residual fp32 (T, hidden), read and written back; delta and out bf16 (T, hidden); weight bf16 (hidden,).
# The mean needs a sum over the whole row: each thread sums its elements, then the block combines the
# partial sums (warp shuffles, __shfl_xor_sync, then shared memory across the 8 warps). You may write
# your own reduction or #include "common.cuh" for block_sum. All arithmetic in fp32; __bfloat162float
# and __float2bfloat16 (from cuda_bf16.h) convert.
RMS_NORM_KERNEL_SOURCE = r"""
#include <cuda_bf16.h>

extern "C" __global__ void add_rms_norm(float* residual, const __nv_bfloat16* delta, const __nv_bfloat16* weight,
                                        __nv_bfloat16* out, float eps, int hidden) {
    // Exercise 3.2: your kernel here
}
"""
