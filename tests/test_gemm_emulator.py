"""The column-major GEMM emulator: the transposition trick reproduces x @ W.T for every GEMM of a layer."""
import numpy as np
import pytest

from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.model.gemm import OP_N, OP_T, gemm_colmajor

SMOL = PRESETS["smollm2-135m"]
SHAPES = {"qkv": (SMOL.q_size + 2 * SMOL.kv_size, SMOL.hidden_size), "o_proj": (SMOL.hidden_size, SMOL.q_size),
          "gate_up": (2 * SMOL.intermediate_size, SMOL.hidden_size),
          "down": (SMOL.hidden_size, SMOL.intermediate_size), "lm_head": (SMOL.vocab_size, SMOL.hidden_size)}


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("T", [1, 17])
def test_transposition_trick_gives_row_major_y(name, T):
    rng = np.random.default_rng(T)
    N, K = SHAPES[name]
    x = rng.standard_normal((T, K), dtype=np.float32)
    w = rng.standard_normal((N, K), dtype=np.float32)
    C = np.full(T * N, np.nan, np.float32)  # beta = 0: C is never read, NaN must vanish
    gemm_colmajor(OP_T, OP_N, N, T, K, 1.0, w.ravel(), K, x.ravel(), K, 0.0, C, N)
    np.testing.assert_allclose(C.reshape(T, N), x @ w.T, rtol=1e-4, atol=1e-3)


def test_naive_call_gives_the_transpose():
    """Asking cuBLAS for Y = X W^T literally (m=T, n=N) writes Y column-major: the row-major reader sees Y^T."""
    rng = np.random.default_rng(0)
    T, N, K = 3, 5, 4
    x, w = rng.standard_normal((T, K), dtype=np.float32), rng.standard_normal((N, K), dtype=np.float32)
    C = np.zeros(T * N, np.float32)
    # x row-major (T, K) is column-major (K, T): op_A = T gives X; w row-major (N, K) is column-major (K, N): op_B = N gives W^T
    gemm_colmajor(OP_T, OP_N, T, N, K, 1.0, x.ravel(), K, w.ravel(), K, 0.0, C, T)
    np.testing.assert_allclose(C.reshape(N, T), (x @ w.T).T, rtol=1e-5, atol=1e-5)


def test_alpha_beta_and_leading_dimensions():
    rng = np.random.default_rng(1)
    m, n, k, lda, ldb, ldc = 4, 3, 5, 7, 6, 9
    A, B = rng.standard_normal(lda * k, dtype=np.float32), rng.standard_normal(ldb * n, dtype=np.float32)
    C = rng.standard_normal(ldc * n, dtype=np.float32)
    a = A.reshape(k, lda).T[:m]          # column-major (m x k) with leading dimension lda
    b = B.reshape(n, ldb).T[:k]
    c = C.reshape(n, ldc).T[:m].copy()
    expected = 2.0 * a @ b + 0.5 * c
    untouched = C.reshape(n, ldc).T[m:].copy()
    gemm_colmajor(OP_N, OP_N, m, n, k, 2.0, A, lda, B, ldb, 0.5, C, ldc)
    np.testing.assert_allclose(C.reshape(n, ldc).T[:m], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(C.reshape(n, ldc).T[m:], untouched)  # rows past m within ldc stay as they were
