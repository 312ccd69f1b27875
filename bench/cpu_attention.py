"""The paged attention twin on the CPU (chapter 6): one decode row's layer of attention, its keys gathered block by
block from a shuffled pool, or read as one slice when its blocks follow each other (numpy_ops.context_rows).

SmolLM2-135M's attention (9 query heads, 3 K/V heads of 64). Before every call a 20 MB array is written, as a
decode step's weights flush the caches between two layers' attention; the median of --calls calls per context.
Both layouts hold the same keys, so the outputs are compared bit for bit. Writes bench/results/cpu_attention-<time>.json.

    python bench/cpu_attention.py [--contexts 50 200 1000 4000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from bench.gpu_common import thread_settings, write_result  # noqa: E402
from tinyvllm.model.backend import numpy_ops  # noqa: E402
from tinyvllm.model.step_plan import BLOCK_SIZE  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def median_us(fn, calls: int, flush: np.ndarray) -> float:
    times = []
    for _ in range(calls):
        flush += 1                                      # the caches now hold this, not the pool
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[50, 200, 1000, 4000])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, load_at_start = np.random.default_rng(args.seed), os.getloadavg()
    flush = np.ones(20_000_000 // 4, np.float32)
    print(f"seed {args.seed}; one layer's attention for one decode row, us (median of {args.calls})")
    rows = []
    for length in args.contexts:
        blocks = -(-length // BLOCK_SIZE)
        pool_blocks = 2 * blocks + 8
        k, v = (rng.standard_normal((length, KV_HEADS, HEAD_DIM), dtype=np.float32) for _ in range(2))
        qkv = rng.standard_normal((1, (HEADS + 2 * KV_HEADS) * HEAD_DIM), dtype=np.float32)
        times, outs = {}, {}
        for layout, table in (("gathered", rng.permutation(pool_blocks)[:blocks]),
                              ("in order", np.arange(5, 5 + blocks))):
            k_cache = np.full((pool_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM), np.nan, np.float32)
            v_cache = k_cache.copy()
            t = np.arange(length)
            slots = table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
            k_cache[slots], v_cache[slots] = k, v
            tables, lengths = table.astype(np.int32)[None], np.array([length], np.int32)
            out = np.full((1, HEADS * HEAD_DIM), np.nan, np.float32)
            call = lambda: numpy_ops.paged_attention(qkv, k_cache, v_cache, tables, lengths, out, HEADS)  # noqa: E731
            call()
            times[layout], outs[layout] = median_us(call, args.calls, flush), out.copy()
        same = bool(np.array_equal(outs["gathered"], outs["in order"]))
        rows.append({"keys": length, "gathered_us": times["gathered"], "in_order_us": times["in order"],
                     "same_bits": same})
        print(f"  {length:5d} keys: gathered {times['gathered']:7.1f}   in order (one slice) {times['in order']:7.1f}"
              f"   same bits {same}")
    write_result("cpu_attention", {
        "benchmark": "cpu_attention", "command": " ".join(["python", "bench/cpu_attention.py", *sys.argv[1:]]),
        "seed": args.seed, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "threads": thread_settings(),
        "load_average_at_start": load_at_start, "numpy_version": np.__version__, "results": rows})


if __name__ == "__main__":
    main()
