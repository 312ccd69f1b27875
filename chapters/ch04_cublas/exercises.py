"""Chapter 4 exercises: the cublasGemmEx parameters that make a column-major library compute row-major Y.

Fill in each function, then:
    make grade CH=4                 # the graders: a score table (CPU, on the emulator)
    make chapter-4 IMPL=student     # the chapter's checkpoint, with your parameters for every GEMM
    .venv/bin/python -m pytest tests/test_ch04_exercises.py --impl=student -x
                                    # the graders alone: the first failure, with its traceback

Each function has the signature and docstring of the engine function it replaces (see REFERENCE).
Try your answers on tinyvllm.model.gemm.gemm_colmajor, which does what cublasGemmEx does, on flat NumPy
buffers: gemm_colmajor(p["transa"], p["transb"], p["m"], p["n"], p["k"], 1.0, w.ravel(), p["lda"],
x.ravel(), p["ldb"], 0.0, y.ravel(), p["ldc"]) must leave x @ w.T in the row-major y.
"""
from __future__ import annotations

from tinyvllm.model.gemm import OP_N, OP_T  # noqa: F401  (the two values transa and transb can take)

REFERENCE = {
    "gemm_params": "tinyvllm.model.gemm:gemm_params",
    "gemm_params_into_slice": "tinyvllm.model.gemm:gemm_params_into_slice",
    "colmajor_index": "tinyvllm.model.gemm:colmajor_index",
}


def gemm_params(T: int, N: int, K: int) -> dict[str, int]:
    """cublasGemmEx's parameters for row-major Y (T, N) = X (T, K) @ W (N, K)^T.

    The call passes W's buffer as A, X's as B and Y's as C (as gemm_cublas does). Returns
    {"transa", "transb", "m", "n", "k", "lda", "ldb", "ldc"}: OP_N / OP_T for the two flags,
    plain ints for the rest, with cuBLAS's column-major meaning (C is m x n, op(A) m x k, op(B) k x n).

    Hints: a row-major (r, c) matrix is, byte for byte, the column-major (c, r) matrix: its transpose.
    Which matrix is Y^T in terms of W and X? What shape is it, and what is the leading dimension
    (the distance between consecutive columns) of each column-major matrix cuBLAS sees?
    """
    raise NotImplementedError("Exercise 4.1: gemm_params — ask cuBLAS for Y^T = W X^T")


def gemm_params_into_slice(T: int, N: int, K: int, row_stride: int) -> dict[str, int]:
    """gemm_params when Y (T, N) is a column slice of a row-major buffer whose rows are row_stride wide.

    C points at the slice's first element (row 0, its first column); X and W are whole, contiguous
    matrices. Same keys as gemm_params.

    Hint: only one number changes. In the column-major C that cuBLAS writes, how far apart are the
    starts of two consecutive columns (= two consecutive rows of the row-major buffer)?
    """
    raise NotImplementedError("Exercise 4.2: gemm_params_into_slice — one leading dimension changes")


def colmajor_index(i: int, j: int, ld: int) -> int:
    """Where element (i, j) of a column-major matrix with leading dimension ld sits in its flat buffer.

    Hint: column-major stores column 0 (ld slots, the first rows of them used), then column 1, ...
    """
    raise NotImplementedError("Exercise 4.3: colmajor_index — columns are contiguous, ld apart")
