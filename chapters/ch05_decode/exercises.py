"""Chapter 5 exercises: decode attention the way the kernel computes it, in NumPy and then in CUDA C.

Exercise 5.1 is NumPy and graded anywhere; Exercise 5.2 is CUDA C and graded on a GPU only (elsewhere
its grader is skipped with "Exercise 5.2 is graded on a GPU"). Fill them in, then:

    make grade CH=5                   # the graders: a score table
    make chapter-5 IMPL=student       # the chapter's checkpoint, with your decode_attention in the engine
    .venv/bin/python -m pytest tests/test_ch05_exercises.py --impl=student -x
                                      # the graders alone: the first failure, with its traceback

Keep Exercise 5.1 in float32: NumPy 2 turns float32 * float64 into float64.
"""
from __future__ import annotations

import numpy as np

REFERENCE = {
    "decode_attention": "tinyvllm.model.backend.numpy_ops:decode_attention",
}
# Exercises written in CUDA C: {the string you fill in: the engine's kernel file it re-implements}.
GPU_EXERCISES = {
    "DECODE_ATTENTION_KERNEL_SOURCE": "tinyvllm/model/kernels/decode_attention.cu",
}


def decode_attention(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, starts: np.ndarray,
                     lengths: np.ndarray, out: np.ndarray, num_heads: int) -> None:
    """One new query per row b (qkv[b]'s Q heads) against keys in slots starts[b] .. starts[b] + lengths[b] - 1.

    The NumPy twin of the decode kernel: same arguments, same buffers, and it writes `out` in place
    (the engine reads that buffer next; return nothing). With d = head_dim and n rows, one layer:
      qkv        (n, cols) float32. Row b is sequence b's newest token. Its first num_heads * d columns
                 are the query heads side by side, RoPE already applied; the K and V columns after
                 them are already in the cache (don't read them).
      k_cache, v_cache  (num_slots, kv_heads, d): a flat list of token slots shared by all sequences.
                 Token t of row b (t = 0 .. lengths[b] - 1, the newest token included) is in slot
                 starts[b] + t.
      starts, lengths   (n,) int32 NumPy arrays. Rows need not be in slot order.
      out        (n, num_heads * d) float32, heads side by side.
    GQA: query head h reads K/V head h // G, with G = num_heads // kv_heads, so K/V head j serves the G
    query heads j*G .. j*G + G - 1 (q.reshape(kv_heads, G, d) lines them up with their K/V head).
    No mask: the new token is the newest position, every cached key is in its past. For each head:
      out[b, h*d:(h+1)*d] = sum_t softmax_t(q_h . k_t / sqrt(d)) v_t

    Compute it as the kernel does (tinyvllm/model/kernels/decode_attention.cuh): cut a row's keys into a few
    contiguous chunks (the kernel has one per thread group; any count gives the same result, try 32),
    and for each chunk and query head keep
      m    the chunk's largest score,
      l    the sum of exp(score - m) over the chunk,
      acc  the sum of exp(score - m) * v over the chunk, a (d,) vector.
    Then merge the chunks with online softmax's rescaling: M = the max of the chunks' m, and
      out = sum_c exp(m_c - M) * acc_c  /  sum_c exp(m_c - M) * l_c.
    A chunk with no key (the last ones, when there are more chunks than keys) has m = -inf and must
    weigh exp(-inf - M) = 0: skip it, or make sure it never computes -inf - -inf (that is NaN).

    What the graders check:
      - slots outside [starts[b], starts[b] + lengths[b]) belong to other sequences or were never
        written: they hold NaN. Slice exactly your row's keys and never touch the others;
      - scores reach the hundreds: exp() of them overflows float32 unless the max is subtracted first;
      - lengths from 1 to 4097, several GQA groupings (1, 3, 4, 8 query heads per K/V head), head_dim
        16, 64 and 128, and a spare row of `out` after yours that must stay NaN.
    Vectorize over the heads of a row (einsum or matmul); loops over rows and chunks are fine.
    """
    raise NotImplementedError("Exercise 5.1: decode_attention")


# Exercise 5.2 (graded on a GPU): the engine's decode attention kernel, tinyvllm/model/kernels/decode_attention.cu,
# in your words. Same template and arguments, so the grader launches it exactly as the engine would:
#   compiled with cupy.RawModule(code=..., options=cuda_ops.NVRTC_OPTIONS (C++17, -I<repo>/tinyvllm/model/kernels
#   and the -D constants of tinyvllm/model/backend/constants.py: DECODE_THREADS, BF16_PER_VECTOR, ...),
#   name_expressions=["decode_attention<64, 4>"]) and fetched with get_function("decode_attention<64, 4>")
#   (also <64, 3>, <128, 1> and <32, 2>); GROUP = num_heads / num_kv_heads query heads per K/V head.
# Launch: grid (num_kv_heads, n), block (256): block (j, b) computes the GROUP query heads j*GROUP ..
#   j*GROUP + GROUP - 1 of row b, the heads that share K/V head j.
# Layout: qkv bf16 (n, qkv_stride): row b's query head h is at qkv + b * qkv_stride + h * HEAD_DIM;
#   k_cache, v_cache bf16 (num_slots, num_kv_heads, HEAD_DIM): token t of row b, K/V head j, is at
#   (starts[b] + t) * num_kv_heads * HEAD_DIM + j * HEAD_DIM, for t < lengths[b] (other slots hold NaN:
#   never read them); out bf16 (n, out_stride), head h of row b at out + b * out_stride + h * HEAD_DIM.
# Compute, for each of the block's query heads: out = softmax(q . k_t * scale over t) @ v, in fp32
#   (__bfloat162float and __float2bfloat16 from cuda_bf16.h convert), with a running max, a running
#   sum and a running output (online softmax: rescale both by expf(m_old - m_new) when the max grows).
# Speed is not graded. The simplest correct design: let warp w of the 8 handle query head w (if
#   w < GROUP); its 32 lanes split the HEAD_DIM values of a row, walk every key in order, reduce each dot
#   product with __shfl_xor_sync, and keep m, l and their slice of the output in registers. You may
#   #include "common.cuh" (warp_sum, INFINITY) from tinyvllm/model/kernels.
DECODE_ATTENTION_KERNEL_SOURCE = r"""
#include <cuda_bf16.h>

template <int HEAD_DIM, int GROUP>
__global__ void decode_attention(const __nv_bfloat16* qkv, const __nv_bfloat16* k_cache,
                                 const __nv_bfloat16* v_cache, const int* starts, const int* lengths,
                                 __nv_bfloat16* out, int num_kv_heads, int qkv_stride, int out_stride,
                                 float scale) {
    // Exercise 5.2: your kernel here
}
"""
