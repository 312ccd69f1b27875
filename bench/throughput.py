"""Throughput on the GPU: tinyvllm against HF transformers, in ONE process, on the same GPU and weights.

The workload is nano-vllm's bench.py, drawn as it draws it (Python's random, seed 0, the same calls in the
same order): 256 requests, prompt and output lengths uniform in [100, 1024], prompt ids uniform in [0, 10000],
temperature 0.6, every request generating exactly its output length (ignore_eos): 142,827 prompt and
133,966 output tokens, so the figure compares with every published run of that benchmark. (Until
2026-12 the draw was NumPy's, 148,756 output tokens, greedy: --also-numpy-draw runs it once more.) Measured:
  - tinyvllm, continuous batching with CUDA graphs: output tokens/s, the median of --runs runs and each run;
  - continuous vs static batching at the same batch size (64): static runs batches of 64 to
    completion one after another, continuous refills a finished request's slot at once;
  - batch-1 decode with CUDA graphs: ms per token (time per output token) against the floor,
    weight bytes / copy bandwidth measured in the same run;
  - the workload and batch-1 decode again with async scheduling off (the step serialized) and in the
    batch-invariant mode (chapter 7), each as a ratio to the default;
  - transformers (bf16, sdpa): its continuous batching (a manager fed one request at a time, each with
    its own max_new_tokens) and `generate` in padded batches of 64 (each batch runs to its longest
    request; only the tokens the workload asks for are counted).
Writes bench/results/throughput-<time>.json.

    python bench/throughput.py [--skip-transformers] [--also-numpy-draw] [--runs 3]
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import kv_bytes_per_step, weight_bytes_per_step  # noqa: E402
from bench.gpu_common import copy_bandwidth, machine, write_result  # noqa: E402

REQUESTS = 256       # nano-vllm's num_seqs
TEMPERATURE = 0.6    # nano-vllm's sampling: the sampler's cost is part of the figure


def workload() -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py, call for call: every prompt (its length, then its ids), then every output length."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(REQUESTS)]
    return prompts, [random.randint(100, 1024) for _ in range(REQUESTS)]


def numpy_workload(vocab: int) -> tuple[list[list[int]], list[int]]:
    """The draw this benchmark used before it took nano-vllm's (kept for continuity with older results)."""
    rng = np.random.default_rng(0)
    prompt_lens, output_lens = rng.integers(100, 1025, REQUESTS), rng.integers(100, 1025, REQUESTS)
    return [rng.integers(0, vocab, int(p)).tolist() for p in prompt_lens], output_lens.tolist()


def run_tinyvllm(llm, prompts, outputs, temperature: float = TEMPERATURE) -> tuple[float, int]:
    from tinyvllm import SamplingParams
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in outputs]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, sum(len(r.token_ids) for r in results)


def repeated_runs(llm, prompts, outputs, runs: int) -> dict:
    """The workload `runs` times on one engine: tokens/s as the median, with every run's figure (the spread)."""
    measured = [run_tinyvllm(llm, prompts, outputs) for _ in range(runs)]
    rates = [tokens / seconds for seconds, tokens in measured]
    return {"seconds": float(np.median([s for s, _ in measured])), "output_tokens": measured[0][1],
            "tokens_per_s": float(np.median(rates)), "runs_tokens_per_s": rates}


def run_static(llm, prompts, outputs, batch: int) -> tuple[float, int]:
    """Static batching with the same engine: a batch runs until its longest request is done."""
    seconds, tokens = 0.0, 0
    for i in range(0, len(prompts), batch):
        s, t = run_tinyvllm(llm, prompts[i:i + batch], outputs[i:i + batch])
        seconds, tokens = seconds + s, tokens + t
    return seconds, tokens


def batch1_ms_per_token(llm, context: int = 512, tokens: int = 256) -> float:
    from tinyvllm import SamplingParams
    prompt = np.random.default_rng(1).integers(0, llm.model_config.vocab_size, context).tolist()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up: the batch-1 graph is captured
    return 1e3 * llm.generate([prompt], params)[0].timings["time_per_output_token_s"]


def hf_continuous(hf, prompts, outputs) -> tuple[float, int]:
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=None, pad_token_id=0)
    manager = hf.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        for i, (p, m) in enumerate(zip(prompts, outputs)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=m)
        done, tokens = 0, 0
        while done < len(prompts):
            if time.perf_counter() - start > 400:
                raise TimeoutError(f"transformers' continuous batching finished {done} requests in 400 s")
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done, tokens = done + 1, tokens + len(result.generated_tokens)
        return time.perf_counter() - start, tokens
    finally:
        manager.stop(block=True)


