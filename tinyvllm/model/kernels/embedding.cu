// Chapter 3 — embedding gather: residual[t, :] = float(table[ids[t], :]).
// Launch: grid (T), block (ROWS, backend/constants.py; any count works, the code reads blockDim);
//         each block copies one row, threads stride over the hidden dim.
// Layout: ids int32 (T,); table bf16 (vocab, hidden) row-major; residual fp32 (T, hidden) row-major.
#include "common.cuh"

extern "C" __global__ void embedding(const int* ids, const __nv_bfloat16* table, float* residual, int hidden) {
    const __nv_bfloat16* row = table + (long long)ids[blockIdx.x] * hidden;
    float* out = residual + (long long)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = __bfloat162float(row[i]);
}
