// Chapter 3 — RMSNorm with the residual add fused in: one pass over the row instead of two.
//   residual[t] += delta[t]            (skipped when delta is null: the first norm of layer 0)
//   out[t] = residual[t] / sqrt(mean(residual[t]^2) + eps) * weight
// Launch: grid (T), block (ROWS = 256, backend/constants.py; the code reads blockDim, a multiple of 32 for
//         block_sum); one block per row, a block reduction (warp shuffles) for the mean.
// Layout: residual fp32 (T, hidden) in/out; delta, out bf16 (T, hidden); weight bf16 (hidden,).
// The residual stream stays fp32 so 30 layers of additions do not lose bf16's 8 bits each time.
#include "common.cuh"

extern "C" __global__ void add_rms_norm(float* residual, const __nv_bfloat16* delta, const __nv_bfloat16* weight,
                                        __nv_bfloat16* out, float eps, int hidden) {
    float* x = residual + (long long)blockIdx.x * hidden;
    const __nv_bfloat16* d = delta ? delta + (long long)blockIdx.x * hidden : nullptr;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = x[i] + (d ? __bfloat162float(d[i]) : 0.0f);
        x[i] = v;
        sum_sq += v * v;
    }
    float scale = rsqrtf(block_sum(sum_sq) / hidden + eps);
    __nv_bfloat16* y = out + (long long)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        y[i] = __float2bfloat16(x[i] * scale * __bfloat162float(weight[i]));
}
