#pragma once
// Chapter 8 — the bodies of the fused decode layer's kernels: fused_decode.cu launches each as a kernel of its own,
// decode_persistent.cu runs them all in one launch. The decode layer in fewer, fatter kernels, for the small
// batches that are bound by memory bandwidth (T <= GEMV_MAX_ROWS rows, gemm's gemv range). Unfused, a layer is ten launches, and between two of them the
// activations go to memory and come back; each launch also ramps up and drains its last blocks while the GPU
// waits. Here each projection is gemv (gemv.cuh: a warp per weight row) with its neighbours folded in:
//   rms_norm_gemv         out = rms_norm(residual) @ W^T            qkv; the final norm + lm_head (fp32 logits)
//   rms_norm_gemv_swiglu  act = silu(n @ Wg^T) * (n @ Wu^T), n = rms_norm(residual)     the MLP's first half
//   gemv_add              residual += x @ W^T                        o_proj and down: the residual add
//   rope_store_kv         RoPE on the Q and K heads, then K and V to their cache slots
// Each does the unfused kernels' arithmetic, rounding for rounding (rms_norm.cu, gemv.cu, swiglu.cu, rope.cu,
// store_kv.cu), so the fused layer gives the unfused layer's bits (tests/test_gpu_fused_decode.py): the norm sums
// in add_rms_norm's order because GEMV_THREADS == ROWS (asserted below), every dot product is gemv_sums itself, and
// RoPE is rope.cu's statements in rope.cu's order (the compiler fuses the same multiply-adds).
// Layouts: residual fp32 (T, K) contiguous, in/out; norm_weight bf16 (K,); W bf16 (N, K) row-major, as the
// checkpoint; out (T, out_stride) bf16 or fp32; act bf16 (T, inter); x bf16 (T, K). T = NB rows, K % 8 == 0.
#ifndef GEMV_MAX_ROWS
#error "GEMV_MAX_ROWS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef GEMV_COLUMNS_PER_BLOCK
#error "GEMV_COLUMNS_PER_BLOCK comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef GEMV_THREADS
#error "GEMV_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef NORM_VECTOR
#error "NORM_VECTOR comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef FUSED_BLOCKS_PER_SM
#error "FUSED_BLOCKS_PER_SM comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef ROWS
#error "ROWS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "gemv.cuh"  // gemv_sums and gemv_store (which stops unless GEMV_LOADS comes through -D)

static_assert(GEMV_THREADS == 32 * GEMV_COLUMNS_PER_BLOCK, "one warp per output column");
// A block sum's order follows the block's threads (their strided columns, then the tree over the warps):
// rms_norm_rows matches add_rms_norm (launched with ROWS threads) bit for bit only with as many threads
static_assert(GEMV_THREADS == ROWS, "the fused norm sums in add_rms_norm's order only with ROWS threads");

// ---- the norm in front of a projection -----------------------------------------------------------------------
// The rows of the fp32 residual, RMS-normalized and rounded to bf16 exactly as add_rms_norm (rms_norm.cu) writes
// its `out`, into shared memory: NB x K bf16 (constants.norm_gemv_smem). Every block recomputes them: a row is 8 KB
// read from L2, far cheaper than a launch of its own plus a round trip of `normed` through memory.
template <int NB>
__device__ void rms_norm_rows(const float* residual, const __nv_bfloat16* weight, __nv_bfloat16* normed, float eps,
                              int K) {
    float sum_sq[NB] = {}, scale[NB];
    for (int i = threadIdx.x * NORM_VECTOR; i < K; i += blockDim.x * NORM_VECTOR) {  // all rows' loads in flight
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            float v[NORM_VECTOR];
            *reinterpret_cast<float4*>(v) = *reinterpret_cast<const float4*>(residual + (long long)b * K + i);
            #pragma unroll
            for (int j = 0; j < NORM_VECTOR; ++j) sum_sq[b] += v[j] * v[j];
        }
    }
    block_sums<NB>(sum_sq);  // one barrier round for the NB rows, each summed in add_rms_norm's order
    #pragma unroll
    for (int b = 0; b < NB; ++b) scale[b] = rsqrtf(sum_sq[b] / K + eps);
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
        const float w = __bfloat162float(weight[i]);
        #pragma unroll
        for (int b = 0; b < NB; ++b)
            normed[b * K + i] = __float2bfloat16(residual[(long long)b * K + i] * scale[b] * w);
    }
    __syncthreads();  // every warp reads every row
}

