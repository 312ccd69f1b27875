// Chapter 3 — greedy sampling on the GPU: out[s] = argmax(logits[s, :]), the first index on ties
// (as NumPy). Only the chosen ids cross to the host, never the (rows x vocab) logits.
// Launch: grid (rows), block (ARGMAX_THREADS); each thread scans a strided slice, then a shared-memory tree.
// Layout: logits fp32 (rows, vocab) row-major; out int32 (rows,).
#ifndef ARGMAX_THREADS
#error "ARGMAX_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "common.cuh"

static_assert((ARGMAX_THREADS & (ARGMAX_THREADS - 1)) == 0 && ARGMAX_THREADS <= 1024, "the tree halves a power of 2");

extern "C" __global__ void argmax(const float* logits, int* out, int vocab) {
    __shared__ float best_val[ARGMAX_THREADS];
    __shared__ int best_idx[ARGMAX_THREADS];
    const float* row = logits + (long long)blockIdx.x * vocab;
    bool has = threadIdx.x < vocab;
    float v = has ? row[threadIdx.x] : -INFINITY;
    int idx = has ? threadIdx.x : 0x7fffffff;  // an all -inf row still answers index 0, like NumPy
    for (int i = threadIdx.x + blockDim.x; i < vocab; i += blockDim.x)
        if (row[i] > v) { v = row[i]; idx = i; }  // strictly greater: keeps the first of equal values
    best_val[threadIdx.x] = v;
    best_idx[threadIdx.x] = idx;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            float ov = best_val[threadIdx.x + stride];
            int oi = best_idx[threadIdx.x + stride];
            if (ov > best_val[threadIdx.x] || (ov == best_val[threadIdx.x] && oi < best_idx[threadIdx.x])) {
                best_val[threadIdx.x] = ov;
                best_idx[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_idx[0];
}
