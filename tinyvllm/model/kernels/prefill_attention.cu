// Chapter 3 — causal prefill attention, flash style: online softmax over key tiles, on tensor cores.
// For each query row i and head h (GQA: K/V head h / (num_heads / num_kv_heads)):
//   out[i, h] = sum_j softmax_j(q_i . k_j * scale) v_j over keys j <= start + i,
// computed PREFILL_KEY_TILE keys at a time with a running max m and sum l, so the (T x T) scores never exist.
// Two kernels share the code and differ only in where a key row is read:
//   prefill_attention_d{D}  a whole prompt (start = 0): keys are the K and V columns of the same qkv rows;
//   chunk_attention_d{D}    chapter 7: a chunk of a prompt at positions start .. start + T - 1, after tokens
//                           already in the paged pool (a cached prefix, earlier chunks); key j is read from
//                           slot block_table[j / BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE of k_cache / v_cache
//                           (the chunk's own K/V were stored there first), for j < start + T.
// Launch: grid (num_heads, ceil(T / PREFILL_TILE)), block (PREFILL_THREADS) = PREFILL_TILE / PREFILL_WARP_ROWS
//         warps x PREFILL_WARP_ROWS query rows (every K/V tile loaded serves PREFILL_TILE queries);
//         query tiles in reverse order, all heads' longest first (bench/attention_tiles.py); dynamic shared memory
//         constants.prefill_smem(head_dim): the Q tile and PREFILL_KV_STAGES stages of K and V tiles, bf16, rows
//         padded by PREFILL_SMEM_PAD — cp.async fills one stage while the warps compute on the other, and ldmatrix
//         reads the tensor-core fragments out of them.
//         One kernel per head_dim of constants.PREFILL_HEAD_DIMS (ATTENTION_KERNEL at the end of this file):
//         register arrays need a compile-time size.
// Layout: qkv bf16 (T, row_stride) = [Q heads | K heads | V heads] per row, after RoPE;
//         k_cache, v_cache bf16 (slots, num_kv_heads, head_dim) — one layer of the pool; block_table int32;
//         out bf16 (T, out_stride), head h in columns h*head_dim .. (h+1)*head_dim.
// Scores, probabilities and the output accumulator live in registers, in the fragment layout of
// the m16n8k16 tensor-core instruction: thread (g = lane / 4, t = lane % 4) holds rows g and g + 8,
// columns 2t and 2t + 1 of every 16 x 8 tile — so each thread knows which row every value belongs to.
#ifndef PREFILL_TILE
#error "PREFILL_TILE comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef PREFILL_KEY_TILE
#error "PREFILL_KEY_TILE comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef PREFILL_WARP_ROWS
#error "PREFILL_WARP_ROWS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef PREFILL_THREADS
#error "PREFILL_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef PREFILL_BLOCKS_PER_SM
#error "PREFILL_BLOCKS_PER_SM comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef PREFILL_KV_STAGES
#error "PREFILL_KV_STAGES comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef PREFILL_SMEM_PAD
#error "PREFILL_SMEM_PAD comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef BLOCK_SIZE
#error "BLOCK_SIZE comes from Python (tinyvllm/model/kv_pool.py, passed on by backend/constants.py) through -D"
#endif
#include "mma.cuh"  // mma_16x8x16 and the cp.async copies

constexpr int BQ = PREFILL_TILE, BK = PREFILL_KEY_TILE;  // query rows per block, keys per K/V tile
static_assert(PREFILL_WARP_ROWS % 16 == 0 && PREFILL_THREADS == BQ / PREFILL_WARP_ROWS * 32,
              "one warp per PREFILL_WARP_ROWS query rows, whole m16n8k16 tiles");
static_assert(PREFILL_KV_STAGES == 2, "the loop below alternates between two K/V stages");
static_assert(BK % 16 == 0 && PREFILL_SMEM_PAD % 8 == 0, "whole mma tiles; padded rows stay 16-byte aligned");

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low 16 bits
    return *reinterpret_cast<unsigned*>(&v);
}

