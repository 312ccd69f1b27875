// Chapter 5 — the body of decode attention, shared by the contiguous (chapter 5) and paged (chapter 6)
// kernels: they differ only in where token t's K/V row lives, which they pass in as slot_of(t).
//
// One thread block serves one sequence and one K/V head, i.e. the GROUP query heads that share it
// (GQA), so each K/V row is read from memory once for all of them. Decode attention reads every cached
// byte once and does ~2 FLOPs per byte: it is bound by memory bandwidth, so the design is about
// keeping many loads in flight:
//   - a thread holds BF16_PER_VECTOR bf16 (16 bytes, one vector load) of a row; TPK = HEAD_DIM / BF16_PER_VECTOR
//     threads hold a whole key row, and the GROUPS = DECODE_THREADS / TPK thread groups of the block work on
//     different keys;
//   - the context is cut into one contiguous chunk per thread group; each group walks its chunk in tiles of
//     DECODE_UNROLL keys (all their loads issued before any is used), keeping an online softmax: running max m,
//     running sum l and running output acc, per query head, rescaled once per tile, not once per key;
//   - at the end the groups merge through shared memory: rescale each group by exp(m_g - M), sum.
// With few sequences (batch 1: 8 blocks for 132 SMs) the paged kernel also splits the context between
// blocks (chapter 7); each block then covers keys [begin, end) and writes its unnormalized output,
// max and sum to `partial` instead, and merge_splits below combines them with the same rescaling.
// Scores are computed in base 2 (q is pre-scaled by log2(e) / sqrt(d)): exp2f is one instruction.
// Launch (both kernels): block (DECODE_THREADS), grid in decode_attention.cu / paged_attention.cu; static shared
// memory only (the merge below: GROUPS x HEAD_DIM floats).
// The NumPy twin cuts the context into the same GROUPS chunks (numpy_ops.decode_attention,
// constants.decode_thread_groups), from the same DECODE_THREADS and BF16_PER_VECTOR.
#pragma once
#include "common.cuh"
#ifndef DECODE_THREADS
#error "DECODE_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef BF16_PER_VECTOR
#error "BF16_PER_VECTOR comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif

static_assert(BF16_PER_VECTOR == 8, "a thread's slice of a row is one uint4: 8 bf16");
#ifndef DECODE_UNROLL
#error "DECODE_UNROLL comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif

// q: the GROUP query heads of this K/V head (GROUP * HEAD_DIM bf16, contiguous); out: same shape.
// k_cache/v_cache: (slots, num_kv_heads, HEAD_DIM), already offset to this block's K/V head.
// partial: null, or this block's (GROUP, HEAD_DIM + 2) fp32 results (output, max, sum), head h at h * partial_stride.
template <int HEAD_DIM, int GROUP, typename SlotOf>
__device__ void decode_attention_block(const __nv_bfloat16* q, const __nv_bfloat16* k_cache,
                                       const __nv_bfloat16* v_cache, long long slot_stride, int begin, int end,
                                       SlotOf slot_of, __nv_bfloat16* out, float scale,
                                       float* partial = nullptr, int partial_stride = 0) {
    constexpr int TPK = HEAD_DIM / BF16_PER_VECTOR;       // threads per key row
    constexpr int GROUPS = DECODE_THREADS / TPK;          // keys processed side by side
    static_assert(HEAD_DIM % 8 == 0 && TPK <= 32 && 32 % TPK == 0, "a key row must fit in one warp");
    const int lane = threadIdx.x % TPK, group = threadIdx.x / TPK;
    const float log2e = 1.4426950408889634f;

    float qf[GROUP][8], acc[GROUP][8], m[GROUP], l[GROUP];
    #pragma unroll
    for (int h = 0; h < GROUP; ++h) {
        bf16x8_to_float(*reinterpret_cast<const uint4*>(q + h * HEAD_DIM + lane * 8), qf[h]);
        #pragma unroll
        for (int i = 0; i < 8; ++i) { qf[h][i] *= scale * log2e; acc[h][i] = 0.0f; }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }

    if (begin >= end) {  // a split past a short sequence's end: nothing to add
        for (int i = threadIdx.x; i < GROUP * (HEAD_DIM + 2); i += blockDim.x)
            partial[(i / (HEAD_DIM + 2)) * partial_stride + i % (HEAD_DIM + 2)] =
                i % (HEAD_DIM + 2) == HEAD_DIM ? -INFINITY : 0.0f;
        return;
    }
    const int chunk = (end - begin + GROUPS - 1) / GROUPS;
    const int first = begin + group * chunk, group_end = min(end, first + chunk);
    // every group runs the same number of iterations (the shuffles below need the whole warp)
    for (int base = first; base < first + chunk; base += DECODE_UNROLL) {
        uint4 k_raw[DECODE_UNROLL], v_raw[DECODE_UNROLL];
        #pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {  // issue all loads first; past the end, reload a valid row
            long long row = slot_of(min(base + u, end - 1)) * slot_stride + lane * 8;
            k_raw[u] = *reinterpret_cast<const uint4*>(k_cache + row);
            v_raw[u] = *reinterpret_cast<const uint4*>(v_cache + row);
        }
        // the tile's scores first, then one max and one rescale per head for the whole tile (not one per key)
        float s[DECODE_UNROLL][GROUP];
        #pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            float k[8];
            bf16x8_to_float(k_raw[u], k);
            #pragma unroll
            for (int h = 0; h < GROUP; ++h) {
                float dot = 0.0f;
                #pragma unroll
                for (int i = 0; i < 8; ++i) dot += qf[h][i] * k[i];
                #pragma unroll
                for (int offset = TPK / 2; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, offset);
                s[u][h] = dot;
            }
        }
        const int valid = group_end - base;  // keys of the tile in this group's chunk: <= 0 past its end
        if (valid > 0) {
            #pragma unroll
            for (int h = 0; h < GROUP; ++h) {
                float m_new = m[h];
                #pragma unroll
                for (int u = 0; u < DECODE_UNROLL; ++u) if (u < valid) m_new = fmaxf(m_new, s[u][h]);
                const float alpha = exp2f(m[h] - m_new);  // 0 on the first tile (m = -inf)
                l[h] *= alpha;
                #pragma unroll
                for (int u = 0; u < DECODE_UNROLL; ++u) {  // s becomes the tile's weights p
                    s[u][h] = u < valid ? exp2f(s[u][h] - m_new) : 0.0f;
                    l[h] += s[u][h];
                }
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc[h][i] *= alpha;
                m[h] = m_new;
            }
            #pragma unroll
            for (int u = 0; u < DECODE_UNROLL; ++u) {
                float v[8];
                bf16x8_to_float(v_raw[u], v);
                #pragma unroll
                for (int h = 0; h < GROUP; ++h)
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc[h][i] += s[u][h] * v[i];
            }
        }
    }

    // merge the groups, one query head at a time (keeps shared memory at GROUPS x HEAD_DIM floats)
    __shared__ float part[GROUPS][HEAD_DIM];
    __shared__ float group_m[GROUPS], group_l[GROUPS];
    #pragma unroll
    for (int h = 0; h < GROUP; ++h) {
        if (lane == 0) group_m[group] = m[h];
        __syncthreads();
        float max_all = -INFINITY;
        for (int g = 0; g < GROUPS; ++g) max_all = fmaxf(max_all, group_m[g]);  // finite: end > begin
        float mine = exp2f(m[h] - max_all);                                     // 0 for an empty chunk
        #pragma unroll
        for (int i = 0; i < 8; ++i) part[group][lane * 8 + i] = acc[h][i] * mine;
        if (lane == 0) group_l[group] = l[h] * mine;  // each group rescales its own sum: one exp2f, not GROUPS
        __syncthreads();
        if (threadIdx.x < HEAD_DIM) {
            float sum = 0.0f, denom = 0.0f;
            for (int g = 0; g < GROUPS; ++g) {
                sum += part[g][threadIdx.x];
                denom += group_l[g];
            }
            if (partial) {
                partial[h * partial_stride + threadIdx.x] = sum;
                if (threadIdx.x == 0) { partial[h * partial_stride + HEAD_DIM] = max_all; partial[h * partial_stride + HEAD_DIM + 1] = denom; }
            } else {
                out[h * HEAD_DIM + threadIdx.x] = __float2bfloat16(sum / denom);
            }
        }
        __syncthreads();  // part[] and group_m[] are rewritten for the next head
    }
}

