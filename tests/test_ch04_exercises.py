"""Chapter 4 graders: cublasGemmEx's parameters for row-major Y = X W^T, checked on the column-major emulator.

The parameters under test are plugged into `gemm_colmajor` (cublasGemmEx's contract on flat NumPy
buffers; tests/test_gpu_gemm.py checks that it lays out C exactly as cuBLAS does) with W's buffer as A,
X's as B and a NaN-filled C. The reference is NumPy's x @ w.T on fresh random matrices; NumPy's own
Fortran-order arrays grade the index formula.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.numeric import close
from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.model.gemm import OP_N, OP_T, gemm_colmajor

pytestmark = pytest.mark.ch4


def layer_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """{name: (N, K)} of every GEMM of one layer with fused QKV and gate/up, plus the lm_head."""
    c = PRESETS[preset]
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (c.vocab_size, h)}


SHAPES = [(preset, name, n, k) for preset in ("smollm2-135m", "llama-3.2-1b")
          for name, (n, k) in layer_shapes(preset).items()
          if (preset, name) != ("llama-3.2-1b", "lm_head")]  # 1 GB of float32: the other shapes cover it


def random_pair(rng: np.random.Generator, T: int, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.standard_normal((T, K), dtype=np.float32), rng.standard_normal((N, K), dtype=np.float32)


KEYS = {"transa", "transb", "m", "n", "k", "lda", "ldb", "ldc"}


def refusal(p: dict, sizes: tuple[int, int, int]) -> str | None:
    """Why cuBLAS would refuse these parameters (a leading dimension below its stored matrix's rows:
    CUBLAS_STATUS_INVALID_VALUE) or read past a buffer; None if it would run."""
    if p["transa"] not in (OP_N, OP_T) or p["transb"] not in (OP_N, OP_T):
        return f"transa and transb must be OP_N ({OP_N}) or OP_T ({OP_T})"
    m, n, k = p["m"], p["n"], p["k"]
    operands = [("A (W's buffer)", (k, m) if p["transa"] == OP_T else (m, k), "lda", sizes[0]),
                ("B (X's buffer)", (n, k) if p["transb"] == OP_T else (k, n), "ldb", sizes[1]),
                ("C (Y's buffer)", (m, n), "ldc", sizes[2])]
    for name, (rows, cols), ld, size in operands:
        if p[ld] < rows:
            return f"{name} is stored as a {rows} x {cols} column-major matrix, so {ld} must be >= {rows}, not {p[ld]}"
        if (cols - 1) * p[ld] + rows > size:
            return (f"{name} as a {rows} x {cols} column-major matrix with {ld} = {p[ld]} spans "
                    f"{(cols - 1) * p[ld] + rows} values, but the buffer holds {size}")
    return None


def run(p: dict, x: np.ndarray, w: np.ndarray, C: np.ndarray) -> None:
    """cublasGemmEx(handle, transa, transb, m, n, k, 1, W, lda, X, ldb, 0, C, ldc), emulated."""
    (T, K), N = x.shape, w.shape[0]
    assert isinstance(p, dict) and set(p) == KEYS, f"return a dict with the keys {sorted(KEYS)}: got {p!r}"
    why = refusal(p, (w.size, x.size, C.size))
    assert why is None, f"T={T}, N={N}, K={K}: {why} (your parameters: {p})"
    gemm_colmajor(p["transa"], p["transb"], p["m"], p["n"], p["k"], 1.0, w.reshape(-1), p["lda"],
                  x.reshape(-1), p["ldb"], 0.0, C, p["ldc"])


def assert_close(got: np.ndarray, x: np.ndarray, w: np.ndarray, p: dict) -> None:
    (T, K), N = x.shape, w.shape[0]
    unwritten = int(np.isnan(got).sum())
    assert not unwritten, (f"T={T}, N={N}, K={K}: {unwritten} of the {got.size} elements of Y were never written "
                           f"(still NaN) with your parameters {p}")
    close(got, x @ w.T, f"Y against x @ w.T, T={T}, N={N}, K={K}, your parameters {p}", rtol=1e-4,
          atol=1e-4 * np.sqrt(K))


# ---- Exercise 4.1: gemm_params ------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("preset, name, N, K", SHAPES, ids=[f"{p}-{n}" for p, n, _, _ in SHAPES])
def test_gemm_params_for_every_layer_gemm(impl, preset, name, N, K, T, rng):
    x, w = random_pair(rng, T, N, K)
    C = np.full(T * N, np.nan, np.float32)  # row-major Y (T, N), flat
    p = impl("gemm_params")(T, N, K)
    run(p, x, w, C)
    assert_close(C.reshape(T, N), x, w, p)


@pytest.mark.parametrize("trial", range(12))
def test_gemm_params_on_random_odd_shapes(impl, trial, rng):
    T, N, K = (int(v) for v in rng.integers(1, 80, size=3) | 1)  # odd: no size hides a mistake
    x, w = random_pair(rng, T, N, K)
    C = np.full(T * N, np.nan, np.float32)
    p = impl("gemm_params")(T, N, K)
    run(p, x, w, C)
    assert_close(C.reshape(T, N), x, w, p)


def test_gemm_params_are_not_the_naive_call(impl, rng):
    """T != N: asking for Y itself (m=T, n=N) would fail this, leaving Y^T's bytes in the buffer."""
    T, N, K = 3, 5, 4
    p = impl("gemm_params")(T, N, K)
    assert (p["m"], p["n"], p["k"]) == (N, T, K), \
        f"T={T}, N={N}, K={K}: (m, n, k) = {(p['m'], p['n'], p['k'])}, but C is Y^T: N rows, T columns, summed over K"
    x, w = random_pair(rng, T, N, K)
    C = np.full(T * N, np.nan, np.float32)
    run(p, x, w, C)
    assert_close(C.reshape(T, N), x, w, p)