// Start copying TILE rows of D bf16 from global into a shared tile with row stride D + PREFILL_SMEM_PAD (the
// padding puts the 8 rows an ldmatrix reads at once in different banks), 16 bytes per cp.async: the copy runs
// while the warps compute on the other stage. Rows from `rows` on are zero-filled (a source size of 0 reads
// nothing; row 0's address stands in, since row(j) may not exist there). row(j): where row j starts in global.
template <int D, int TILE, typename Row>
__device__ void load_tile_async(__nv_bfloat16* dst, Row row, int first_row, int rows) {
    for (int c = threadIdx.x; c < TILE * D / 8; c += blockDim.x) {
        int r = c / (D / 8), col = (c % (D / 8)) * 8;
        bool inside = first_row + r < rows;
        const __nv_bfloat16* src = row(inside ? first_row + r : 0) + col;
        copy_16_async(dst + r * (D + PREFILL_SMEM_PAD) + col, src, inside);
    }
    commit_copies();
}

// Four 8x8 bf16 matrices from shared memory, one row address per lane (lanes 8i .. 8i+7: matrix i); TRANS
// transposes each, which turns V's key-major rows into the B fragment of P V.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const __nv_bfloat16* row) {
    unsigned at = (unsigned)__cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}

__device__ __forceinline__ float exp2_approx(float x) {  // one MUFU.EX2; exp2(-inf) = 0, denormals flushed
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Query rows 0 .. tokens - 1 (positions start ..) against keys 0 .. start + tokens - 1: k_row(j), v_row(j).
// A warp holds R = PREFILL_WARP_ROWS / 16 groups of 16 query rows: every K and V fragment it loads feeds R
// products. Index [r][h] below: row group r, and h = 0 / 1 for the thread's rows g and g + 8 in that group.
template <int D, typename KRow, typename VRow>
__device__ void attention(const __nv_bfloat16* qkv, __nv_bfloat16* out, int tokens, int start, int num_heads,
                          int num_kv_heads, int row_stride, int out_stride, float scale, KRow k_row, VRow v_row) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int LD = D + PREFILL_SMEM_PAD, R = PREFILL_WARP_ROWS / 16;
    __nv_bfloat16* Qs = (__nv_bfloat16*)smem;
    __nv_bfloat16* Ks = Qs + BQ * LD;                   // PREFILL_KV_STAGES K tiles, then as many V tiles
    __nv_bfloat16* Vs = Ks + PREFILL_KV_STAGES * BK * LD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // Blocks start in blockIdx order, x fastest: every head's last query tile (the most keys under the causal
    // mask) first, then every head's next-to-last, ... so no long block starts when the others are finishing
    const int head = blockIdx.x, kv_head = head / (num_heads / num_kv_heads), q0 = (gridDim.y - 1 - blockIdx.y) * BQ;
    const int warp_row = q0 + warp * PREFILL_WARP_ROWS;     // this warp's first query row
    const float scale_log2 = scale * 1.4426950408889634f;   // exp(x) = exp2(x log2 e): exp2 is one instruction
    const int keys = start + tokens;
    const int last_key = start + min(q0 + BQ, tokens) - 1;  // causal: later key tiles are fully masked
    const int warp_first = start + warp_row;                 // the position of this warp's first query row
    auto load_kv = [&](int k0, int stage) {                  // one commit group: the K and V tiles at key k0
        load_tile_async<D, BK>(Ks + stage * BK * LD, [=](int j) { return k_row(j) + kv_head * D; }, k0, keys);
        load_tile_async<D, BK>(Vs + stage * BK * LD, [=](int j) { return v_row(j) + kv_head * D; }, k0, keys);
    };

    load_tile_async<D, BQ>(Qs, [=](int j) { return qkv + (long long)j * row_stride + head * D; }, q0, tokens);
    load_kv(0, 0);
    unsigned qf[R][D / 16][4];  // this warp's query rows as A fragments, loaded once
    float o[R][D / 8][4] = {};
    float m[R][2], l[R][2];     // running max (of the unscaled scores) and this thread's share of the sum
    #pragma unroll
    for (int r = 0; r < R; r++) m[r][0] = m[r][1] = -INFINITY, l[r][0] = l[r][1] = 0.0f;

    for (int k0 = 0, stage = 0; k0 <= last_key; k0 += BK, stage ^= 1) {
        if (k0 + BK <= last_key) {       // the next tile's copy overlaps this tile's products
            load_kv(k0 + BK, stage ^ 1);
            wait_copies<2>();            // Q's and this tile's groups are done; the next one may still run
        } else {
            wait_copies<0>();
        }
        __syncthreads();
        if (k0 == 0)
            #pragma unroll
            for (int r = 0; r < R; r++)
                #pragma unroll
                for (int k = 0; k < D / 16; k++) {
                    const __nv_bfloat16* q = Qs + (warp * PREFILL_WARP_ROWS + r * 16 + g) * LD + k * 16 + 2 * t;
                    qf[r][k][0] = *(const unsigned*)q;
                    qf[r][k][1] = *(const unsigned*)(q + 8 * LD);
                    qf[r][k][2] = *(const unsigned*)(q + 8);
                    qf[r][k][3] = *(const unsigned*)(q + 8 * LD + 8);
                }
        const __nv_bfloat16* Kt = Ks + stage * BK * LD;
        const __nv_bfloat16* Vt = Vs + stage * BK * LD;
        if (k0 <= warp_first + PREFILL_WARP_ROWS - 1) {  // else every key of this tile is after all this warp's rows
            // S = Q K^T: K's rows are exactly the column-major B operand; one ldmatrix feeds two key groups.
            float s[R][BK / 8][4] = {};
            #pragma unroll
            for (int n = 0; n < BK / 8; n += 2)
                #pragma unroll
                for (int k = 0; k < D / 16; k++) {
                    unsigned b[4];
                    ldmatrix_x4<false>(b, Kt + (n * 8 + (lane / 16) * 8 + lane % 8) * LD + k * 16 + (lane / 8) % 2 * 8);
                    #pragma unroll
                    for (int r = 0; r < R; r++) {
                        mma_16x8x16(s[r][n], qf[r][k], b);
                        mma_16x8x16(s[r][n + 1], qf[r][k], b + 2);
                    }
                }

            // Online softmax on the unscaled scores (scale > 0 keeps their order): mask (only a tile that reaches
            // past a row's position or the last key needs it), new running max, rescale, exponentiate with the
            // scale folded into one fused multiply-add.
            const bool masked = k0 + BK - 1 > warp_first || k0 + BK > keys;
            unsigned p[R][BK / 16][4];  // probabilities, already in the A-fragment layout of the next product
            #pragma unroll
            for (int r = 0; r < R; r++) {
                float tile[2] = {-INFINITY, -INFINITY};
                #pragma unroll
                for (int n = 0; n < BK / 8; n++)
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {  // e: columns 2t + e % 2 of rows g (e < 2) and g + 8
                        int key = k0 + n * 8 + 2 * t + e % 2, pos = warp_first + r * 16 + g + e / 2 * 8;
                        if (masked && (key > pos || key >= keys)) s[r][n][e] = -INFINITY;
                        tile[e / 2] = fmaxf(tile[e / 2], s[r][n][e]);
                    }
                float shift[2];  // the new max in exp2 units
                #pragma unroll
                for (int h = 0; h < 2; h++) {
                    #pragma unroll
                    for (int x = 1; x < 4; x <<= 1)  // the 4 threads sharing a row hold its BK columns
                        tile[h] = fmaxf(tile[h], __shfl_xor_sync(0xffffffff, tile[h], x));
                    float new_max = fmaxf(m[r][h], tile[h]);
                    // A row with no visible key yet (max -inf) shifts by 0: exp2(-inf - 0) = 0, never -inf + inf = NaN
                    shift[h] = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
                    float alpha = exp2_approx(fmaf(m[r][h], scale_log2, -shift[h]));  // 0 while nothing was seen
                    m[r][h] = new_max;
                    l[r][h] *= alpha;
                    #pragma unroll
                    for (int n = 0; n < D / 8; n++) o[r][n][2 * h] *= alpha, o[r][n][2 * h + 1] *= alpha;
                }
                #pragma unroll
                for (int n = 0; n < BK / 8; n++) {
                    float e[4];
                    #pragma unroll
                    for (int i = 0; i < 4; i++) e[i] = exp2_approx(fmaf(s[r][n][i], scale_log2, -shift[i / 2]));
                    l[r][0] += e[0] + e[1], l[r][1] += e[2] + e[3];
                    p[r][n / 2][(n % 2) * 2] = pack_bf16(e[0], e[1]);      // row g:   keys 2t, 2t+1 (+8 for odd n)
                    p[r][n / 2][(n % 2) * 2 + 1] = pack_bf16(e[2], e[3]);  // row g+8
                }
            }

            // O += P V: ldmatrix.trans turns 8 keys x 8 value columns into the B fragment (keys 2t, 2t+1 of
            // column g); one call feeds two groups of 8 columns.
            #pragma unroll
            for (int n = 0; n < D / 8; n += 2)
                #pragma unroll
                for (int k = 0; k < BK / 16; k++) {
                    unsigned b[4];
                    ldmatrix_x4<true>(b, Vt + (k * 16 + (lane / 8) % 2 * 8 + lane % 8) * LD + n * 8 + (lane / 16) * 8);
                    #pragma unroll
                    for (int r = 0; r < R; r++) {
                        mma_16x8x16(o[r][n], p[r][k], b);
                        mma_16x8x16(o[r][n + 1], p[r][k], b + 2);
                    }
                }
        }
        __syncthreads();  // everyone is done with this stage before the next iteration's copy overwrites it
    }

    #pragma unroll
    for (int r = 0; r < R; r++)
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            float sum = l[r][h];
            #pragma unroll
            for (int x = 1; x < 4; x <<= 1) sum += __shfl_xor_sync(0xffffffff, sum, x);
            int row = warp_row + r * 16 + g + 8 * h;
            if (row < tokens)
                #pragma unroll
                for (int n = 0; n < D / 8; n++)
                    *(unsigned*)(out + (long long)row * out_stride + head * D + n * 8 + 2 * t) =
                        pack_bf16(o[r][n][2 * h] / sum, o[r][n][2 * h + 1] / sum);
        }
}

