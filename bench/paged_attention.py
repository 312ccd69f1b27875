"""Paged decode attention alone on the GPU: what reading K/V through block tables costs.

For batch 1, 16, 64, 256 and contexts 512 and 4096 (Llama 3.2 1B's attention: 32 query heads, 8 K/V
heads of 64), one layer's decode attention over a contiguous cache (chapter 5's kernel) and over a
paged pool whose blocks were handed out in random order (chapter 6's kernel), also with the context
split between blocks as the engine runs it for a few sequences (chapter 7). Reports the K/V bytes
read per second against the copy bandwidth measured in the same run; each kernel is timed on the GPU's
clock, queued behind hold_gpu() so the host's launch overhead is not counted (bench/decode.py measures it). Writes
bench/results/paged_attention-<time>.json.

    python bench/paged_attention.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_common import copy_bandwidth, machine, time_gpu, write_result  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
BATCHES, CONTEXTS = [1, 16, 64, 256], [512, 4096]


def random_bf16(shape):
    import cupy as cp
    return (cp.random.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)


def measure(batch: int, context: int, bandwidth: float) -> dict:
    import cupy as cp

    from tinyvllm.engine.block_manager import BLOCK_SIZE
    from tinyvllm.model.backend import cuda_ops
    tokens, blocks_per_seq = batch * context, context // BLOCK_SIZE
    qkv = random_bf16((batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM))
    out = cp.empty((batch, HEADS * HEAD_DIM), dtype=cp.uint16)
    k, v = random_bf16((tokens, KV_HEADS, HEAD_DIM)), random_bf16((tokens, KV_HEADS, HEAD_DIM))
    lengths = cp.full(batch, context, dtype=cp.int32)
    starts = cp.arange(batch, dtype=cp.int32) * context
    tables = cp.asarray(np.random.default_rng(0).permutation(tokens // BLOCK_SIZE).astype(np.int32)
                        .reshape(batch, blocks_per_seq))  # every sequence's blocks scattered over the pool
    kv_bytes = 2 * k.nbytes  # K and V of every cached token, read once
    row = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    splits = {"paged": 1, "paged_split": None}  # chapter 6's kernel; the engine's choice (chapter 7)
    for name, call in [("contiguous", lambda: cuda_ops.decode_attention(qkv, k, v, starts, lengths, out, HEADS)),
                       *[(n, lambda s=s: cuda_ops.paged_attention(qkv, k, v, tables, lengths, out, HEADS, s))
                         for n, s in splits.items()]]:
        seconds = time_gpu(call, repeats=20, queued=True)
        row[name] = {"us": seconds * 1e6, "gb_s": kv_bytes / seconds / 1e9,
                     "fraction_of_bandwidth": kv_bytes / seconds / bandwidth}
    row["paged_over_contiguous_time"] = row["paged"]["us"] / row["contiguous"]["us"]
    return row


def main() -> None:
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = []
    for context in CONTEXTS:
        for batch in BATCHES:
            r = measure(batch, context, bandwidth)
            rows.append(r)
            print(f"batch {batch:4d} context {context:5d}: contiguous {r['contiguous']['us']:9.1f} us "
                  f"{r['contiguous']['fraction_of_bandwidth']:6.1%}  paged {r['paged']['us']:9.1f} us "
                  f"{r['paged']['fraction_of_bandwidth']:6.1%}  paged, context split {r['paged_split']['us']:9.1f} us "
                  f"{r['paged_split']['fraction_of_bandwidth']:6.1%} of the bandwidth")
    result = {"benchmark": "paged_attention", "machine": machine(), "copy_bandwidth_gb_s": bandwidth / 1e9,
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "layers": 1},
              "results": rows}
    write_result("paged_attention", result)


if __name__ == "__main__":
    main()
