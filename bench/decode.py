"""Decode speed against the memory-bandwidth floor: a synthetic Llama-3.2-1B checkpoint, a 512-token context.

One decode step reads every weight once (plus the context's K/V), so its floor is

    (weight bytes + KV bytes read) / copy bandwidth measured in the same run.

Batch 1, eager (one launch at a time from Python), contiguous cache: ms per token (decode step + greedy
sampling, until the id is on the host) against that floor, and where the step's time goes — the GPU time of the
step with its kernels queued back to back (behind op_timer.hold_gpu), per op, and the rest: launch gaps, the host
launching the kernels one by one, which chapter 7's CUDA graphs remove. The top-level fields are the unfused
layer's (model.fused_decode = False: chapters 3-7); `fused` holds the same for chapter 8's fused layer, with a
per-kernel table: bytes each kernel moves / its time / the copy bandwidth. Also the same step in the
batch-invariant mode (chapter 7: its `batch_invariant` field, always unfused) and HF transformers (bf16, its KV
cache) on the same weights and context.

Then `batches`: at batch 1, 8 and 64 (--batches), the paged pool at the same context per sequence, one CUDA graph
replay per step (eager on the CPU): ms per step (= per token of each sequence) fused, unfused and (on a GPU)
persistent (chapter 8's one-launch step), the engine's choice among them, the floor and x the floor, and the backend op calls per step (one kernel launch each; paged attention adds a merge kernel in the
layers where it splits a context; above GEMV_MAX_ROWS rows both modes run the unfused layer), and the same step in
the batch-invariant mode (`batch_invariant`, with its ratio to the engine's default path). Per batch size also the
unfused step's kernel table (eager, each op alone: what the graph replays above GEMV_DECODE_ROWS rows).

On the CPU (--device cpu: NumPy, no graphs, no transformers) the same figures, as a smoke test with a small
--model. Writes bench/results/decode-<time>.json (decode-cpu-<time>.json on the CPU).

    python bench/decode.py [--model DIR] [--device cuda] [--context 512] [--steps 64] [--batches 1,8,64]
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_common import write_result  # noqa: E402
from tinyvllm.model.op_timer import OpTimer, timed_ops  # noqa: E402


def weight_bytes_per_step(model) -> int:
    """Every weight matrix is read once per step; the embedding table only for one row (unless it is the head)."""
    read = sum(r.nbytes for r in model.weight_regions if r.name != "embed")
    return read + (model.weights["embed"].nbytes if model.cfg.tie_word_embeddings else 0)


def kv_bytes_per_step(cfg, context: int) -> int:
    return 2 * cfg.num_hidden_layers * context * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16


def floor_ms(model, context: int, batch: int, bandwidth: float) -> float:
    """The step's floor: every weight once, and each sequence's K/V."""
    return 1e3 * (weight_bytes_per_step(model) + batch * kv_bytes_per_step(model.cfg, context)) / bandwidth


def synchronize(model) -> None:
    if model.device == "cuda":
        model.ops.xp.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------- bytes each op moves

def op_bytes(name: str, args: tuple, context: int) -> int:
    """The bytes an op must move at the least: each array argument read or written once, a residual it updates
    twice, and of the tables it only indexes, the rows it touches: the embedding's rows, a cos and a sin row per
    token, the K/V of `context` keys per row (attention) or the new slots (a store)."""
    rows = len(args[0])
    if name == "embedding":
        ids, table, residual = args
        return ids.nbytes + rows * table.shape[1] * table.itemsize + residual.nbytes
    if name in ("decode_attention", "paged_attention"):
        k_cache, out = args[1], args[5]
        return rows * context * 2 * k_cache[0].size * k_cache.itemsize + 2 * out.nbytes   # K/V; Q in, out
    if name == "rope":
        qkv, _, _, _, heads, head_dim = args
        return rows * (2 * heads * head_dim * qkv.itemsize + head_dim * 4)    # heads read and written; cos, sin
    if name == "store_kv":
        qkv, k_cache = args[0], args[1]
        return rows * 4 * k_cache[0].size * qkv.itemsize                     # K and V read, then written
    if name == "rope_store_kv":
        qkv, heads, kv_heads, head_dim = args[0], *args[7:]
        return rows * (2 * (heads + kv_heads) * head_dim + 3 * kv_heads * head_dim) * qkv.itemsize + rows * head_dim * 4
    moved = sum(a.nbytes for a in args if hasattr(a, "nbytes"))
    if name in ("gemv_add", "add_rms_norm"):                                # the residual: read, then written
        moved += (args[2] if name == "gemv_add" else args[0]).nbytes
    return moved


class ByteCounter(OpTimer):
    """OpTimer that also adds up each op's bytes (op_bytes)."""

    def __init__(self, ops, context: int):
        super().__init__(ops)
        self.context, self.bytes = context, {}

    def _timed(self, name: str, fn, args, kwargs):
        self.bytes[name] = self.bytes.get(name, 0) + op_bytes(name, args, self.context)
        return super()._timed(name, fn, args, kwargs)


