"""What a verification step costs against a decode step, by batch size: where speculation stops paying.

    python bench/verify_cost.py [--model default] [--device cpu] [--k 4] [--rounds 6] [--batches 1 2 4 8 16 32]

For each batch B, one decode step of B sequences (one row each) and one verification step of the same B, each
sequence its newest token and k guesses (k + 1 rows each, through the prefill path as the engine runs it), every
sequence 200 tokens into its context. Speculation pays while a verification costs fewer decode steps than the
tokens it emits on average (1 to k + 1: 3.6 for prompt lookup on grounded text): the ratio below. Rounds are
interleaved, and the minimum over rounds is reported beside the median (on a shared machine the minimum is the
least-disturbed run). Writes bench/results/verify-cost-<device>-<date>-<time>.json; asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from bench.gpu_common import thread_settings, write_result  # noqa: E402
from tinyvllm import LLM  # noqa: E402
from tinyvllm.model.step_plan import BLOCK_SIZE, SeqStep, StepPlan  # noqa: E402

CONTEXT = 200   # tokens each sequence already has in the pool


def plan(batch: int, k: int) -> StepPlan:
    """B sequences at position CONTEXT, each in its own blocks: decodes (k = 0) or verifications of k guesses."""
    blocks = -(-(CONTEXT + k + 1) // BLOCK_SIZE)
    steps = []
    for i in range(batch):
        table = list(range(i * blocks, (i + 1) * blocks))
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(CONTEXT, CONTEXT + k + 1)]
        steps.append(SeqStep([100] * (k + 1), CONTEXT, slots, table, proposed=k))
    return StepPlan(verifies=steps) if k else StepPlan(decodes=steps)


def measure(llm: LLM, batches: list[int], k: int, rounds: int) -> dict:
    """Seconds per step, decode and verification, per batch: every round runs each once, in turn."""
    runner, seconds = llm.engine.runner, {(b, kind): [] for b in batches for kind in ("decode", "verify")}
    for _ in range(rounds):
        for b in batches:
            for kind, guesses in (("decode", 0), ("verify", k)):
                step = plan(b, guesses)
                start = time.perf_counter()
                runner.finish(runner.launch(step))   # nothing to sample: finish only waits for the logits
                seconds[b, kind].append(time.perf_counter() - start)
    return {b: {kind: {"min": min(seconds[b, kind]), "median": statistics.median(seconds[b, kind]),
                       "runs": seconds[b, kind]} for kind in ("decode", "verify")} for b in batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--k", type=int, default=4, help="guesses per verification")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--out", help="where to write the JSON (default: bench/results/verify-cost-<device>-<time>.json)")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    rows = max(args.batches) * (args.k + 1)
    blocks = max(args.batches) * -(-(CONTEXT + args.k + 1) // BLOCK_SIZE)
    llm = LLM(args.model, device=args.device, num_blocks=blocks, max_num_batched_tokens=rows)
    llm.engine.runner.launch(plan(1, args.k))   # warm up
    results = measure(llm, args.batches, args.k, args.rounds)
    for b, r in results.items():
        decode, verify = r["decode"]["min"], r["verify"]["min"]
        print(f"batch {b:3d}: decode {decode * 1e3:7.1f} ms ({b / decode:6.1f} tokens/s)   verify k={args.k} "
              f"({b * (args.k + 1)} rows) {verify * 1e3:7.1f} ms   = {verify / decode:.2f} decode steps")
    write_result(f"verify-cost-{args.device}", {
        "benchmark": "verify_cost", "device": args.device, "model": args.model, "k": args.k, "context": CONTEXT,
        "rounds": args.rounds, "threads": thread_settings(), "cpu_cores": os.cpu_count(),
        "load_average_at_start": load_at_start, "results": results}, args.out)


if __name__ == "__main__":
    main()
