// Chapter 7 — sample_rows: one token per row of logits, drawn by an arithmetic that depends on the row alone
// (the batch-invariant mode's sampler). A library's batched softmax and cumulative sum choose their reduction
// schedule from the whole array's shape; here a row's every sum has one order, fixed by the vocabulary size:
//   m = max(row); p_i = exp((row_i - m) * inv_temperature), float64;
//   thread t owns the slice [t * span, (t + 1) * span) and sums its p_i in increasing i (s_t);
//   thread 0 takes the prefix sums P_t = s_0 + ... + s_{t-1} in increasing t, the total, and the owner: the
//   last thread with s_t > 0 and P_t <= u * total;
//   the owner walks its slice again and answers the first i whose running sum passes u * total - P_t
//   (the last i with p_i > 0 when rounding leaves none): inverse-CDF sampling in the vocabulary's order.
// Launch: grid (rows), block (SAMPLE_THREADS); span = ceil(vocab / SAMPLE_THREADS).
// Layout: logits fp32 (rows, stride) row-major; inv_temperature, u float64 (rows,), u in [0, 1); out int32 (rows,).
#ifndef SAMPLE_THREADS
#error "SAMPLE_THREADS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "common.cuh"

static_assert((SAMPLE_THREADS & (SAMPLE_THREADS - 1)) == 0 && SAMPLE_THREADS <= 1024, "the max tree halves a power of 2");

extern "C" __global__ void sample_rows(const float* logits, int stride, int vocab, const double* inv_temperature,
                                       const double* u, int* out) {
    __shared__ float top[SAMPLE_THREADS];
    __shared__ double mass[SAMPLE_THREADS];   // s_t, then P_t
    __shared__ double rest;                   // u * total - P_owner: how far into the owner's slice the draw lands
    __shared__ int owner;
    const float* row = logits + (long long)blockIdx.x * stride;
    const int t = threadIdx.x, span = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int lo = min(t * span, vocab), hi = min(lo + span, vocab);

    float m = -INFINITY;
    for (int i = lo; i < hi; ++i) m = fmaxf(m, row[i]);
    top[t] = m;
    __syncthreads();
    for (int half = SAMPLE_THREADS / 2; half > 0; half >>= 1) {  // a max is exact: any order gives the same bits
        if (t < half) top[t] = fmaxf(top[t], top[t + half]);
        __syncthreads();
    }
    const double peak = top[0], scale = inv_temperature[blockIdx.x];
    if (peak == -INFINITY) {  // every token forbidden: answer 0, as argmax does (a mask never leaves none)
        if (t == 0) out[blockIdx.x] = 0;
        return;
    }
    double s = 0.0;
    for (int i = lo; i < hi; ++i) s += exp(((double)row[i] - peak) * scale);
    mass[t] = s;
    __syncthreads();
    if (t == 0) {
        double running = 0.0;
        for (int k = 0; k < SAMPLE_THREADS; ++k) {  // exclusive prefix sums, in increasing k
            const double sk = mass[k];
            mass[k] = running;
            running += sk;
        }
        const double target = u[blockIdx.x] * running;
        int who = 0;
        for (int k = 0; k < SAMPLE_THREADS; ++k) {
            const double next = k + 1 < SAMPLE_THREADS ? mass[k + 1] : running;
            if (next > mass[k] && mass[k] <= target) who = k;  // s_k > 0: the prefix grows past it
        }
        owner = who;
        rest = target - mass[who];
    }
    __syncthreads();
    if (t != owner) return;
    double walked = 0.0;
    int last = lo;
    for (int i = lo; i < hi; ++i) {
        const double p = exp(((double)row[i] - peak) * scale);
        if (p > 0.0) last = i;
        walked += p;
        if (walked > rest) {
            out[blockIdx.x] = i;
            return;
        }
    }
    out[blockIdx.x] = last;
}
