// Chapter 3 — RMSNorm with the residual add fused in: one pass over the row instead of two.
//   residual[t] += delta[t]            (skipped when delta is null: the first norm of layer 0)
//   out[t] = residual[t] / sqrt(mean(residual[t]^2) + eps) * weight
// Launch: grid (T), block (ROWS, backend/constants.py; the code reads blockDim, a multiple of 32 for
//         block_sum); one block per row, a block reduction (warp shuffles) for the mean. Each thread takes
//         NORM_VECTOR consecutive columns at a time (one 16-byte fp32 load, 8-byte bf16 ones) when
//         hidden % NORM_VECTOR == 0 (rows then start 16-byte aligned), else one.
// Layout: residual fp32 (T, hidden) in/out; delta, out bf16 (T, hidden); weight bf16 (hidden,).
// The residual stream stays fp32 so 30 layers of additions do not lose bf16's 8 bits each time.
// The fused decode kernels (fused_decode.cu, rms_norm_rows) sum a row's squares in this same order.
#ifndef NORM_VECTOR
#error "NORM_VECTOR comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "common.cuh"

static_assert(NORM_VECTOR == 4, "a float4 of the residual, 4 bf16 of delta, weight and out");

// V consecutive values at p: one vector load or store when V == NORM_VECTOR, else (V == 1) a scalar one
template <int V> __device__ __forceinline__ void load_floats(const float* p, float* v) {
    if constexpr (V == NORM_VECTOR) *reinterpret_cast<float4*>(v) = *reinterpret_cast<const float4*>(p);
    else v[0] = p[0];
}
template <int V> __device__ __forceinline__ void store_floats(const float* v, float* p) {
    if constexpr (V == NORM_VECTOR) *reinterpret_cast<float4*>(p) = *reinterpret_cast<const float4*>(v);
    else p[0] = v[0];
}
template <int V> __device__ __forceinline__ void load_bf16s(const __nv_bfloat16* p, float* v) {
    if constexpr (V == NORM_VECTOR) bf16x4_to_float(p, v);
    else v[0] = __bfloat162float(p[0]);
}
template <int V> __device__ __forceinline__ void store_bf16s(const float* v, __nv_bfloat16* p) {
    if constexpr (V == NORM_VECTOR) float_to_bf16x4(v, p);
    else p[0] = __float2bfloat16(v[0]);
}

// One row, V columns per thread per step (a thread's squares summed in column order within each step).
template <int V>
__device__ void add_rms_norm_row(float* x, const __nv_bfloat16* d, const __nv_bfloat16* weight, __nv_bfloat16* y,
                                 float eps, int hidden) {
    float sum_sq = 0.0f;
    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
        float v[V], dv[V] = {};
        load_floats<V>(x + i, v);
        if (d) load_bf16s<V>(d + i, dv);
        #pragma unroll
        for (int j = 0; j < V; ++j) v[j] += dv[j], sum_sq += v[j] * v[j];
        store_floats<V>(v, x + i);
    }
    float scale = rsqrtf(block_sum(sum_sq) / hidden + eps);
    for (int i = threadIdx.x * V; i < hidden; i += blockDim.x * V) {
        float v[V], w[V];
        load_floats<V>(x + i, v);
        load_bf16s<V>(weight + i, w);
        #pragma unroll
        for (int j = 0; j < V; ++j) v[j] = v[j] * scale * w[j];
        store_bf16s<V>(v, y + i);
    }
}

// hidden % NORM_VECTOR != 0 (no model has one; the chapter's exercise grades any width) takes one column at a time
extern "C" __global__ void add_rms_norm(float* residual, const __nv_bfloat16* delta, const __nv_bfloat16* weight,
                                        __nv_bfloat16* out, float eps, int hidden) {
    const long long row = (long long)blockIdx.x * hidden;
    float* x = residual + row;
    const __nv_bfloat16* d = delta ? delta + row : nullptr;
    if (hidden % NORM_VECTOR == 0)
        add_rms_norm_row<NORM_VECTOR>(x, d, weight, out + row, eps, hidden);
    else
        add_rms_norm_row<1>(x, d, weight, out + row, eps, hidden);
}