# ---- Exercise 4.2: gemm_params_into_slice -------------------------------------------------

def slice_run(p: dict, x: np.ndarray, w: np.ndarray, buffer: np.ndarray, first_column: int) -> None:
    """C points at row 0, column first_column of the row-major buffer, as a pointer offset would."""
    run(p, x, w, buffer.reshape(-1)[first_column:])


@pytest.mark.parametrize("trial", range(12))
def test_gemm_params_into_slice_writes_only_the_slice(impl, trial, rng):
    T, N, K = int(rng.integers(2, 60)), int(rng.integers(1, 60)), int(rng.integers(1, 60))
    before, after = int(rng.integers(0, 40)), int(rng.integers(1, 40))  # rows wider than the slice
    buffer = np.full((T, before + N + after), np.nan, np.float32)
    x, w = random_pair(rng, T, N, K)
    p = impl("gemm_params_into_slice")(T, N, K, buffer.shape[1])
    slice_run(p, x, w, buffer, before)
    outside = int((~np.isnan(buffer[:, :before])).sum() + (~np.isnan(buffer[:, before + N:])).sum())
    assert not outside, (f"rows {buffer.shape[1]} wide, the slice columns {before}..{before + N - 1}: the GEMM wrote "
                         f"{outside} elements outside the slice, with your parameters {p}")
    assert_close(buffer[:, before:before + N], x, w, p)


@pytest.mark.parametrize("preset", ["smollm2-135m", "llama-3.2-1b"])
def test_gemm_params_into_slice_builds_fused_qkv(impl, preset, rng):
    """Three GEMMs with q_proj, k_proj and v_proj land side by side in one (T, q + 2 kv) buffer."""
    c, T = PRESETS[preset], 7
    x = rng.standard_normal((T, c.hidden_size), dtype=np.float32)
    ws = [rng.standard_normal((n, c.hidden_size), dtype=np.float32) for n in (c.q_size, c.kv_size, c.kv_size)]
    qkv = np.full((T, c.q_size + 2 * c.kv_size), np.nan, np.float32)
    for w, first in zip(ws, (0, c.q_size, c.q_size + c.kv_size)):
        p = impl("gemm_params_into_slice")(T, w.shape[0], c.hidden_size, qkv.shape[1])
        slice_run(p, x, w, qkv, first)
    assert_close(qkv, x, np.concatenate(ws), p)


def test_gemm_params_into_slice_of_the_whole_buffer(impl, rng):
    T, N, K = 9, 13, 11
    x, w = random_pair(rng, T, N, K)
    C = np.full(T * N, np.nan, np.float32)
    p = impl("gemm_params_into_slice")(T, N, K, N)
    run(p, x, w, C)  # a slice as wide as the rows: plain Y
    assert_close(C.reshape(T, N), x, w, p)


def test_gemm_params_into_slice_answers_are_independent(impl):
    """Each call returns its own dict, which a later call must not rewrite: a caller may hold an answer while
    it asks for the next (the fused QKV's three slices). Deriving the answer from gemm_params is fine;
    changing the very dict gemm_params returned is not, if gemm_params hands out that dict again."""
    into_slice, T, N, K = impl("gemm_params_into_slice"), 7, 13, 11
    first = into_slice(T, N, K, 40)
    kept = dict(first)
    second = into_slice(T, N, K, 64)
    assert first is not second, "two calls returned the same dict: return a new one each time"
    assert first == kept, (f"gemm_params_into_slice({T}, {N}, {K}, 64) changed the answer of the call before it, "
                           f"gemm_params_into_slice({T}, {N}, {K}, 40): it was {kept}, it is now {first}")


# ---- Exercise 4.3: colmajor_index ---------------------------------------------------------

@pytest.mark.parametrize("trial", range(6))
def test_colmajor_index_matches_fortran_order(impl, trial, rng):
    rows, cols = (int(v) for v in rng.integers(1, 30, size=2))
    ld = rows + int(rng.integers(0, 5))
    storage = np.asfortranarray(rng.standard_normal((ld, cols)))  # NumPy's own column-major layout
    flat, a = storage.ravel(order="K"), storage[:rows]  # a: rows x cols, columns ld apart in memory
    assert np.shares_memory(flat, storage), "the grader's flat view must be the storage itself"
    index = impl("colmajor_index")
    for i in range(rows):
        for j in range(cols):
            got = index(i, j, ld)
            assert isinstance(got, (int, np.integer)), f"colmajor_index({i}, {j}, {ld}) returned {got!r}: return an int"
            assert flat[got] == a[i, j], (f"a {rows} x {cols} matrix, columns {ld} apart: colmajor_index({i}, {j}, "
                                          f"{ld}) = {got}, but element ({i}, {j}) is at {i + j * ld}")


def test_colmajor_index_of_a_row_major_matrix_is_its_transpose(impl, rng):
    """A row-major (r, c) matrix read column-major with ld = c is its transpose (c, r)."""
    r, c = 3, 5
    m = rng.standard_normal((r, c))
    flat, index = m.reshape(-1), impl("colmajor_index")
    for i in range(r):
        for j in range(c):
            got = index(j, i, c)
            assert flat[got] == m[i, j], (f"a row-major {r} x {c} matrix read column-major with ld = {c}: element "
                                          f"({j}, {i}) of that {c} x {r} matrix is m[{i}, {j}], at {j + i * c}; "
                                          f"colmajor_index({j}, {i}, {c}) = {got}")
