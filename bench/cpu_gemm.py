"""CPU prefill's GEMMs: NumPy's float32 GEMM (OpenBLAS) against torch's on the same shapes, one core.

A prefill of T tokens multiplies T rows by every weight matrix: out (T, N) = x (T, K) @ w (N, K)^T, as
the engine's NumPy backend does (`gemm_numpy`). At T = 37 (the chat prompt of cpu_decode.py) each GEMM
is bound by arithmetic, not memory, so the library's kernel sets the prefill's speed. Both libraries
run the same shapes back to back in one process, on one thread each (the comparison is of kernels, not
of threading), timed with process CPU time over --reps repetitions of --calls calls; the median is
reported as GFLOP/s. Writes bench/results/cpu_gemm-<time>.json.

    python bench/cpu_gemm.py [--tokens 37] [--reps 30] [--calls 10]
"""
from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"   # before NumPy loads OpenBLAS: one core for each library

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from bench.gpu_common import write_result  # noqa: E402

# SmolLM2-135M's projections (N, K): fused QKV, O, fused gate/up, down
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def cpu_seconds(fn, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls


def measure(T: int, N: int, K: int, reps: int, calls: int, rng: np.random.Generator) -> dict:
    x, w = rng.standard_normal((T, K), dtype=np.float32), rng.standard_normal((N, K), dtype=np.float32)
    out = np.empty((T, N), np.float32)
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    runs = {"numpy": lambda: np.matmul(x, w.T, out=out), "torch": lambda: torch.nn.functional.linear(tx, tw)}
    times = {name: [] for name in runs}
    for _ in range(reps):   # alternating: a drift of the machine hits both alike
        for name, fn in runs.items():
            times[name].append(cpu_seconds(fn, calls))
    flops = 2 * T * N * K
    return {name: {"median_us": 1e6 * statistics.median(t), "gflops": flops / statistics.median(t) / 1e9}
            for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=37, help="rows of x: the prompt's tokens")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_at_start, rng = os.getloadavg(), np.random.default_rng(0)
    results = {name: measure(args.tokens, N, K, args.reps, args.calls, rng) for name, (N, K) in SHAPES.items()}
    print(f"T = {args.tokens} rows, one thread each, GFLOP/s (median of {args.reps} x {args.calls} calls)")
    for name, r in results.items():
        print(f"  {name:8} numpy {r['numpy']['gflops']:6.1f}   torch {r['torch']['gflops']:6.1f}   "
              f"numpy / torch {r['numpy']['gflops'] / r['torch']['gflops']:.2f}")
    write_result("cpu_gemm", {
        "benchmark": "cpu_gemm", "command": " ".join(["python", "bench/cpu_gemm.py", *sys.argv[1:]]),
        "tokens": args.tokens, "shapes": SHAPES, "threads": 1, "load_average_at_start": load_at_start,
        "numpy_version": np.__version__, "torch_version": torch.__version__, "results": results})


if __name__ == "__main__":
    main()
