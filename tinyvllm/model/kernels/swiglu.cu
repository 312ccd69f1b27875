// Chapter 3 — SwiGLU: act = silu(gate) * up, gate and up side by side from one fused GEMM.
// Launch: grid (ceil(T * inter / ROWS)), block (ROWS = 256, backend/constants.py; the code reads blockDim);
//         one thread per output element.
// Layout: gate_up bf16 (T, 2 * inter) = [gate | up] per row; act bf16 (T, inter).
#include "common.cuh"

extern "C" __global__ void swiglu(const __nv_bfloat16* gate_up, __nv_bfloat16* act, int tokens, int inter) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)tokens * inter) return;
    long long t = idx / inter, i = idx % inter;
    float g = __bfloat162float(gate_up[t * 2 * inter + i]);
    float u = __bfloat162float(gate_up[t * 2 * inter + inter + i]);
    act[idx] = __float2bfloat16(g / (1.0f + __expf(-g)) * u);
}
