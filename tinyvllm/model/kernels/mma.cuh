// Chapters 3 and 7 — the tensor-core pieces shared by prefill attention (prefill_attention.cu) and the
// batch-invariant GEMM (gemm_invariant.cu): one m16n8k16 product and the asynchronous global -> shared copy.
// Fragment layout of m16n8k16 (thread g = lane / 4, t = lane % 4): A holds rows g and g + 8, k slots 2t, 2t + 1,
// 2t + 8, 2t + 9; B holds column g at the same k slots; C holds rows g and g + 8, columns 2t and 2t + 1.
#pragma once
#include "common.cuh"

// c (16x8 fp32) += a (16x16 bf16, row-major) * b (16x8 bf16, column-major)
__device__ __forceinline__ void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Start a 16-byte copy global -> shared that runs while the warps compute; !inside copies nothing and fills
// the 16 bytes with zeros (a source size of 0 reads nothing, but src must still be a valid address)
__device__ __forceinline__ void copy_16_async(void* dst, const void* src, bool inside) {
    unsigned to = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(inside ? 16 : 0));
}

// Close the copies started so far into one group, which wait_copies counts
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>  // wait until at most PENDING groups of copies are still in flight
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }
