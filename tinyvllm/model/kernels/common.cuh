// Shared helpers for every tinyvllm kernel: bf16 <-> fp32 and warp/block reductions.
// bf16 values travel as __nv_bfloat16 (CuPy holds them as uint16 bits); all math is fp32.
#pragma once
#include <cuda_bf16.h>

#ifndef INFINITY  // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024): warps reduce, then warp 0.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = (threadIdx.x < blockDim.x / 32) ? partial[lane] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    return partial[0];
}

// block_sum of NB values at once, one barrier round for all: each value summed exactly as block_sum sums one
// (its warp's shuffle tree, then a tree over the warps' partial sums), every warp getting the totals
template <int NB>
__device__ __forceinline__ void block_sums(float (&v)[NB]) {
    __shared__ float partial[NB][32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    #pragma unroll
    for (int b = 0; b < NB; ++b) v[b] = warp_sum(v[b]);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) {
        #pragma unroll
        for (int b = 0; b < NB; ++b) partial[b][warp] = v[b];
    }
    __syncthreads();
    #pragma unroll
    for (int b = 0; b < NB; ++b) v[b] = warp_sum(lane < blockDim.x / 32 ? partial[b][lane] : 0.0f);
}

// What a bf16 buffer would hand the next kernel: v rounded to bf16 (round to nearest even) and widened back
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16(v)); }

// 4 bf16 values, loaded as one 8-byte vector, to fp32 (p 8-byte aligned)
__device__ __forceinline__ void bf16x4_to_float(const __nv_bfloat16* p, float* out) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
    float2 a = __bfloat1622float2(pairs[0]), b = __bfloat1622float2(pairs[1]);
    out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}

// 4 fp32 values rounded to bf16 and stored as one 8-byte vector (p 8-byte aligned)
__device__ __forceinline__ void float_to_bf16x4(const float* v, __nv_bfloat16* p) {
    __nv_bfloat162 pairs[2] = {__floats2bfloat162_rn(v[0], v[1]), __floats2bfloat162_rn(v[2], v[3])};
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(pairs);
}

// 8 bf16 values, loaded as one 16-byte vector, to fp32
__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float* out) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(pairs[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}