// Ask L2 for a weight row now (no register waits for a prefetch), so that the row's trip from memory overlaps the
// norm and the block's first gemv_sums after it finds the row on chip. One 128-byte line per lane.
__device__ __forceinline__ void prefetch_row(const __nv_bfloat16* row, int K) {
    for (int k = (threadIdx.x % 32) * 64; k < K; k += 32 * 64) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + k));
}

// A body's blocks are few (the norm kernels: FUSED_BLOCKS_PER_SM per SM, cuda_ops._launch_norm_gemv; the persistent
// kernel: all of its blocks) and each walks many output columns, so the norm is computed once per block, not once per GEMV_COLUMNS_PER_BLOCK columns:
// warp w of block g takes column g * GEMV_COLUMNS_PER_BLOCK + w, then that plus gridDim.x * GEMV_COLUMNS_PER_BLOCK,
// and so on.
__device__ __forceinline__ int first_column() { return blockIdx.x * GEMV_COLUMNS_PER_BLOCK + threadIdx.x / 32; }
__device__ __forceinline__ int column_step() { return gridDim.x * GEMV_COLUMNS_PER_BLOCK; }

// out (NB, N) = rms_norm(residual) @ W^T (rms_norm_gemv). Reads: residual NB x K x 4 bytes and norm_weight (from L2,
// per block), W once; writes: out only. Dynamic shared memory: constants.norm_gemv_smem(NB, K), the normalized rows.
template <int NB, bool F32_OUT>
__device__ void rms_norm_gemv_body(const float* residual, const __nv_bfloat16* norm_weight, const __nv_bfloat16* w,
                                   void* out, float eps, int K, int N, int out_stride) {
    static_assert(NB >= 1 && NB <= GEMV_MAX_ROWS, "the fused layer runs up to GEMV_MAX_ROWS rows");
    extern __shared__ uint4 shared_rows[];  // uint4: 16-byte aligned, for gemv_sums' vector loads
    __nv_bfloat16* normed = reinterpret_cast<__nv_bfloat16*>(shared_rows);
    if (first_column() < N) prefetch_row(w + (long long)first_column() * K, K);
    rms_norm_rows<NB>(residual, norm_weight, normed, eps, K);
    for (int j = first_column(); j < N; j += column_step()) {
        float acc[NB] = {};
        gemv_sums<NB>(normed, w + (long long)j * K, K, NB, acc);
        gemv_store<NB, F32_OUT>(acc, out, NB, out_stride, j);
    }
}

