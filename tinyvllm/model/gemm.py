"""Chapter 4: row-major math on a column-major library — the cuBLAS transposition trick.

We store everything row-major and want Y = X W^T, with X (T, K) activations and W (N, K) weights in
HF's (out, in) layout. cuBLAS is column-major: it reads a row-major (r, c) matrix as its transpose,
a column-major (c, r) matrix. So instead of asking for Y we ask for Y^T = W X^T, which cuBLAS sees as

    C (N x T, ldc) = op(A) op(B),  A = W read as (K x N) -> op = T,  B = X read as (K x T) -> op = N

and the column-major C it writes IS row-major Y. No transpose is ever materialized.
`gemm_colmajor` emulates that interface in NumPy on flat buffers, so the trick can be explored
(and graded) without a GPU; `gemm_cublas` makes the real call, through ctypes so that it can be
captured into a CUDA graph (CuPy's own cuBLAS wrapper refuses calls during stream capture).
"""
from __future__ import annotations

import ctypes

import numpy as np

OP_N, OP_T = 0, 1                     # cublasOperation_t
CUDA_R_32F, CUDA_R_16BF = 0, 14       # cudaDataType
CUBLAS_COMPUTE_32F = 68               # accumulate in fp32 whatever the storage type
CUBLAS_GEMM_DEFAULT = -1


def gemm_colmajor(transa: int, transb: int, m: int, n: int, k: int, alpha: float, A: np.ndarray, lda: int,
                  B: np.ndarray, ldb: int, beta: float, C: np.ndarray, ldc: int) -> None:
    """cublasGemmEx's contract on flat NumPy buffers: C = alpha op(A) op(B) + beta C, column-major.

    op(A) is m x k, op(B) is k x n, C is m x n; element (i, j) of a column-major matrix with leading
    dimension ld lives at flat index i + j * ld.
    """
    def matrix(buf, rows, cols, ld):  # a column-major (rows x cols) view of a flat buffer
        assert ld >= rows and (cols - 1) * ld + rows <= buf.size, "leading dimension or size out of range"
        s = buf.itemsize
        return np.lib.stride_tricks.as_strided(buf, shape=(rows, cols), strides=(s, ld * s), writeable=True)

    op_a = matrix(A, k, m, lda).T if transa == OP_T else matrix(A, m, k, lda)
    op_b = matrix(B, n, k, ldb).T if transb == OP_T else matrix(B, k, n, ldb)
    c = matrix(C, m, n, ldc)
    c[...] = alpha * (op_a.astype(np.float32) @ op_b.astype(np.float32)) + (beta * c if beta else 0)


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


# Up to this many rows the product is taken as W X^T (chapter 4's orientation) and transposed into `out`:
# OpenBLAS's two threads then split W's N rows instead of the few rows of X. From 5 rows on, X gets zero rows up to
# a multiple of TRANSPOSED_GEMM_PAD (OpenBLAS's kernel takes X^T's columns 8 at a time: 40 rows took less than 37).
# bench/gemm_orientation.py measures the three ways on SmolLM2-135M's layer shapes, weights streamed from memory.
TRANSPOSED_GEMM_MAX_ROWS = 48
TRANSPOSED_GEMM_PAD = 8
_transposed_scratch: dict[tuple[str, int], np.ndarray] = {}  # (role, N or K) -> float32, made once


def _scratch(role: str, n: int) -> np.ndarray:
    """A (n * (TRANSPOSED_GEMM_MAX_ROWS + TRANSPOSED_GEMM_PAD),) float32 array for gemm_numpy, kept per role and n."""
    if (role, n) not in _transposed_scratch:
        _transposed_scratch[role, n] = np.zeros(n * (TRANSPOSED_GEMM_MAX_ROWS + TRANSPOSED_GEMM_PAD), np.float32)
    return _transposed_scratch[role, n]


def gemm_numpy(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ w (N, K)^T, row-major, float32: the twin of gemm_cublas.

    The fastest way NumPy offers, not a fixed order: the BLAS chooses a kernel and a split between its threads
    from the shape (gemv for one row, GEMM kernels for more, a small-matrix kernel on some CPUs), so a row's
    last bits may depend on T. The batch-invariant mode uses numpy_ops.gemm_invariant instead."""
    T, N = out.shape
    if 1 < T <= TRANSPOSED_GEMM_MAX_ROWS:
        K, pad = x.shape[1], TRANSPOSED_GEMM_PAD
        rows = T if T <= pad // 2 else -(-T // pad) * pad
        if rows > T:  # the extra rows' products land in columns nobody reads: whatever they hold is harmless
            padded = _scratch("x", K)[:rows * K].reshape(rows, K)
            padded[:T] = x
            x = padded
        y_t = _scratch("y", N)[:N * rows].reshape(N, rows)
        np.matmul(w, x.T, out=y_t)   # Y^T = W X^T, as cuBLAS computes it in chapter 4
        out[...] = y_t[:, :T].T
    else:
        np.matmul(x, w.T, out=out)


_cublas = None


def _libcublas() -> ctypes.CDLL:
    """libcublas as CuPy already loaded it (its handle works with our direct calls)."""
    global _cublas
    if _cublas is None:
        for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so", "cublas64_13.dll", "cublas64_12.dll"):
            try:
                _cublas = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise OSError("libcublas not found; is CuPy installed for this CUDA version?")
        v, i, p = ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p
        _cublas.cublasGemmEx.argtypes = [v, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        _cublas.cublasSetStream_v2.argtypes = [v, v]
    return _cublas


def gemm_cublas(x, w, out) -> None:
    """out (T, N) = x (T, K) @ w (N, K)^T on the GPU: bf16 in, fp32 accumulate, bf16 or fp32 out.

    x and w are whole, contiguous matrices (x may be a row slice of a buffer: its rows are whole).
    out may be a column slice of a wider row-major buffer: its row stride becomes ldc, which is how
    Q, K and V can land side by side in one buffer.
    """
    import cupy as cp

    (T, K), (N, K2) = x.shape, w.shape
    assert K == K2 and out.shape == (T, N), f"gemm shapes {x.shape} x {w.shape}^T -> {out.shape}"
    assert x.strides == w.strides == (2 * K, 2), "x and w must be contiguous bf16 matrices (whole rows)"
    assert out.strides[1] == out.itemsize, "out's rows must be contiguous"
    p = gemm_params_into_slice(T, N, K, row_stride=out.strides[0] // out.itemsize)
    lib, handle = _libcublas(), cp.cuda.device.get_cublas_handle()
    _check(lib.cublasSetStream_v2(handle, cp.cuda.get_current_stream().ptr), "cublasSetStream")
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    out_type = CUDA_R_32F if out.dtype == np.float32 else CUDA_R_16BF
    status = lib.cublasGemmEx(handle, p["transa"], p["transb"], p["m"], p["n"], p["k"], ctypes.byref(alpha),
                              w.data.ptr, CUDA_R_16BF, p["lda"], x.data.ptr, CUDA_R_16BF, p["ldb"],
                              ctypes.byref(beta), out.data.ptr, out_type, p["ldc"],
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    _check(status, f"cublasGemmEx(m={N}, n={T}, k={K})")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cublasStatus_t {status}")
