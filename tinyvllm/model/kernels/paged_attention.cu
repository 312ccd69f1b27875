// Chapter 6 — paged decode attention: chapter 5's decode attention, reading each sequence's keys through
// its block table. Token t of row b lives in physical block block_tables[b][t / BLOCK_SIZE], at offset
// t % BLOCK_SIZE (BLOCK_SIZE tokens, tinyvllm/model/kv_pool.py);
// the last block may be partly filled (t < lengths[b] says which slots are real). The online softmax,
// the GQA grouping and the merge are chapter 5's, in decode_attention.cuh.
// Launch: grid (num_kv_heads, n, splits), block (DECODE_THREADS); instantiated per (HEAD_DIM, GROUP).
//   splits > 1 (few sequences, chapter 7): block z takes the z-th stretch of split_span keys of the context
//   (`splits` equal parts; in the batch-invariant mode, split_tokens > 0, parts sized by the row's own length)
//   and writes to partial (n, num_heads, splits, HEAD_DIM + 2) fp32; merge_splits then writes out.
// Layout: qkv bf16 (n, qkv_stride), Q heads from column 0; k_cache, v_cache bf16 (num_blocks * BLOCK_SIZE,
//   kv_heads, HEAD_DIM) — one layer of the pool; block_tables int32 (n, max_blocks), -1 past the end;
//   lengths int32 (n,); out bf16 (n, out_stride), heads side by side.
#ifndef BLOCK_SIZE
#error "BLOCK_SIZE comes from Python (tinyvllm/model/kv_pool.py, passed on by backend/constants.py) through -D"
#endif
#pragma once
#include "decode_attention.cuh"  // which stops unless DECODE_THREADS and BF16_PER_VECTOR come through -D

// The work of one block of paged_attention: K/V head kv_head of row b, split `split` of `splits`.
template <int HEAD_DIM, int GROUP>
__device__ void paged_attention_item(int kv_head, int b, int split, int splits, const __nv_bfloat16* qkv,
                                     const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                                     const int* block_tables, int max_blocks, const int* lengths, __nv_bfloat16* out,
                                     int num_kv_heads, int qkv_stride, int out_stride, float scale, float* partial,
                                     int split_tokens) {
    const int* table = block_tables + (long long)b * max_blocks;
    const long long head_offset = (long long)kv_head * HEAD_DIM;
    const int span = split_span(lengths[b], splits, split_tokens), begin = split * span;
    if (split > 0 && begin >= lengths[b]) return;  // past the row's end: merge_splits reads the row's own parts only
    const bool whole = span >= lengths[b];          // one part: its block writes out, merge_splits skips the row
    float* mine = whole ? nullptr
                        : partial + (((long long)b * num_kv_heads + kv_head) * GROUP * splits + split) * (HEAD_DIM + 2);
    decode_attention_block<HEAD_DIM, GROUP>(
        qkv + (long long)b * qkv_stride + kv_head * GROUP * HEAD_DIM, k_cache + head_offset,
        v_cache + head_offset, (long long)num_kv_heads * HEAD_DIM, begin, min(lengths[b], begin + span),
        [=](int t) { return (long long)table[t / BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE; },
        out + (long long)b * out_stride + kv_head * GROUP * HEAD_DIM, scale, mine, splits * (HEAD_DIM + 2));
}

template <int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(DECODE_THREADS)
paged_attention(const __nv_bfloat16* qkv, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                const int* block_tables, int max_blocks, const int* lengths, __nv_bfloat16* out, int num_kv_heads,
                int qkv_stride, int out_stride, float scale, float* partial, int split_tokens) {
    paged_attention_item<HEAD_DIM, GROUP>(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.z, qkv, k_cache, v_cache,
                                          block_tables, max_blocks, lengths, out, num_kv_heads, qkv_stride,
                                          out_stride, scale, partial, split_tokens);
}
