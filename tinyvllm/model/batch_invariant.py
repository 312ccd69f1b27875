"""Chapter 7: the batch-invariant mode — the same request gets the same logits, whatever else is batched.

Floating-point addition is not associative: summed in another order, the same numbers give a result that
differs in its last bits, and one flipped bit in a logit can change a greedy token, after which the two
answers part. Two operations choose their order by the batch:

  gemm             the gemv kernel up to GEMV_DECODE_ROWS rows, cuBLAS above it — and cuBLAS picks its tiling
                   and its split of K from the shape, so row i's dot products are summed differently at
                   T = 3 and T = 300;
  paged_attention  splits a context between thread blocks only when the batch is small (too few blocks
                   to fill the GPU otherwise), and merges the parts: another order of the same sums.

Everything else works row by row (RMSNorm, RoPE, SwiGLU, the K/V store, the argmax) or, on the GPU, already
sums in a fixed order per query: the prefill and chunk attention kernels walk keys in 64-key tiles from
position 0, so a prompt's tokens see the same tiles whether the prefix was prefilled now or found in the
prefix cache, in one chunk or three. The mode swaps the two. `gemm_invariant` (kernels/gemm_invariant.cu) runs every
GEMM on tensor cores with one order of summation per output element, the same at any T: a chain of m16n8k16
products over k in 32-wide chunks, never split, whatever block tile T picks. Paged attention splits every context
into parts whose size follows the row's own length (INVARIANT_SPLIT_TOKENS), at every batch size, and merges them
in order. What it costs — bench/invariant_steps.py and bench/invariant_gemm.py measure: the kernel runs at a
quarter to a third of cuBLAS's rate, so a decode step costs 2.1x to 2.6x the default's on an H200.

On the CPU a BLAS library makes those choices, and they cannot be trusted: which kernel a product of T rows
gets, how it is blocked and split between threads, depends on the CPU (OpenBLAS has a kernel family per core
type), the build (OpenBLAS, MKL, Accelerate) and the thread count, and none of them promises an order. So the
NumPy mode does not ask the BLAS for one; it makes every row's arithmetic one fixed call: `gemm_invariant`
copies row t into one (1, K) scratch row and multiplies it into one (1, N) scratch row, the same shapes and
pointers at any T (at T = 1 that is the default's own call, so batch-1 decode costs nothing more; T rows read
the weights T times). Attention attends one query at a time (`prefill_attention_invariant`,
`chunk_attention_invariant`, and paged_attention already does), so a query's sums have the shapes of its own
context only. RMSNorm, RoPE and SwiGLU work row by row in both modes.

Sampling is the model runner's (sampler.py): in this mode it draws the sampled rows of a step together with the
backend's `sample_rows` (kernels/sample_rows.cu, or its NumPy twin), whose every sum has an order fixed by the
vocabulary size, where the default mode's batched softmax and cumsum are a library's, scheduled by the array's
shape. Greedy rows are an argmax: exact in any order.

Chapter 8's fused decode kernels are withheld: they run only up to GEMV_DECODE_ROWS rows, so a sequence would switch
between them and the unfused layer as its batch grows, and nothing makes the two sum alike (the fused norm's
block reduction matches add_rms_norm's only while their block sizes agree). The mode keeps the unfused layer.
"""
from __future__ import annotations

from types import ModuleType

from tinyvllm.model.backend.constants import INVARIANT_SPLIT_TOKENS, MAX_SPLITS
from tinyvllm.model.fused import FUSED_OPS


class BatchInvariantOps:
    """A backend module with gemm and the attention ops replaced by their batch-invariant forms and without the
    fused decode ops (decode then takes the unfused layer); every other operation is the module's own."""
    def __init__(self, ops: ModuleType):
        self._ops = ops

    def __getattr__(self, name: str):
        if name in FUSED_OPS:
            raise AttributeError(f"the batch-invariant mode has no {name}: its decode runs the unfused layer")
        return getattr(self._ops, name)

    def gemm(self, x, w, out) -> None:
        self._ops.gemm_invariant(x, w, out)

    def paged_attention(self, qkv, k_cache, v_cache, block_tables, lengths, out, num_heads: int) -> None:
        self._ops.paged_attention(qkv, k_cache, v_cache, block_tables, lengths, out, num_heads, splits=MAX_SPLITS,
                                  split_tokens=INVARIANT_SPLIT_TOKENS)

    def prefill_attention(self, qkv, out, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self._ops.prefill_attention_invariant(qkv, out, num_heads, num_kv_heads, head_dim)

    def chunk_attention(self, qkv, k_cache, v_cache, block_table, start: int, out, num_heads: int) -> None:
        self._ops.chunk_attention_invariant(qkv, k_cache, v_cache, block_table, start, out, num_heads)
