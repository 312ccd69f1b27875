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
prefix cache, in one chunk or three. The mode swaps the two: `gemm_invariant` (every row through gemv's
arithmetic, in groups of rows) and paged attention never split. What it costs — CUDA cores instead of
tensor cores for every GEMM, a weight read per group of rows, one block per (sequence, head) at batch 1 —
bench/throughput.py measures.

The NumPy twins have their own orders (tests/test_batch_invariance.py found them): BLAS sends one row to
gemv, which sums otherwise than its GEMM (`gemm_invariant` pads it to two), and the whole-prompt attention
groups a row's sums by the prompt's length (`prefill_attention_invariant` and `chunk_attention_invariant`
attend one query at a time, as a decode query does). Every backend provides the `_invariant` forms.

Chapter 8's fused decode kernels are withheld: they run only up to GEMV_DECODE_ROWS rows, so a sequence would switch
between them and the unfused layer as its batch grows, and nothing makes the two sum alike (the fused norm's
block reduction matches add_rms_norm's only while their block sizes agree). The mode keeps the unfused layer.
"""
from __future__ import annotations

from types import ModuleType

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
        self._ops.paged_attention(qkv, k_cache, v_cache, block_tables, lengths, out, num_heads, splits=1)

    def prefill_attention(self, qkv, out, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self._ops.prefill_attention_invariant(qkv, out, num_heads, num_kv_heads, head_dim)

    def chunk_attention(self, qkv, k_cache, v_cache, block_table, start: int, out, num_heads: int) -> None:
        self._ops.chunk_attention_invariant(qkv, k_cache, v_cache, block_table, start, out, num_heads)
