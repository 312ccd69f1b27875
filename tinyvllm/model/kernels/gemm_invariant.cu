// Chapter 7 — gemm_invariant: the batch-invariant GEMM on tensor cores, out (T, N) = x (T, K) @ W (N, K)^T for any T.
// The rule it keeps: the order of a row's sum must not depend on its neighbours. Every output element (i, j) is ONE
// chain of m16n8k16 tensor-core products over k, in 32-k chunks in increasing k, each chunk as the same two
// instructions with the same assignment of its 32 k to their slots — whatever the block's tile shape. The tile
// (chosen by T for speed: constants.INVARIANT_GEMM_TILES) decides which elements a block computes, never the order of
// an element's sum: no split of K, no sum across warps, no extra steps past K. cuBLAS chooses its kernel, tiles and
// split of K from the shape, which is why the default mode's row i has other bits at T = 3 and T = 300.
// The k slots: lane (g = lane / 4, t = lane % 4) reads 16 bytes, k = c + 8t .. c + 8t + 7 of the chunk at c, from its
// A rows (g, g + 8) and its B column (g); the first instruction takes k 8t .. 8t + 3 into its slots 2t, 2t + 1, 2t + 8,
// 2t + 9 (mma.cuh), the second 8t + 4 .. 8t + 7. A and B agree on the mapping, so the sum is x_i . w_j all the same,
// and the fragments come straight from shared memory, one 16-byte load each (no ldmatrix, no shuffles).
// Launch: grid (ceil(N / BN), ceil(T / BM)), block (WARPS_M * WARPS_N * 32); BM = WARPS_M * TM * 16 rows and
//   BN = WARPS_N * TN * 8 columns per block, TM x TN m16n8 tiles per warp. Dynamic shared memory
//   constants.GemmTile.smem: STAGES stages of the A (BM x BK) and B (BN x BK) tiles, bf16, row stride
//   LD (a quarter warp's 8 reads, rows r and r + 1, land in different banks); cp.async fills
//   stage s + STAGES - 1 while the warps compute on stage s.
// Layout: x bf16 (T, K) row-major; W bf16 (N, K) row-major (the checkpoint's, no transpose); out bf16 or fp32
//   (F32_OUT) (T, out_stride); K % 32 == 0.
#ifndef INVARIANT_CHUNK
#error "INVARIANT_CHUNK comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "mma.cuh"  // mma_16x8x16 and the cp.async copies

static_assert(INVARIANT_CHUNK == 32, "a chunk is two m16n8k16 instructions: 8 k per lane, one 16-byte load");

// LD: the shared-memory row stride in bf16 (constants.GemmTile.row_stride), 64 bytes modulo 128 so that the rows r
// and r + 1 a quarter warp reads share no bank
template <int WARPS_M, int WARPS_N, int TM, int TN, int BK, int LD, int STAGES, bool F32_OUT>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32)
gemm_invariant(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, void* __restrict__ out,
               int T, int K, int N, int out_stride) {
    constexpr int BM = WARPS_M * TM * 16, BN = WARPS_N * TN * 8;
    static_assert(BK % INVARIANT_CHUNK == 0 && STAGES >= 2, "whole chunks per stage; one stage loads, one computes");
    static_assert(LD >= BK && (2 * LD) % 128 == 64, "rows r and r + 1 of a tile in different banks");
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem);  // STAGES x BM rows, then STAGES x BN rows
    __nv_bfloat16* Bs = As + STAGES * BM * LD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int wm = (warp / WARPS_N) * TM * 16, wn = (warp % WARPS_N) * TN * 8;  // the warp's corner in the block tile

    // Rows past T (or N) are not copied: whatever shared memory holds there only reaches rows (columns) not stored
    auto load_stage = [&](int stage, int k0) {
        for (int c = threadIdx.x; c < (BM + BN) * (BK / 8); c += blockDim.x) {
            const int r = c / (BK / 8), col = (c % (BK / 8)) * 8;
            if (k0 + col >= K) continue;
            if (r < BM) {
                if (m0 + r < T) copy_16_async(As + (stage * BM + r) * LD + col, x + (long long)(m0 + r) * K + k0 + col, true);
            } else if (n0 + r - BM < N) {
                copy_16_async(Bs + (stage * BN + r - BM) * LD + col, w + (long long)(n0 + r - BM) * K + k0 + col, true);
            }
        }
        commit_copies();  // one group per stage, empty or not: wait_copies counts them
    };

    float acc[TM][TN][4] = {};
    auto compute_stage = [&](int stage, int k0) {
        const __nv_bfloat16* A = As + (stage * BM + wm + g) * LD + 8 * t;
        const __nv_bfloat16* B = Bs + (stage * BN + wn + g) * LD + 8 * t;
        #pragma unroll
        for (int c = 0; c < BK; c += INVARIANT_CHUNK) {
            if (k0 + c >= K) break;  // the last stage may be partly past K: no extra steps on zeros
            uint4 a[TM][2], b[TN];
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                a[i][0] = *reinterpret_cast<const uint4*>(A + (i * 16) * LD + c);      // row g
                a[i][1] = *reinterpret_cast<const uint4*>(A + (i * 16 + 8) * LD + c);  // row g + 8
            }
            #pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = *reinterpret_cast<const uint4*>(B + (j * 8) * LD + c);
            // every tile's first instruction, then every tile's second: an element's two steps run in order, and
            // TM x TN independent products lie between them to hide the tensor cores' latency
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int j = 0; j < TN; ++j) {  // k 8t .. 8t + 3 of the chunk
                    const unsigned a0[4] = {a[i][0].x, a[i][1].x, a[i][0].y, a[i][1].y}, b0[2] = {b[j].x, b[j].y};
                    mma_16x8x16(acc[i][j], a0, b0);
                }
            }
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int j = 0; j < TN; ++j) {  // k 8t + 4 .. 8t + 7
                    const unsigned a1[4] = {a[i][0].z, a[i][1].z, a[i][0].w, a[i][1].w}, b1[2] = {b[j].z, b[j].w};
                    mma_16x8x16(acc[i][j], a1, b1);
                }
            }
        }
    };

    const int steps = (K + BK - 1) / BK;
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load_stage(s, s * BK);
        else commit_copies();
    }
    for (int s = 0; s < steps; ++s) {
        wait_copies<STAGES - 2>();  // stage s has landed (one group per step; STAGES - 2 later ones may still run)
        __syncthreads();            // ... for every thread's copies, and every warp is done with step s - 1's stage
        const int next = s + STAGES - 1;  // refill the stage step s - 1 used
        if (next < steps) load_stage(next % STAGES, next * BK);
        else commit_copies();
        compute_stage(s % STAGES, s * BK);
    }

    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        #pragma unroll
        for (int j = 0; j < TN; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {  // c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8
                const int row = m0 + wm + i * 16 + g + (e / 2) * 8, col = n0 + wn + j * 8 + 2 * t + e % 2;
                if (row >= T || col >= N) continue;
                const long long at = (long long)row * out_stride + col;
                if (F32_OUT) static_cast<float*>(out)[at] = acc[i][j][e];
                else static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16(acc[i][j][e]);
            }
        }
    }
}
