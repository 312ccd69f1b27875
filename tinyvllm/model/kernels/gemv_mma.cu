// Chapter 8 — gemv on tensor cores: out (n, N) = x (n, K) @ W (N, K)^T for a decode step of up to
// 8 x MMA_GEMV_MAX_TILES rows, one m16n8k16 chain per 16 weight rows and 8 input rows.
// A decode GEMM reads every weight once and does 2n FLOPs per weight. gemv.cu does them on CUDA cores, 8 FMAs
// per 16-byte load and row, so from 2 rows cuBLAS's tiles win (chapter 5). Here the tensor cores do them: the
// weight rows are the A operand as they lie in memory (row-major, k contiguous) and the input rows the B operand
// (column-major B = x's rows), so nothing is transposed or staged in shared memory.
// The k inside a 32-wide chunk are permuted: lane (g = lane / 4, t = lane % 4) loads 16 bytes, k = 8t .. 8t + 7, of
// weight rows g and g + 8 and of input row g of each 8-row tile, and feeds k 8t .. 8t + 3 to the chunk's first
// product and 8t + 4 .. 8t + 7 to its second, for A and B alike (the fragment layout, mma.cuh, says which lane holds
// which k slot; a dot product does not care which k a slot holds, as long as A and B agree).
// Launch: grid (ceil(N / 16)), block (MMA_GEMV_WARPS x 32): the block's warps share 16 weight rows and split K
//   (warp w takes LOADS consecutive chunks of every MMA_GEMV_WARPS x LOADS), then add their sums in shared memory;
//   instantiated per (NT = 8-row tiles of x, F32_OUT).
// Layout: x bf16 (n, K) row-major; W bf16 (N, K) row-major; out (n, out_stride) bf16 or fp32 (F32_OUT), column j of
//   row b at b * out_stride + j; K % MMA_K == 0.
#ifndef MMA_GEMV_WARPS
#error "MMA_GEMV_WARPS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef MMA_GEMV_LOADS
#error "MMA_GEMV_LOADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef MMA_GEMV_MAX_TILES
#error "MMA_GEMV_MAX_TILES comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef MMA_K
#error "MMA_K comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "mma.cuh"

static_assert(MMA_K == 32, "a chunk is one 16-byte load per lane and row: 4 lanes x 8 bf16");

__device__ __forceinline__ uint4 load16(const __nv_bfloat16* p) { return *reinterpret_cast<const uint4*>(p); }

template <int NT, bool F32_OUT>
__global__ void __launch_bounds__(MMA_GEMV_WARPS * 32) gemv_mma(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                                                void* out, int n, int K, int N, int out_stride) {
    static_assert(NT >= 1 && NT <= MMA_GEMV_MAX_TILES, "gemm sends more rows to cuBLAS");
    constexpr int LOADS = MMA_GEMV_LOADS / NT > 0 ? MMA_GEMV_LOADS / NT : 1;  // chunks in flight: registers cap it
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int tile = blockIdx.x * 16;
    // weight rows past N read row N - 1 (a valid address); their sums are never stored
    const __nv_bfloat16* w_lo = w + (long long)min(tile + g, N - 1) * K + 8 * t;
    const __nv_bfloat16* w_hi = w + (long long)min(tile + g + 8, N - 1) * K + 8 * t;
    float c[NT][4] = {};
    for (int first = warp * LOADS * MMA_K; first < K; first += MMA_GEMV_WARPS * LOADS * MMA_K) {
        uint4 a_lo[LOADS], a_hi[LOADS], b[LOADS][NT];
        #pragma unroll
        for (int u = 0; u < LOADS; ++u) {  // every load in flight before the first product
            const int k = first + u * MMA_K;
            if (k >= K) break;
            a_lo[u] = load16(w_lo + k);
            a_hi[u] = load16(w_hi + k);
            #pragma unroll
            for (int j = 0; j < NT; ++j)  // input rows past n are zeros
                b[u][j] = j * 8 + g < n ? load16(x + (long long)(j * 8 + g) * K + 8 * t + k) : make_uint4(0, 0, 0, 0);
        }
        #pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            if (first + u * MMA_K >= K) break;  // the same for the whole warp: mma.sync needs every lane
            const unsigned first_a[4] = {a_lo[u].x, a_hi[u].x, a_lo[u].y, a_hi[u].y};   // k 8t .. 8t + 3
            const unsigned second_a[4] = {a_lo[u].z, a_hi[u].z, a_lo[u].w, a_hi[u].w};  // k 8t + 4 .. 8t + 7
            #pragma unroll
            for (int j = 0; j < NT; ++j) {
                const unsigned first_b[2] = {b[u][j].x, b[u][j].y}, second_b[2] = {b[u][j].z, b[u][j].w};
                mma_16x8x16(c[j], first_a, first_b);
                mma_16x8x16(c[j], second_a, second_b);
            }
        }
    }
    // the warps' sums added in shared memory; C holds rows g and g + 8, columns (input rows) 2t and 2t + 1
    __shared__ float sums[MMA_GEMV_WARPS][NT][32][4];
    #pragma unroll
    for (int j = 0; j < NT; ++j)
        #pragma unroll
        for (int i = 0; i < 4; ++i) sums[warp][j][lane][i] = c[j][i];
    __syncthreads();
    for (int e = threadIdx.x; e < NT * 32 * 4; e += blockDim.x) {
        const int j = e / 128, l = e / 4 % 32, i = e % 4;
        float sum = 0.0f;
        #pragma unroll
        for (int v = 0; v < MMA_GEMV_WARPS; ++v) sum += sums[v][j][l][i];
        const int col = tile + l / 4 + (i >= 2 ? 8 : 0), row = j * 8 + 2 * (l % 4) + (i & 1);
        if (col >= N || row >= n) continue;
        const long long at = (long long)row * out_stride + col;
        if (F32_OUT) static_cast<float*>(out)[at] = sum;
        else static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16(sum);
    }
}
