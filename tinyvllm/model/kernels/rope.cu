// Chapter 3 — RoPE, in place on the Q and K columns of the qkv buffer, HF's "rotate half" pairing:
//   (x[i], x[i + d/2]) -> (x[i] cos - x[i + d/2] sin, x[i + d/2] cos + x[i] sin),  i < d/2
// cos/sin come from tables built once per model (llama3 scaling already applied) and shared with
// decode, so prefill and decode rotate identically.
// Launch: grid (T), block (ROWS, backend/constants.py; any count works, the code reads blockDim);
//         threads stride over (q_heads + kv_heads) * d/2 pairs of one token.
// Layout: qkv bf16 (T, row_stride), Q heads then K heads from column 0; positions int32 (T,);
//         cos, sin fp32 (max_positions, d/2).
#include "common.cuh"

extern "C" __global__ void rope(__nv_bfloat16* qkv, const int* positions, const float* cos_table,
                                const float* sin_table, int num_heads, int head_dim, int row_stride) {
    int half = head_dim / 2;
    __nv_bfloat16* row = qkv + (long long)blockIdx.x * row_stride;
    const float* c = cos_table + (long long)positions[blockIdx.x] * half;
    const float* s = sin_table + (long long)positions[blockIdx.x] * half;
    for (int p = threadIdx.x; p < num_heads * half; p += blockDim.x) {
        int head = p / half, i = p % half;
        __nv_bfloat16* x = row + head * head_dim;
        float a = __bfloat162float(x[i]), b = __bfloat162float(x[i + half]);
        x[i] = __float2bfloat16(a * c[i] - b * s[i]);
        x[i + half] = __float2bfloat16(b * c[i] + a * s[i]);
    }
}
