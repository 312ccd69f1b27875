// Chapter 3 — SwiGLU: act = silu(gate) * up, gate and up side by side from one fused GEMM.
// Launch: grid (ceil(T * inter / BF16_PER_VECTOR / ROWS)), block (ROWS, backend/constants.py; the code reads
//         blockDim); one thread per BF16_PER_VECTOR neighbouring outputs of a row: a 16-byte load of gate,
//         one of up and a 16-byte store. At 4,096 tokens of Llama 3.2 1B on an H200 (3.2 GB moved): 2.05 ms with
//         one bf16 per thread, 0.82 ms so (bench/results/prefill-20261202-030312.json), ~94% of the copy bandwidth.
// Layout: gate_up bf16 (T, 2 * inter) = [gate | up] per row; act bf16 (T, inter).
#include "common.cuh"
#ifndef BF16_PER_VECTOR
#error "BF16_PER_VECTOR comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif

extern "C" __global__ void swiglu(const __nv_bfloat16* gate_up, __nv_bfloat16* act, int tokens, int inter) {
    long long idx = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * BF16_PER_VECTOR;  // first of its outputs
    if (idx >= (long long)tokens * inter) return;
    if (inter % BF16_PER_VECTOR) {  // rows not whole vectors (no model we know): one element at a time
        for (long long e = idx; e < idx + BF16_PER_VECTOR && e < (long long)tokens * inter; ++e) {
            long long t = e / inter, i = e % inter;
            float g = __bfloat162float(gate_up[t * 2 * inter + i]);
            float u = __bfloat162float(gate_up[t * 2 * inter + inter + i]);
            act[e] = __float2bfloat16(g / (1.0f + __expf(-g)) * u);
        }
        return;
    }
    long long t = idx / inter, i = idx % inter;  // the 8 outputs share a row
    float g[BF16_PER_VECTOR], u[BF16_PER_VECTOR];
    bf16x8_to_float(*reinterpret_cast<const uint4*>(gate_up + t * 2 * inter + i), g);
    bf16x8_to_float(*reinterpret_cast<const uint4*>(gate_up + t * 2 * inter + inter + i), u);
    __align__(16) __nv_bfloat16 out[BF16_PER_VECTOR];
    #pragma unroll
    for (int k = 0; k < BF16_PER_VECTOR; ++k) out[k] = __float2bfloat16(g[k] / (1.0f + __expf(-g[k])) * u[k]);
    *reinterpret_cast<uint4*>(act + idx) = *reinterpret_cast<const uint4*>(out);
}
