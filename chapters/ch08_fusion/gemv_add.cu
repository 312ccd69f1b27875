// Chapter 8 — gemv_add: o_proj and down with the residual add in the epilogue (Exercise 8.5's answer).
//   residual[b, j] += sum_k x[b, k] * w[j, k]      b < NB rows (one per sequence), j < N columns
// Before fusion, the projection wrote `delta` (bf16) and the next add_rms_norm read it back and added it to
// the residual; here the sum goes straight into the fp32 residual, and that kernel and buffer are gone.
// The main loop is the engine's gemv (tinyvllm/model/kernels/gemv.cu): one warp streams one weight row
// with 16-byte loads. The engine's fused kernels live in tinyvllm/model/kernels/fused_decode.cu.
// Launch: grid (ceil(N / GEMV_COLUMNS_PER_BLOCK)), block (GEMV_THREADS): warp w of block i owns
//   column j = i * GEMV_COLUMNS_PER_BLOCK + w.
// Layout: x bf16 (NB, K) row-major; w bf16 (N, K) row-major; residual fp32 (NB, N) row-major, in and out;
//   K % 8 == 0.
#ifndef GEMV_COLUMNS_PER_BLOCK
#error "GEMV_COLUMNS_PER_BLOCK comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef GEMV_THREADS
#error "GEMV_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
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
    // The epilogue: the warp adds up its lanes' partial sums, then lane 0 adds each row's sum into the
    // residual. One warp owns column j, so this read-modify-write needs no atomics.
    #pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = warp_sum(acc[b]);
    if (lane != 0) return;
    #pragma unroll
    for (int b = 0; b < NB; ++b) residual[(long long)b * N + j] += acc[b];
}
