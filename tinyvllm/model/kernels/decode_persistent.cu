// Chapter 8 — the whole decode step in one launch: a persistent kernel that runs the fused layer's instruction list.
// The fused layer (fused_decode.cu) is ~7 kernels a layer, ~110 a step; at batch 1 every kernel boundary costs a
// launch gap, a ramp-up (the first loads wait a full memory latency with nothing else in flight) and a tail (the
// last blocks run while most SMs idle), and during the latency-bound kernels (RoPE, attention, the merge) the HBM
// has nothing to do. Here the blocks stay resident for the whole step and walk the instruction list the host built
// once (model/persistent.py): each instruction is one of the fused layer's ops, run by the same device functions
// (fused_decode.cuh, paged_attention.cu), so the step gives the fused layer's bits. Between two instructions the
// blocks meet at a grid barrier (a counter in global memory) instead of a kernel boundary. With PREFETCH_BYTES > 0 a
// block also asks L2 for its share of the next projection's weight rows before it waits there
// (cp.async.bulk.prefetch.L2, one instruction per row), to keep the weight stream going through the barriers and the
// latency-bound ops — measured slower on an H200 (backend/constants.py), so off by default.
// Launch: grid (FUSED_BLOCKS_PER_SM x SMs at most, and no more than can be resident at once: a block waiting at a
//   barrier for a block that never started would wait forever), block (GEMV_THREADS), dynamic shared memory
//   constants.norm_gemv_smem(NB, hidden) (the normalized rows of the norm ops); instantiated per (NB = rows,
//   HEAD_DIM, GROUP = query heads per K/V head). `arrived` (uint32, 32 x (blocks + 1): the arrivals, then a flag a
//   block, see grid_barrier) is zeroed before each launch; `timeline` null, or (count, blocks, 4) uint64 filled
//   with stamp()s.
// Layout: program int64 (count, INSTRUCTION_WORDS): word 0 the op (OP_* below, from constants.PERSISTENT_OPS), then
//   its arguments in the order of the op's kernel — pointers and ints as int64, floats as their bits
//   (cuda_ops.persistent_program writes them). The twin, numpy_ops.decode_persistent, runs the same list in order.
#include "fused_decode.cuh"    // the bodies of the fused layer's kernels
#include "paged_attention.cu"  // paged_attention_item, and merge_one (decode_attention.cuh)
#ifndef INSTRUCTION_WORDS
#error "INSTRUCTION_WORDS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef PREFETCH_BYTES
#error "PREFETCH_BYTES comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef PREFETCH_AHEAD
#error "PREFETCH_AHEAD comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef BARRIER_FLAGS
#error "BARRIER_FLAGS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef BARRIER_BACKOFF_NS
#error "BARRIER_BACKOFF_NS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef OP_EMBEDDING
#error "OP_EMBEDDING comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef OP_RMS_NORM_GEMV
#error "OP_RMS_NORM_GEMV comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef OP_RMS_NORM_GEMV_SWIGLU
#error "OP_RMS_NORM_GEMV_SWIGLU comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef OP_GEMV_ADD
#error "OP_GEMV_ADD comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef OP_ROPE_STORE_KV
#error "OP_ROPE_STORE_KV comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef OP_PAGED_ATTENTION
#error "OP_PAGED_ATTENTION comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif
#ifndef OP_MERGE_SPLITS
#error "OP_MERGE_SPLITS comes from Python (tinyvllm/model/backend/constants.py) through -D"
#endif

static_assert(GEMV_THREADS == DECODE_THREADS, "attention runs on the persistent kernel's blocks as they are");

template <typename T> __device__ __forceinline__ T* pointer(long long word) { return reinterpret_cast<T*>(word); }
__device__ __forceinline__ float float_bits(long long word) { return __int_as_float(static_cast<int>(word)); }

// Every block arrives, then waits until all have. arrived[0] counts arrivals and only grows within a launch, so
// barrier i is complete when it reaches (i + 1) x blocks; thread 0 arrives for the block after its threads' writes
// (the fence makes them visible GPU-wide) and its acquire load keeps the block's later reads from stale lines. How
// the others learn that the barrier is complete (BARRIER_FLAGS, measured by bench/persistent_timeline.py):
//   0: every block polls arrived[0] — one line of L2 that all SMs load while the late blocks' atomics queue on it;
//   1: the last block to arrive writes the barrier's number into every block's own flag (arrived[32 (b + 1)], a
//      128-byte line each, one thread per block), and each block polls its own line.
// A block that waits ~4 s traps: the launch fails with an error rather than hang (blocks not resident at once).
__device__ __forceinline__ unsigned load_acquire(const unsigned* at) {
    unsigned value;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(at) : "memory");
    return value;
}

__device__ __forceinline__ void wait_until(const unsigned* at, unsigned target) {
    const long long start = clock64();
    while (load_acquire(at) < target) {
        if (clock64() - start > (1ll << 33)) __trap();
#if BARRIER_BACKOFF_NS > 0
        __nanosleep(BARRIER_BACKOFF_NS);
#endif
    }
}

