"""A kernel workbench in llm.c's manner (its dev/cuda/*.cu): one kernel of tinyvllm/model/kernels at a time,
compiled with the constants you give it, checked against its NumPy twin, and timed.

    python bench/kernel_bench.py --list
    python bench/kernel_bench.py gemv --define GEMV_LOADS=8 --shapes 1x2056x1000x0 8x8200x2051x0 --repeat 50
    python bench/kernel_bench.py all                       # every kernel on its default shapes

--define NAME=value replaces one of the constants tinyvllm/model/backend/constants.py hands the kernels through -D
(KERNEL_CONSTANTS); the values derived from others (GEMV_THREADS, PREFILL_THREADS) follow unless given too. They are
set before cuda_ops is imported, so the engine's own launchers compile the kernel with them and launch it with them:
nothing here re-implements a kernel or a launch.

For each launch shape (the defaults are odd sizes within each kernel's layout rules: rows that are no multiple of a
tile, K a multiple of 8 but no power of two, contexts that end inside a KV block):
- fresh random inputs, and every output filled with NaN first, so an element the kernel forgets to write fails;
- one launch, compared with the kernel's twin (backend/numpy_ops.py) with the GPU tests' tolerances;
- the time per launch: the median of --repeat launches timed with CUDA events after 3 warm-up ones, each queued
  behind op_timer.hold_gpu so that the events time the kernel, not the host launching it (bench/gpu_common.py);
- bytes/s: the bytes the launch must read and write at the least, over that time, and its ratio to the
  device-to-device copy bandwidth measured at the start of the same run.
One line per shape (paged_attention's time includes merge_splits when it splits), then the whole run's seconds.
Exit 1 if a check failed, 2 on a usage mistake (one line). Nothing is written to disk.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_common import copy_bandwidth, machine, time_gpu  # noqa: E402
from tinyvllm.errors import TinyVLLMError  # noqa: E402
from tinyvllm.formats.bf16 import bf16_bits_to_float32, float32_to_bf16_bits  # noqa: E402
from tinyvllm.model.backend import constants  # noqa: E402

EPS = 1e-5
NAN_BF16 = np.uint16(0x7FC0)
# constants.py computes these from others: they follow a --define of those, unless given themselves
DERIVED: dict[str, Callable[[dict[str, int]], int]] = {
    "PREFILL_THREADS": lambda c: c["PREFILL_TILE"] // c["PREFILL_WARP_ROWS"] * 32,
    "GEMV_THREADS": lambda c: 32 * c["GEMV_COLUMNS_PER_BLOCK"],
}


class Mismatch(AssertionError):
    """The kernel's output is not its twin's: the message says where."""


@dataclass
class Case:
    """One launch shape, its buffers ready: launch() runs the kernel through its cuda_ops launcher; check(), called
    after the first launch, compares the buffers with the twin's and returns a note, or raises Mismatch."""
    launch: Callable[[], None]
    check: Callable[[], str]
    moved: int     # bytes the launch must read and write at the least
    smem: int = 0  # dynamic shared memory per block (from constants.py's function for the family), 0 if none


@dataclass(frozen=True)
class Kernel:
    fields: tuple[str, ...]              # what the numbers of a --shapes entry mean, in order
    shapes: tuple[tuple[int, ...], ...]  # the default shapes
    make: Callable[..., Case]            # make(ops, twin, rng, *shape) -> Case
    about: str                           # --list's line: what it computes, its layout rules


KERNELS: dict[str, Kernel] = {}


def kernel(name: str, fields: str, *shapes: tuple[int, ...]):
    """Register a Case maker under its kernel's name; the first line of its docstring is what --list says."""
    def register(make: Callable[..., Case]) -> Callable[..., Case]:
        KERNELS[name] = Kernel(tuple(fields.split()), shapes, make, make.__doc__.strip().splitlines()[0])
        return make
    return register


# ---------------------------------------------------------------- buffers and checks

def device(*arrays: np.ndarray) -> list:
    import cupy as cp
    return [cp.asarray(a) for a in arrays]


def to_bf16(a: np.ndarray) -> tuple[np.ndarray, object]:
    """float32 values (NaN kept) -> (the float32 values bf16 holds, for the twin; the bf16 bits on the GPU)."""
    bits = float32_to_bf16_bits(a)
    return bf16_bits_to_float32(bits), device(bits)[0]


