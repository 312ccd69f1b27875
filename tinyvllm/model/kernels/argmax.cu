// Chapter 3 — greedy sampling on the GPU: out[r] = argmax(logits[r, :]) as NumPy answers it: the first index of the
// maximum, or of the first NaN. Only the chosen ids cross to the host, never the (rows x vocab) logits.
// Two launches, so that one long row (128K entries at batch 1) spreads over the whole GPU instead of one SM:
//   argmax_pieces  grid (pieces, rows), block ARGMAX_THREADS: block p scans columns [p, p + 1) x ARGMAX_PIECE of its
//                  row (each thread a strided slice, then the block's tree) and writes the piece's best;
//   argmax_merge   grid (rows), block ARGMAX_THREADS: the best of the row's pieces.
// Layout: logits fp32 (rows, vocab), `stride` floats between rows; piece_val fp32 and piece_idx int32 (rows, pieces);
// out int32 (rows,).
#ifndef ARGMAX_THREADS
#error "ARGMAX_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef ARGMAX_PIECE
#error "ARGMAX_PIECE comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "common.cuh"

static_assert(ARGMAX_THREADS % 32 == 0 && ARGMAX_THREADS <= 1024, "whole warps, one block");

// Whether (v, i) wins over (best, best_i) in NumPy's order: a NaN over any number, then the larger value, then the
// smaller index (the first of equal values, or of NaNs)
__device__ __forceinline__ bool wins(float v, int i, float best, int best_i) {
    bool nan = v != v, best_nan = best != best;
    if (nan != best_nan) return nan;
    return (!nan && v > best) || ((nan || v == best) && i < best_i);
}

// Every thread's candidate to the block's winner, which thread 0 holds: warps by shuffles, then warp 0
__device__ __forceinline__ void block_argmax(float& v, int& i) {
    __shared__ float warp_val[32];
    __shared__ int warp_idx[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other = __shfl_xor_sync(0xffffffff, v, offset);
        int other_i = __shfl_xor_sync(0xffffffff, i, offset);
        if (wins(other, other_i, v, i)) v = other, i = other_i;
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warp_val[warp] = v, warp_idx[warp] = i;
    __syncthreads();
    if (warp == 0) {
        bool has = lane < blockDim.x / 32;
        v = has ? warp_val[lane] : -INFINITY;
        i = has ? warp_idx[lane] : 0x7fffffff;
        for (int offset = 16; offset > 0; offset >>= 1) {
            float other = __shfl_xor_sync(0xffffffff, v, offset);
            int other_i = __shfl_xor_sync(0xffffffff, i, offset);
            if (wins(other, other_i, v, i)) v = other, i = other_i;
        }
    }
}

extern "C" __global__ void argmax_pieces(const float* logits, int stride, int vocab, float* piece_val, int* piece_idx) {
    const float* row = logits + (long long)blockIdx.y * stride;
    int end = min(vocab, (int)(blockIdx.x + 1) * ARGMAX_PIECE);
    float v = -INFINITY;
    int idx = 0x7fffffff;  // loses to any entry, so an all -inf row still answers its first index, as NumPy
    for (int c = (int)(blockIdx.x * ARGMAX_PIECE + threadIdx.x); c < end; c += blockDim.x)
        if (wins(row[c], c, v, idx)) v = row[c], idx = c;
    block_argmax(v, idx);
    int piece = blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) piece_val[piece] = v, piece_idx[piece] = idx;
}

extern "C" __global__ void argmax_merge(const float* piece_val, const int* piece_idx, int pieces, int* out) {
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int p = (int)(blockIdx.x * pieces + threadIdx.x); p < (int)(blockIdx.x + 1) * pieces; p += blockDim.x)
        if (wins(piece_val[p], piece_idx[p], v, idx)) v = piece_val[p], idx = piece_idx[p];
    block_argmax(v, idx);
    if (threadIdx.x == 0) out[blockIdx.x] = idx;
}
