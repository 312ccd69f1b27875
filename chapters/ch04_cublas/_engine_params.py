"""cublasGemmEx's parameters for the engine's row-major GEMMs: the transposition trick as data."""
from __future__ import annotations

from tinyvllm.gemm import OP_N, OP_T


def gemm_params(T: int, N: int, K: int) -> dict[str, int]:
    """cublasGemmEx's parameters for row-major Y (T, N) = X (T, K) @ W (N, K)^T.

    The call passes W's buffer as A, X's as B and Y's as C (as gemm_cublas does). Returns
    {"transa", "transb", "m", "n", "k", "lda", "ldb", "ldc"}: OP_N / OP_T for the two flags,
    plain ints for the rest, with cuBLAS's column-major meaning (C is m x n, op(A) m x k, op(B) k x n).
    """
    return gemm_params_into_slice(T, N, K, row_stride=N)


def gemm_params_into_slice(T: int, N: int, K: int, row_stride: int) -> dict[str, int]:
    """gemm_params when Y (T, N) is a column slice of a row-major buffer whose rows are row_stride wide.

    C points at the slice's first element (row 0, its first column); X and W are whole, contiguous
    matrices. Same keys as gemm_params.
    """
    assert row_stride >= N, f"a row of {row_stride} elements cannot hold a slice {N} wide"
    # cuBLAS sees row-major W as column-major W^T (K x N) and X as X^T (K x T): ask for
    # C = (W^T)^T X^T = W X^T = Y^T (N x T); written column-major, its bytes ARE row-major Y.
    return {"transa": OP_T, "transb": OP_N, "m": N, "n": T, "k": K, "lda": K, "ldb": K, "ldc": row_stride}


def colmajor_index(i: int, j: int, ld: int) -> int:
    """Where element (i, j) of a column-major matrix with leading dimension ld sits in its flat buffer."""
    return i + j * ld  # columns are contiguous; the next column starts ld elements further on