def bf16_pair(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> tuple[np.ndarray, object]:
    """Random values exactly representable in bf16: (float32 for the twin, bf16 bits on the GPU)."""
    return to_bf16(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def poisoned(shape: tuple[int, ...], f32: bool = False):
    """An output buffer full of NaN, fp32 or bf16: an element the kernel does not write stays NaN."""
    import cupy as cp
    return cp.full(shape, np.nan, cp.float32) if f32 else cp.full(shape, NAN_BF16, cp.uint16)


def host(a) -> np.ndarray:
    """A device array on the host, bf16 bits widened to float32."""
    import cupy as cp
    got = cp.asnumpy(a)
    return bf16_bits_to_float32(got) if got.dtype == np.uint16 else got


def nan_like(a) -> np.ndarray:
    """A float32 host array of a's shape full of NaN: the twin's output, poisoned as the kernel's is."""
    return np.full(a.shape, np.nan, np.float32)


def rel_err(got: np.ndarray, expected: np.ndarray) -> float:
    """||got - expected|| / ||expected|| in float64: the GPU tests' measure (tests/numeric.py)."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise Mismatch(what)


def close(got: np.ndarray, expected: np.ndarray, tol: float, what: str = "out") -> float:
    """No NaN left in got (every element written, no NaN slot read) and within tol of the twin; the error."""
    missing = np.isnan(got)
    if missing.any():
        raise Mismatch(f"{what}: {int(missing.sum())} of {got.size} values NaN, the first at "
                       f"{np.argwhere(missing)[0].tolist()}")
    err = rel_err(got, expected)
    expect(err < tol, f"{what}: relative error {err:.2e} against the twin (tolerance {tol:.0e})")
    return err


def outside_untouched(wide: np.ndarray, N: int) -> None:
    """out was columns 8 .. 8 + N of a wider NaN buffer: the kernel must not write the others."""
    expect(np.isnan(wide[:, :8]).all() and np.isnan(wide[:, 8 + N:]).all(), "wrote outside its columns")


def rope_tables(rng: np.random.Generator, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (4096 positions, head_dim / 2) of random angles: the kernels only look them up."""
    angles = rng.uniform(0, 4096, (4096, head_dim // 2))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def context_lengths(n: int, longest: int) -> np.ndarray:
    """n context lengths from `longest` down to 1, evenly spread: most end inside a KV block."""
    return np.linspace(longest, 1, n).round().astype(np.int32)


def attention_rows(got: np.ndarray, expected: np.ndarray, lengths: np.ndarray) -> str:
    """As the decode tests: the spare last row untouched, each row within 1e-2 of the twin's (NaN: a wrong key read)."""
    expect(np.isnan(got[-1]).all(), "wrote past the last row")
    errors = [close(got[b], expected[b], 1e-2, f"row {b} ({length} keys)") for b, length in enumerate(lengths)]
    return f"worst row's rel err {max(errors):.1e}"


# ---------------------------------------------------------------- gemv and the fused decode layer (chapters 5, 8)

@kernel("gemv", "T K N f32", (1, 2056, 1000, 0), (3, 576, 3001, 1), (8, 8200, 2051, 0))
def gemv(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, K: int, N: int, f32: int) -> Case:
    """out (T, N) = x @ W^T, T <= GEMV_MAX_ROWS, K % 8 == 0, out a column slice; f32 1: fp32 out (the logits)"""
    x32, x = bf16_pair(rng, (T, K))
    w32, w = bf16_pair(rng, (N, K), scale=K ** -0.5)
    wide = poisoned((T, N + 16), f32)
    out = wide[:, 8:8 + N]

    def check() -> str:
        got, expected = host(wide), np.full((T, N), np.nan, np.float32)
        outside_untouched(got, N)
        twin.gemv(x32, w32, expected)
        return f"rel err {close(got[:, 8:8 + N], expected, 1e-5 if f32 else 1e-2):.1e}"
    return Case(lambda: ops.gemv(x, w, out), check, x.nbytes + w.nbytes + out.nbytes)


@kernel("gemm_invariant", "T K N f32", (13, 2080, 1000, 0), (37, 576, 1003, 1), (300, 2080, 3000, 0))
def gemm_invariant(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, K: int, N: int,
                   f32: int) -> Case:
    """the batch-invariant GEMM (chapter 7): out (T, N) = x @ W^T on tensor cores, any T, K % INVARIANT_CHUNK == 0"""
    x32, x = bf16_pair(rng, (T, K))
    w32, w = bf16_pair(rng, (N, K), scale=K ** -0.5)
    out = poisoned((T, N), f32)

    def check() -> str:
        expected = nan_like(out)
        twin.gemm_invariant(x32, w32, expected)
        return f"rel err {close(host(out), expected, 1e-5 if f32 else 1e-2):.1e}"
    return Case(lambda: ops.gemm_invariant(x, w, out), check, x.nbytes + w.nbytes + out.nbytes)


def norm_inputs(rng: np.random.Generator, T: int, K: int, N: int) -> tuple:
    """The fused norm kernels' inputs: residual fp32 (host, device); norm weight and W as (float32, bf16 bits)."""
    residual = rng.standard_normal((T, K), dtype=np.float32) * np.float32(3)
    return residual, device(residual)[0], bf16_pair(rng, (K,)), bf16_pair(rng, (N, K), scale=K ** -0.5)


@kernel("rms_norm_gemv", "T K N f32", (1, 2056, 1000, 0), (3, 576, 49157, 1), (8, 4104, 1003, 0))
def rms_norm_gemv(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, K: int, N: int,
                  f32: int) -> Case:
    """out (T, N) = rms_norm(residual) @ W^T in one launch, T <= GEMV_MAX_ROWS, K % 8 == 0; f32 1: fp32 out"""
    residual, res, (norm32, norm), (w32, w) = norm_inputs(rng, T, K, N)
    wide = poisoned((T, N + 16), f32)
    out = wide[:, 8:8 + N]

    def check() -> str:
        got, expected = host(wide), np.full((T, N), np.nan, np.float32)
        outside_untouched(got, N)
        expect(np.array_equal(host(res), residual), "changed the residual, which it only reads")
        twin.rms_norm_gemv(residual.copy(), norm32, w32, expected, EPS)
        return f"rel err {close(got[:, 8:8 + N], expected, 1e-2):.1e}"
    return Case(lambda: ops.rms_norm_gemv(res, norm, w, out, EPS), check,
                res.nbytes + norm.nbytes + w.nbytes + out.nbytes, constants.norm_gemv_smem(T, K))


@kernel("rms_norm_gemv_swiglu", "T K inter", (1, 2056, 1001), (8, 4104, 1539))
def rms_norm_gemv_swiglu(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, K: int,
                         inter: int) -> Case:
    """act (T, inter) = swiglu(rms_norm(residual) @ W_gate_up^T) in one launch, T <= GEMV_MAX_ROWS, K % 8 == 0"""
    residual, res, (norm32, norm), (w32, w) = norm_inputs(rng, T, K, 2 * inter)
    act = poisoned((T, inter))

    def check() -> str:
        expected = nan_like(act)
        twin.rms_norm_gemv_swiglu(residual.copy(), norm32, w32, expected, EPS)
        return f"rel err {close(host(act), expected, 1e-2):.1e}"
    return Case(lambda: ops.rms_norm_gemv_swiglu(res, norm, w, act, EPS), check,
                res.nbytes + norm.nbytes + w.nbytes + act.nbytes, constants.norm_gemv_smem(T, K))


@kernel("gemv_add", "T K N", (1, 2056, 2051), (8, 8200, 1000))
def gemv_add(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, K: int, N: int) -> Case:
    """residual (T, N) fp32 += bf16(x @ W^T): o_proj and down with the residual add, T <= GEMV_MAX_ROWS, K % 8 == 0"""
    x32, x = bf16_pair(rng, (T, K))
    w32, w = bf16_pair(rng, (N, K), scale=K ** -0.5)
    residual = rng.standard_normal((T, N), dtype=np.float32) * np.float32(3)
    res = device(residual)[0]

    def check() -> str:
        got, expected = host(res), residual.copy()
        twin.gemv_add(x32, w32, expected)
        # the residual is read and written, so it cannot start as NaN: a skipped element keeps its old value
        skipped = (got == residual) & (np.abs(expected - residual) > 1e-3)
        expect(not skipped.any(), f"{int(skipped.sum())} of {got.size} values not added to")
        return f"rel err of the delta {close(got - residual, expected - residual, 1e-2, 'delta'):.1e}"
    return Case(lambda: ops.gemv_add(x, w, res), check, x.nbytes + w.nbytes + 2 * res.nbytes)


@kernel("rope_store_kv", "T heads kv_heads head_dim", (1, 32, 8, 64), (37, 9, 3, 128))
def rope_store_kv(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, heads: int, kv_heads: int,
                  head_dim: int) -> Case:
    """RoPE on row t's Q and K heads in place, then its K and V to cache slot slots[t]; one block per row"""
    cos, sin = rope_tables(rng, head_dim)
    qkv32, qkv = bf16_pair(rng, (T, (heads + 2 * kv_heads) * head_dim), scale=2.0)
    positions = rng.integers(0, len(cos), T).astype(np.int32)
    slots = rng.choice(2 * T + 5, T, replace=False).astype(np.int32)  # a pool with free slots, which stay NaN
    k_cache, v_cache = poisoned((2 * T + 5, kv_heads, head_dim)), poisoned((2 * T + 5, kv_heads, head_dim))
    args = device(positions, cos, sin, slots)

    def launch() -> None:
        ops.rope_store_kv(qkv, args[0], args[1], args[2], k_cache, v_cache, args[3], heads, kv_heads, head_dim)

    def check() -> str:
        k32, v32 = nan_like(k_cache), nan_like(v_cache)
        twin.rope_store_kv(qkv32, positions, cos, sin, k32, v32, slots, heads, kv_heads, head_dim)
        k_got, v_got = host(k_cache), host(v_cache)
        free = np.setdiff1d(np.arange(len(k32)), slots)
        expect(np.isnan(k_got[free]).all() and np.isnan(v_got[free]).all(), "wrote outside its slots")
        expect(np.array_equal(v_got[slots], v32[slots]), "V is a copy, yet its bits differ")
        close(k_got[slots], k32[slots], 1e-2, "k_cache")
        return f"rel err {close(host(qkv), qkv32, 1e-2, 'qkv'):.1e}"
    # Q and K heads read and written, K stored; V read and stored; a cos and a sin row per token
    moved = T * ((2 * (heads + kv_heads) + 3 * kv_heads) * head_dim * 2 + head_dim * 4)
    return Case(launch, check, moved)


# ---------------------------------------------------------------- decode attention (chapters 5-7)

@kernel("decode_attention", "n heads kv_heads head_dim longest", (6, 32, 8, 64, 4097), (5, 9, 3, 128, 1001))
def decode_attention(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, n: int, heads: int, kv_heads: int,
                     head_dim: int, longest: int) -> Case:
    """one query per row against its keys in a contiguous cache; head_dim in DECODE_HEAD_DIMS, contexts longest .. 1"""
    lengths, spare = context_lengths(n, longest), 3  # NaN slots around each sequence: a key read outside makes NaN
    starts = (spare + np.concatenate([[0], np.cumsum(lengths + spare)[:-1]])).astype(np.int32)
    k = np.full((int(starts[-1] + lengths[-1] + spare), kv_heads, head_dim), np.nan, np.float32)
    v = k.copy()
    for start, length in zip(starts, lengths):
        k[start:start + length] = rng.standard_normal((length, kv_heads, head_dim), dtype=np.float32) * 2
        v[start:start + length] = rng.standard_normal((length, kv_heads, head_dim), dtype=np.float32)
    (k32, k_gpu), (v32, v_gpu) = to_bf16(k), to_bf16(v)
    qkv32, qkv = bf16_pair(rng, (n, (heads + 2 * kv_heads) * head_dim), scale=2.0)
    out = poisoned((n + 1, heads * head_dim))  # one spare row, which must stay NaN
    where = device(starts, lengths)

    def check() -> str:
        expected = np.full((n, heads * head_dim), np.nan, np.float32)
        twin.decode_attention(qkv32, k32, v32, starts, lengths, expected, heads)
        return attention_rows(host(out), expected, lengths)
    moved = int(lengths.sum()) * 2 * kv_heads * head_dim * 2 + 2 * n * heads * head_dim * 2  # K and V rows; Q, out
    return Case(lambda: ops.decode_attention(qkv, k_gpu, v_gpu, *where, out[:n], heads), check, moved)


@kernel("paged_attention", "n heads kv_heads head_dim longest splits", (6, 32, 8, 64, 4097, 0),
        (3, 9, 3, 128, 1001, 16), (40, 8, 2, 64, 517, 0))
def paged_attention(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, n: int, heads: int, kv_heads: int,
                    head_dim: int, longest: int, splits: int) -> Case:
    """decode attention through block tables; splits > 1 adds merge_splits (0: the engine's choice, 1: none)"""
    block = constants.BLOCK_SIZE  # read now: a --define may have changed it
    lengths = context_lengths(n, longest)
    counts = -(-lengths // block)
    first = np.concatenate([[0], np.cumsum(counts)])  # row b owns the blocks pool[first[b]:first[b + 1]]
    pool = rng.permutation(int(first[-1]) + 5)  # the blocks in shuffled order; 5 spare ones stay NaN
    tables = np.full((n, int(counts.max())), -1, np.int32)
    k = np.full((len(pool) * block, kv_heads, head_dim), np.nan, np.float32)
    v = k.copy()
    for b, length in enumerate(lengths):
        tables[b, :counts[b]] = pool[first[b]:first[b + 1]]
        t = np.arange(length)
        slots = tables[b, t // block] * block + t % block  # the tail of its last block stays NaN
        k[slots] = rng.standard_normal((length, kv_heads, head_dim), dtype=np.float32) * 2
        v[slots] = rng.standard_normal((length, kv_heads, head_dim), dtype=np.float32)
    (k32, k_gpu), (v32, v_gpu) = to_bf16(k), to_bf16(v)
    qkv32, qkv = bf16_pair(rng, (n, (heads + 2 * kv_heads) * head_dim), scale=2.0)
    out = poisoned((n + 1, heads * head_dim))
    tables_gpu, lengths_gpu = device(tables, lengths)

    def launch() -> None:
        ops.paged_attention(qkv, k_gpu, v_gpu, tables_gpu, lengths_gpu, out[:n], heads, splits or None)

    def check() -> str:
        expected = np.full((n, heads * head_dim), np.nan, np.float32)
        twin.paged_attention(qkv32, k32, v32, tables, lengths, expected, heads)
        return attention_rows(host(out), expected, lengths)
    moved = int(lengths.sum()) * 2 * kv_heads * head_dim * 2 + 2 * n * heads * head_dim * 2 + tables.nbytes
    return Case(launch, check, moved)


# ---------------------------------------------------------------- the row kernels and the rest (chapters 3, 5)

@kernel("add_rms_norm", "T hidden delta", (37, 2048, 1), (3, 2050, 0), (129, 576, 1))
def add_rms_norm(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, hidden: int,
                 with_delta: int) -> Case:
    """residual += delta (delta 1), out = rms_norm(residual) * weight; NORM_VECTOR columns at once if they divide"""
    residual = rng.standard_normal((T, hidden), dtype=np.float32) * np.float32(3)
    res = device(residual)[0]
    delta32, delta = bf16_pair(rng, (T, hidden)) if with_delta else (None, None)
    weight32, weight = bf16_pair(rng, (hidden,))
    out = poisoned((T, hidden))

    def check() -> str:
        kept, expected = residual.copy(), nan_like(out)
        twin.add_rms_norm(kept, delta32, weight32, expected, EPS)
        expect(np.allclose(host(res), kept, rtol=1e-6, atol=1e-6), "the residual after the add is not the twin's")
        return f"rel err {close(host(out), expected, 1e-2):.1e}"
    moved = 2 * res.nbytes + (delta.nbytes if with_delta else 0) + weight.nbytes + out.nbytes
    return Case(lambda: ops.add_rms_norm(res, delta, weight, out, EPS), check, moved)


@kernel("embedding", "T vocab hidden", (37, 49152, 576), (130, 5000, 2049))
def embedding(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, vocab: int, hidden: int) -> Case:
    """residual[t] = float(table[ids[t]]): a gather, one block per row"""
    table32, table = bf16_pair(rng, (vocab, hidden))
    ids = rng.integers(0, vocab, T).astype(np.int32)
    ids_gpu, out = device(ids)[0], poisoned((T, hidden), f32=True)

    def check() -> str:
        expected = nan_like(out)
        twin.embedding(ids, table32, expected)
        expect(np.array_equal(host(out), expected), "the rows are not exact copies")
        return "exact"
    return Case(lambda: ops.embedding(ids_gpu, table, out), check, ids.nbytes + T * hidden * 2 + out.nbytes)


@kernel("rope", "T heads kv_heads head_dim", (37, 9, 3, 64), (17, 24, 8, 128))
def rope(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, heads: int, kv_heads: int,
         head_dim: int) -> Case:
    """RoPE in place on the Q and K heads of each row ("rotate half"); the V columns untouched"""
    cos, sin = rope_tables(rng, head_dim)
    qkv32, qkv = bf16_pair(rng, (T, (heads + 2 * kv_heads) * head_dim))
    positions = rng.integers(0, len(cos), T).astype(np.int32)
    args = device(positions, cos, sin)

    def check() -> str:
        twin.rope(qkv32, positions, cos, sin, heads + kv_heads, head_dim)
        got, v = host(qkv), slice((heads + kv_heads) * head_dim, None)
        expect(np.array_equal(got[:, v], qkv32[:, v]), "changed the V columns")
        return f"rel err {close(got, qkv32, 1e-2, 'qkv'):.1e}"
    moved = T * (2 * (heads + kv_heads) * head_dim * 2 + head_dim * 4)  # Q and K heads read and written; cos, sin
    return Case(lambda: ops.rope(qkv, *args, heads + kv_heads, head_dim), check, moved)


@kernel("swiglu", "T inter", (5, 1000), (129, 8192), (3, 100))
def swiglu(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, inter: int) -> Case:
    """act = silu(gate) * up from [gate | up] rows, BF16_PER_VECTOR outputs a thread (one if inter % 8 != 0)"""
    gate_up32, gate_up = bf16_pair(rng, (T, 2 * inter))
    act = poisoned((T, inter))

    def check() -> str:
        expected = nan_like(act)
        twin.swiglu(gate_up32, expected)
        return f"rel err {close(host(act), expected, 1e-2):.1e}"
    return Case(lambda: ops.swiglu(gate_up, act), check, gate_up.nbytes + act.nbytes)


@kernel("store_kv", "T heads kv_heads head_dim", (37, 32, 8, 64), (3, 9, 3, 128))
def store_kv(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, heads: int, kv_heads: int,
             head_dim: int) -> Case:
    """row t's K and V columns to cache slot slots[t], a copy; head_dim % 8 == 0"""
    qkv32, qkv = bf16_pair(rng, (T, (heads + 2 * kv_heads) * head_dim))
    slots = rng.choice(2 * T + 5, T, replace=False).astype(np.int32)
    k_cache, v_cache = poisoned((2 * T + 5, kv_heads, head_dim)), poisoned((2 * T + 5, kv_heads, head_dim))
    slots_gpu = device(slots)[0]

    def check() -> str:
        k32, v32 = nan_like(k_cache), nan_like(v_cache)
        twin.store_kv(qkv32, k32, v32, slots, heads)
        same = all(np.array_equal(host(got), want, equal_nan=True) for got, want in ((k_cache, k32), (v_cache, v32)))
        expect(same, "the cache is not the twin's, bit for bit (NaN where no slot was written)")
        return "exact"
    return Case(lambda: ops.store_kv(qkv, k_cache, v_cache, slots_gpu, heads), check,
                T * 4 * kv_heads * head_dim * 2)


@kernel("argmax", "rows vocab", (3, 49152), (1, 128256), (64, 128256), (4, 1))
def argmax(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, rows: int, vocab: int) -> Case:
    """out[r] = argmax(logits[r]), the first index on ties as NumPy's; a block of ARGMAX_THREADS per ARGMAX_PIECE
    entries of a row, then one per row over the pieces' winners"""
    logits = rng.standard_normal((rows, vocab), dtype=np.float32)
    if vocab > 10:  # a tie: the first index must win
        logits[:, vocab // 2] = logits[:, vocab - 1] = logits.max(axis=1) + 1
    logits_gpu, out = device(logits, np.full(rows, -1, np.int32))

    def check() -> str:
        expected = np.full(rows, -1, np.int32)
        twin.argmax(logits, expected)
        got = host(out)
        expect(np.array_equal(got, expected), f"picked {got.tolist()}, the twin {expected.tolist()}")
        return "exact"
    return Case(lambda: ops.argmax(logits_gpu, out), check, logits.nbytes + out.nbytes)


@kernel("prefill_attention", "T heads kv_heads head_dim", (200, 9, 3, 64), (65, 8, 2, 128))
def prefill_attention(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, T: int, heads: int,
                      kv_heads: int, head_dim: int) -> Case:
    """causal GQA attention over a whole prompt, on tensor cores; head_dim in PREFILL_HEAD_DIMS"""
    qkv32, qkv = bf16_pair(rng, (T, (heads + 2 * kv_heads) * head_dim), scale=2.0)
    out = poisoned((T, heads * head_dim))

    def check() -> str:
        expected = nan_like(out)
        twin.prefill_attention(qkv32, expected, heads, kv_heads, head_dim)
        return f"rel err {close(host(out), expected, 1e-2):.1e}"
    return Case(lambda: ops.prefill_attention(qkv, out, heads, kv_heads, head_dim), check,
                qkv.nbytes + out.nbytes, constants.prefill_smem(head_dim))


@kernel("chunk_attention", "start T heads kv_heads head_dim", (1000, 37, 9, 3, 64), (17, 65, 8, 2, 128))
def chunk_attention(ops: ModuleType, twin: ModuleType, rng: np.random.Generator, start: int, T: int, heads: int,
                    kv_heads: int, head_dim: int) -> Case:
    """a prompt's chunk at positions start .. start + T - 1 against its keys in the paged pool; PREFILL_HEAD_DIMS"""
    block = constants.BLOCK_SIZE
    blocks = -(-(start + T) // block)
    table = rng.permutation(3 * blocks)[:blocks].astype(np.int32)  # spread over a pool three times bigger
    t = np.arange(start + T)
    slots = table[t // block] * block + t % block
    k = np.full((3 * blocks * block, kv_heads, head_dim), np.nan, np.float32)  # every other slot NaN
    v = k.copy()
    k[slots] = rng.standard_normal((start + T, kv_heads, head_dim), dtype=np.float32) * 2
    v[slots] = rng.standard_normal((start + T, kv_heads, head_dim), dtype=np.float32) * 2
    (k32, k_gpu), (v32, v_gpu) = to_bf16(k), to_bf16(v)
    qkv32, qkv = bf16_pair(rng, (T, (heads + 2 * kv_heads) * head_dim), scale=2.0)
    out, table_gpu = poisoned((T, heads * head_dim)), device(table)[0]

    def check() -> str:
        expected = nan_like(out)
        twin.chunk_attention(qkv32, k32, v32, table, start, expected, heads)
        return f"rel err {close(host(out), expected, 1e-2):.1e}"
    moved = qkv.nbytes + (start + T) * 2 * kv_heads * head_dim * 2 + out.nbytes
    return Case(lambda: ops.chunk_attention(qkv, k_gpu, v_gpu, table_gpu, start, out, heads), check, moved,
                constants.prefill_smem(head_dim))


# ---------------------------------------------------------------- the command line

class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own mistakes: one line and exit 2, as ours (as tinyvllm's CLI)
        raise TinyVLLMError(f"{message} (see python bench/kernel_bench.py --help)")


def whole(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
    return int(text)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="bench/kernel_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="kernels to run (--list names them), or all")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="compile and launch with another value of a -D constant (backend/constants.py)")
    parser.add_argument("--shapes", nargs="+", metavar="AxBx...", help="launch shapes, the kernel's fields in order")
    parser.add_argument("--repeat", type=positive, default=20, help="timed launches per shape (their median)")
    parser.add_argument("--seed", type=whole, default=0, help="the inputs' random seed")
    parser.add_argument("--list", action="store_true", help="the kernels, their shape fields and default shapes")
    return parser.parse_args(argv)


def chosen(names: list[str]) -> list[str]:
    if not names:
        raise TinyVLLMError("name a kernel, or all (python bench/kernel_bench.py --list names them)")
    if "all" in names:
        return list(KERNELS)
    for name in names:
        if name not in KERNELS:
            raise TinyVLLMError(f"unknown kernel {name!r}: bench/kernel_bench.py knows {', '.join(KERNELS)}, or all")
    return names


def parse_defines(items: list[str]) -> dict[str, int]:
    """["GEMV_LOADS=8"] -> {"GEMV_LOADS": 8}; only the constants the kernels get through -D."""
    defines = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in constants.KERNEL_CONSTANTS:
            raise TinyVLLMError(f"unknown --define constant {name!r}: the kernels take "
                                f"{', '.join(constants.KERNEL_CONSTANTS)} (tinyvllm/model/backend/constants.py)")
        if not value.isdigit() or int(value) < 1:  # every one of them is a count or a size
            raise TinyVLLMError(f"--define {item}: give NAME=VALUE, VALUE a positive integer")
        defines[name] = int(value)
    return defines


def parse_shapes(name: str, texts: list[str]) -> list[tuple[int, ...]]:
    """["1x2056x1000x0"] -> [(1, 2056, 1000, 0)], as many numbers as the kernel's fields."""
    fields, shapes = KERNELS[name].fields, []
    for text in texts:
        numbers = text.split("x")
        if len(numbers) != len(fields) or not all(n.isdigit() for n in numbers):
            raise TinyVLLMError(f"--shapes {text}: {name} takes {' x '.join(fields)}, whole numbers joined by x, "
                                f"e.g. {'x'.join(map(str, KERNELS[name].shapes[0]))}")
        shapes.append(tuple(int(n) for n in numbers))
    return shapes


def print_list() -> None:
    for name, k in KERNELS.items():
        print(f"{name:<21} {' x '.join(k.fields)}: {k.about}")
        print(f"{'':<21} default shapes: {' '.join('x'.join(map(str, s)) for s in k.shapes)}")


# ---------------------------------------------------------------- the run

def set_constants(defines: dict[str, int]) -> list[str]:
    """Give this process's kernels and launchers other constants: backend/constants.py's values replaced before
    numpy_ops and cuda_ops are imported (they read them at import: launch shapes, -D options, BLOCK_SIZE).
    Returns what changed, "NAME=value (given)" or "(derived)"."""
    from tinyvllm.model import step_plan
    values = {**constants.KERNEL_CONSTANTS, **defines}
    values.update({name: derive(values) for name, derive in DERIVED.items() if name not in defines})
    changed = []
    for name, value in values.items():
        if value != constants.KERNEL_CONSTANTS[name]:
            changed.append(f"{name}={value} ({'given' if name in defines else 'derived'})")
            setattr(constants, name, value)
            constants.KERNEL_CONSTANTS[name] = value
    step_plan.BLOCK_SIZE = constants.BLOCK_SIZE  # the paged layout's one source, which numpy_ops imports
    for module in ("tinyvllm.model.backend.numpy_ops", "tinyvllm.model.backend.cuda_ops"):
        if module in sys.modules:  # imported before the change: read the values again
            importlib.reload(sys.modules[module])
    return changed


def first_line(e: BaseException) -> str:
    """The line that says what went wrong: a compiler's first error, an assertion's message (or its source line)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    if errors or lines:
        return (errors or lines)[0][:200]
    return (traceback.extract_tb(e.__traceback__)[-1].line or "")[:200]  # a bare `assert`: its condition


def label(name: str, shape: tuple[int, ...]) -> str:
    return f"{name} " + " ".join(f"{field}={value}" for field, value in zip(KERNELS[name].fields, shape))


def run(name: str, shape: tuple[int, ...], ops: ModuleType, twin: ModuleType, rng: np.random.Generator,
        repeats: int, bandwidth: float, width: int) -> bool:
    """One launch shape: build it, launch once, check against the twin, time it; one printed line; False if it
    failed."""
    try:
        case = KERNELS[name].make(ops, twin, rng, *shape)
        start = time.perf_counter()
        case.launch()  # the first launch compiles the kernel (NVRTC; CuPy keeps it on disk for the next run)
        ops.xp.cuda.Device().synchronize()
        first = time.perf_counter() - start
        note = case.check()
        seconds = time_gpu(case.launch, repeats=repeats, queued=True)
    except Exception as e:  # a compile error, a shape the launcher refuses, a mismatch: said, and the run goes on
        print(f"{label(name, shape):<{width}} FAIL {type(e).__name__}: {first_line(e)}", flush=True)
        return False
    rate, smem = case.moved / seconds, f"{case.smem / 1024:.1f}" if case.smem else "-"
    print(f"{label(name, shape):<{width}} {smem:>8} {seconds * 1e6:10.2f} {rate / 1e9:8.0f} {rate / bandwidth:7.2f} "
          f"{first:6.2f}  ok, {note}", flush=True)
    return True


def workbench(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.list:
        print_list()
        return 0
    names = chosen(args.names)
    defines = parse_defines(args.define)
    if args.shapes and len(names) > 1:
        raise TinyVLLMError("--shapes goes with one kernel: each kernel's shape has other fields")
    shapes = {name: parse_shapes(name, args.shapes) if args.shapes else list(KERNELS[name].shapes) for name in names}
    from tinyvllm.model.backend import cuda_available
    if not cuda_available():
        raise TinyVLLMError("bench/kernel_bench.py runs CUDA kernels: it needs CuPy and an NVIDIA GPU "
                            "(pip install -e '.[gpu]'), and finds none here")
    changed = set_constants(defines)  # before cuda_ops and numpy_ops are imported
    ops = importlib.import_module("tinyvllm.model.backend.cuda_ops")
    twin = importlib.import_module("tinyvllm.model.backend.numpy_ops")
    bandwidth = copy_bandwidth()
    print(f"{machine()['gpu']}: copy bandwidth {bandwidth / 1e9:,.0f} GB/s (device to device); the median of "
          f"{args.repeat} timed launches a shape, after 3 warm-up ones")
    print(f"constants: {', '.join(changed) if changed else 'as tinyvllm/model/backend/constants.py says'}")
    cases = [(name, shape) for name in names for shape in shapes[name]]
    width = max(len(label(name, shape)) for name, shape in cases)
    print(f"{'kernel and shape':<{width}} {'smem KiB':>8} {'us/launch':>10} {'GB/s':>8} {'x copy':>7} {'1st s':>6}  "
          f"check (1st s: the first launch, compile included)")
    rng = np.random.default_rng(args.seed)
    results = [run(name, shape, ops, twin, rng, args.repeat, bandwidth, width) for name, shape in cases]
    print(f"{results.count(True)} of {len(results)} shapes ok, {time.perf_counter() - started:.1f} s")
    return 0 if all(results) else 1


def main(argv: list[str] | None = None) -> int:
    try:
        return workbench(parse_args(argv))
    except TinyVLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head` closed our stdout: not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
