// Chapter 3 — causal prefill attention, flash style: online softmax over key tiles, tensor cores.
// For each query row i and head h (GQA: K/V head h / (num_heads / num_kv_heads)):
//   out[i, h] = sum_j softmax_j(q_i . k_j * scale) v_j over keys j <= i,
// computed tile by tile with a running max m and sum l, so the (T x T) score matrix never exists.
// Launch: grid (ceil(T / 64), num_heads), block (128) = 4 warps x 16 query rows; dynamic shared
//         memory (see smem_bytes in backend/cuda_ops.py). Needs head_dim % 16 == 0 (WMMA tiles).
// Layout: qkv bf16 (T, row_stride) = [Q heads | K heads | V heads] per row, after RoPE;
//         out bf16 (T, out_stride), head h in columns h*head_dim .. (h+1)*head_dim.
#include "common.cuh"
#include <mma.h>
using namespace nvcuda;

constexpr int BQ = 64, BK = 64, WARPS = 4, TILE = 16;
// Shared-memory rows are padded (+8 bf16 / +4 floats) so the 16 rows a warp touches at once fall in
// different banks; WMMA needs the padded strides to stay multiples of 16 bytes.
__host__ __device__ constexpr int ld_bf16(int cols) { return cols + 8; }
__host__ __device__ constexpr int ld_f32(int cols) { return cols + 4; }
typedef wmma::fragment<wmma::accumulator, TILE, TILE, TILE, float> Acc;

// Copy 64 rows of head_dim bf16 (zeros past `tokens`) from global to shared, 16 bytes at a time.
__device__ void load_tile(__nv_bfloat16* dst, const __nv_bfloat16* src, int first_row, int tokens,
                          int head_dim, int row_stride) {
    int chunks = head_dim / 8;
    for (int c = threadIdx.x; c < BQ * chunks; c += blockDim.x) {
        int r = c / chunks, col = (c % chunks) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (first_row + r < tokens) v = *(const uint4*)(src + (long long)(first_row + r) * row_stride + col);
        *(uint4*)(dst + r * ld_bf16(head_dim) + col) = v;
    }
}

extern "C" __global__ void prefill_attention(const __nv_bfloat16* qkv, __nv_bfloat16* out, int tokens,
                                             int num_heads, int num_kv_heads, int head_dim, int row_stride,
                                             int out_stride, float scale) {
    extern __shared__ __align__(32) unsigned char smem[];
    const int D = head_dim, LDQ = ld_bf16(D), LDS = ld_f32(BK), LDO = ld_f32(D), LDP = ld_bf16(BK);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int head = blockIdx.y, kv_head = head / (num_heads / num_kv_heads), q0 = blockIdx.x * BQ;
    __nv_bfloat16* Qs = (__nv_bfloat16*)smem;                     // (BQ, D) query tile
    __nv_bfloat16* Ks = Qs + BQ * LDQ;                             // (BK, D) key tile
    __nv_bfloat16* Vs = Ks + BK * LDQ;                             // (BK, D) value tile
    float* S = (float*)(Vs + BK * LDQ) + warp * TILE * LDS;        // this warp's (16, BK) scores
    float* O = (float*)(Vs + BK * LDQ) + WARPS * TILE * LDS + warp * TILE * LDO;  // its (16, D) output
    __nv_bfloat16* P = (__nv_bfloat16*)((float*)(Vs + BK * LDQ) + WARPS * TILE * (LDS + LDO)) + warp * TILE * LDP;

    const int q_cols = num_heads * D, kv_cols = num_kv_heads * D;
    load_tile(Qs, qkv + head * D, q0, tokens, D, row_stride);
    // Lanes r and r + 16 own query row r of this warp: its running max and sum, and the even
    // (h = 0) or odd (h = 1) columns of its scores and output.
    const int r = lane % 16, h = lane / 16, query = q0 + warp * TILE + r;
    for (int c = h; c < D; c += 2) O[r * LDO + c] = 0.0f;
    float m = -INFINITY, l = 0.0f;

    const int last_key = min(q0 + BQ, tokens) - 1;  // causal: later key tiles are fully masked
    for (int k0 = 0; k0 <= last_key; k0 += BK) {
        __syncthreads();  // everyone is done with the previous K/V tile
        load_tile(Ks, qkv + q_cols + kv_head * D, k0, tokens, D, row_stride);
        load_tile(Vs, qkv + q_cols + kv_cols + kv_head * D, k0, tokens, D, row_stride);
        __syncthreads();

        // S = Q_w K^T on tensor cores: K row-major in shared memory is K^T column-major.
        for (int n = 0; n < BK / TILE; n++) {
            Acc acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int k = 0; k < D / TILE; k++) {
                wmma::fragment<wmma::matrix_a, TILE, TILE, TILE, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, TILE, TILE, TILE, __nv_bfloat16, wmma::col_major> b;
                wmma::load_matrix_sync(a, Qs + warp * TILE * LDQ + k * TILE, LDQ);
                wmma::load_matrix_sync(b, Ks + n * TILE * LDQ + k * TILE, LDQ);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(S + n * TILE, acc, LDS, wmma::mem_row_major);
        }
        __syncwarp();

        // Online softmax on this lane's half of row r; lane ^ 16 holds the other half.
        float tile_max = -INFINITY;
        for (int c = h; c < BK; c += 2) {
            int key = k0 + c;
            float s = (key <= query && key < tokens) ? S[r * LDS + c] * scale : -INFINITY;
            S[r * LDS + c] = s;
            tile_max = fmaxf(tile_max, s);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 16));
        float m_new = fmaxf(m, tile_max);
        // A row with no visible key yet (m_new = -inf) must not compute exp(-inf - -inf) = NaN.
        float alpha = (m_new == -INFINITY) ? 1.0f : __expf(m - m_new);
        float sum = 0.0f;
        for (int c = h; c < BK; c += 2) {
            float p = (m_new == -INFINITY) ? 0.0f : __expf(S[r * LDS + c] - m_new);
            sum += p;
            P[r * LDP + c] = __float2bfloat16(p);
        }
        sum += __shfl_xor_sync(0xffffffff, sum, 16);
        l = l * alpha + sum;
        m = m_new;
        for (int c = h; c < D; c += 2) O[r * LDO + c] *= alpha;
        __syncwarp();

        // O += P V on tensor cores.
        for (int n = 0; n < D / TILE; n++) {
            Acc acc;
            wmma::load_matrix_sync(acc, O + n * TILE, LDO, wmma::mem_row_major);
            for (int k = 0; k < BK / TILE; k++) {
                wmma::fragment<wmma::matrix_a, TILE, TILE, TILE, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, TILE, TILE, TILE, __nv_bfloat16, wmma::row_major> b;
                wmma::load_matrix_sync(a, P + k * TILE, LDP);
                wmma::load_matrix_sync(b, Vs + k * TILE * LDQ + n * TILE, LDQ);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(O + n * TILE, acc, LDO, wmma::mem_row_major);
        }
        __syncwarp();
    }

    if (query < tokens) {
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        __nv_bfloat16* dst = out + (long long)query * out_stride + head * D;
        for (int c = h; c < D; c += 2) dst[c] = __float2bfloat16(O[r * LDO + c] * inv);
    }
}