def kernel_table(model, step, context: int, bandwidth: float) -> list[dict]:
    """One step's ops, each timed alone: calls, ms, bytes moved and bytes / time / copy bandwidth."""
    counter, original = ByteCounter(model.ops, context), model.ops
    hold(model)
    model.ops = counter
    try:
        step()
    finally:
        model.ops = original
    calls: dict[str, int] = {}
    for name, _ in counter.calls:
        calls[name] = calls.get(name, 0) + 1
    rows = []
    for name, seconds in counter.totals().items():
        moved = counter.bytes[name]
        rows.append({"op": name, "calls": calls[name], "ms": round(seconds * 1e3, 4), "bytes": moved,
                     "gb_s": moved / seconds / 1e9, "of_copy_bandwidth": moved / seconds / bandwidth})
    return rows


def hold(model) -> None:
    """On the GPU, queue what follows behind op_timer.hold_gpu(): the kernels then run back to back."""
    if model.device == "cuda":
        from tinyvllm.model.op_timer import hold_gpu
        hold_gpu()


# ---------------------------------------------------------------- batch 1, eager, contiguous cache

def tinyvllm_ms_per_token(model, context: int, steps: int, bandwidth: float, table: bool = False) -> dict:
    """At `context` cached tokens: median ms per decode step + greedy sample; the time of one step with its kernels
    run back to back (no launch gaps); that step's ms per op; op calls per step; with `table`, kernel_table's rows."""
    from tinyvllm.engine.sampling import SamplingParams
    from tinyvllm.model.sampler import sample
    from tinyvllm.model.decode import decode_step
    from tinyvllm.model.kv_pool import ContiguousKVCache
    from tinyvllm.model.prefill import prefill
    greedy, rng = SamplingParams(temperature=0), np.random.default_rng(0)
    ids = rng.integers(0, model.cfg.vocab_size, context).tolist()

    def fresh_cache():
        cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=context + steps + 32)
        logits, _ = prefill(model, ids, cache=cache)
        return cache, sample(logits, greedy, rng)

    cache, token = fresh_cache()
    for _ in range(5):  # warm-up: compiles every kernel, grows CuPy's memory pool
        token = sample(decode_step(model, [token], cache, [0])[0], greedy, rng)
    cache, token = fresh_cache()
    times = []
    for _ in range(steps):  # each step: the context grows by one, as in real generation
        start = time.perf_counter()
        token = sample(decode_step(model, [token], cache, [0])[0], greedy, rng)
        times.append(time.perf_counter() - start)
    busy = [back_to_back_ms(model, lambda: decode_step(model, [token], cache, [0])) for _ in range(5)]
    hold(model)
    with timed_ops(model) as timer:
        decode_step(model, [token], cache, [0])
    ms, kernel_ms = 1e3 * statistics.median(times), statistics.median(busy)
    result = {"ms_per_token": ms, "kernel_ms": kernel_ms, "launch_gaps_and_host_ms": ms - kernel_ms,
              "op_calls_per_step": len(timer.calls),
              "kernel_ms_by_op": {k: round(v * 1e3, 4) for k, v in timer.totals().items()}}
    if table:  # the cache now holds about context + steps tokens
        result["kernel_table"] = kernel_table(model, lambda: decode_step(model, [token], cache, [0]), context + steps,
                                              bandwidth)
    return result


def back_to_back_ms(model, step) -> float:
    """The step's time with its kernels queued behind hold_gpu (the GPU's clock); on the CPU, its wall time."""
    if model.device != "cuda":
        start = time.perf_counter()
        step()
        return 1e3 * (time.perf_counter() - start)
    cp = model.ops.xp
    start, end = cp.cuda.Event(), cp.cuda.Event()
    hold(model)
    start.record()
    step()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end)


