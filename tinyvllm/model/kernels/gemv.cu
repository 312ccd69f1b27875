// Chapter 5 — gemv: decode's projections, out (n, N) = x (n, K) @ W (N, K)^T for a handful of rows,
// n <= GEMV_MAX_ROWS.
// With one row per sequence, a decode GEMM reads every weight once and does 2 n FLOPs per weight: pure
// bandwidth. cuBLAS's GEMM kernels are tiled for large n; here each warp streams one weight row with
// 16-byte loads, multiplies it with the n input rows (tiny, and hot in L1/L2), and reduces with shuffles.
// Launch: grid (ceil(N / GEMV_COLUMNS_PER_BLOCK)), block (GEMV_THREADS): GEMV_COLUMNS_PER_BLOCK warps, one
//   output column j = weight row j each (gemv.cuh); instantiated per (NB = n rows, F32_OUT).
// Layout: x bf16 (n, K) row-major; W bf16 (N, K) row-major (the checkpoint's layout, no transpose);
//   out (n, out_stride) bf16 or fp32 (F32_OUT), column j of row b at b * out_stride + j; K % 8 == 0.
#ifndef GEMV_MAX_ROWS
#error "GEMV_MAX_ROWS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef GEMV_COLUMNS_PER_BLOCK
#error "GEMV_COLUMNS_PER_BLOCK comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef GEMV_THREADS
#error "GEMV_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "gemv.cuh"  // gemv_sums and gemv_store: the warp per weight row (which stops unless GEMV_LOADS comes through -D)

static_assert(GEMV_THREADS == 32 * GEMV_COLUMNS_PER_BLOCK, "one warp per output column");

template <int NB, bool F32_OUT>
__global__ void __launch_bounds__(GEMV_THREADS) gemv(const __nv_bfloat16* x, const __nv_bfloat16* w, void* out, int K,
                                                     int N, int out_stride) {
    static_assert(NB >= 1 && NB <= GEMV_MAX_ROWS, "gemm sends more rows to cuBLAS");
    const int j = blockIdx.x * GEMV_COLUMNS_PER_BLOCK + threadIdx.x / 32;
    if (j >= N) return;  // the whole warp leaves together
    float acc[NB] = {};
    gemv_sums<NB>(x, w + (long long)j * K, K, NB, acc);
    gemv_store<NB, F32_OUT>(acc, out, NB, out_stride, j);
}