__device__ __forceinline__ void grid_barrier(unsigned* arrived, unsigned barrier) {
    const unsigned target = (barrier + 1) * gridDim.x;
    __syncthreads();
#if BARRIER_FLAGS
    __shared__ bool last;
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(arrived, 1u) == target - 1;
    }
    __syncthreads();
    if (last) {  // every other block has arrived: tell each, one store a thread
        __threadfence();
        for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x)
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(arrived + 32 * (b + 1)), "r"(barrier + 1) : "memory");
    } else if (threadIdx.x == 0) {
        wait_until(arrived + 32 * (blockIdx.x + 1), barrier + 1);
    }
#else
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(arrived, 1u);
        wait_until(arrived, target);
    }
#endif
    __syncthreads();
}

// Ask L2 for `bytes` from `at` (16-byte aligned, a multiple of 16) without waiting: on Hopper one bulk-prefetch
// instruction from one lane, before it a 128-byte line per lane.
__device__ __forceinline__ void prefetch_l2(const void* at, int bytes) {
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x % 32 == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(bytes) : "memory");
#else
    for (int k = (threadIdx.x % 32) * 128; k < bytes; k += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(at) + k));
#endif
}

// Whether an op streams weight rows (and which): the projections, with W at word 3 (the norm ops) or 2 (gemv_add)
__device__ __forceinline__ bool is_projection(long long op) {
    return op == OP_RMS_NORM_GEMV || op == OP_RMS_NORM_GEMV_SWIGLU || op == OP_GEMV_ADD;
}

// This warp's first weight rows of projection `in`, up to PREFETCH_BYTES: the rows its columns will read (the
// bodies' first_column / column_step walk), gate and up side by side for the MLP's first half.
__device__ void prefetch_projection(const long long* in) {
    const long long op = in[0];
    const __nv_bfloat16* w = pointer<const __nv_bfloat16>(op == OP_GEMV_ADD ? in[2] : in[3]);
    const int K = static_cast<int>(op == OP_GEMV_ADD ? in[4] : in[6]);
    const int N = static_cast<int>(op == OP_GEMV_ADD ? in[5] : in[7]);  // columns (swiglu: inter)
    const int row_bytes = K * 2;
    int budget = PREFETCH_BYTES;
    for (int j = first_column(); j < N && budget > 0; j += column_step()) {
        const int bytes = min(row_bytes, budget);
        prefetch_l2(w + (long long)j * K, bytes);
        if (op == OP_RMS_NORM_GEMV_SWIGLU) prefetch_l2(w + (long long)(N + j) * K, bytes);
        budget -= op == OP_RMS_NORM_GEMV_SWIGLU ? 2 * bytes : bytes;
    }
}

