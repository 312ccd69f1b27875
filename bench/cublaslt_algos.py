"""Chapter 8's question for batches of 2-64 rows: is cuBLAS's default GEMM (cublasGemmEx, what gemm.py calls) the best
cuBLAS has for decode's skinny products Y (T, N) = X (T, K) W (N, K)^T? Times it against every algorithm cuBLASLt's
heuristic offers (up to 64, a 64 MiB workspace), and gemv (kernels/gemv.cu) up to 8 rows, on Llama 3.2 1B's projection
shapes. The weights stream from HBM as in a decode step: enough copies are cycled (400 MB) that none is still in the
50 MB L2; each figure is one launch's share of a CUDA graph of 4 x copies launches (no host time), the median of 3
replays. A probe, not part of the engine (which never calls cuBLASLt).

    python bench/cublaslt_algos.py OUT.json      (an NVIDIA GPU)
"""
from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tinyvllm.model import gemm as G  # noqa: E402
from tinyvllm.model.backend import cuda_ops  # noqa: E402

SHAPES = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
          ("head", 128256, 2048)]                  # (name, N, K) of Llama 3.2 1B
ROWS = (1, 2, 4, 8, 16, 32, 64)
STREAMED_BYTES = 400e6                             # weight copies cycled per shape: 8x the H200's L2
WORKSPACE = 64 << 20
MATMUL_DESC_TRANSA, MATMUL_DESC_TRANSB = 3, 4      # cublasLtMatmulDescAttributes_t
PREF_MAX_WORKSPACE_BYTES = 1                       # cublasLtMatmulPreferenceAttributes_t
Handle = ctypes.c_void_p


class HeuristicResult(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"{what} failed with cublasStatus_t {status}")


def _cublaslt() -> ctypes.CDLL:
    for name in ("libcublasLt.so.13", "libcublasLt.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libcublasLt not found")


LT = _cublaslt()
HANDLE = Handle()
_check(LT.cublasLtCreate(ctypes.byref(HANDLE)), "cublasLtCreate")
WORKSPACE_BUFFER = cp.empty(WORKSPACE, np.uint8)
ONE, ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


def layout(dtype: int, rows: int, cols: int, ld: int) -> Handle:
    out = Handle()
    _check(LT.cublasLtMatrixLayoutCreate(ctypes.byref(out), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                         ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
    return out


def candidates(T: int, N: int, K: int, out_type: int) -> tuple[tuple, list[HeuristicResult]]:
    """The matmul's descriptors (chapter 4's transposition: C (N x T) = W^T^T X^T) and the algorithms the heuristic
    offers for it that it says can run."""
    desc = Handle()
    _check(LT.cublasLtMatmulDescCreate(ctypes.byref(desc), G.CUBLAS_COMPUTE_32F, G.CUDA_R_32F), "MatmulDescCreate")
    for attribute, op in ((MATMUL_DESC_TRANSA, G.OP_T), (MATMUL_DESC_TRANSB, G.OP_N)):
        value = ctypes.c_int32(op)
        _check(LT.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.c_size_t(4)), "attr")
    a, b, c = layout(G.CUDA_R_16BF, K, N, K), layout(G.CUDA_R_16BF, K, T, K), layout(out_type, N, T, N)
    preference = Handle()
    _check(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "MatmulPreferenceCreate")
    size = ctypes.c_uint64(WORKSPACE)
    _check(LT.cublasLtMatmulPreferenceSetAttribute(preference, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                   ctypes.c_size_t(8)), "preference")
    results, count = (HeuristicResult * 64)(), ctypes.c_int()
    _check(LT.cublasLtMatmulAlgoGetHeuristic(HANDLE, desc, a, b, c, c, preference, 64, results, ctypes.byref(count)),
           "MatmulAlgoGetHeuristic")
    return (desc, a, b, c), [results[i] for i in range(count.value) if results[i].state == 0]


def lt_matmul(descriptors: tuple, algo: HeuristicResult, x, w, out) -> None:
    desc, a, b, c = descriptors
    _check(LT.cublasLtMatmul(HANDLE, desc, ctypes.byref(ONE), Handle(w.data.ptr), a, Handle(x.data.ptr), b,
                             ctypes.byref(ZERO), Handle(out.data.ptr), c, Handle(out.data.ptr), c,
                             ctypes.byref(algo.algo), Handle(WORKSPACE_BUFFER.data.ptr), ctypes.c_size_t(WORKSPACE),
                             Handle(cp.cuda.get_current_stream().ptr)), "cublasLtMatmul")


def graph_us(launch, copies: int, replays: int = 3) -> float:
    """Microseconds per launch(i): a CUDA graph of 4 passes over the copies, the median of `replays` replays."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(copies):
            launch(i)                              # compiles, and cuBLAS picks its kernels, before the capture
        stream.begin_capture()
        for _ in range(4):
            for i in range(copies):
                launch(i)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(replays):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1000 / (4 * copies))
    return float(np.median(times))


def bf16_bits(shape: tuple) -> cp.ndarray:
    """Random bf16 values as their uint16 bits (the dtype the kernels take bf16 in)."""
    return (cp.random.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def shape_rows(name: str, N: int, K: int) -> list[dict]:
    copies = max(2, int(np.ceil(STREAMED_BYTES / (N * K * 2))))
    weights, f32 = bf16_bits((copies, N, K)), name == "head"
    rows = []
    for T in ROWS:
        x, out = bf16_bits((T, K)), cp.empty((T, N), np.float32 if f32 else np.uint16)
        default_us = graph_us(lambda i: G.gemm_cublas(x, weights[i], out), copies)
        gemv_us = graph_us(lambda i: cuda_ops.gemv(x, weights[i], out), copies) if T <= 8 else None
        descriptors, algos = candidates(T, N, K, G.CUDA_R_32F if f32 else G.CUDA_R_16BF)
        timed = [{"i": i, "us": graph_us(lambda j: lt_matmul(descriptors, algo, x, weights[j], out), copies),
                  "workspace": int(algo.workspace_size), "waves": float(algo.waves)} for i, algo in enumerate(algos)]
        best = min(timed, key=lambda a: a["us"]) if timed else None
        rows.append({"shape": name, "T": T, "N": N, "K": K, "default_us": default_us, "gemv_us": gemv_us,
                     "default_gbs": N * K * 2 / default_us / 1e3, "lt_first_us": timed[0]["us"] if timed else None,
                     "lt_best_us": best and best["us"], "lt_best_i": best and best["i"], "algos": timed})
        print(f"{name:8s} T={T:3d} gemv {gemv_us or 0:8.2f} default {default_us:8.2f} us "
              f"({N * K * 2 / default_us / 1e3:6.0f} GB/s)  best of {len(timed)} cuBLASLt algorithms "
              f"(#{best and best['i']}) {best and best['us'] or 0:8.2f} us", flush=True)
    return rows


def main(path: str) -> None:
    rows = []
    for name, N, K in SHAPES:
        rows += shape_rows(name, N, K)
        cp.get_default_memory_pool().free_all_blocks()   # this shape's copies, before the next shape's
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    Path(path).write_text(json.dumps({"rows": rows, "gpu": gpu}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
