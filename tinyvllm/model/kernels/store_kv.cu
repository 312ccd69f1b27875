// Chapter 5 — store_kv: copy each new token's K and V (after RoPE) from the qkv buffer into its cache slot.
// The cache is a flat list of token slots; the slot numbers say where (contiguous in chapter 5, a
// block-table lookup in chapter 6), so this kernel serves both layouts.
// Launch: grid (T), block (STORE_KV_THREADS); each thread moves 8 bf16 (one 16-byte vector) of K
//         and the same of V, striding over the kv_cols / 8 vectors.
// Layout: qkv bf16 (T, qkv_stride): Q heads, K heads, V heads; slots int32 (T,);
//         k_cache, v_cache bf16 (num_slots, kv_heads, head_dim) — one layer; kv_cols, q_cols and
//         qkv_stride multiples of 8 (head_dim is), so every vector is 16-byte aligned.
#ifndef STORE_KV_THREADS
#error "STORE_KV_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(STORE_KV_THREADS) store_kv(const __nv_bfloat16* __restrict__ qkv,
        __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ slots,
        int q_cols, int kv_cols, int qkv_stride) {
    const uint4* k = reinterpret_cast<const uint4*>(qkv + (long long)blockIdx.x * qkv_stride + q_cols);
    const uint4* v = reinterpret_cast<const uint4*>(qkv + (long long)blockIdx.x * qkv_stride + q_cols + kv_cols);
    long long slot = (long long)slots[blockIdx.x] * kv_cols / 8;
    for (int i = threadIdx.x; i < kv_cols / 8; i += blockDim.x) {
        uint4 key = k[i], value = v[i];  // both loads in flight before either store
        reinterpret_cast<uint4*>(k_cache)[slot + i] = key;
        reinterpret_cast<uint4*>(v_cache)[slot + i] = value;
    }
}
