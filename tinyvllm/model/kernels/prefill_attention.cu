// Chapter 3 — causal prefill attention, flash style: online softmax over key tiles, on tensor cores.
// For each query row i and head h (GQA: K/V head h / (num_heads / num_kv_heads)):
//   out[i, h] = sum_j softmax_j(q_i . k_j * scale) v_j over keys j <= start + i,
// computed PREFILL_KEY_TILE = 64 keys at a time with a running max m and sum l, so the (T x T) scores never exist.
// Two kernels share the code and differ only in where a key row is read:
//   prefill_attention_d{D}  a whole prompt (start = 0): keys are the K and V columns of the same qkv rows;
//   chunk_attention_d{D}    chapter 7: a chunk of a prompt at positions start .. start + T - 1, after tokens
//                           already in the paged pool (a cached prefix, earlier chunks); key j is read from
//                           slot block_table[j / BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE of k_cache / v_cache
//                           (the chunk's own K/V were stored there first), for j < start + T.
// Launch: grid (ceil(T / PREFILL_TILE), num_heads), block (PREFILL_THREADS = 256) = 8 warps x 16 query rows
//         (PREFILL_TILE = 128: every K/V tile loaded serves 128 queries);
//         query tiles in reverse order (the longest first); dynamic shared memory
//         (PREFILL_TILE + 2 x PREFILL_KV_STAGES x PREFILL_KEY_TILE) x (head_dim + PREFILL_SMEM_PAD) bf16: the Q tile
//         and two stages of K and V tiles (rows padded by 8) — cp.async fills one stage while the warps compute
//         on the other, and ldmatrix reads the tensor-core fragments out of them.
//         One kernel per head_dim (16, 32, 64, 128 = constants.PREFILL_HEAD_DIMS): register arrays need a
//         compile-time size.
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
#ifndef PREFILL_THREADS
#error "PREFILL_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
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
#include "common.cuh"

constexpr int BQ = PREFILL_TILE, BK = PREFILL_KEY_TILE;  // query rows per block, keys per K/V tile
static_assert(PREFILL_THREADS == BQ / 16 * 32, "one warp per 16 query rows (the m16n8k16 tile)");
static_assert(BK % 16 == 0 && PREFILL_SMEM_PAD % 8 == 0, "whole mma tiles; padded rows stay 16-byte aligned");

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low 16 bits
    return *reinterpret_cast<unsigned*>(&v);
}

// c (16x8 fp32) += a (16x16 bf16, row-major) * b (16x8 bf16, column-major)
__device__ __forceinline__ void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
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
        unsigned to = (unsigned)__cvta_generic_to_shared(dst + r * (D + PREFILL_SMEM_PAD) + col);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(inside ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int PENDING>  // wait until at most PENDING groups of copies are still in flight
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }

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