// Chapter 7 — the keys one split of a context covers: `splits` equal parts of the length (split_tokens == 0), or,
// in the batch-invariant mode, split_tokens times as many as fit the length into `splits` parts — a function of the
// row's own length, never of the batch, so its sums run in the same order in any batch
__device__ __forceinline__ int split_span(int length, int splits, int split_tokens) {
    if (split_tokens == 0) return (length + splits - 1) / splits;
    const int parts = (length + split_tokens - 1) / split_tokens;
    return split_tokens * ((parts + splits - 1) / splits);
}

// Chapter 7 — merge the splits of one (sequence, query head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
// Only the row's own non-empty splits are read, in order; a row of one part was written by paged_attention.
// Launch: grid (num_heads, n), block (HEAD_DIM). Layout: partial fp32 (n, num_heads, splits, HEAD_DIM + 2)
//   = output, max, sum of each split; lengths int32 (n,); out bf16 (n, out_stride).
// One output value of merge_splits: dimension d of one (sequence, query head) whose splits are at p (splits x
// (HEAD_DIM + 2) fp32), its context `length` tokens long.
template <int HEAD_DIM>
__device__ __forceinline__ void merge_one(const float* __restrict__ p, int splits, int length, int split_tokens,
                                          __nv_bfloat16* __restrict__ out, int d) {
    const int span = split_span(length, splits, split_tokens);
    const int parts = span > 0 ? (length + span - 1) / span : 0;  // the row's own splits: the rest are empty
    if (parts <= 1) return;  // one part: paged_attention wrote out itself
    float max_all = -INFINITY;
    for (int s = 0; s < parts; ++s) max_all = fmaxf(max_all, p[s * (HEAD_DIM + 2) + HEAD_DIM]);
    float sum = 0.0f, denom = 0.0f;
    for (int s = 0; s < parts; ++s) {
        float weight = exp2f(p[s * (HEAD_DIM + 2) + HEAD_DIM] - max_all);
        sum += weight * p[s * (HEAD_DIM + 2) + d];
        denom += weight * p[s * (HEAD_DIM + 2) + HEAD_DIM + 1];
    }
    out[d] = __float2bfloat16(sum / denom);
}

template <int HEAD_DIM>
__global__ void merge_splits(const float* __restrict__ partial, int splits, const int* __restrict__ lengths,
                             int split_tokens, __nv_bfloat16* __restrict__ out, int out_stride) {
    const int h = blockIdx.x, b = blockIdx.y;
    merge_one<HEAD_DIM>(partial + ((long long)b * gridDim.x + h) * splits * (HEAD_DIM + 2), splits, lengths[b],
                        split_tokens, out + (long long)b * out_stride + h * HEAD_DIM, threadIdx.x);
}
