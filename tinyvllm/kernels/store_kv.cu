// Chapter 5 — store_kv: copy each new token's K and V (after RoPE) from the qkv buffer into its cache slot.
// The cache is a flat list of token slots; the slot numbers say where (contiguous in chapter 5, a
// block-table lookup in chapter 6), so this kernel serves both layouts.
// Launch: grid (T), block (128); threads stride over the kv_heads * head_dim values of K, then of V.
// Layout: qkv bf16 (T, qkv_stride): Q heads, K heads, V heads; slots int32 (T,);
//         k_cache, v_cache bf16 (num_slots, kv_heads, head_dim) — one layer.
#include "common.cuh"

extern "C" __global__ void store_kv(const __nv_bfloat16* qkv, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
                                    const int* slots, int q_cols, int kv_cols, int qkv_stride) {
    const __nv_bfloat16* row = qkv + (long long)blockIdx.x * qkv_stride + q_cols;
    long long slot = (long long)slots[blockIdx.x] * kv_cols;
    for (int i = threadIdx.x; i < kv_cols; i += blockDim.x) {
        k_cache[slot + i] = row[i];
        v_cache[slot + i] = row[kv_cols + i];
    }
}
