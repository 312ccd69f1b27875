// Chapter 5 (its loads batched in chapter 8) — the heart of every gemv kernel: one warp's dot products of one
// weight row with a handful of input rows, shared by gemv.cu (decode's projections) and fused_decode.cu
// (chapter 8's fused decode layer), so they all sum in the same order.
// A warp owns one output column j = weight row j: lane l takes k = 8l, 8l + 256, 8l + 512, ... (16-byte loads, a
// warp reads 512 contiguous bytes per step), keeps one running sum per input row, and the warp adds its 32 partial
// sums up with shuffles. The weights are read exactly once, so the speed is the number of bytes in flight: each
// lane issues GEMV_LOADS loads before it uses the first (GEMV_LOADS x 512 bytes per warp), where a plain loop
// waits for each.
// Layout: x bf16 (rows, K) row-major, global or shared memory; row: K bf16 contiguous; K % 8 == 0.
#pragma once
#include "common.cuh"
#ifndef GEMV_LOADS
#error "GEMV_LOADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif

constexpr int GEMV_WARP_STEP = 32 * 8;  // k covered by one 16-byte load of every lane of a warp

// acc[b] = x[b] . row for the first `rows` input rows (every caller passes NB)
template <int NB>
__device__ __forceinline__ void gemv_sums(const __nv_bfloat16* x, const __nv_bfloat16* row, int K, int rows,
                                          float (&acc)[NB]) {
    const int lane = threadIdx.x % 32;
    for (int first = lane * 8; first < K; first += GEMV_LOADS * GEMV_WARP_STEP) {
        uint4 w[GEMV_LOADS];
        #pragma unroll
        for (int u = 0; u < GEMV_LOADS; ++u)  // all of them in flight before the first is used
            if (first + u * GEMV_WARP_STEP < K)
                w[u] = *reinterpret_cast<const uint4*>(row + first + u * GEMV_WARP_STEP);
        #pragma unroll
        for (int u = 0; u < GEMV_LOADS; ++u) {  // then used in the order of k: the sums do not depend on GEMV_LOADS
            const int k = first + u * GEMV_WARP_STEP;
            if (k >= K) break;
            float wf[8];
            bf16x8_to_float(w[u], wf);
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                if (b >= rows) break;
                float xf[8];
                bf16x8_to_float(*reinterpret_cast<const uint4*>(x + (long long)b * K + k), xf);
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc[b] += wf[i] * xf[i];
            }
        }
    }
    #pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = warp_sum(acc[b]);
}

// Lane 0 writes the warp's sums: column j of the first `rows` rows of out (bf16, or fp32 for the logits)
template <int NB, bool F32_OUT>
__device__ __forceinline__ void gemv_store(const float (&acc)[NB], void* out, int rows, int out_stride, int j) {
    if (threadIdx.x % 32 != 0) return;
    #pragma unroll
    for (int b = 0; b < NB; ++b) {
        if (b >= rows) break;
        long long at = (long long)b * out_stride + j;
        if (F32_OUT) static_cast<float*>(out)[at] = acc[b];
        else static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16(acc[b]);
    }
}
