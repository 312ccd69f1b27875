"""The live page's cost: engine throughput while a page reads the snapshot stream, against while nobody
does, in ONE run on one server.

The workload is nano-vllm's (bench/throughput.py): --num-seqs requests of random token ids, prompt and
output lengths uniform in [--min-len, --max-input-len] and [--min-len, --max-output-len], each generating
exactly its output length (ignore_eos), all sent at once over HTTP (non-streaming) to a server running
`serve`'s code in this process, its engine core in a process of its own. "Watched": a client reads
/ui/events the whole time, as an open page does (the engine takes a snapshot at most every 250 ms).
Measured per run: output tokens/s from the first request sent to the last reply, engine steps/s,
snapshots received per second and the engine core's own time for each (each snapshot says it): their
share of the run is the direct cost, which no drift of a shared machine blurs.

The two kinds of run alternate, --rounds times, and an unwatched run closes the series (unwatched, watched,
unwatched, ..., watched, unwatched), each with the same lengths but fresh token ids: on a shared machine
throughput drifts over minutes, and a prompt seen before would be served from the prefix cache. Each
watched run is compared with the mean of the unwatched runs just before and after it (a drift that is
steady over the three cancels out); the ratio reported is the median of those over the rounds.
Writes bench/results/ui_overhead-<time>.json (or --out).

    python bench/ui_overhead.py [--model default] [--device auto] [--num-seqs 256] [--min-len 100]
        [--max-input-len 1024] [--max-output-len 1024] [--max-num-seqs 256] [--num-blocks B] [--rounds 3]

CPU run: python bench/ui_overhead.py --device cpu --num-seqs 8 --min-len 16 --max-input-len 64 \
             --max-output-len 32 --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from bench.gpu_common import machine as gpu_machine  # noqa: E402
from bench.gpu_common import write_result  # noqa: E402
from bench.serving import allowed_ids, host  # noqa: E402

REQUEST_TIMEOUT_S = 1800     # a whole run on a slow CPU; a server that hangs fails the run instead
WARMUP_TOKENS = 8            # the warm-up: kernels compiled (and CUDA graphs captured) before any clock runs


def workload(args, allowed: np.ndarray, run: int) -> list[dict]:
    """The request bodies of one run: the same lengths in every run (drawn with --seed), fresh random ids
    from `allowed` (drawn with --seed and the run's number)."""
    lengths = np.random.default_rng(args.seed)
    inputs = lengths.integers(args.min_len, args.max_input_len + 1, args.num_seqs)
    outputs = lengths.integers(args.min_len, args.max_output_len + 1, args.num_seqs)
    ids = np.random.default_rng([args.seed, run])
    return [{"prompt": ids.choice(allowed, int(n)).tolist(), "max_tokens": int(m), "ignore_eos": True,
             "temperature": 0} for n, m in zip(inputs, outputs)]


async def watch(client: httpx.AsyncClient, arrivals: list[tuple[float, float]]) -> None:
    """Read /ui/events as the page does; note when each snapshot arrives and what it cost the engine core."""
    async with client.stream("GET", "/ui/events") as events:
        async for line in events.aiter_lines():
            if line.startswith("data: "):
                arrivals.append((time.perf_counter(), json.loads(line[6:])["snapshot_ms"]))


async def run_once(server, bodies: list[dict], watched: bool) -> dict:
    """All the requests at once; with watched, while a reader follows the snapshot stream."""
    limits = httpx.Limits(max_connections=len(bodies) + 1, max_keepalive_connections=len(bodies) + 1)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        arrivals: list[tuple[float, float]] = []
        watcher = asyncio.create_task(watch(client, arrivals)) if watched else None
        while watched and not arrivals:   # the stream is open before the clock starts
            await asyncio.sleep(0.01)
        steps, start = server.engine.client.stats.steps, time.perf_counter()
        replies = await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))
        seconds, steps = time.perf_counter() - start, server.engine.client.stats.steps - steps
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)   # closed before the client is
    failed = [r for r in replies if r.status_code != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: HTTP {failed[0].status_code} {failed[0].text[:200]}")
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in replies)
    costs = [ms for t, ms in arrivals if start <= t <= start + seconds]
    row = {"watched": watched, "seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
           "steps": steps, "steps_per_s": steps / seconds, "snapshots": len(costs),
           "snapshots_per_s": len(costs) / seconds}
    if costs:   # the engine core's own time in snapshots: a share of the run that no drift of the machine blurs
        row |= {"snapshot_ms_median": statistics.median(costs), "snapshot_share": sum(costs) / 1e3 / seconds}
    return row


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a model directory")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-seqs", type=int, default=256, help="requests per run, sent at once")
    p.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences the engine runs at once")
    p.add_argument("--num-blocks", type=int, help="KV cache blocks (default: what memory allows)")
    p.add_argument("--rounds", type=int, default=3, help="watched runs, each between two unwatched ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="the result file (default: bench/results/ui_overhead-<time>.json)")
    args = p.parse_args()
    if not 1 <= args.min_len <= min(args.max_input_len, args.max_output_len):
        p.error("--min-len must be at least 1 and at most --max-input-len and --max-output-len")
    return args


def main() -> None:
    args = parse_args()
    from tinyvllm.engine.engine_config import EngineConfig
    from tinyvllm.entrypoints.server import Server
    from tinyvllm.model.backend import resolve_device
    device, load_at_start = resolve_device(args.device), os.getloadavg()
    config = EngineConfig(args.model, device, max_model_len=args.max_input_len + args.max_output_len,
                          num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs)
    server = Server(config, args.model, port=0, log_level="warning").start()
    try:
        allowed = allowed_ids(server.engine.tokenizer)
        warmup = [{"prompt": body["prompt"][:16], "max_tokens": WARMUP_TOKENS, "ignore_eos": True}
                  for body in workload(args, allowed, run=10_000)]   # ids no timed run uses
        asyncio.run(run_once(server, warmup, watched=True))
        runs = []
        for i, watched in enumerate([False, True] * args.rounds + [False]):   # the last unwatched run closes it
            r = i // 2
            bodies = workload(args, allowed, run=len(runs))
            runs.append({"round": r, "watched": watched, **asyncio.run(run_once(server, bodies, watched))})
            row = runs[-1]
            cost = (f", {row['snapshots_per_s']:.2f} snapshots/s of {row['snapshot_ms_median']:.3f} ms each in "
                    f"the engine core ({100 * row['snapshot_share']:.3f}% of the run)") if row["snapshots"] else ""
            print(f"round {r} {'watched  ' if watched else 'unwatched'}: {row['output_tokens']} tokens in "
                  f"{row['seconds']:.2f} s = {row['tokens_per_s']:,.1f} tok/s, {row['steps_per_s']:.1f} steps/s{cost}")
        info = server.engine.info
    finally:
        server.stop()
    plain = [row["tokens_per_s"] for row in runs if not row["watched"]]
    seen = [row["tokens_per_s"] for row in runs if row["watched"]]
    ratios = [w / ((before + after) / 2) for w, before, after in zip(seen, plain, plain[1:])]
    ratio = statistics.median(ratios)
    shares = [row["snapshot_share"] for row in runs if row["snapshots"]]
    share = statistics.median(shares) if shares else None
    print(f"watched / unwatched output tokens/s: {ratio:.3f} (median of {', '.join(f'{x:.3f}' for x in ratios)})")
    if share is not None:
        print(f"snapshots took the engine core {100 * share:.3f}% of a watched run (median)")
    machine = {"host": host() | {"load_average_at_start": load_at_start}}
    if device == "cuda":
        machine |= gpu_machine()
    result = {"benchmark": "ui_overhead", "machine": machine, "model": args.model, "device": device,
              "engine": {key: info[key] for key in ("num_blocks", "max_num_seqs", "max_model_len", "max_num_batched_tokens")},
              "workload": {"num_seqs": args.num_seqs, "prompt_len": [args.min_len, args.max_input_len],
                           "output_len": [args.min_len, args.max_output_len], "seed": args.seed, "ignore_eos": True,
                           "rounds": args.rounds},
              "runs": runs, "ratios": ratios, "ratio_watched_over_unwatched": ratio,
              "snapshot_share_of_watched_run": share}
    write_result("ui_overhead", result, args.out)


if __name__ == "__main__":
    main()
