"""Structured outputs as the engine serves them: what a constraint adds to a batch's step, through LLM.generate.

The same BATCH requests (chat prompts, temperature 1, a seed each, ignore_eos, --max-tokens tokens) run with and
without a constraint that never ends them early (a regex of letters and punctuation, so both runs make the same
number of steps); the figure is seconds per step of the batch, the median of --runs runs taken in turns (free,
constrained, free, ...), after a warm-up of each that caches the masks and captures the CUDA graphs. Also: the
same batch under a JSON schema at temperature 1, every output parsed and its required keys checked — the
constraint's correctness on real weights, where the timing above is its cost. Issue target: at most 5% at batch 64.
Writes bench/results/structured-batch-<device>-<time>.json.

    python bench/structured_batch.py [--device cuda] [--batch 64] [--max-tokens 64] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from bench.gpu_common import machine, thread_settings, write_result  # noqa: E402
from tinyvllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}
NEVER_ENDS = r"[a-z ,.]{1,2000}"   # holds every step of the run: the constrained batch runs as long as the free one


def seconds_per_step(llm, prompts: list, max_tokens: int, constraint) -> float:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=constraint) for i in range(len(prompts))]
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds / max(len(o.outputs[0].token_ids) for o in out)   # every sequence emits one token a step


def schema_outputs_valid(llm, prompts: list) -> int:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=StructuredOutputsParams(
        json=SCHEMA)) for i in range(len(prompts))]
    valid = 0
    for o in llm.generate(prompts, params, use_tqdm=False):
        try:
            value = json.loads(o.outputs[0].text)
        except ValueError:
            continue
        valid += isinstance(value, dict) and set(SCHEMA["required"]) <= set(value) and isinstance(value["age"], int)
    return valid


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="where to write the JSON (default: bench/results/)")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Describe person number {i}."}])
               for i in range(args.batch)]
    constraint = StructuredOutputsParams(regex=NEVER_ENDS)
    for c in (None, constraint):   # warm-up: graphs captured, the regex's masks cached
        seconds_per_step(llm, prompts, args.max_tokens, c)
    runs: dict[str, list[float]] = {"free": [], "constrained": []}
    for _ in range(args.runs):
        runs["free"].append(seconds_per_step(llm, prompts, args.max_tokens, None))
        runs["constrained"].append(seconds_per_step(llm, prompts, args.max_tokens, constraint))
    ms = {k: 1e3 * statistics.median(v) for k, v in runs.items()}
    valid = schema_outputs_valid(llm, prompts)
    print(f"batch {args.batch}: {ms['free']:.3f} ms a step free, {ms['constrained']:.3f} constrained "
          f"(+{100 * (ms['constrained'] / ms['free'] - 1):.1f}%); JSON schema outputs valid: {valid} of {args.batch}")
    device = "cuda" if llm.engine.runner.model.device == "cuda" else "cpu"
    where = machine() if device == "cuda" else {"cpu": platform.processor() or platform.machine(),
                                                "cpu_cores": os.cpu_count(), "threads": thread_settings()}
    write_result(f"structured-batch-{device}", {
        "benchmark": "structured_batch", "machine": where, "model": args.model, "batch": args.batch,
        "max_tokens": args.max_tokens, "regex": NEVER_ENDS, "ms_per_step": ms,
        "runs_ms_per_step": {k: [1e3 * x for x in v] for k, v in runs.items()},
        "overhead": ms["constrained"] / ms["free"] - 1, "schema": SCHEMA, "schema_outputs_valid": valid}, args.out)


if __name__ == "__main__":
    main()
