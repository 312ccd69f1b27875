// Chapter 3 — RMSNorm with the residual add fused in: one pass over the row instead of two.
//   residual[t] += delta[t]            (skipped when delta is null: the first norm of layer 0)
//   out[t] = residual[t] / sqrt(mean(residual[t]^2) + eps) * weight
// Launch: grid (T), block (ROWS = 256, backend/constants.py; the code reads blockDim, a multiple of 32 for
//         block_sum); one block per row, a block reduction (warp shuffles) for the mean. Each thread takes
//         NORM_VECTOR = 4 consecutive columns at a time (one 16-byte fp32 load, 8-byte bf16 ones), so hidden % 4 == 0.
// Layout: residual fp32 (T, hidden) in/out; delta, out bf16 (T, hidden); weight bf16 (hidden,).
// The residual stream stays fp32 so 30 layers of additions do not lose bf16's 8 bits each time.
// The fused decode kernels (fused_decode.cu, rms_norm_rows) sum a row's squares in this same order.
#ifndef NORM_VECTOR
#error "NORM_VECTOR comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#include "common.cuh"

static_assert(NORM_VECTOR == 4, "a float4 of the residual, 4 bf16 of delta, weight and out");

extern "C" __global__ void add_rms_norm(float* residual, const __nv_bfloat16* delta, const __nv_bfloat16* weight,
                                        __nv_bfloat16* out, float eps, int hidden) {
    float* x = residual + (long long)blockIdx.x * hidden;
    const __nv_bfloat16* d = delta ? delta + (long long)blockIdx.x * hidden : nullptr;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x * NORM_VECTOR; i < hidden; i += blockDim.x * NORM_VECTOR) {
        float v[NORM_VECTOR], dv[NORM_VECTOR] = {};
        *reinterpret_cast<float4*>(v) = *reinterpret_cast<const float4*>(x + i);
        if (d) bf16x4_to_float(d + i, dv);
        #pragma unroll
        for (int j = 0; j < NORM_VECTOR; ++j) v[j] += dv[j], sum_sq += v[j] * v[j];
        *reinterpret_cast<float4*>(x + i) = *reinterpret_cast<const float4*>(v);
    }
    float scale = rsqrtf(block_sum(sum_sq) / hidden + eps);
    __nv_bfloat16* y = out + (long long)blockIdx.x * hidden;
    for (int i = threadIdx.x * NORM_VECTOR; i < hidden; i += blockDim.x * NORM_VECTOR) {
        float v[NORM_VECTOR], w[NORM_VECTOR];
        *reinterpret_cast<float4*>(v) = *reinterpret_cast<const float4*>(x + i);
        bf16x4_to_float(weight + i, w);
        #pragma unroll
        for (int j = 0; j < NORM_VECTOR; ++j) v[j] = v[j] * scale * w[j];
        float_to_bf16x4(v, y + i);
    }
}
