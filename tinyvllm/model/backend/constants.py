"""The kernels' launch shapes and tile sizes: defined once, here, and nowhere else.

cuda_ops.kernel() hands every value below to NVRTC as `-D NAME=value` (nvrtc_defines()), and a kernel
file that uses one stops with `#error` when it is missing, so a kernel and its launch cannot disagree.
The NumPy twins (numpy_ops.py) read the same values where they change the arithmetic (decode attention's
chunking). BLOCK_SIZE, the paged KV block size, has its one source in tinyvllm/model/kv_pool.py.
"""
from __future__ import annotations

from typing import NamedTuple

from tinyvllm.model.step_plan import BLOCK_SIZE

BF16_PER_VECTOR = 8  # bf16 values in one 16-byte vector load (uint4): what a kernel thread loads at once

# Row kernels (embedding, add_rms_norm, rope, swiglu): one block per row; they read blockDim, so any multiple
# of 32 works (block_sum's warps). It still goes through -D: fused_decode.cu's norm sums a row in add_rms_norm's
# order only while GEMV_THREADS == ROWS, and asserts it
ROWS = 256  # 8 warps stride over a row: 576 (SmolLM2) to 2048 (Llama 3.2 1B) columns in 3 to 8 steps
NORM_VECTOR = 4  # columns add_rms_norm's threads take at once (a 16-byte fp32 load) when the hidden size is a multiple
ARGMAX_THREADS = 256  # argmax: a block scans one piece of a row, 4 entries a thread
ARGMAX_PIECE = 1024  # ... of this many entries: a 128K-entry row (Llama 3.2) is 126 blocks, about one per SM of an H200
SAMPLE_THREADS = 1024  # sample_rows: one block a row, a slice of ceil(vocab / SAMPLE_THREADS) tokens a thread
STORE_KV_THREADS = 128  # 8 bf16 each: 1024 K (and V) columns in one pass, 8 K/V heads x 128 (Llama 3.1 8B)

# Prefill attention (chapter 3): PREFILL_TILE query rows per block, PREFILL_KEY_TILE keys per K/V tile
PREFILL_TILE = 128  # query rows per block: each K/V tile loaded serves 128 queries
PREFILL_KEY_TILE = 64  # keys per tile: a warp's scores stay 64 registers; Q + 2 x (K + V) at d 128: 102 KiB smem
PREFILL_WARP_ROWS = 16  # query rows per warp, whole m16n8k16 tiles: with 32, each K/V fragment loaded feeds 2 products
PREFILL_THREADS = PREFILL_TILE // PREFILL_WARP_ROWS * 32  # one warp per PREFILL_WARP_ROWS rows of the tile
PREFILL_BLOCKS_PER_SM = 2  # __launch_bounds__ minimum at head_dim <= 64: caps registers at 128 so two blocks fit an SM
PREFILL_KV_STAGES = 2  # K/V tiles in flight: cp.async fills one stage while the warps compute on the other
PREFILL_SMEM_PAD = 8  # bf16 per shared-memory row past head_dim: a warp's 8 rows land in different banks
PREFILL_HEAD_DIMS = (16, 32, 64, 128)  # prefill_attention.cu instantiates one kernel for each (ATTENTION_KERNEL)

# Decode attention (chapters 5-7): one block per (sequence, K/V head), its threads in groups of one key row each
DECODE_THREADS = 256  # 8 warps: 256 / (head_dim / 8) keys read side by side, 32 at head_dim 64
DECODE_UNROLL = 4  # keys a thread group takes per iteration: their loads all issued first, one softmax rescale for
# the tile (H200, 64 sequences: 33.1 us vs 38.5 rescaling per key; 2 keys 38.3; 8 keys need more than 128 registers
# a thread at GROUP 4: one block an SM, or spills)
DECODE_HEAD_DIMS = (16, 32, 64, 128, 256)  # a key row (head_dim / 8 threads) must fit in one warp
SPLIT_MAX_ROWS = 16  # paged attention splits a context only for up to this many sequences (the workspace's rows)
MAX_SPLITS = 16  # ... into at most this many parts: batch 1 x 8 K/V heads x 16 = 128 blocks, ~1 per SM of an H200

