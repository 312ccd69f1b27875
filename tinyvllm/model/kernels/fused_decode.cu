// Chapter 8 — the decode layer in fewer, fatter kernels: each of fused_decode.cuh's bodies as a kernel of its own
// (the bodies, what each folds together and their layouts are described there):
//   rms_norm_gemv         out = rms_norm(residual) @ W^T            qkv; the final norm + lm_head (fp32 logits)
//   rms_norm_gemv_swiglu  act = silu(n @ Wg^T) * (n @ Wu^T), n = rms_norm(residual)     the MLP's first half
//   gemv_add              residual += x @ W^T                        o_proj and down: the residual add
//   rope_store_kv         RoPE on the Q and K heads, then K and V to their cache slots
#include "fused_decode.cuh"  // which stops unless the launch constants come through -D

// Launch: grid (min(ceil(N / GEMV_COLUMNS_PER_BLOCK), FUSED_BLOCKS_PER_SM x SMs)), block (GEMV_THREADS),
//   dynamic shared memory constants.norm_gemv_smem(NB, K) (the normalized rows); instantiated per (NB, F32_OUT).
template <int NB, bool F32_OUT>
__global__ void __launch_bounds__(GEMV_THREADS, FUSED_BLOCKS_PER_SM)
rms_norm_gemv(const float* residual, const __nv_bfloat16* norm_weight, const __nv_bfloat16* w, void* out, float eps,
              int K, int N, int out_stride) {
    rms_norm_gemv_body<NB, F32_OUT>(residual, norm_weight, w, out, eps, K, N, out_stride);
}

// Launch: as rms_norm_gemv's, over inter columns; instantiated per NB. Reads: residual, norm_weight, W_gate_up
// (2 inter, K) once; writes: act only — the unfused layer also wrote and read back gate_up (2 inter x NB bf16) and normed.
template <int NB>
__global__ void __launch_bounds__(GEMV_THREADS, FUSED_BLOCKS_PER_SM)
rms_norm_gemv_swiglu(const float* residual, const __nv_bfloat16* norm_weight, const __nv_bfloat16* w_gate_up,
                     __nv_bfloat16* act, float eps, int K, int inter) {
    rms_norm_gemv_swiglu_body<NB>(residual, norm_weight, w_gate_up, act, eps, K, inter);
}

// Launch: grid (ceil(N / GEMV_COLUMNS_PER_BLOCK)), block (GEMV_THREADS), as gemv: one column per warp; instantiated
// per NB. Reads: x (NB x K bf16), W once, residual; writes: residual — no delta buffer written and read back.
template <int NB>
__global__ void __launch_bounds__(GEMV_THREADS) gemv_add(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                                         float* residual, int K, int N) {
    gemv_add_body<NB>(x, w, residual, K, N);
}

// rope_store_kv: rope.cu then store_kv.cu in one launch.
// Launch: grid (T), block (ROWS; the code reads blockDim).
// Layout: qkv bf16 (T, row_stride): Q heads, K heads, V heads; positions, slots int32 (T,); cos, sin fp32
//   (max_positions, d/2); k_cache, v_cache bf16 (num_slots, kv_heads, d) — one layer.
extern "C" __global__ void rope_store_kv(__nv_bfloat16* qkv, const int* positions, const float* cos_table,
                                         const float* sin_table, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
                                         const int* slots, int num_heads, int num_kv_heads, int head_dim,
                                         int row_stride) {
    rope_store_row(blockIdx.x, qkv, positions, cos_table, sin_table, k_cache, v_cache, slots, num_heads, num_kv_heads,
                   head_dim, row_stride);
}
