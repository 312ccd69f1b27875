"""What speculative decoding (prompt lookup, early exit, or a draft model) buys, on the CPU or a GPU, and where not.

    python bench/spec_decode.py [--model default] [--device cpu] [--tokens 96] [--runs 3] [--k 4]
                                [--method ngram | --method early_exit --draft-layers 24
                                 | --method draft_model --draft-model DIR] [--batch 1] [--no-batch-limit]

Two workloads, each a few chat requests run one at a time (batch 1: the latency a user sees), greedy:
  grounded   the answer repeats its input: repeat a paragraph, fix a typo in code, rename a variable
             (prompt lookup finds the next tokens in the prompt);
  free-form  the answer is new text (stories, explanations): few n-gram matches.
Each workload runs with speculation off and on (speculative_method --method, k proposals per step), --runs
times, alternating, so a neighbour that loads the CPU for a while slows both. With --batch B, each run sends B
requests at once (the workload's prompts, repeated) instead of one at a time; speculation then stops above
the engine's MAX_SPECULATING_BATCH decoding sequences, unless --no-batch-limit. Reported per workload and
mode: output tokens per second (median and spread), and with speculation the acceptance rate and the mean
tokens a verification emits; also whether the tokens were the same with and without speculation (they
must be). Writes bench/results/spec-decode-<device>-<date>-<time>.json; asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from bench.gpu_common import thread_settings, write_result  # noqa: E402
from tinyvllm import LLM, SamplingParams  # noqa: E402

PARAGRAPH = ("The paged KV cache splits the memory of every sequence into blocks of sixteen tokens. A block "
             "table maps the logical blocks of a sequence to physical blocks in one shared pool, so memory is "
             "taken only when a sequence needs it, and a finished sequence gives its blocks back at once.")
CODE = '''def moving_average(values, window):
    total = 0.0
    result = []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
WORKLOADS = {
    "grounded": [f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
                 f"Rename the variable `total` to `running_sum` in this Python function and show the whole "
                 f"function:\n\n{CODE}",
                 f"Fix the spelling mistakes in this text and return the corrected text:\n\n"
                 f"{PARAGRAPH.replace('sequence', 'sequnce').replace('blocks', 'blokcs')}"],
    "free-form": ["Write a short story about a robot who learns to paint.",
                  "Explain why the sky is blue to a ten-year-old.",
                  "Give three ideas for a weekend trip in the mountains."],
}


def run_once(llm: LLM, prompts: list[str], params: SamplingParams, batch: int = 1) -> tuple[float, int, list[list[int]]]:
    """Batch 1: each prompt alone, in turn; else `batch` requests at once, the prompts repeated in turn.
    Returns (seconds, output tokens, the output ids)."""
    conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
    if batch > 1:
        conversations = [conversations[i % len(conversations)] for i in range(batch)]
    groups = [[c] for c in conversations] if batch == 1 else [conversations]
    outputs, start = [], time.perf_counter()
    for group in groups:
        outputs += [out.outputs[0].token_ids for out in llm.chat(group, params)]
    return time.perf_counter() - start, sum(map(len, outputs)), outputs


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def bench(model: str, device: str, tokens: int, runs: int, k: int, method: str = "ngram",
          draft_layers: int | None = None, batch: int = 1, batch_limit: bool = True,
          draft_model: str | None = None) -> dict:
    params = SamplingParams(temperature=0, max_tokens=tokens)
    share = {"num_blocks": 4096} if device == "cuda" else {}   # two engines share the GPU: a pool each, not 90% each
    speculation = {"method": method, "num_speculative_tokens": k}
    if method == "early_exit":
        speculation["num_draft_layers"] = draft_layers
    if method == "draft_model":
        speculation["model"] = draft_model
    llms = {"off": LLM(model, device=device, **share),
            method: LLM(model, device=device, speculative_config=speculation, **share)}   # keyed by the method
    if not batch_limit:   # what a large batch's speculation costs: the rule that turns it off, off
        llms[method].engine.scheduler.max_speculating_batch = None
    for llm in llms.values():
        run_once(llm, ["Hello"], SamplingParams(temperature=0, max_tokens=4))   # warm up
    results = {}
    for name, prompts in WORKLOADS.items():
        rates, outputs = {mode: [] for mode in llms}, {}
        stats_before = vars(llms[method].engine.spec_stats).copy()
        for _ in range(runs):
            for mode, llm in llms.items():    # alternating: a noisy neighbour slows both modes alike
                seconds, count, outputs[mode] = run_once(llm, prompts, params, batch)
                rates[mode].append(count / seconds)
        spec = llms[method].engine.spec_stats
        proposed, accepted, verifications = (getattr(spec, f) - stats_before[f]
                                             for f in ("proposed", "accepted", "verifications"))
        results[name] = {
            "tokens_per_s": {mode: spread(r) for mode, r in rates.items()},
            "speedup_median": statistics.median(rates[method]) / statistics.median(rates["off"]),
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_tokens_per_verification": 1 + accepted / verifications if verifications else 0.0,
            "proposed": proposed, "accepted": accepted, "verifications": verifications,
            "output_tokens_per_run": sum(map(len, outputs["off"])),
            "same_tokens": outputs["off"] == outputs[method]}
    for llm in llms.values():
        llm.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=96, help="max_tokens per request")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--method", default="ngram", choices=["ngram", "early_exit", "draft_model"],
                        help="speculative_method")
    parser.add_argument("--draft-layers", type=int, default=24, help="early_exit: num_draft_layers")
    parser.add_argument("--draft-model", default="default",
                        help="draft_model: the draft ('default', or a HF model directory with the model's vocabulary)")
    parser.add_argument("--batch", type=int, default=1, help="requests at once (1: one at a time)")
    parser.add_argument("--no-batch-limit", action="store_true",
                        help="speculate at any batch (the engine stops above MAX_SPECULATING_BATCH decoding sequences)")
    parser.add_argument("--out", help="where to write the JSON (default: bench/results/spec-decode-<device>-<time>.json)")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    draft_layers = args.draft_layers if args.method == "early_exit" else None
    draft_model = args.draft_model if args.method == "draft_model" else None
    results = bench(args.model, args.device, args.tokens, args.runs, args.k, args.method, draft_layers, args.batch,
                    not args.no_batch_limit, draft_model)
    for name, r in results.items():
        off, on = r["tokens_per_s"]["off"], r["tokens_per_s"][args.method]
        print(f"{name:9s} off {off['median']:6.1f} tok/s [{off['min']:.1f}, {off['max']:.1f}]   "
              f"{args.method} k={args.k} {on['median']:6.1f} tok/s [{on['min']:.1f}, {on['max']:.1f}]   "
              f"x{r['speedup_median']:.2f}   acceptance {r['acceptance_rate']:.0%}, "
              f"{r['mean_tokens_per_verification']:.2f} tokens per verification, same tokens: {r['same_tokens']}")
    write_result(f"spec-decode-{args.device}", {
        "benchmark": "spec_decode", "device": args.device, "model": args.model,
        "workload": {"requests": {name: max(len(p), args.batch) for name, p in WORKLOADS.items()},
                     "batch": args.batch, "greedy": True, "max_tokens": args.tokens, "runs": args.runs,
                     "method": args.method, "num_speculative_tokens": args.k, "num_draft_layers": draft_layers,
                     "draft_model": draft_model,
                     "batch_limit": not args.no_batch_limit},
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_cores": os.cpu_count(),
                    "python": platform.python_version(), "numpy": np.__version__, "threads": thread_settings(),
                    "load_average_at_start": load_at_start},
        "results": results}, args.out)


if __name__ == "__main__":
    main()