def hf_padded(hf, prompts, outputs, batch: int = 64) -> tuple[float, int]:
    import torch
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        chunk, wanted = prompts[i:i + batch], outputs[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(wanted),
                              min_new_tokens=max(wanted), pad_token_id=0)
        assert out.shape[1] - width == max(wanted)
        tokens += sum(wanted)  # the tokens the workload asked for; the rest of each row is padding work
    torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def mode_cost(label: str, model_dir: Path, prompts, outputs, rows: dict, runs: int, **settings) -> dict:
    """The same workload and batch-1 decode with LLM(**settings), beside the default's rows: what a mode costs or
    saves (batch_invariant=True: chapter 7's invariance; async_scheduling=False: the step serialized, chapter 7)."""
    import cupy as cp

    from tinyvllm import LLM
    llm = LLM(str(model_dir), device="cuda", gpu_memory_utilization=0.6, max_num_seqs=256, **settings)
    run_tinyvllm(llm, [p[:16] for p in prompts], list(range(1, len(prompts) + 1)))   # warm-up, as the default's
    cost = repeated_runs(llm, prompts, outputs, runs)
    ms = batch1_ms_per_token(llm)
    cost.update(throughput_over_default=cost["tokens_per_s"] / rows["tinyvllm"]["tokens_per_s"],
                batch1_ms_per_token=ms, batch1_over_default=ms / rows["batch1_graphs"]["ms_per_token"])
    print(f"{label}: {cost['tokens_per_s']:,.0f} tok/s (median of {runs}: "
          f"{min(cost['runs_tokens_per_s']):,.0f}-{max(cost['runs_tokens_per_s']):,.0f}; "
          f"{cost['throughput_over_default']:.2f} of the default), batch-1 decode {ms:.3f} ms/token "
          f"({cost['batch1_over_default']:.2f}x the default)")
    del llm
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    return cost


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--also-numpy-draw", action="store_true",
                        help="also run the workload this benchmark drew before 2026-12 (NumPy, greedy)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-batch-invariant", action="store_true", help="leave out the batch-invariant mode's run")
    parser.add_argument("--runs", type=int, default=3, help="runs of the workload per mode: the median and the spread")
    args = parser.parse_args()
    import cupy as cp

    from tinyvllm import LLM
    from tinyvllm.formats.checkpoints import synth_model
    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    bandwidth = copy_bandwidth()
    llm = LLM(str(model_dir), device="cuda", gpu_memory_utilization=0.6, max_num_seqs=256)
    prompts, outputs = workload()
    # warm-up: kernels compile, and requests finishing one per step walk every batch size, so the graph
    # of every bucket is captured before the clock starts
    run_tinyvllm(llm, [p[:16] for p in prompts], list(range(1, len(prompts) + 1)))
    rows = {}
    rows["tinyvllm"] = repeated_runs(llm, prompts, outputs, args.runs)
    rates = rows["tinyvllm"]["runs_tokens_per_s"]
    print(f"tinyvllm continuous (max_num_seqs 256): {rows['tinyvllm']['output_tokens']} tokens, "
          f"{rows['tinyvllm']['tokens_per_s']:,.0f} tok/s (median of {args.runs}: {min(rates):,.0f}-{max(rates):,.0f})")
    if args.also_numpy_draw:
        old_prompts, old_outputs = numpy_workload(llm.model_config.vocab_size)
        seconds, tokens = run_tinyvllm(llm, old_prompts, old_outputs, temperature=0)
        rows["tinyvllm_numpy_draw"] = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}
        print(f"tinyvllm on the old NumPy draw (greedy): {tokens} tokens, {tokens / seconds:,.0f} tok/s")
    small = LLM(str(model_dir), device="cuda", num_blocks=llm.engine.pool.num_blocks // 4, max_num_seqs=64)
    run_tinyvllm(small, [p[:16] for p in prompts[:64]], list(range(1, 65)))
    for name, fn in [("continuous_64", lambda s=small: run_tinyvllm(s, prompts, outputs)),
                     ("static_64", lambda s=small: run_static(s, prompts, outputs, 64))]:
        seconds, tokens = fn()
        rows[name] = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}
        print(f"tinyvllm {name}: {tokens / seconds:,.0f} tok/s ({seconds:.2f} s)")
    floor_ms = 1e3 * (weight_bytes_per_step(llm.model) + kv_bytes_per_step(llm.model_config, 512 + 128)) / bandwidth
    ms = batch1_ms_per_token(llm)
    rows["batch1_graphs"] = {"ms_per_token": ms, "floor_ms": floor_ms, "ratio_to_floor": ms / floor_ms}
    print(f"batch-1 decode with CUDA graphs: {ms:.3f} ms/token, floor {floor_ms:.3f} ms -> {ms / floor_ms:.2f}x")
    del llm, small
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    serialized = mode_cost("async scheduling off", model_dir, prompts, outputs, rows, args.runs,
                           async_scheduling=False)
    invariant = None if args.skip_batch_invariant else mode_cost("batch-invariant mode", model_dir, prompts, outputs,
                                                                 rows, args.runs, batch_invariant=True)

    if not args.skip_transformers:
        import torch
        from transformers import LlamaForCausalLM
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
        hf.eval()
        for name, fn in [("transformers_continuous", hf_continuous), ("transformers_padded_64", hf_padded)]:
            try:
                seconds, tokens = fn(hf, prompts, outputs)
                rows[name] = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}
                print(f"{name}: {tokens / seconds:,.0f} tok/s ({seconds:.1f} s)")
            except Exception as e:  # recorded, not hidden: a transformers API change shows up in the JSON
                rows[name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name}: failed: {e}")
        best = max((r["tokens_per_s"] for k, r in rows.items() if k.startswith("transformers") and "error" not in r),
                   default=None)
        if best:
            rows["speedup_vs_best_transformers"] = rows["tinyvllm"]["tokens_per_s"] / best
            print(f"tinyvllm / best transformers: {rows['speedup_vs_best_transformers']:.1f}x")
    result = {"benchmark": "throughput", "machine": machine(), "model": str(model_dir),
              "workload": {"draw": "nano-vllm bench.py (Python random, seed 0)", "requests": REQUESTS,
                           "prompt_len": [100, 1024], "output_len": [100, 1024], "temperature": TEMPERATURE,
                           "ignore_eos": True, "total_prompt_tokens": sum(map(len, prompts)),
                           "total_output_tokens": int(sum(outputs))},
              "copy_bandwidth_gb_s": bandwidth / 1e9, "results": rows, "async_scheduling_off": serialized,
              "batch_invariant": invariant}
    write_result("throughput", result)


if __name__ == "__main__":
    main()
