"""What every GPU benchmark records: the machine, and the physical limits measured in the same run."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(0)
    return {"gpu": props["name"].decode(), "multiprocessors": props["multiProcessorCount"],
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "driver": cp.cuda.runtime.driverGetVersion(), "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "cupy": cp.__version__, "python": platform.python_version(), "numpy": np.__version__,
            "load_average_at_start": os.getloadavg(), "cpu_cores": os.cpu_count(), "threads": thread_settings()}


def thread_settings() -> dict:
    """The thread counts the host side ran with: BLAS and OpenMP pools change CPU timings a lot."""
    return {name: os.environ.get(name, "default") for name in
            ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def time_gpu(fn, repeats: int = 10, warmup: int = 3, queued: bool = False) -> float:
    """Median seconds of fn() measured with CUDA events (the GPU's clock, not the host's).

    queued: fn's work is queued behind op_timer.hold_gpu() and runs back to back, so the time is the
    GPU's alone, without the host's launch overhead (which dominates a kernel of a few microseconds)."""
    import cupy as cp

    from tinyvllm.model.op_timer import hold_gpu
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        if queued:
            hold_gpu(0.005)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second: the memory roof."""
    import cupy as cp
    a = cp.empty(2**31, dtype=cp.uint8)
    b = cp.empty_like(a)
    seconds = time_gpu(lambda: cp.copyto(b, a))
    return 2 * a.nbytes / seconds


def bf16_gemm_rate(n: int = 8192) -> float:
    """FLOP/s of one n x n x n bf16 GEMM through the engine's own cuBLAS call: the compute roof."""
    import cupy as cp

    from tinyvllm.model.gemm import gemm_cublas
    # random bf16 bits: the top halves of random float32s (zeros would flatter the tensor cores)
    x = (cp.random.standard_normal((n, n), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    w = (cp.random.standard_normal((n, n), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    out = cp.empty((n, n), dtype=cp.uint16)
    return 2 * n**3 / time_gpu(lambda: gemm_cublas(x, w, out))


def write_result(name: str, result: dict, out: str | None = None) -> Path:
    """bench/results/<name>-<time>.json (or `out`, a script's --out), with the load average at the end of the run
    beside the figures; says where it wrote."""
    result = {**result, "load_average_at_end": os.getloadavg()}
    RESULTS.mkdir(exist_ok=True)
    path = Path(out) if out else RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print("wrote", path)
    return path