def compare_fused(model, context: int, steps: int, bandwidth: float) -> tuple[dict, dict]:
    """(unfused, fused): batch-1 eager figures of each layer, on the same model."""
    model.fused_decode = False
    unfused = tinyvllm_ms_per_token(model, context, steps, bandwidth)
    model.fused_decode = True
    fused = tinyvllm_ms_per_token(model, context, steps, bandwidth, table=True)
    return unfused, fused


# ---------------------------------------------------------------- batch 1 / 8 / 64, paged pool, CUDA graphs

def ms_per_step(model, batch: int, context: int, steps: int, layer: str | None = None) -> tuple[float, int]:
    """(median ms of a decode step of `batch` sequences at `context` tokens each, op calls per step): one CUDA graph
    replay per step on the GPU, decode_batch on the CPU. The pool's K/V are zeros: the time does not depend on them.
    layer: "unfused", "fused" or "persistent" where it can run the batch; None: the graph the engine would keep,
    the fastest of them (cuda_graphs.GraphedDecode)."""
    from tinyvllm.engine.block_manager import BlockManager, plan_decode
    from tinyvllm.model.decode import decode_batch
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.step_plan import blocks_for
    warmup = 3
    num_blocks = batch * blocks_for(context + warmup + steps + 1)
    blocks, pool = BlockManager(num_blocks), PagedKVPool(model.cfg, model.ops, num_blocks)
    seqs, rng = list(range(batch)), np.random.default_rng(batch)
    for s in seqs:
        blocks.allocate(s, context)
    if model.device == "cuda":
        from tinyvllm.model.cuda_graphs import GraphedDecode
        run = GraphedDecode(model, pool, max_num_seqs=batch, layer=layer)
    else:
        def run(plan):
            return decode_batch(model, pool, plan)

    def step():
        plan = plan_decode(blocks, seqs, rng.integers(0, model.cfg.vocab_size, batch).tolist())
        start = time.perf_counter()
        run(plan)
        synchronize(model)
        return time.perf_counter() - start

    for _ in range(warmup):  # the first captures the graph
        step()
    times = [step() for _ in range(steps)]
    with timed_ops(model) as timer:  # one eager step, its ops counted
        decode_batch(model, pool, plan_decode(blocks, seqs, [0] * batch))
    return 1e3 * statistics.median(times), len(timer.calls)


def batch_kernel_table(model, batch: int, context: int, bandwidth: float) -> list[dict]:
    """kernel_table of one eager decode step of `batch` sequences at `context` tokens each in the paged pool, the layer
    model.fused_decode says (above GEMV_DECODE_ROWS rows the unfused one, on cuBLAS, whatever it says)."""
    from tinyvllm.engine.block_manager import BlockManager, plan_decode
    from tinyvllm.model.decode import decode_batch
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.step_plan import blocks_for
    blocks = BlockManager(batch * blocks_for(context + 1))
    pool, seqs = PagedKVPool(model.cfg, model.ops, blocks.num_free), list(range(batch))
    for s in seqs:
        blocks.allocate(s, context)
    plan = plan_decode(blocks, seqs, [0] * batch)
    decode_batch(model, pool, plan)   # warm-up: compiles what the step runs
    return kernel_table(model, lambda: decode_batch(model, pool, plan), context + 1, bandwidth)


def batch_sweep(model, batches: list[int], context: int, steps: int, bandwidth: float) -> list[dict]:
    """Per batch size: each layer's graph-replayed step, the engine's choice, and (on the GPU) the unfused step's
    kernel table, which is what runs above GEMV_DECODE_ROWS rows."""
    rows = []
    for batch in batches:
        floor = floor_ms(model, context, batch, bandwidth)
        row = {"batch": batch, "floor_ms": floor}
        for layer in ("fused", "unfused") + (("persistent",) if model.device == "cuda" else ()):
            model.fused_decode = layer != "unfused"   # the CPU's decode_batch follows it
            ms, calls = ms_per_step(model, batch, context, steps, layer=layer)
            row[layer] = {"ms_per_token": ms, "ratio_to_floor": ms / floor, "op_calls_per_step": calls}
            if layer == "unfused":
                row[layer]["kernel_table"] = batch_kernel_table(model, batch, context, bandwidth)
        model.fused_decode = True
        if model.device == "cuda":   # what the engine runs: the fastest, chosen at capture
            ms, calls = ms_per_step(model, batch, context, steps)
            row["engine"] = {"ms_per_token": ms, "ratio_to_floor": ms / floor, "op_calls_per_step": calls}
        rows.append(row)
        if model.device == "cuda":
            model.ops.free_cached_memory()
    return rows


