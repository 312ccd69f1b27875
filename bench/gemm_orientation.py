"""Where TRANSPOSED_GEMM_MAX_ROWS and TRANSPOSED_GEMM_PAD come from: the CPU GEMM asked as X W^T or as W X^T
(chapter 4), per row count.

out (T, N) = x (T, K) @ w (N, K)^T is what the engine needs. NumPy hands `x @ w.T` to OpenBLAS as is; with few rows
the library's threads have little of x to split. Asked for Y^T = W X^T (cuBLAS's orientation) and transposed into
`out`, they split W's rows instead; and since OpenBLAS's kernel takes X^T's columns 8 at a time, X can be padded
with rows up to a multiple of 8 (their products thrown away). For each row count, SmolLM2-135M's four layer shapes
are timed three ways (x_wt, w_xt, w_xt_padded) with NumPy's default threads:
  hot       each weight matrix multiplied 30 times in a row (it stays in the caches): the kernels alone;
  streamed  30 layers of distinct weights (425 MB, as a decode or prefill step reads them): what a step sees.
A fourth column, torch_linear, runs the same X W^T through torch.nn.functional.linear (Intel MKL in the CPU wheels,
torch's default threads), the library transformers' CPU prefill runs on: what the CPU prefill's target in
BENCHMARKS.md is up against. Each way starts after a 0.3 s pause (the other library's threads stop spinning). The
NumPy outputs are compared bit for bit with X W^T's, a fact about this machine's BLAS (the orders of its kernels),
recorded, not a property the engine relies on. Writes bench/results/gemm_orientation-<time>.json.

    python bench/gemm_orientation.py [--rows 2 3 4 5 8 13 16 24 37 48 57 64 96]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from bench.gpu_common import thread_settings, write_result  # noqa: E402
from tinyvllm.model.gemm import TRANSPOSED_GEMM_MAX_ROWS, TRANSPOSED_GEMM_PAD  # noqa: E402

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # SmolLM2 (N, K)
LAYERS = 30


def x_wt(x: np.ndarray, w: np.ndarray, out: np.ndarray, _scratch: np.ndarray) -> None:
    np.matmul(x, w.T, out=out)


def w_xt(x: np.ndarray, w: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    y_t = scratch[:w.shape[0] * x.shape[0]].reshape(w.shape[0], x.shape[0])
    np.matmul(w, x.T, out=y_t)
    out[...] = y_t.T


def w_xt_padded(x: np.ndarray, w: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    T, K = x.shape
    padded = np.zeros((-(-T // 8) * 8, K), np.float32)
    padded[:T] = x
    y_t = scratch[:w.shape[0] * len(padded)].reshape(w.shape[0], len(padded))
    np.matmul(w, padded.T, out=y_t)
    out[...] = y_t[:, :T].T


def torch_linear(x: np.ndarray, w: np.ndarray, out: np.ndarray, _scratch: np.ndarray) -> None:
    torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(w), out=torch.from_numpy(out))


WAYS = {"x_wt": x_wt, "w_xt": w_xt, "w_xt_padded": w_xt_padded, "torch_linear": torch_linear}
SETTLE_S = 0.3


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 3, 4, 5, 8, 13, 16, 24, 37, 48, 57, 64, 96])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    load_at_start = os.getloadavg()
    layers = [{name: rng.standard_normal(shape, dtype=np.float32) for name, shape in SHAPES.items()}
              for _ in range(LAYERS)]
    scratch = np.empty(max(N for N, _ in SHAPES.values()) * (max(args.rows) + 8), np.float32)
    rows = []
    print(f"seed {args.seed}; ms for SmolLM2-135M's four layer GEMMs, over X W^T's time in brackets")
    for T in args.rows:
        xs = {K: rng.standard_normal((T, K), dtype=np.float32) for _, K in SHAPES.values()}
        outs = {way: {N: np.empty((T, N), np.float32) for N, _ in SHAPES.values()} for way in WAYS}
        same = True
        for w in layers[0].values():
            for way, fn in WAYS.items():
                fn(xs[w.shape[1]], w, outs[way][w.shape[0]], scratch)
                if way != "torch_linear":  # another library sums in another order: only close
                    same &= bool(np.array_equal(outs[way][w.shape[0]], outs["x_wt"][w.shape[0]]))
                else:
                    assert np.allclose(outs[way][w.shape[0]], outs["x_wt"][w.shape[0]], rtol=1e-3, atol=1e-3), way
        row = {"rows": T, "same_bits": same}
        for way, fn in WAYS.items():
            def hot(fn=fn, way=way):
                for w in layers[0].values():
                    for _ in range(LAYERS):
                        fn(xs[w.shape[1]], w, outs[way][w.shape[0]], scratch)

            def streamed(fn=fn, way=way):
                for layer in layers:
                    for w in layer.values():
                        fn(xs[w.shape[1]], w, outs[way][w.shape[0]], scratch)
            time.sleep(SETTLE_S)
            row[f"{way}_hot_ms"] = median_ms(hot, args.reps)
            row[f"{way}_streamed_ms"] = median_ms(streamed, args.reps)
        rows.append(row)
        print(f"  {T:4d} rows, streamed: X W^T {row['x_wt_streamed_ms']:6.1f}   W X^T {row['w_xt_streamed_ms']:6.1f} "
              f"({row['w_xt_streamed_ms'] / row['x_wt_streamed_ms']:.2f})   padded {row['w_xt_padded_streamed_ms']:6.1f} "
              f"({row['w_xt_padded_streamed_ms'] / row['x_wt_streamed_ms']:.2f})   "
              f"torch {row['torch_linear_streamed_ms']:6.1f};   hot: {row['x_wt_hot_ms']:6.1f} / "
              f"{row['w_xt_hot_ms']:6.1f} / {row['w_xt_padded_hot_ms']:6.1f}   same bits {same}")
    write_result("gemm_orientation", {
        "benchmark": "gemm_orientation", "command": " ".join(["python", "bench/gemm_orientation.py", *sys.argv[1:]]),
        "seed": args.seed, "shapes": SHAPES, "layers": LAYERS, "threads": thread_settings(),
        "transposed_gemm_max_rows": TRANSPOSED_GEMM_MAX_ROWS, "transposed_gemm_pad": TRANSPOSED_GEMM_PAD,
        "load_average_at_start": load_at_start,
        "numpy_version": np.__version__, "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
        "results": rows})


if __name__ == "__main__":
    main()
