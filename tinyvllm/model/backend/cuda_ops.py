"""The CUDA backend: CuPy arrays, the kernels of tinyvllm/model/kernels/*.cu, GEMMs through cuBLAS.

bf16 has no CuPy dtype, so bf16 tensors are uint16 arrays holding the bits; the kernels read them
as __nv_bfloat16. Each kernel file is compiled once per process by NVRTC (cupy.RawModule).
"""
from __future__ import annotations

import functools
from pathlib import Path

import cupy as cp
import numpy as np

from tinyvllm.model.backend.constants import (
    ARGMAX_PIECE,
    ARGMAX_THREADS,
    BF16_PER_VECTOR,
    DECODE_HEAD_DIMS,
    DECODE_THREADS,
    FUSED_BLOCKS_PER_SM,
    GEMV_COLUMNS_PER_BLOCK,
    GEMV_DECODE_ROWS,
    GEMV_MAX_ROWS,
    GEMV_THREADS,
    INSTRUCTION_WORDS,
    INVARIANT_CHUNK,
    MAX_SPLITS,
    NORM_VECTOR,
    PERSISTENT_OPS,
    PREFILL_HEAD_DIMS,
    PREFILL_THREADS,
    PREFILL_TILE,
    ROWS,
    SAMPLE_THREADS,
    SPLIT_MAX_ROWS,
    STORE_KV_THREADS,
    GemmTile,
    invariant_gemm_tile,
    norm_gemv_smem,
    nvrtc_defines,
    prefill_smem,
)
from tinyvllm.model.gemm import gemm_cublas

xp = cp
DTYPE = np.uint16  # bf16 bits
KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
# Every launch constant reaches the kernels as -D NAME=value (backend/constants.py): CuPy caches a compiled
# module by its source and options, so they are compiled once per value, and a kernel file that uses one
# fails to compile without it.
NVRTC_OPTIONS = ("-std=c++17", f"-I{KERNELS_DIR}", *nvrtc_defines())


@functools.lru_cache(maxsize=None)
def kernel(file: str, name: str) -> cp.RawKernel:
    """A kernel of kernels/<file>.cu; a template instance such as "decode_attention<64, 4>" is compiled
    for exactly those arguments (NVRTC name expressions)."""
    source = (KERNELS_DIR / f"{file}.cu").read_text()
    templates = (name,) if "<" in name else None
    module = cp.RawModule(code=source, options=NVRTC_OPTIONS, name_expressions=templates)
    return module.get_function(name)


def gemm(x: cp.ndarray, w: cp.ndarray, out: cp.ndarray) -> None:
    """out (T, N) = x (T, K) @ w (N, K)^T: cuBLAS (chapter 4), or for up to GEMV_DECODE_ROWS rows (decode at
    batch 1) the gemv kernel, which streams the weights (chapter 5)."""
    T, K = x.shape
    if T > GEMV_DECODE_ROWS or K % BF16_PER_VECTOR:
        return gemm_cublas(x, w, out)
    gemv(x, w, out)


