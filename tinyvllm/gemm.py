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


def gemm_numpy(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ w (N, K)^T, row-major, float32: the twin of gemm_cublas."""
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

    x and out may be row slices or column slices of larger row-major buffers: their row strides
    become ldb and ldc, which is how Q, K and V land side by side in one buffer.
    """
    import cupy as cp

    (T, K), (N, K2) = x.shape, w.shape
    assert K == K2 and out.shape == (T, N), f"gemm shapes {x.shape} x {w.shape}^T -> {out.shape}"
    assert x.strides[1] == w.strides[1] == 2 and out.strides[1] == out.itemsize, "rows must be contiguous"
    lib, handle = _libcublas(), cp.cuda.device.get_cublas_handle()
    _check(lib.cublasSetStream_v2(handle, cp.cuda.get_current_stream().ptr), "cublasSetStream")
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    out_type = CUDA_R_32F if out.dtype == np.float32 else CUDA_R_16BF
    status = lib.cublasGemmEx(handle, OP_T, OP_N, N, T, K, ctypes.byref(alpha),
                              w.data.ptr, CUDA_R_16BF, w.strides[0] // 2,
                              x.data.ptr, CUDA_R_16BF, x.strides[0] // 2, ctypes.byref(beta),
                              out.data.ptr, out_type, out.strides[0] // out.itemsize,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    _check(status, f"cublasGemmEx(m={N}, n={T}, k={K})")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cublasStatus_t {status}")
