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

// Chapter 7 — gemv_rows: the batch-invariant GEMM (LLM(batch_invariant=True)), out (T, N) = x (T, K) @ W (N, K)^T
// for any T: gemv's arithmetic on groups of GEMV_MAX_ROWS rows. Every row's sum runs in the same order (its
// lane-strided k, then the warp's shuffle tree) whatever T is and whichever rows share its group, so a row's
// result does not depend on its batch — unlike cuBLAS, whose tiling and split of K follow the shape. The price:
// CUDA cores, not tensor cores, and the weights read once per group of rows (from L2 when the groups run together).
// Launch: grid (ceil(T / GEMV_MAX_ROWS), ceil(N / GEMV_COLUMNS_PER_BLOCK)): the groups of rows vary fastest, so the
//   blocks that run at once share their weight rows in L2; block (GEMV_THREADS), one output column per warp.
// Layout: as gemv's; x (T, K) row-major, out (T, out_stride).
template <bool F32_OUT>
__global__ void __launch_bounds__(GEMV_THREADS) gemv_rows(const __nv_bfloat16* x, const __nv_bfloat16* w, void* out,
                                                          int T, int K, int N, int out_stride) {
    const int first = blockIdx.x * GEMV_MAX_ROWS, rows = min(GEMV_MAX_ROWS, T - first);
    const int j = blockIdx.y * GEMV_COLUMNS_PER_BLOCK + threadIdx.x / 32;
    if (j >= N) return;
    float acc[GEMV_MAX_ROWS] = {};
    gemv_sums<GEMV_MAX_ROWS>(x + (long long)first * K, w + (long long)j * K, K, rows, acc);
    char* group_out = static_cast<char*>(out) + (long long)first * out_stride * (F32_OUT ? 4 : 2);  // its first row
    gemv_store<GEMV_MAX_ROWS, F32_OUT>(acc, group_out, rows, out_stride, j);
}