def invariant_sweep(model, rows: list[dict], context: int, steps: int) -> None:
    """The same steps in the batch-invariant mode (its unfused layer on gemm_invariant, attention split by each
    row's length), beside the engine's default path: rows[i]["batch_invariant"]."""
    for row in rows:
        ms, calls = ms_per_step(model, row["batch"], context, steps)
        default = row.get("engine", row["fused"])["ms_per_token"]
        row["batch_invariant"] = {"ms_per_token": ms, "ratio_to_floor": ms / row["floor_ms"],
                                  "op_calls_per_step": calls, "over_default": ms / default}
        if model.device == "cuda":
            model.ops.free_cached_memory()


# ---------------------------------------------------------------- transformers

def load_transformers(model_dir: Path, device: str):
    """HF transformers' Llama on the same weights: bf16 on the GPU, float32 on the CPU (as tinyvllm's twins)."""
    import torch
    from transformers import LlamaForCausalLM
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def transformers_ms_per_token(hf, context: int, steps: int, device: str = "cuda") -> float:
    """transformers' own decode loop: its dynamic KV cache, one forward per token, the id read on the host."""
    import torch
    from transformers import DynamicCache
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    ids = torch.randint(0, hf.config.vocab_size, (1, context), device=device)
    times = []
    with torch.no_grad():
        for run in range(2):  # the first run warms up
            cache = DynamicCache()
            out = hf(ids, **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
            token = int(out.logits[0, -1].argmax())
            for _ in range(steps):
                start = time.perf_counter()
                out = hf(torch.tensor([[token]], device=device), **{cache_arg: cache}, use_cache=True)
                token = int(out.logits[0, -1].argmax())  # the id on the host, as for tinyvllm
                if run:
                    times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def transformers_static_ms_per_token(hf, context: int, steps: int, device: str = "cuda") -> dict:
    """transformers' fastest decode: generate() with a static KV cache, which generate() compiles on a GPU
    (torch.compile with CUDA graphs; not on a CPU). Per token: a generation of steps + 1 tokens minus one of 1
    token, over the `steps` extra tokens (the prefill cancels), medians of 3 after two compiling warm-ups."""
    import torch
    ids = torch.randint(0, hf.config.vocab_size, (1, context), device=device)

    def seconds(new_tokens: int) -> float:
        synchronize_torch(device)
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    cache_implementation="static", pad_token_id=0)
        synchronize_torch(device)
        return time.perf_counter() - start

    with torch.no_grad():
        for n in (steps + 1, 1):     # compile, capture, warm up
            seconds(n)
        long = statistics.median(seconds(steps + 1) for _ in range(3))
        short = statistics.median(seconds(1) for _ in range(3))
    return {"ms_per_token": 1e3 * (long - short) / steps, "compiled": device == "cuda"}


