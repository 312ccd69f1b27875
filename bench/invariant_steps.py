"""The batch-invariant mode's decode step against the default's (chapter 7), on a synthetic Llama 3.2 1B, context 512.

1. The graph-replayed decode step (bench/decode.py's ms_per_step: one CUDA graph replay per step, the median of
   32) at batch 1, 8, 64 and 256, both modes, and its ratio to the bandwidth floor (weights once + every sequence's
   K/V, over the copy bandwidth measured in the same run); the default mode's graph is the faster of fused and
   unfused, as the engine picks it.
2. Where the step's time goes at batch 1 and 256: one eager step per mode with every op queued behind
   op_timer.hold_gpu and timed alone, ms per op summed over the layers.
3. Paged attention alone (one layer, 32 heads, 8 K/V heads, 512 keys per row, zero K/V) at 1 and 256 rows: the
   default's split by batch size against the invariant split (parts sized by the row's length) at 64 to 512 tokens
   per part: what INVARIANT_SPLIT_TOKENS was chosen from.

    python bench/invariant_steps.py

Writes bench/results/invariant_steps-<time>.json.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import floor_ms, hold, ms_per_step  # noqa: E402
from bench.gpu_common import copy_bandwidth, machine, write_result  # noqa: E402

CONTEXT, STEPS, BATCHES = 512, 32, (1, 8, 64, 256)
SPLITS = {"default": {}, **{f"split_tokens {n}": {"splits": 16, "split_tokens": n} for n in (64, 128, 256, 512)}}


def steps(model_dir: Path, bandwidth: float) -> dict:
    from tinyvllm.model.model import Model
    result = {}
    for invariant in (False, True):
        model = Model(model_dir, device="cuda", max_num_batched_tokens=CONTEXT, batch_invariant=invariant)
        for batch in BATCHES:
            ms, _ = ms_per_step(model, batch, CONTEXT, STEPS)
            floor = floor_ms(model, CONTEXT, batch, bandwidth)
            result[f"{'batch_invariant' if invariant else 'default'} batch {batch}"] = {
                "ms_per_step": ms, "ratio_to_floor": ms / floor}
            print(f"{'invariant' if invariant else 'default':>9} batch {batch:3d}: {ms:.3f} ms ({ms / floor:.2f}x the floor)")
            model.ops.free_cached_memory()
        del model
    return result


def ops_per_step(model_dir: Path) -> dict:
    from tinyvllm.engine.block_manager import BlockManager, plan_decode
    from tinyvllm.model.decode import decode_batch
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.model import Model
    from tinyvllm.model.op_timer import timed_ops
    from tinyvllm.model.step_plan import blocks_for
    result = {}
    for invariant in (False, True):
        model = Model(model_dir, device="cuda", max_num_batched_tokens=CONTEXT, batch_invariant=invariant)
        for batch in (1, 256):
            num_blocks = batch * blocks_for(CONTEXT + 88)
            blocks, pool = BlockManager(num_blocks), PagedKVPool(model.cfg, model.ops, num_blocks)
            for s in range(batch):
                blocks.allocate(s, CONTEXT)
            for _ in range(2):   # compiles every kernel
                decode_batch(model, pool, plan_decode(blocks, list(range(batch)), [0] * batch))
            hold(model)
            with timed_ops(model) as timer:
                decode_batch(model, pool, plan_decode(blocks, list(range(batch)), [0] * batch))
            key = f"{'batch_invariant' if invariant else 'default'} batch {batch}"
            result[key] = {op: round(s * 1e3, 4) for op, s in timer.totals().items()}
            print(key, result[key])
            del pool
            model.ops.free_cached_memory()
        del model
    return result


def attention_splits() -> dict:
    import cupy as cp

    from tinyvllm.model.backend import cuda_ops
    heads, kv_heads, head_dim, width = 32, 8, 64, -(-CONTEXT // 16) + 1
    result = {}
    for n in (1, 256):
        k = cp.zeros((n * width * 16, kv_heads, head_dim), cp.uint16)
        v = cp.zeros_like(k)
        tables = cp.arange(n * width, dtype=cp.int32).reshape(n, width)
        lengths = cp.full(n, CONTEXT, cp.int32)
        qkv = cp.zeros((n, (heads + 2 * kv_heads) * head_dim), cp.uint16)
        out = cp.empty((n, heads * head_dim), cp.uint16)
        for label, split in SPLITS.items():
            def attend():
                cuda_ops.paged_attention(qkv, k, v, tables, lengths, out, heads, **split)
            for _ in range(3):
                attend()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(20):
                attend()
            end.record()
            end.synchronize()
            result[f"rows {n} {label}"] = us = cp.cuda.get_elapsed_time(start, end) / 20 * 1e3
            print(f"paged attention, {n} rows, {label}: {us:.1f} us")
    return result


def main() -> Path:
    from tinyvllm.formats.checkpoints import synth_model
    model_dir = synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    bandwidth = copy_bandwidth()
    return write_result("invariant_steps", {
        "benchmark": "invariant_steps", "machine": machine(), "context": CONTEXT, "steps": STEPS,
        "copy_bandwidth_gb_s": bandwidth / 1e9, "steps_ms": steps(model_dir, bandwidth),
        "ms_per_op": ops_per_step(model_dir), "paged_attention_us": attention_splits()})


if __name__ == "__main__":
    main()