// act (NB, inter) = silu(gate) * up, [gate | up] = rms_norm(residual) @ W_gate_up^T (rms_norm_gemv_swiglu): the warp of
// column j sums weight row j (gate) and row inter + j (up), rounds both to bf16 as the gate_up buffer would hold them,
// and applies swiglu.cu's formula. The (NB, 2 inter) gate_up never exists.
template <int NB>
__device__ void rms_norm_gemv_swiglu_body(const float* residual, const __nv_bfloat16* norm_weight,
                                          const __nv_bfloat16* w_gate_up, __nv_bfloat16* act, float eps, int K,
                                          int inter) {
    static_assert(NB >= 1 && NB <= GEMV_MAX_ROWS, "the fused layer runs up to GEMV_MAX_ROWS rows");
    extern __shared__ uint4 shared_rows[];
    __nv_bfloat16* normed = reinterpret_cast<__nv_bfloat16*>(shared_rows);
    if (first_column() < inter) {
        prefetch_row(w_gate_up + (long long)first_column() * K, K);
        prefetch_row(w_gate_up + (long long)(inter + first_column()) * K, K);
    }
    rms_norm_rows<NB>(residual, norm_weight, normed, eps, K);
    for (int j = first_column(); j < inter; j += column_step()) {
        float gate[NB] = {}, up[NB] = {};
        gemv_sums<NB>(normed, w_gate_up + (long long)j * K, K, NB, gate);
        gemv_sums<NB>(normed, w_gate_up + (long long)(inter + j) * K, K, NB, up);
        if (threadIdx.x % 32 != 0) continue;
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            const float g = bf16_round(gate[b]), u = bf16_round(up[b]);
            act[(long long)b * inter + j] = __float2bfloat16(g / (1.0f + __expf(-g)) * u);  // swiglu.cu's formula
        }
    }
}

// residual (NB, N) += bf16(x @ W^T) (gemv_add): each column is one warp's, so its NB additions race with nothing.
// Rounded to bf16 first, as the unfused layer's delta buffer was before add_rms_norm added it.
template <int NB>
__device__ void gemv_add_body(const __nv_bfloat16* x, const __nv_bfloat16* w, float* residual, int K, int N) {
    static_assert(NB >= 1 && NB <= GEMV_MAX_ROWS, "the fused layer runs up to GEMV_MAX_ROWS rows");
    for (int j = first_column(); j < N; j += column_step()) {
        float acc[NB] = {};
        gemv_sums<NB>(x, w + (long long)j * K, K, NB, acc);
        if (threadIdx.x % 32 != 0) continue;
        #pragma unroll
        for (int b = 0; b < NB; ++b) residual[(long long)b * N + j] += bf16_round(acc[b]);
    }
}

// Row t of rope_store_kv: rotate its Q and K heads in place at position positions[t], and write its rotated K and
// its V to slot slots[t] of this layer's cache. The block's threads stride over the (heads + kv_heads) x d/2
// rotation pairs, then over the kv_heads x d values of V.
__device__ void rope_store_row(int t, __nv_bfloat16* qkv, const int* positions, const float* cos_table,
                               const float* sin_table, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
                               const int* slots, int num_heads, int num_kv_heads, int head_dim, int row_stride) {
    const int half = head_dim / 2, kv_cols = num_kv_heads * head_dim;
    __nv_bfloat16* row = qkv + (long long)t * row_stride;
    const float* c = cos_table + (long long)positions[t] * half;
    const float* s = sin_table + (long long)positions[t] * half;
    const long long slot = (long long)slots[t] * kv_cols;
    for (int p = threadIdx.x; p < (num_heads + num_kv_heads) * half; p += blockDim.x) {
        const int head = p / half, i = p % half;
        __nv_bfloat16* x = row + head * head_dim;
        float a = __bfloat162float(x[i]), b = __bfloat162float(x[i + half]);
        // rope.cu's statements, in its order: the compiler then fuses the same products into multiply-adds
        // (b * c + a * s is one fma, rounded differently depending on which product it fuses)
        x[i] = __float2bfloat16(a * c[i] - b * s[i]);
        x[i + half] = __float2bfloat16(b * c[i] + a * s[i]);
        if (head >= num_heads) {  // a K head: its cache slot gets the rotated values, as store_kv copies them
            __nv_bfloat16* key = k_cache + slot + (head - num_heads) * head_dim;
            key[i] = x[i];
            key[i + half] = x[i + half];
        }
    }
    const __nv_bfloat16* v = row + (num_heads + num_kv_heads) * head_dim;
    for (int i = threadIdx.x; i < kv_cols; i += blockDim.x) v_cache[slot + i] = v[i];
}