// One instruction, by every block: each op divides its work among the blocks as its kernel's grid would.
template <int NB, int HEAD_DIM, int GROUP>
__device__ void run_instruction(const long long* in) {
    const long long op = in[0];
    if (op == OP_EMBEDDING) {  // ids, table, residual, hidden: embedding.cu's copy, every thread of the grid a value
        const int* ids = pointer<const int>(in[1]);
        const __nv_bfloat16* table = pointer<const __nv_bfloat16>(in[2]);
        float* residual = pointer<float>(in[3]);
        const int hidden = static_cast<int>(in[4]);
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < NB * hidden; i += gridDim.x * blockDim.x)
            residual[i] = __bfloat162float(table[(long long)ids[i / hidden] * hidden + i % hidden]);
    } else if (op == OP_RMS_NORM_GEMV) {  // residual, norm_weight, w, out, eps, K, N, out_stride, fp32 out
        if (in[9])
            rms_norm_gemv_body<NB, true>(pointer<const float>(in[1]), pointer<const __nv_bfloat16>(in[2]),
                                         pointer<const __nv_bfloat16>(in[3]), pointer<void>(in[4]), float_bits(in[5]),
                                         static_cast<int>(in[6]), static_cast<int>(in[7]), static_cast<int>(in[8]));
        else
            rms_norm_gemv_body<NB, false>(pointer<const float>(in[1]), pointer<const __nv_bfloat16>(in[2]),
                                          pointer<const __nv_bfloat16>(in[3]), pointer<void>(in[4]), float_bits(in[5]),
                                          static_cast<int>(in[6]), static_cast<int>(in[7]), static_cast<int>(in[8]));
    } else if (op == OP_RMS_NORM_GEMV_SWIGLU) {  // residual, norm_weight, w_gate_up, act, eps, K, inter
        rms_norm_gemv_swiglu_body<NB>(pointer<const float>(in[1]), pointer<const __nv_bfloat16>(in[2]),
                                      pointer<const __nv_bfloat16>(in[3]), pointer<__nv_bfloat16>(in[4]),
                                      float_bits(in[5]), static_cast<int>(in[6]), static_cast<int>(in[7]));
    } else if (op == OP_GEMV_ADD) {  // x, w, residual, K, N
        gemv_add_body<NB>(pointer<const __nv_bfloat16>(in[1]), pointer<const __nv_bfloat16>(in[2]),
                          pointer<float>(in[3]), static_cast<int>(in[4]), static_cast<int>(in[5]));
    } else if (op == OP_ROPE_STORE_KV) {  // qkv, positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads, d, stride
        for (int t = blockIdx.x; t < NB; t += gridDim.x)
            rope_store_row(t, pointer<__nv_bfloat16>(in[1]), pointer<const int>(in[2]), pointer<const float>(in[3]),
                           pointer<const float>(in[4]), pointer<__nv_bfloat16>(in[5]), pointer<__nv_bfloat16>(in[6]),
                           pointer<const int>(in[7]), static_cast<int>(in[8]), static_cast<int>(in[9]),
                           static_cast<int>(in[10]), static_cast<int>(in[11]));
    } else if (op == OP_PAGED_ATTENTION) {  // paged_attention's arguments, then splits: its grid's blocks in turn
        const int kv_heads = static_cast<int>(in[8]), splits = static_cast<int>(in[14]);
        for (int item = blockIdx.x; item < kv_heads * NB * splits; item += gridDim.x)
            paged_attention_item<HEAD_DIM, GROUP>(
                item % kv_heads, item / kv_heads % NB, item / (kv_heads * NB), splits,
                pointer<const __nv_bfloat16>(in[1]), pointer<const __nv_bfloat16>(in[2]),
                pointer<const __nv_bfloat16>(in[3]), pointer<const int>(in[4]), static_cast<int>(in[5]),
                pointer<const int>(in[6]), pointer<__nv_bfloat16>(in[7]), kv_heads, static_cast<int>(in[9]),
                static_cast<int>(in[10]), float_bits(in[11]), pointer<float>(in[12]), static_cast<int>(in[13]));
    } else if (op == OP_MERGE_SPLITS) {  // partial, splits, lengths, split_tokens, out, out_stride, heads
        const int heads = static_cast<int>(in[7]), per_block = blockDim.x / HEAD_DIM, sub = threadIdx.x / HEAD_DIM;
        const int splits = static_cast<int>(in[2]), out_stride = static_cast<int>(in[6]);
        for (int item = blockIdx.x * per_block + sub; item < heads * NB; item += gridDim.x * per_block) {
            const int h = item % heads, b = item / heads;
            merge_one<HEAD_DIM>(pointer<const float>(in[1]) + ((long long)b * heads + h) * splits * (HEAD_DIM + 2),
                                splits, pointer<const int>(in[3])[b], static_cast<int>(in[4]),
                                pointer<__nv_bfloat16>(in[5]) + (long long)b * out_stride + h * HEAD_DIM,
                                threadIdx.x % HEAD_DIM);
        }
    } else if (threadIdx.x == 0) {
        __trap();  // an op the list builder knows and this kernel does not
    }
}

// The timeline (bench/persistent_timeline.py): per instruction and block, the GPU's clock in ns when the block began
// it and when it finished its share, and the SM's cycle counter at both — where the step's time goes.
__device__ __forceinline__ void stamp(unsigned long long* at) {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    at[0] = ns;
    at[2] = clock64();
}

template <int NB, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(GEMV_THREADS, FUSED_BLOCKS_PER_SM)
decode_persistent(const long long* program, int count, unsigned* arrived, unsigned long long* timeline) {
    static_assert(GEMV_THREADS % HEAD_DIM == 0, "the merge gives each (row, head) HEAD_DIM threads of a block");
#if PREFETCH_BYTES > 0
    int prefetched = 0;  // the projections before this one have been asked of L2 already
#endif
    for (int i = 0; i < count; ++i) {
        unsigned long long* times = timeline + ((long long)i * gridDim.x + blockIdx.x) * 4;  // null: not recorded
        if (timeline && threadIdx.x == 0) stamp(times);
        run_instruction<NB, HEAD_DIM, GROUP>(program + (long long)i * INSTRUCTION_WORDS);
        if (timeline) {
            __syncthreads();  // the block's share is done when its last warp is
            if (threadIdx.x == 0) stamp(times + 1);
        }
        if (i + 1 == count) break;
#if PREFETCH_BYTES > 0
        // before waiting: the first projection of the next PREFETCH_AHEAD instructions not asked for yet (after
        // qkv: o_proj; during RoPE and attention, the MLP's and the next layer's qkv), so the stream never stops
        for (int next = max(i + 1, prefetched); next < min(count, i + 1 + PREFETCH_AHEAD); ++next) {
            const long long* in = program + (long long)next * INSTRUCTION_WORDS;
            if (is_projection(in[0])) {
                prefetch_projection(in);
                prefetched = next + 1;
                break;
            }
        }
#endif
        grid_barrier(arrived, i);
    }
}