def synchronize_torch(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


# ---------------------------------------------------------------- the run

def measure_machine(device: str) -> tuple[dict, float]:
    """(the machine, its copy bandwidth in bytes/s): the GPU's device-to-device copy, or NumPy's on the CPU."""
    if device == "cuda":
        from bench.gpu_common import copy_bandwidth, machine
    else:
        from bench.cpu_decode import copy_bandwidth, machine
    return machine(), copy_bandwidth()


def print_kernel_table(table: list[dict]) -> None:
    for row in table:
        print(f"    {row['op']:<22} {row['calls']:4d} calls {row['ms']:8.3f} ms {row['bytes'] / 1e6:10.2f} MB "
              f"{row['gb_s']:8.0f} GB/s {100 * row['of_copy_bandwidth']:5.1f}%")


def report(result: dict) -> None:
    floor = result["floor_ms"]
    print(f"copy bandwidth {result['copy_bandwidth_gb_s']:.0f} GB/s; a step reads "
          f"{result['bytes_per_step'] / 1e9:.3f} GB -> floor {floor:.3f} ms")
    for name, r in (("unfused", result), ("fused", result["fused"])):
        print(f"tinyvllm eager, {name}: {r['ms_per_token']:.3f} ms/token = {r['ms_per_token'] / floor:.2f}x the floor; "
              f"kernels {r['kernel_ms']:.3f} ms ({r['kernel_ms'] / floor:.2f}x the floor), launch gaps and host "
              f"{r['launch_gaps_and_host_ms']:.3f} ms; {r['op_calls_per_step']} op calls per step")
        for op, ms in r["kernel_ms_by_op"].items():
            print(f"    {op:<22} {ms:8.3f} ms")
    print("    (timing each op on its own adds a little to its time)")
    print("the fused step, op by op: bytes moved / time / copy bandwidth")
    print_kernel_table(result["fused"]["kernel_table"])
    print(f"batch sweep ({result['batches_mode']}, context {result['context']} per sequence): ms per step")
    for row in result["batches"]:
        cells = "  ".join(f"{mode} {row[mode]['ms_per_token']:.3f} ({row[mode]['ratio_to_floor']:.2f}x, "
                          f"{row[mode]['op_calls_per_step']} op calls)"
                          for mode in ("fused", "unfused", "persistent", "engine", "batch_invariant")
                          if mode in row)
        print(f"    batch {row['batch']:3d}: floor {row['floor_ms']:.3f}  {cells}")
    for row in result["batches"]:
        print(f"the unfused step at batch {row['batch']}, op by op (eager, each op alone): bytes / time / copy bandwidth")
        print_kernel_table(row["unfused"]["kernel_table"])
    invariant = result["batch_invariant"]
    print(f"batch-invariant mode (chapter 7): {invariant['ms_per_token']:.3f} ms/token, "
          f"{invariant['over_default']:.2f}x the default (fused) layer")
    print(f"transformers (its KV cache, eager): {result['transformers_ms_per_token']:.3f} ms/token -> tinyvllm "
          f"(fused, eager) is {result['speedup_vs_transformers']:.2f}x faster")
    static = result["transformers_static_cache"]
    print(f"transformers (generate, static cache{', compiled' if static['compiled'] else ''}): "
          f"{static['ms_per_token']:.3f} ms/token = {static['ratio_to_floor']:.2f}x the floor")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batches", default="1,8,64", help="batch sizes of the sweep, comma-separated")
    args = parser.parse_args(argv)
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.model import Model

    batches = [int(b) for b in args.batches.split(",")]
    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    model = Model(model_dir, device=args.device, max_num_batched_tokens=max(args.context, *batches))
    cfg = model.cfg
    machine, bandwidth = measure_machine(args.device)
    step_bytes = weight_bytes_per_step(model) + kv_bytes_per_step(model.cfg, args.context)
    floor = floor_ms(model, args.context, 1, bandwidth)
    unfused, fused = compare_fused(model, args.context, args.steps, bandwidth)
    batches_rows = batch_sweep(model, batches, args.context, args.steps, bandwidth)
    del model
    invariant = Model(model_dir, device=args.device, max_num_batched_tokens=max(args.context, *batches),
                      batch_invariant=True)
    invariant_run = tinyvllm_ms_per_token(invariant, args.context, args.steps, bandwidth)
    invariant_sweep(invariant, batches_rows, args.context, args.steps)
    del invariant
    hf = load_transformers(model_dir, args.device)   # the peers: transformers' eager loop, then its static cache
    hf_ms = transformers_ms_per_token(hf, args.context, args.steps, args.device)
    hf_static = transformers_static_ms_per_token(hf, args.context, args.steps, args.device)
    del hf
    ms = fused["ms_per_token"]
    result = {"benchmark": "decode", "machine": machine, "model": str(model_dir), "config": vars(cfg),
              "device": args.device,
              "batch": 1, "context": args.context, "steps": args.steps, "mode": "eager",
              "copy_bandwidth_gb_s": bandwidth / 1e9, "bytes_per_step": step_bytes, "floor_ms": floor,
              **unfused, "ratio_to_floor": unfused["ms_per_token"] / floor,
              "kernel_ratio_to_floor": unfused["kernel_ms"] / floor,
              "fused": {**fused, "ratio_to_floor": ms / floor, "kernel_ratio_to_floor": fused["kernel_ms"] / floor},
              "batches_mode": "cuda_graphs" if args.device == "cuda" else "eager", "batches": batches_rows,
              "transformers_ms_per_token": hf_ms, "speedup_vs_transformers": hf_ms / ms,
              "transformers_static_cache": {**hf_static, "ratio_to_floor": hf_static["ms_per_token"] / floor,
                                            "tinyvllm_graphs_batch1_over_it": batches_rows[0]["fused"]["ms_per_token"]
                                            / hf_static["ms_per_token"] if batches_rows[0]["batch"] == 1 else None},
              "batch_invariant": {"ms_per_token": invariant_run["ms_per_token"],
                                  "over_default": invariant_run["ms_per_token"] / ms,
                                  "kernel_ms": invariant_run["kernel_ms"]}}
    report(result)
    path = write_result("decode" if args.device == "cuda" else "decode-cpu", result)
    return path


if __name__ == "__main__":
    main()