def gemv(x: cp.ndarray, w: cp.ndarray, out: cp.ndarray) -> None:
    """gemm by kernels/gemv.cu, up to GEMV_MAX_ROWS rows: one warp per output column, the weights read once."""
    T, K = x.shape
    assert T <= GEMV_MAX_ROWS and K % BF16_PER_VECTOR == 0, "gemv: up to GEMV_MAX_ROWS rows, 16-byte loads"
    assert x.strides == w.strides == (2 * K, 2) and out.strides[1] == out.itemsize and out.shape == (T, w.shape[0])
    f32 = out.dtype == np.float32
    N = w.shape[0]
    kernel("gemv", f"gemv<{T}, {'true' if f32 else 'false'}>")(
        (-(-N // GEMV_COLUMNS_PER_BLOCK),), (GEMV_THREADS,),
        (x, w, out, np.int32(K), np.int32(N), np.int32(out.strides[0] // out.itemsize)))


def gemm_invariant(x: cp.ndarray, w: cp.ndarray, out: cp.ndarray) -> None:
    """gemm for the batch-invariant mode (chapter 7): on tensor cores, every output element summed in one fixed
    order whatever T is (kernels/gemm_invariant.cu), so a sequence's logits do not depend on its batch; the block
    tile follows T for speed (constants.INVARIANT_GEMM_TILES) and changes no bits."""
    gemm_invariant_tiled(x, w, out, invariant_gemm_tile(x.shape[0]))


def gemm_invariant_tiled(x: cp.ndarray, w: cp.ndarray, out: cp.ndarray, tile: GemmTile) -> None:
    """gemm_invariant with a given block tile: bench/invariant_gemm.py times them, the GPU tests compare their bits."""
    T, K = x.shape
    N = w.shape[0]
    assert K % INVARIANT_CHUNK == 0, f"gemm_invariant sums k in chunks of {INVARIANT_CHUNK}: K = {K} is no multiple"
    assert x.strides == w.strides == (2 * K, 2) and out.strides[1] == out.itemsize and out.shape == (T, N)
    f32 = "true" if out.dtype == np.float32 else "false"
    k = kernel("gemm_invariant", f"gemm_invariant<{tile.warps_m}, {tile.warps_n}, {tile.tm}, {tile.tn}, {tile.bk}, "
                                 f"{tile.row_stride}, {tile.stages}, {f32}>")
    k.max_dynamic_shared_size_bytes = tile.smem
    k((-(-N // tile.cols), -(-T // tile.rows)), (tile.threads,),
      (x, w, out, np.int32(T), np.int32(K), np.int32(N), np.int32(out.strides[0] // out.itemsize)), shared_mem=tile.smem)


# ---- chapter 8: the fused decode layer (kernels/fused_decode.cu), up to GEMV_MAX_ROWS rows

def rms_norm_gemv(residual: cp.ndarray, norm_weight: cp.ndarray, w: cp.ndarray, out: cp.ndarray, eps: float) -> None:
    """out (T, N) = rms_norm(residual) @ w (N, K)^T in one launch: add_rms_norm (no delta) and gemm, without the
    normed buffer between them; out bf16, or fp32 (the logits)."""
    T, K = residual.shape
    N = w.shape[0]
    _fused_shapes_ok(residual, w)
    assert out.shape == (T, N) and out.strides[1] == out.itemsize
    _launch_norm_gemv(f"rms_norm_gemv<{T}, {'true' if out.dtype == np.float32 else 'false'}>", T, K, N,
                      (residual, norm_weight, w, out, np.float32(eps), np.int32(K), np.int32(N),
                       np.int32(out.strides[0] // out.itemsize)))


def rms_norm_gemv_swiglu(residual: cp.ndarray, norm_weight: cp.ndarray, w_gate_up: cp.ndarray, act: cp.ndarray,
                         eps: float) -> None:
    """act (T, inter) = swiglu(rms_norm(residual) @ w_gate_up (2 inter, K)^T) in one launch: no gate_up buffer."""
    T, K = residual.shape
    inter = w_gate_up.shape[0] // 2
    _fused_shapes_ok(residual, w_gate_up)
    assert act.shape == (T, inter) and act.flags.c_contiguous, "act: whole (T, inter) rows"
    _launch_norm_gemv(f"rms_norm_gemv_swiglu<{T}>", T, K, inter,
                      (residual, norm_weight, w_gate_up, act, np.float32(eps), np.int32(K), np.int32(inter)))


def gemv_add(x: cp.ndarray, w: cp.ndarray, residual: cp.ndarray) -> None:
    """residual (T, N) fp32 += bf16(x (T, K) @ w (N, K)^T): gemv with the residual add in its epilogue."""
    T, K = x.shape
    N = w.shape[0]
    assert T <= GEMV_MAX_ROWS and K % BF16_PER_VECTOR == 0, "the fused layer: up to GEMV_MAX_ROWS rows, 16-byte loads"
    assert x.strides == w.strides == (2 * K, 2) and residual.shape == (T, N) and residual.flags.c_contiguous
    kernel("fused_decode", f"gemv_add<{T}>")((-(-N // GEMV_COLUMNS_PER_BLOCK),), (GEMV_THREADS,),
                                             (x, w, residual, np.int32(K), np.int32(N)))


def rope_store_kv(qkv: cp.ndarray, positions: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray, k_cache: cp.ndarray,
                  v_cache: cp.ndarray, slots: cp.ndarray, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """rope on the Q and K heads, then store_kv, in one launch (one block per row)."""
    _rows_ok(qkv)
    assert k_cache.flags.c_contiguous and v_cache.flags.c_contiguous, "the cache must be (slots, kv_heads, head_dim)"
    assert k_cache.shape[1:] == (num_kv_heads, head_dim)
    kernel("fused_decode", "rope_store_kv")((len(positions),), (ROWS,),
                                            (qkv, positions, cos, sin, k_cache, v_cache, slots, np.int32(num_heads),
                                             np.int32(num_kv_heads), np.int32(head_dim),
                                             np.int32(qkv.strides[0] // 2)))


def _fused_shapes_ok(residual: cp.ndarray, w: cp.ndarray) -> None:
    T, K = residual.shape
    assert 1 <= T <= GEMV_MAX_ROWS and K % BF16_PER_VECTOR == 0, "the fused layer: up to GEMV_MAX_ROWS rows, K % 8 == 0"
    assert residual.dtype == np.float32 and residual.flags.c_contiguous and w.strides == (2 * K, 2)


def _launch_norm_gemv(name: str, T: int, K: int, columns: int, args: tuple) -> None:
    """The two norm kernels: FUSED_BLOCKS_PER_SM blocks per SM at most (each normalizes the rows once, into shared
    memory, then walks its share of the columns), or one per GEMV_COLUMNS_PER_BLOCK columns if that is fewer."""
    k = kernel("fused_decode", name)
    smem = norm_gemv_smem(T, K)
    if smem > 48 * 1024:  # past the default limit a kernel must opt in (Llama 3.1 8B: 8 x 4096 x 2 = 64 KiB)
        k.max_dynamic_shared_size_bytes = smem
    blocks = min(-(-columns // GEMV_COLUMNS_PER_BLOCK), FUSED_BLOCKS_PER_SM * _multiprocessors())
    k((blocks,), (GEMV_THREADS,), args, shared_mem=smem)


# ---- chapter 8, last section: the decode step in one launch (kernels/decode_persistent.cu, model/persistent.py)

class PersistentProgram:
    """A step's instruction list on the GPU: (count, INSTRUCTION_WORDS) int64, with the kernel instance that runs it
    and the counter its grid barrier counts on. Kept alive by whoever replays its launch (a CUDA graph)."""

    def __init__(self, words: np.ndarray, rows: int, hidden: int, head_dim: int, group: int):
        self.words, self.count = cp.asarray(words), len(words)
        self.rows, self.hidden = rows, hidden
        self.name = f"decode_persistent<{rows}, {head_dim}, {group}>"
        self.arrived = cp.zeros(32, np.uint32)   # grid_barrier's counter, then a 128-byte flag a block (launch sizes it)


def persistent_program(calls: list[tuple[str, tuple]]) -> PersistentProgram:
    """Encode a step's instruction list (model/persistent.py): one row of int64 words per instruction, the op's code
    then its kernel's arguments (pointers as addresses, floats as their bits); paged attention that splits its
    contexts becomes two instructions, the attention and the merge, a barrier apart."""
    words, shapes = [], {"rows": set(), "hidden": set(), "heads": set()}
    for name, args in calls:
        for row in _encode(name, args, shapes):
            words.append(row + [0] * (INSTRUCTION_WORDS - len(row)))
    (rows,), (hidden,), ((head_dim, group),) = shapes["rows"], shapes["hidden"], shapes["heads"]  # one of each a step
    return PersistentProgram(np.asarray(words, dtype=np.int64), rows, hidden, head_dim, group)


def _encode(name: str, args: tuple, shapes: dict[str, set]) -> list[list[int]]:
    """The instruction rows of one call, in the argument order kernels/decode_persistent.cu reads; what the call
    says of the step's shape into `shapes`: its rows, the width its norm runs over, (head_dim, query heads per K/V
    head) of its attention — the kernel's template arguments and its shared memory."""
    code = PERSISTENT_OPS.index(name)
    if name == "embedding":
        ids, table, residual = args
        shapes["rows"].add(len(ids))
        return [[code, ids.data.ptr, table.data.ptr, residual.data.ptr, residual.shape[1]]]
    if name in ("rms_norm_gemv", "rms_norm_gemv_swiglu"):
        residual, norm_weight, w, out, eps = args
        _fused_shapes_ok(residual, w)
        shapes["rows"].add(residual.shape[0])
        shapes["hidden"].add(residual.shape[1])
        K, N = residual.shape[1], out.shape[1]
        head = [code, residual.data.ptr, norm_weight.data.ptr, w.data.ptr, out.data.ptr, _float_bits(eps), K, N]
        if name == "rms_norm_gemv_swiglu":
            assert out.flags.c_contiguous and w.shape[0] == 2 * N, "act: whole (T, inter) rows"
            return [head]
        assert out.strides[1] == out.itemsize
        return [head + [out.strides[0] // out.itemsize, int(out.dtype == np.float32)]]
    if name == "gemv_add":
        x, w, residual = args
        assert x.strides == w.strides == (2 * x.shape[1], 2) and residual.flags.c_contiguous
        return [[code, x.data.ptr, w.data.ptr, residual.data.ptr, x.shape[1], w.shape[0]]]
    if name == "rope_store_kv":
        qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim = args
        assert k_cache.flags.c_contiguous and v_cache.flags.c_contiguous and k_cache.shape[1:] == (num_kv_heads, head_dim)
        return [[code, qkv.data.ptr, positions.data.ptr, cos.data.ptr, sin.data.ptr, k_cache.data.ptr, v_cache.data.ptr,
                 slots.data.ptr, num_heads, num_kv_heads, head_dim, qkv.strides[0] // 2]]
    if name == "paged_attention":
        qkv, k_cache, v_cache, tables, lengths, out, num_heads = args
        n, (_, kv_heads, head_dim) = out.shape[0], k_cache.shape
        assert tables.flags.c_contiguous and tables.dtype == np.int32 and qkv.strides[0] % 16 == 0
        shapes["rows"].add(n)
        shapes["heads"].add((head_dim, num_heads // kv_heads))
        splits = _default_splits(n, kv_heads)
        partial = _split_workspace(num_heads, head_dim, _workspace_rows(n))
        out_stride = out.strides[0] // 2
        attend = [code, qkv.data.ptr, k_cache.data.ptr, v_cache.data.ptr, tables.data.ptr, tables.shape[1],
                  lengths.data.ptr, out.data.ptr, kv_heads, qkv.strides[0] // 2, out_stride,
                  _float_bits(head_dim ** -0.5), partial.data.ptr, 0, splits]
        merge = [PERSISTENT_OPS.index("merge_splits"), partial.data.ptr, splits, lengths.data.ptr, 0, out.data.ptr,
                 out_stride, num_heads]
        return [attend, merge] if splits > 1 else [attend]
    raise ValueError(f"the persistent kernel has no op {name!r}: it runs {PERSISTENT_OPS}")


def _resident_blocks_per_sm(k: cp.RawKernel, smem: int) -> int:
    """How many of the kernel's blocks an SM holds at once, FUSED_BLOCKS_PER_SM at most: its registers (capped by
    __launch_bounds__ for FUSED_BLOCKS_PER_SM blocks) and its shared memory, static and dynamic, must fit."""
    attributes, device = k.attributes, cp.cuda.Device().attributes
    by_registers = device["MaxRegistersPerMultiprocessor"] // (attributes["num_regs"] * GEMV_THREADS)
    by_memory = device["MaxSharedMemoryPerMultiprocessor"] // (attributes["shared_size_bytes"] + smem + 1024)
    return max(1, min(FUSED_BLOCKS_PER_SM, by_registers, by_memory))


def _float_bits(value: float) -> int:
    return int(np.float32(value).view(np.int32))


def decode_persistent(program: PersistentProgram, timeline: cp.ndarray | None = None) -> None:
    """One launch runs the whole step: as many blocks as can be resident at once (they wait for each other at the
    grid barriers), FUSED_BLOCKS_PER_SM per SM at most. timeline: None, or persistent_blocks() x count x 4 uint64
    that the kernel fills with when each block began and ended each instruction (bench/persistent_timeline.py)."""
    k = kernel("decode_persistent", program.name)
    smem = norm_gemv_smem(program.rows, program.hidden)
    if smem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = smem
    blocks = persistent_blocks(program)
    if program.arrived.size < 32 * (blocks + 1):   # the first launch, eager, before a graph captures the address
        program.arrived = cp.zeros(32 * (blocks + 1), np.uint32)
    program.arrived.fill(0)
    k((blocks,), (GEMV_THREADS,),
      (program.words, np.int32(program.count), program.arrived, np.uint64(0) if timeline is None else timeline),
      shared_mem=smem)


def persistent_blocks(program: PersistentProgram) -> int:
    """The persistent kernel's grid for this program: every block resident at once."""
    k = kernel("decode_persistent", program.name)
    return _resident_blocks_per_sm(k, norm_gemv_smem(program.rows, program.hidden)) * _multiprocessors()


def free_cached_memory() -> None:
    """Hand the memory CuPy caches for reuse back to the driver: a freed array's device memory stays in
    CuPy's pool (and pinned host memory in its pinned pool), where no other process can have it."""
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def blob(nbytes: int) -> cp.ndarray:
    """One device allocation to carve named views from (CuPy's allocations are 256-byte aligned)."""
    return cp.empty(nbytes, dtype=cp.uint8)


def to_device(a: np.ndarray, dtype=None) -> cp.ndarray:
    return cp.asarray(np.ascontiguousarray(a, dtype=dtype))


def to_host(a: cp.ndarray) -> np.ndarray:
    return cp.asnumpy(a)


class HostCopy:
    """A device array's copy to the host, queued now on the current stream into pinned memory; result() waits for that
    copy alone, not for the kernels queued on the stream after it (with async scheduling: the next step's)."""
    def __init__(self, a: cp.ndarray):
        import cupyx
        stream = cp.cuda.get_current_stream()
        self.host = cupyx.empty_pinned(a.shape, a.dtype)
        a.get(stream=stream, out=self.host, blocking=False)
        self.done = stream.record()

    def result(self) -> np.ndarray:
        self.done.synchronize()
        return self.host


def upload_weight(a: np.ndarray) -> cp.ndarray:
    """A checkpoint tensor -> bf16 bits on the GPU: half the bytes of float32 to read every step."""
    from tinyvllm.formats.bf16 import float32_to_bf16_bits
    return cp.asarray(a if a.dtype == np.uint16 else float32_to_bf16_bits(a.astype(np.float32)))


def _rows_ok(*arrays) -> None:
    for a in arrays:  # the kernels index rows with one stride and contiguous columns
        assert a is None or a.strides[-1] == a.itemsize, "rows must be contiguous"


def embedding(ids: cp.ndarray, table: cp.ndarray, residual: cp.ndarray) -> None:
    _rows_ok(table, residual)
    kernel("embedding", "embedding")((len(ids),), (ROWS,), (ids, table, residual, np.int32(table.shape[1])))


def add_rms_norm(residual: cp.ndarray, delta: cp.ndarray | None, weight: cp.ndarray, out: cp.ndarray,
                 eps: float) -> None:
    _rows_ok(residual, delta, out)
    T, hidden = residual.shape
    assert hidden % NORM_VECTOR or residual.data.ptr % 16 == 0, "rms_norm.cu's 16-byte loads need aligned rows"
    kernel("rms_norm", "add_rms_norm")((T,), (ROWS,), (residual, delta if delta is not None else np.uint64(0), weight, out,
                                                        np.float32(eps), np.int32(hidden)))


def rope(qkv: cp.ndarray, positions: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray, num_heads: int,
         head_dim: int) -> None:
    _rows_ok(qkv)
    kernel("rope", "rope")((len(positions),), (ROWS,), (qkv, positions, cos, sin, np.int32(num_heads),
                                                        np.int32(head_dim), np.int32(qkv.strides[0] // 2)))


def prefill_attention(qkv: cp.ndarray, out: cp.ndarray, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> None:
    assert head_dim in PREFILL_HEAD_DIMS, f"the attention kernel is built for head_dim {PREFILL_HEAD_DIMS}"
    assert qkv.strides[0] % 16 == 0, "rows must start on 16-byte boundaries (vector loads)"
    _rows_ok(qkv, out)
    T = qkv.shape[0]
    k = kernel("prefill_attention", f"prefill_attention_d{head_dim}")
    smem = prefill_smem(head_dim)
    k.max_dynamic_shared_size_bytes = smem
    k((num_heads, -(-T // PREFILL_TILE)), (PREFILL_THREADS,),
      (qkv, out, np.int32(T), np.int32(num_heads), np.int32(num_kv_heads), np.int32(qkv.strides[0] // 2),
       np.int32(out.strides[0] // 2), np.float32(head_dim ** -0.5)), shared_mem=smem)


def swiglu(gate_up: cp.ndarray, act: cp.ndarray) -> None:
    _rows_ok(gate_up, act)
    T, inter = act.shape
    assert act.strides[0] == inter * 2 and gate_up.strides[0] == 4 * inter, "swiglu wants whole rows"
    assert gate_up.data.ptr % 16 == 0 and act.data.ptr % 16 == 0, "16-byte vectors"
    threads = T * inter // BF16_PER_VECTOR
    kernel("swiglu", "swiglu")((-(-threads // ROWS),), (ROWS,), (gate_up, act, np.int32(T), np.int32(inter)))


def argmax(logits: cp.ndarray, out: cp.ndarray) -> None:
    """out[r] = the first index of row r's maximum (or first NaN), as NumPy's argmax: each row in pieces of
    ARGMAX_PIECE entries, one block a piece, then the pieces' winners (kernels/argmax.cu)."""
    _rows_ok(logits)
    assert logits.dtype == np.float32 and out.dtype == np.int32 and out.shape == logits.shape[:1]
    rows, vocab = logits.shape
    pieces = -(-vocab // ARGMAX_PIECE)
    piece_val, piece_idx = cp.empty((rows, pieces), np.float32), cp.empty((rows, pieces), np.int32)
    if rows:
        kernel("argmax", "argmax_pieces")((pieces, rows), (ARGMAX_THREADS,), (
            logits, np.int32(logits.strides[0] // 4), np.int32(vocab), piece_val, piece_idx))
        kernel("argmax", "argmax_merge")((rows,), (ARGMAX_THREADS,), (piece_val, piece_idx, np.int32(pieces), out))


def sample_rows(logits: cp.ndarray, inv_temperature: cp.ndarray, u: cp.ndarray, out: cp.ndarray) -> None:
    """A token per row, every sum in an order fixed by the vocabulary size alone (kernels/sample_rows.cu)."""
    assert logits.dtype == np.float32 and logits.strides[1] == 4, "fp32 rows"
    assert inv_temperature.dtype == u.dtype == np.float64 and out.dtype == np.int32
    rows, vocab = logits.shape
    kernel("sample_rows", "sample_rows")((rows,), (SAMPLE_THREADS,), (logits, np.int32(logits.strides[0] // 4),
                                         np.int32(vocab), inv_temperature, u, out))


def store_kv(qkv: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray, slots: cp.ndarray, num_heads: int) -> None:
    _rows_ok(qkv)
    _, kv_heads, head_dim = k_cache.shape
    assert k_cache.flags.c_contiguous and v_cache.flags.c_contiguous, "the cache must be (slots, kv_heads, head_dim)"
    assert head_dim % BF16_PER_VECTOR == 0 and qkv.strides[0] % 16 == 0 and qkv.data.ptr % 16 == 0, "16-byte vectors"
    kernel("store_kv", "store_kv")((len(slots),), (STORE_KV_THREADS,),
                                   (qkv, k_cache, v_cache, slots, np.int32(num_heads * head_dim),
                                    np.int32(kv_heads * head_dim), np.int32(qkv.strides[0] // 2)))


def decode_attention(qkv: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray, starts: cp.ndarray,
                     lengths: cp.ndarray, out: cp.ndarray, num_heads: int) -> None:
    _launch_decode("decode_attention", qkv, k_cache, v_cache, (starts, lengths), out, num_heads)


@functools.lru_cache(maxsize=None)
def _multiprocessors() -> int:
    return cp.cuda.Device().attributes["MultiProcessorCount"]


def paged_attention(qkv: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray, block_tables: cp.ndarray,
                    lengths: cp.ndarray, out: cp.ndarray, num_heads: int, splits: int | None = None,
                    split_tokens: int = 0) -> None:
    """splits: how many blocks share one sequence's context. By default the context is split only when
    one block per (sequence, K/V head) would leave most SMs idle (bench/paged_attention.py: at 16
    sequences x 8 heads the extra merge costs more than it gains), into enough parts for ~2 blocks per SM.
    split_tokens > 0 (the batch-invariant mode): parts of a size set by each row's own length, in multiples of
    split_tokens, at most `splits` of them (decode_attention.cuh's split_span), at any batch size."""
    assert block_tables.flags.c_contiguous and block_tables.dtype == np.int32
    n, (_, kv_heads, head_dim) = out.shape[0], k_cache.shape
    splits = _default_splits(n, kv_heads) if splits is None else splits
    assert 1 <= splits <= MAX_SPLITS and (splits == 1 or split_tokens or n <= SPLIT_MAX_ROWS)
    partial = _split_workspace(num_heads, head_dim, _workspace_rows(n))
    _launch_decode("paged_attention", qkv, k_cache, v_cache,
                   (block_tables, np.int32(block_tables.shape[1]), lengths), out, num_heads, splits,
                   (partial, np.int32(split_tokens)))
    if splits > 1:
        kernel("paged_attention", f"merge_splits<{head_dim}>")(
            (num_heads, n), (head_dim,),
            (partial, np.int32(splits), lengths, np.int32(split_tokens), out, np.int32(out.strides[0] // 2)))


def _workspace_rows(n: int) -> int:
    return max(SPLIT_MAX_ROWS, 1 << (n - 1).bit_length())


def _default_splits(n: int, kv_heads: int) -> int:
    blocks, sms = n * kv_heads, _multiprocessors()
    return min(MAX_SPLITS, -(-2 * sms // blocks)) if 2 * blocks <= sms and n <= SPLIT_MAX_ROWS else 1


@functools.lru_cache(maxsize=None)
def _split_workspace(num_heads: int, head_dim: int, rows: int) -> cp.ndarray:
    """(rows, num_heads, MAX_SPLITS, head_dim + 2) fp32: each split's output, max and sum; one per power of 2 of rows,
    allocated once: a CUDA graph keeps its address."""
    return cp.empty(rows * num_heads * MAX_SPLITS * (head_dim + 2), np.float32)


def _launch_decode(name: str, qkv, k_cache, v_cache, where: tuple, out, num_heads: int, splits: int = 1,
                   extra: tuple = ()) -> None:
    """Both decode attention kernels: grid (kv_heads, n, splits), one instance per (head_dim, query heads
    per K/V head)."""
    _rows_ok(qkv, out)
    _, kv_heads, head_dim = k_cache.shape
    assert head_dim in DECODE_HEAD_DIMS and num_heads % kv_heads == 0
    assert qkv.strides[0] % 16 == 0 and k_cache.flags.c_contiguous, "16-byte rows for the vector loads"
    k = kernel(name, f"{name}<{head_dim}, {num_heads // kv_heads}>")
    k((kv_heads, out.shape[0], splits), (DECODE_THREADS,),
      (qkv, k_cache, v_cache, *where, out, np.int32(kv_heads), np.int32(qkv.strides[0] // 2),
       np.int32(out.strides[0] // 2), np.float32(head_dim ** -0.5), *extra))


def chunk_attention(qkv: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray, block_table: cp.ndarray,
                    start: int, out: cp.ndarray, num_heads: int) -> None:
    """A chunk of one sequence's prompt (chapter 7): row i is the query at position start + i, attending to
    the sequence's keys 0 .. start + i, read through its block table (kernels/prefill_attention.cu)."""
    _, kv_heads, head_dim = k_cache.shape
    assert head_dim in PREFILL_HEAD_DIMS, f"the attention kernel is built for head_dim {PREFILL_HEAD_DIMS}"
    assert qkv.strides[0] % 16 == 0 and k_cache.flags.c_contiguous and block_table.dtype == np.int32
    _rows_ok(qkv, out)
    T = qkv.shape[0]
    k = kernel("prefill_attention", f"chunk_attention_d{head_dim}")
    smem = prefill_smem(head_dim)
    k.max_dynamic_shared_size_bytes = smem
    k((num_heads, -(-T // PREFILL_TILE)), (PREFILL_THREADS,),
      (qkv, k_cache, v_cache, block_table, np.int32(start), out, np.int32(T), np.int32(num_heads), np.int32(kv_heads),
       np.int32(qkv.strides[0] // 2), np.int32(out.strides[0] // 2), np.float32(head_dim ** -0.5)), shared_mem=smem)


# The batch-invariant mode's attention (chapter 7): the prefill and chunk kernels already walk a query's
# keys in PREFILL_KEY_TILE tiles from position 0, whatever the prompt's length or chunking: the same sums.
prefill_attention_invariant = prefill_attention
chunk_attention_invariant = chunk_attention
