"""Decode speed on the GPU, batch 1: a synthetic Llama-3.2-1B checkpoint, a 512-token context, eager mode.

One decode step reads every weight once (plus the context's K/V), so its floor is

    (weight bytes + KV bytes read) / copy bandwidth measured in the same run.

Reports ms per token (decode step + greedy sampling, until the id is on the host) against that floor,
where the step's time goes — the GPU time of the step with its kernels queued back to back (behind
op_timer.hold_gpu), per op, and the rest: launch gaps, the host launching ~150 kernels one by one,
which chapter 7's CUDA graphs remove — the same step in the batch-invariant mode (chapter 7: its
`batch_invariant` field), and HF transformers (bf16, its KV cache) decoding on the same weights and
context. Writes bench/results/decode-<time>.json.

    python bench/decode.py [--model DIR] [--context 512] [--steps 64]
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
from bench.gpu_common import copy_bandwidth, machine, write_result  # noqa: E402


def weight_bytes_per_step(model) -> int:
    """Every weight matrix is read once per step; the embedding table only for one row (unless it is the head)."""
    read = sum(r.nbytes for r in model.weight_regions if r.name != "embed")
    return read + (model.weights["embed"].nbytes if model.cfg.tie_word_embeddings else 0)


def kv_bytes_per_step(cfg, context: int) -> int:
    return 2 * cfg.num_hidden_layers * context * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16


def tinyvllm_ms_per_token(model, context: int, steps: int) -> tuple[float, float, dict]:
    """At `context` cached tokens: median ms per decode step + greedy sample; the GPU time of one step with
    its kernels run back to back (no launch gaps); that step's seconds per op."""
    import cupy as cp

    from tinyvllm.engine.sampling import SamplingParams, sample
    from tinyvllm.model.decode import decode_step
    from tinyvllm.model.kv_pool import ContiguousKVCache
    from tinyvllm.model.op_timer import hold_gpu, timed_ops
    from tinyvllm.model.prefill import prefill
    greedy, rng = SamplingParams(temperature=0), np.random.default_rng(0)
    ids = rng.integers(0, model.cfg.vocab_size, context).tolist()

    def fresh_cache():
        cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=context + steps + 16)
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
    busy = []
    for _ in range(5):  # the whole step queued behind hold_gpu(): kernels back to back
        start, end = cp.cuda.Event(), cp.cuda.Event()
        hold_gpu()
        start.record()
        decode_step(model, [token], cache, [0])
        end.record()
        end.synchronize()
        busy.append(cp.cuda.get_elapsed_time(start, end))
    hold_gpu()
    with timed_ops(model) as timer:
        decode_step(model, [token], cache, [0])
    return 1e3 * statistics.median(times), statistics.median(busy), timer.totals()


def transformers_ms_per_token(model_dir: Path, context: int, steps: int) -> float:
    import torch
    from transformers import DynamicCache, LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    ids = torch.randint(0, hf.config.vocab_size, (1, context), device="cuda")
    times = []
    with torch.no_grad():
        for run in range(2):  # the first run warms up
            cache = DynamicCache()
            out = hf(ids, **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
            token = int(out.logits[0, -1].argmax())
            for _ in range(steps):
                start = time.perf_counter()
                out = hf(torch.tensor([[token]], device="cuda"), **{cache_arg: cache}, use_cache=True)
                token = int(out.logits[0, -1].argmax())  # the id on the host, as for tinyvllm
                if run:
                    times.append(time.perf_counter() - start)
    del hf
    torch.cuda.empty_cache()
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.model import Model

    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    model = Model(model_dir, device="cuda", max_step_tokens=args.context)
    bandwidth = copy_bandwidth()
    step_bytes = weight_bytes_per_step(model) + kv_bytes_per_step(model.cfg, args.context)
    floor_ms = 1e3 * step_bytes / bandwidth
    ms, kernel_ms, kernels = tinyvllm_ms_per_token(model, args.context, args.steps)
    invariant = Model(model_dir, device="cuda", max_step_tokens=args.context, batch_invariant=True)
    invariant_ms, invariant_kernel_ms, _ = tinyvllm_ms_per_token(invariant, args.context, args.steps)
    del invariant
    hf_ms = transformers_ms_per_token(model_dir, args.context, args.steps)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; a step reads {step_bytes / 1e9:.3f} GB -> floor {floor_ms:.3f} ms")
    print(f"tinyvllm eager: {ms:.3f} ms/token = {ms / floor_ms:.2f}x the floor; kernels {kernel_ms:.3f} ms "
          f"({kernel_ms / floor_ms:.2f}x the floor), launch gaps and host {ms - kernel_ms:.3f} ms")
    for name, s in kernels.items():
        print(f"    {name:<18} {s * 1e3:8.3f} ms")
    print(f"    (sum over ops {1e3 * sum(kernels.values()):.3f} ms: each op's pair of CUDA events adds a little)")
    print(f"batch-invariant mode (chapter 7): {invariant_ms:.3f} ms/token, {invariant_ms / ms:.2f}x the default")
    print(f"transformers (bf16, KV cache): {hf_ms:.3f} ms/token -> tinyvllm is {hf_ms / ms:.2f}x faster")
    result = {"benchmark": "decode", "machine": machine(), "model": str(model_dir), "config": vars(model.cfg),
              "batch": 1, "context": args.context, "steps": args.steps, "mode": "eager",
              "copy_bandwidth_gb_s": bandwidth / 1e9, "bytes_per_step": step_bytes, "floor_ms": floor_ms,
              "ms_per_token": ms, "ratio_to_floor": ms / floor_ms,
              "kernel_ms": kernel_ms, "kernel_ratio_to_floor": kernel_ms / floor_ms,
              "launch_gaps_and_host_ms": ms - kernel_ms,
              "kernel_ms_by_op": {k: round(v * 1e3, 4) for k, v in kernels.items()},
              "transformers_ms_per_token": hf_ms, "speedup_vs_transformers": hf_ms / ms,
              "batch_invariant": {"ms_per_token": invariant_ms, "over_default": invariant_ms / ms,
                                  "kernel_ms": invariant_kernel_ms}}
    print("wrote", write_result("decode", result))


if __name__ == "__main__":
    main()