# gemv (chapter 5): decode's projections for a handful of rows
GEMV_MAX_ROWS = 8  # the most rows gemv and the fused kernels take (their templates): a thread keeps one sum per row
# decode steps of up to this many rows use gemv and the fused layer, more rows go to cuBLAS: on CUDA cores every
# extra row is 8 more FMAs per 16-byte weight load, and bench/gemv_rows.py measured cuBLAS's tensor cores ahead
# from 2 rows on an H200 (gemv_rows-20261202-032104.json: a step of 2 rows 1.43 ms vs 1.49 fused; of 8, 1.51 vs 3.42)
GEMV_DECODE_ROWS = 1
GEMV_COLUMNS_PER_BLOCK = 8  # one output column per warp
GEMV_THREADS = 32 * GEMV_COLUMNS_PER_BLOCK  # one warp per output column
GEMV_LOADS = 2  # 16-byte weight loads a lane issues before using any (chapter 8). The batch-1 step on an H200, both in
# one process (bench/step_constants.py, step_constants-20261204-190300.json): 1.182 ms with 2, 1.227 with 4; 8 and 16
# were slower than 4 (chapter 8). The sums do not depend on it: gemv.cuh uses the loads in the order of k

# The fused decode layer (chapter 8, kernels/fused_decode.cu): gemv with its neighbours folded in, up to
# GEMV_MAX_ROWS rows. Its norm kernels start at most this many blocks per SM (also their __launch_bounds__ minimum,
# which caps a thread's registers so that they fit) and each block walks many columns: the rows are normalized
# once per block (1 to 4 blocks per SM measured alike on an H200)
FUSED_BLOCKS_PER_SM = 2

# Chapter 8's persistent decode step (kernels/decode_persistent.cu): the fused layer's ops as an instruction list
# that one launch walks. An instruction is INSTRUCTION_WORDS int64: its op's index here, then the op's arguments.
PERSISTENT_OPS = ("embedding", "rms_norm_gemv", "rms_norm_gemv_swiglu", "gemv_add", "rope_store_kv",
                  "paged_attention", "merge_splits")
INSTRUCTION_WORDS = 16
# What was tried against the grid barrier's cost, measured on an H200 at batch 1 (bench/persistent_timeline.py
# --define ...; persistent_prefetch-20261203-160300.json, persistent_sweep-20261203-161400/-162400.json), each at its
# best value here, 0 turning it off:
#   PREFETCH_BYTES: before a block waits at a barrier, each warp asks L2 for up to this many bytes of its rows of the
#     first projection among the next PREFETCH_AHEAD instructions: 8 KB cost 0.09-0.23 ms a step, 16 KB 0.16 ms;
#   BARRIER_FLAGS: 1 = the last block to arrive writes every block's own flag (no polling of one line): the barriers
#     took 229 us a step against 132 us polling the counter;
#   BARRIER_BACKOFF_NS: a polling block sleeps this long between loads: 200 ns changed nothing.
PREFETCH_BYTES = 0
PREFETCH_AHEAD = 4
BARRIER_FLAGS = 0
BARRIER_BACKOFF_NS = 0

# The batch-invariant mode (chapter 7): paged attention splits every context into parts of a size fixed by its own
# length, at every batch size: span = INVARIANT_SPLIT_TOKENS x ceil(ceil(length / INVARIANT_SPLIT_TOKENS) /
# MAX_SPLITS), at most MAX_SPLITS parts (decode_attention.cuh's split_span), so a row's sums never follow the batch
INVARIANT_SPLIT_TOKENS = 512  # long enough that most rows of a large batch are one part (no merge), short enough
# that batch 1 at 4,096 keys gets 8 parts x 8 K/V heads

# The batch-invariant GEMM (chapter 7, kernels/gemm_invariant.cu): every output element is one chain of
# m16n8k16 products over k in INVARIANT_CHUNK-wide chunks, so K % INVARIANT_CHUNK == 0
INVARIANT_CHUNK = 32  # two m16n8k16 instructions of 16 k; one 16-byte load per lane and row


class GemmTile(NamedTuple):
    """A block tile of gemm_invariant: warps_m x warps_n warps, each tm x tn m16n8 tiles; bk columns of k per stage,
    `stages` stages in flight. Any tile gives a row the same bits (the kernel's one order of k): the choice is speed."""
    warps_m: int
    warps_n: int
    tm: int
    tn: int
    bk: int
    stages: int

    @property
    def rows(self) -> int:
        return self.warps_m * self.tm * 16

    @property
    def cols(self) -> int:
        return self.warps_n * self.tn * 8

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * 32

    @property
    def row_stride(self) -> int:
        """bf16 per shared-memory row: 64 bytes modulo 128, so the rows r and r + 1 a quarter warp reads share no bank."""
        return self.bk if (2 * self.bk) % 128 == 64 else self.bk + 32

    @property
    def smem(self) -> int:
        """Dynamic shared memory per block: `stages` A (rows x bk) and B (cols x bk) tiles, bf16."""
        return self.stages * (self.rows + self.cols) * self.row_stride * 2


# (up to this many rows, the tile): the fastest for a whole layer of Llama 3.2 1B on an H200 among the candidates
# bench/invariant_gemm.py times (invariant_gemm-20261203-095339.json)
INVARIANT_GEMM_TILES = ((32, GemmTile(1, 4, 1, 1, 128, 4)),
                        (256, GemmTile(2, 4, 2, 2, 64, 4)),
                        (None, GemmTile(2, 4, 4, 4, 32, 3)))