// At head_dim <= 64, __launch_bounds__ caps the registers so that PREFILL_BLOCKS_PER_SM blocks fit an SM (128 each at
// 2); at 128 the capped kernel would spill its accumulators, so one block per SM there.
#define BLOCKS_PER_SM(D) ((D) > 64 ? 1 : PREFILL_BLOCKS_PER_SM)
#define ATTENTION_KERNEL(D)                                                                                \
    extern "C" __global__ void __launch_bounds__(PREFILL_THREADS, BLOCKS_PER_SM(D))                       \
    prefill_attention_d##D(const __nv_bfloat16* qkv, __nv_bfloat16* out, int tokens, int num_heads,       \
                           int num_kv_heads, int row_stride, int out_stride, float scale) {               \
        const long long q_cols = num_heads * D, kv_cols = num_kv_heads * D;                              \
        attention<D>(qkv, out, tokens, 0, num_heads, num_kv_heads, row_stride, out_stride, scale,         \
                     [=](int j) { return qkv + j * (long long)row_stride + q_cols; },                    \
                     [=](int j) { return qkv + j * (long long)row_stride + q_cols + kv_cols; });         \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(PREFILL_THREADS, BLOCKS_PER_SM(D)) chunk_attention_d##D(    \
            const __nv_bfloat16* qkv, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,         \
            const int* block_table, int start, __nv_bfloat16* out, int tokens, int num_heads,              \
            int num_kv_heads, int row_stride, int out_stride, float scale) {                               \
        const long long slot_stride = num_kv_heads * D;                                                   \
        auto slot = [=](int j) { return (long long)block_table[j / BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE; }; \
        attention<D>(qkv, out, tokens, start, num_heads, num_kv_heads, row_stride, out_stride, scale,     \
                     [=](int j) { return k_cache + slot(j) * slot_stride; },                              \
                     [=](int j) { return v_cache + slot(j) * slot_stride; });                             \
    }
ATTENTION_KERNEL(16)
ATTENTION_KERNEL(32)
ATTENTION_KERNEL(64)
ATTENTION_KERNEL(128)