// Query rows 0 .. tokens - 1 (positions start ..) against keys 0 .. start + tokens - 1: k_row(j), v_row(j).
template <int D, typename KRow, typename VRow>
__device__ void attention(const __nv_bfloat16* qkv, __nv_bfloat16* out, int tokens, int start, int num_heads,
                          int num_kv_heads, int row_stride, int out_stride, float scale, KRow k_row, VRow v_row) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int LD = D + PREFILL_SMEM_PAD;
    __nv_bfloat16* Qs = (__nv_bfloat16*)smem;
    __nv_bfloat16* Ks = Qs + BQ * LD;                   // PREFILL_KV_STAGES K tiles, then as many V tiles
    __nv_bfloat16* Vs = Ks + PREFILL_KV_STAGES * BK * LD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // the longest query tiles (the most keys under the causal mask) first, so no long block starts last
    const int head = blockIdx.y, kv_head = head / (num_heads / num_kv_heads), q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;  // the two query rows this thread holds
    const float scale_log2 = scale * 1.4426950408889634f;   // exp(x) = exp2(x log2 e): exp2 is one instruction
    const int keys = start + tokens;
    const int last_key = start + min(q0 + BQ, tokens) - 1;  // causal: later key tiles are fully masked
    const int pos0 = start + row0, pos1 = start + row1;      // the positions of this thread's two query rows
    const int warp_first = start + q0 + warp * 16;           // the position of this warp's first query row
    auto load_kv = [&](int k0, int stage) {                  // one commit group: the K and V tiles at key k0
        load_tile_async<D, BK>(Ks + stage * BK * LD, [=](int j) { return k_row(j) + kv_head * D; }, k0, keys);
        load_tile_async<D, BK>(Vs + stage * BK * LD, [=](int j) { return v_row(j) + kv_head * D; }, k0, keys);
    };

    load_tile_async<D, BQ>(Qs, [=](int j) { return qkv + (long long)j * row_stride + head * D; }, q0, tokens);
    load_kv(0, 0);
    unsigned qf[D / 16][4];  // this warp's 16 query rows as A fragments, loaded once
    float o[D / 8][4] = {};
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // l: this thread's share of the sum

    for (int k0 = 0, stage = 0; k0 <= last_key; k0 += BK, stage ^= 1) {
        if (k0 + BK <= last_key) {       // the next tile's copy overlaps this tile's products
            load_kv(k0 + BK, stage ^ 1);
            wait_copies<2>();            // Q's and this tile's groups are done; the next one may still run
        } else {
            wait_copies<0>();
        }
        __syncthreads();
        if (k0 == 0)
            for (int k = 0; k < D / 16; k++) {
                const __nv_bfloat16* q = Qs + (warp * 16 + g) * LD + k * 16 + 2 * t;
                qf[k][0] = *(const unsigned*)q;
                qf[k][1] = *(const unsigned*)(q + 8 * LD);
                qf[k][2] = *(const unsigned*)(q + 8);
                qf[k][3] = *(const unsigned*)(q + 8 * LD + 8);
            }
        const __nv_bfloat16* Kt = Ks + stage * BK * LD;
        const __nv_bfloat16* Vt = Vs + stage * BK * LD;
        if (k0 <= warp_first + 15) {     // else every key of this tile is after all of this warp's rows
            // S = Q K^T: K's rows are exactly the column-major B operand; one ldmatrix feeds two key groups.
            float s[BK / 8][4] = {};
            for (int n = 0; n < BK / 8; n += 2)
                for (int k = 0; k < D / 16; k++) {
                    unsigned b[4];
                    ldmatrix_x4<false>(b, Kt + (n * 8 + (lane / 16) * 8 + lane % 8) * LD + k * 16 + (lane / 8) % 2 * 8);
                    mma_16x8x16(s[n], qf[k], b);
                    mma_16x8x16(s[n + 1], qf[k], b + 2);
                }

            // Online softmax: mask (only a tile that reaches past a row's position or the last key needs it),
            // new running max, rescale what was accumulated, exponentiate.
            const bool masked = k0 + BK - 1 > warp_first || k0 + BK > keys;
            float tile0 = -INFINITY, tile1 = -INFINITY;
            for (int n = 0; n < BK / 8; n++)
                for (int e = 0; e < 2; e++) {
                    int key = k0 + n * 8 + 2 * t + e;
                    s[n][e] = (!masked || (key <= pos0 && key < keys)) ? s[n][e] * scale_log2 : -INFINITY;
                    s[n][2 + e] = (!masked || (key <= pos1 && key < keys)) ? s[n][2 + e] * scale_log2 : -INFINITY;
                    tile0 = fmaxf(tile0, s[n][e]);
                    tile1 = fmaxf(tile1, s[n][2 + e]);
                }
            for (int x = 1; x < 4; x <<= 1) {  // the 4 threads sharing a row hold its 64 columns
                tile0 = fmaxf(tile0, __shfl_xor_sync(0xffffffff, tile0, x));
                tile1 = fmaxf(tile1, __shfl_xor_sync(0xffffffff, tile1, x));
            }
            float new0 = fmaxf(m0, tile0), new1 = fmaxf(m1, tile1);
            // A row with no visible key yet (max -inf) must not compute exp(-inf - -inf) = NaN.
            float alpha0 = new0 == -INFINITY ? 1.0f : exp2f(m0 - new0);
            float alpha1 = new1 == -INFINITY ? 1.0f : exp2f(m1 - new1);
            m0 = new0, m1 = new1;
            l0 *= alpha0, l1 *= alpha1;
            for (int n = 0; n < D / 8; n++) o[n][0] *= alpha0, o[n][1] *= alpha0, o[n][2] *= alpha1, o[n][3] *= alpha1;
            unsigned p[BK / 16][4];  // probabilities, already in the A-fragment layout of the next product
            for (int n = 0; n < BK / 8; n++) {
                float p00 = m0 == -INFINITY ? 0.0f : exp2f(s[n][0] - m0), p01 = m0 == -INFINITY ? 0.0f : exp2f(s[n][1] - m0);
                float p10 = m1 == -INFINITY ? 0.0f : exp2f(s[n][2] - m1), p11 = m1 == -INFINITY ? 0.0f : exp2f(s[n][3] - m1);
                l0 += p00 + p01, l1 += p10 + p11;
                p[n / 2][(n % 2) * 2] = pack_bf16(p00, p01);      // row g:   keys 2t, 2t+1 (+8 for odd n)
                p[n / 2][(n % 2) * 2 + 1] = pack_bf16(p10, p11);  // row g+8
            }

            // O += P V: ldmatrix.trans turns 8 keys x 8 value columns into the B fragment (keys 2t, 2t+1 of
            // column g); one call feeds two groups of 8 columns.
            for (int n = 0; n < D / 8; n += 2)
                for (int k = 0; k < BK / 16; k++) {
                    unsigned b[4];
                    ldmatrix_x4<true>(b, Vt + (k * 16 + (lane / 8) % 2 * 8 + lane % 8) * LD + n * 8 + (lane / 16) * 8);
                    mma_16x8x16(o[n], p[k], b);
                    mma_16x8x16(o[n + 1], p[k], b + 2);
                }
        }
        __syncthreads();  // everyone is done with this stage before the next iteration's copy overwrites it
    }

    for (int x = 1; x < 4; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffff, l0, x);
        l1 += __shfl_xor_sync(0xffffffff, l1, x);
    }
    for (int n = 0; n < D / 8; n++) {
        int col = head * D + n * 8 + 2 * t;
        if (row0 < tokens)
            *(unsigned*)(out + (long long)row0 * out_stride + col) = pack_bf16(o[n][0] / l0, o[n][1] / l0);
        if (row1 < tokens)
            *(unsigned*)(out + (long long)row1 * out_stride + col) = pack_bf16(o[n][2] / l1, o[n][3] / l1);
    }
}

#define ATTENTION_KERNEL(D)                                                                                \
    extern "C" __global__ void prefill_attention_d##D(const __nv_bfloat16* qkv, __nv_bfloat16* out,      \
                                                      int tokens, int num_heads, int num_kv_heads,        \
                                                      int row_stride, int out_stride, float scale) {      \
        const long long q_cols = num_heads * D, kv_cols = num_kv_heads * D;                              \
        attention<D>(qkv, out, tokens, 0, num_heads, num_kv_heads, row_stride, out_stride, scale,         \
                     [=](int j) { return qkv + j * (long long)row_stride + q_cols; },                    \
                     [=](int j) { return qkv + j * (long long)row_stride + q_cols + kv_cols; });         \
    }                                                                                                     \
    extern "C" __global__ void chunk_attention_d##D(                                                      \
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