def invariant_gemm_tile(rows: int) -> GemmTile:
    """The tile gemm_invariant uses for a product of `rows` rows (INVARIANT_GEMM_TILES)."""
    return next(tile for most, tile in INVARIANT_GEMM_TILES if most is None or rows <= most)


def decode_thread_groups(head_dim: int) -> int:
    """How many keys decode attention's block works on side by side, i.e. how many chunks it cuts a
    context into: HEAD_DIM / BF16_PER_VECTOR threads hold one key row (TPK in decode_attention.cuh), and
    the block's DECODE_THREADS threads form DECODE_THREADS / TPK such groups (GROUPS there)."""
    assert head_dim in DECODE_HEAD_DIMS, f"decode attention is built for head_dim {DECODE_HEAD_DIMS}, got {head_dim}"
    return DECODE_THREADS // (head_dim // BF16_PER_VECTOR)


# What the kernels receive through -D: every launch-shape constant a .cu/.cuh file may use
KERNEL_CONSTANTS = {
    "BLOCK_SIZE": BLOCK_SIZE,
    "BF16_PER_VECTOR": BF16_PER_VECTOR,
    "ROWS": ROWS,
    "NORM_VECTOR": NORM_VECTOR,
    "ARGMAX_THREADS": ARGMAX_THREADS,
    "ARGMAX_PIECE": ARGMAX_PIECE,
    "SAMPLE_THREADS": SAMPLE_THREADS,
    "STORE_KV_THREADS": STORE_KV_THREADS,
    "PREFILL_TILE": PREFILL_TILE,
    "PREFILL_KEY_TILE": PREFILL_KEY_TILE,
    "PREFILL_WARP_ROWS": PREFILL_WARP_ROWS,
    "PREFILL_THREADS": PREFILL_THREADS,
    "PREFILL_KV_STAGES": PREFILL_KV_STAGES,
    "PREFILL_BLOCKS_PER_SM": PREFILL_BLOCKS_PER_SM,
    "PREFILL_SMEM_PAD": PREFILL_SMEM_PAD,
    "DECODE_THREADS": DECODE_THREADS,
    "DECODE_UNROLL": DECODE_UNROLL,
    "GEMV_MAX_ROWS": GEMV_MAX_ROWS,
    "GEMV_COLUMNS_PER_BLOCK": GEMV_COLUMNS_PER_BLOCK,
    "GEMV_THREADS": GEMV_THREADS,
    "GEMV_LOADS": GEMV_LOADS,
    "FUSED_BLOCKS_PER_SM": FUSED_BLOCKS_PER_SM,
    "INVARIANT_CHUNK": INVARIANT_CHUNK,
    "INSTRUCTION_WORDS": INSTRUCTION_WORDS,
    "PREFETCH_BYTES": PREFETCH_BYTES,
    "PREFETCH_AHEAD": PREFETCH_AHEAD,
    "BARRIER_FLAGS": BARRIER_FLAGS,
    "BARRIER_BACKOFF_NS": BARRIER_BACKOFF_NS,
    **{f"OP_{name.upper()}": code for code, name in enumerate(PERSISTENT_OPS)},
}


def nvrtc_defines() -> tuple[str, ...]:
    """("-DBLOCK_SIZE=16", ...): the compiler options that give the kernels these constants (NVRTC and nvcc
    both read them). Anything that compiles a file of tinyvllm/model/kernels needs them."""
    return tuple(f"-D{name}={value}" for name, value in KERNEL_CONSTANTS.items())


# ---- dynamic shared memory per block: one function per kernel family, the single source for the launchers
# (cuda_ops) and the benchmarks that launch the kernels with other constants (bench/kernel_bench.py, attention_tiles.py)

def prefill_smem(head_dim: int, constants: dict[str, int] | None = None) -> int:
    """prefill_attention.cu's (both kernels): the Q tile and PREFILL_KV_STAGES pairs of K and V tiles, bf16, each
    row padded by PREFILL_SMEM_PAD. `constants`: the values the kernel was compiled with, KERNEL_CONSTANTS if None."""
    c = KERNEL_CONSTANTS if constants is None else constants  # looked up now: bench/kernel_bench.py may have changed it
    rows = c["PREFILL_TILE"] + 2 * c["PREFILL_KV_STAGES"] * c["PREFILL_KEY_TILE"]
    return rows * (head_dim + c["PREFILL_SMEM_PAD"]) * 2


def norm_gemv_smem(rows: int, K: int) -> int:
    """fused_decode.cu's rms_norm_gemv and rms_norm_gemv_swiglu: the `rows` normalized rows of K columns, bf16."""
    return rows * K * 2
