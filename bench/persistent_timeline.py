"""Where the persistent decode step's time goes (chapter 8, last section): its timeline, instruction by instruction.

The persistent kernel (kernels/decode_persistent.cu) stamps, per instruction and block, when the block began the
instruction and when it finished its share. From those, per instruction (median over --steps launches):

    span     first block's start to last block's end: the instruction's time on the step's critical path
    busy     a block's own share, mean over the blocks that had work (a few of them for RoPE and attention)
    barrier  last block's end to the next instruction's first start: what the grid barrier itself costs

and, per op (all layers together), the span's share of the step, and for the projections their weight bytes over
their span against the copy bandwidth measured in the same run. Batch 1, a synthetic Llama 3.2 1B (random weights
cost what real ones cost), a --context token context; the same step's fused and unfused CUDA graphs for scale.

    python bench/persistent_timeline.py [--model DIR] [--context 512] [--steps 20] [--define NAME=VALUE ...]
Writes bench/results/persistent_timeline-<time>.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import floor_ms, ms_per_step  # noqa: E402
from bench.gpu_common import copy_bandwidth, machine, write_result  # noqa: E402


def use_defines(defines: list[str]) -> dict[str, int]:
    """Recompile the kernels with some launch constants changed (NAME=VALUE), as bench/kernel_bench.py --define does."""
    from tinyvllm.model.backend import constants, cuda_ops
    changed = {name: int(value) for name, value in (d.split("=", 1) for d in defines)}
    unknown = set(changed) - set(constants.KERNEL_CONSTANTS)
    if unknown:
        raise SystemExit(f"--define: no kernel constant {sorted(unknown)}; they are {sorted(constants.KERNEL_CONSTANTS)}")
    merged = {**constants.KERNEL_CONSTANTS, **changed}
    cuda_ops.NVRTC_OPTIONS = ("-std=c++17", f"-I{cuda_ops.KERNELS_DIR}", *(f"-D{k}={v}" for k, v in merged.items()))
    cuda_ops.kernel.cache_clear()
    return changed


WEIGHT_ARGUMENT = {"rms_norm_gemv": 2, "rms_norm_gemv_swiglu": 2, "gemv_add": 1}   # the projections' weights


def weight_bytes(name: str, args: tuple) -> int:
    """The weight bytes an instruction streams (0 for the ops that stream none)."""
    return int(args[WEIGHT_ARGUMENT[name]].nbytes) if name in WEIGHT_ARGUMENT else 0


def timeline(model, context: int, steps: int) -> tuple[list[str], list[int], np.ndarray, float]:
    """(instruction names, their weight bytes, stamps (steps, count, blocks, 4) uint64, ms per plain launch)."""
    import cupy as cp

    from tinyvllm.engine.block_manager import BlockManager, plan_decode
    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.persistent import build_program
    from tinyvllm.model.step_plan import step_inputs
    blocks, pool = BlockManager(64), PagedKVPool(model.cfg, model.ops, 64)
    blocks.allocate(0, context)
    plan = plan_decode(blocks, [0], [1])
    ids, positions, slots = (cp.asarray(np.asarray(c, np.int32)) for c in step_inputs(plan))
    tables, lengths = pool.where(plan, [s.end for s in plan])
    logits = cp.empty((1, model.cfg.vocab_size), np.float32)
    calls = build_program(model, ids, positions, slots, pool, tables, lengths, logits)
    program = cuda_ops.persistent_program(calls)
    names = [cuda_ops.PERSISTENT_OPS[int(code)] for code in cp.asnumpy(program.words[:, 0])]
    nbytes = []
    for name, args in calls:   # a call is one instruction, or two: attention that splits its context, and the merge
        nbytes.append(weight_bytes(name, args))
        if len(nbytes) < len(names) and names[len(nbytes)] == "merge_splits" and name == "paged_attention":
            nbytes.append(0)
    stamps = cp.zeros((program.count, cuda_ops.persistent_blocks(program), 4), np.uint64)
    runs = []
    for _ in range(steps + 3):
        cuda_ops.decode_persistent(program, stamps)
        runs.append(cp.asnumpy(stamps))
    start, end = cp.cuda.Event(), cp.cuda.Event()
    plain = []
    for _ in range(steps):
        start.record()
        cuda_ops.decode_persistent(program)
        end.record()
        end.synchronize()
        plain.append(cp.cuda.get_elapsed_time(start, end))
    return names, nbytes, np.stack(runs[3:]), statistics.median(plain)


def summarize(names: list[str], nbytes: list[int], stamps: np.ndarray, bandwidth: float) -> dict:
    """Per instruction (median over the launches) span, busy and barrier in µs; per op the totals."""
    begin, finish = stamps[..., 0].astype(np.int64), stamps[..., 1].astype(np.int64)
    t0 = begin[:, 0, :].min(axis=1, keepdims=True)
    begin, finish = begin - t0[:, :, None], finish - t0[:, :, None]   # ns from the launch's first stamp
    span = np.median(finish.max(axis=2) - begin.min(axis=2), axis=0) / 1e3
    own = finish - begin
    worked = own > 200   # the blocks that had a share of the work (more than 200 ns)
    busy = np.median(np.where(worked, own, 0).sum(axis=2) / np.maximum(worked.sum(axis=2), 1), axis=0) / 1e3
    barrier = np.zeros(len(names))
    barrier[:-1] = np.median(begin[:, 1:].min(axis=2) - finish[:, :-1].max(axis=2), axis=0) / 1e3
    step_us = float(np.median(finish[:, -1].max(axis=1)) / 1e3)
    per_op: dict[str, dict] = defaultdict(lambda: {"count": 0, "span_us": 0.0, "barrier_us": 0.0, "weight_bytes": 0})
    for i, name in enumerate(names):
        op = per_op[name]
        op["count"] += 1
        op["span_us"] += float(span[i])
        op["barrier_us"] += float(barrier[i])
        op["weight_bytes"] += nbytes[i]
    for op in per_op.values():
        op["share_of_step"] = op["span_us"] / step_us
        if op["weight_bytes"]:
            op["of_copy_bandwidth"] = op["weight_bytes"] / (op["span_us"] * 1e-6) / bandwidth
    return {"step_us_from_stamps": step_us, "barriers_us": float(barrier.sum()), "per_op": dict(per_op),
            "instructions": [{"op": n, "span_us": float(s), "busy_us": float(b), "barrier_us": float(w),
                              "weight_bytes": nb} for n, s, b, w, nb in zip(names, span, busy, barrier, nbytes)]}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--define", action="append", default=[], help="NAME=VALUE: a kernel constant changed")
    args = parser.parse_args(argv)
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.model import Model
    changed = use_defines(args.define)
    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    model = Model(model_dir, device="cuda", max_num_batched_tokens=args.context)
    bandwidth = copy_bandwidth()
    names, nbytes, stamps, plain_ms = timeline(model, args.context, args.steps)
    summary = summarize(names, nbytes, stamps, bandwidth)
    graphs = {layer: ms_per_step(model, 1, args.context, args.steps, layer=layer)[0]
              for layer in ("persistent", "fused", "unfused")}
    floor = floor_ms(model, args.context, 1, bandwidth)
    result = {"benchmark": "persistent_timeline", "machine": machine(), "model": str(model_dir), "context": args.context,
              "steps": args.steps, "defines": changed, "copy_bandwidth_gb_s": bandwidth / 1e9, "floor_ms": floor,
              "launch_ms": plain_ms, "graph_step_ms": graphs, **summary}
    print(f"floor {floor:.3f} ms; one launch {plain_ms:.3f} ms ({plain_ms / floor:.2f}x), from its stamps "
          f"{summary['step_us_from_stamps'] / 1e3:.3f} ms, of which grid barriers {summary['barriers_us'] / 1e3:.3f} ms")
    print("graph steps (host included): " + ", ".join(f"{k} {v:.3f} ms" for k, v in graphs.items()))
    for name, op in sorted(summary["per_op"].items(), key=lambda kv: -kv[1]["span_us"]):
        bw = f"{100 * op['of_copy_bandwidth']:5.1f}% of copy bandwidth" if "of_copy_bandwidth" in op else ""
        print(f"    {name:<22} x{op['count']:<3} {op['span_us']:8.1f} µs ({100 * op['share_of_step']:4.1f}%), "
              f"barriers after it {op['barrier_us']:6.1f} µs  {bw}")
    return write_result("persistent_timeline", result)


if __name__ == "__main__":
    main()
