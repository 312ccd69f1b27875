// Chapter 5 — decode attention over the contiguous KV cache: one new query per (sequence, query head)
// against every cached key of its sequence. The work itself is in decode_attention.cuh (shared with
// chapter 6's paged kernel); this kernel only says where the keys are: token t of row b in slot starts[b] + t.
// Launch: grid (num_kv_heads, n), block (DECODE_THREADS); instantiated per (HEAD_DIM, GROUP),
//   GROUP = num_heads / num_kv_heads query heads per block.
// Layout: qkv bf16 (n, qkv_stride), Q heads from column 0; k_cache, v_cache bf16 (num_slots, kv_heads,
//   HEAD_DIM) — one layer; starts, lengths int32 (n,); out bf16 (n, out_stride), heads side by side.
#include "decode_attention.cuh"  // which stops unless DECODE_THREADS and BF16_PER_VECTOR come through -D

template <int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(DECODE_THREADS)
decode_attention(const __nv_bfloat16* qkv, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                 const int* starts, const int* lengths, __nv_bfloat16* out, int num_kv_heads, int qkv_stride,
                 int out_stride, float scale) {
    const int kv_head = blockIdx.x, b = blockIdx.y, start = starts[b];
    const long long head_offset = (long long)kv_head * HEAD_DIM;
    decode_attention_block<HEAD_DIM, GROUP>(
        qkv + (long long)b * qkv_stride + kv_head * GROUP * HEAD_DIM, k_cache + head_offset,
        v_cache + head_offset, (long long)num_kv_heads * HEAD_DIM, 0, lengths[b],
        [=](int t) { return (long long)start + t; }, out + (long long)b * out_stride + kv_head * GROUP * HEAD_DIM,
        scale);
}
