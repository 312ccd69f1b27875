"""Does a long prompt make others wait? A short request's time to first token beside a long prompt.

    python bench/long_prefill.py [--device cpu|cuda] [--model DIR] [--long 4000] [--gap 1.0] [--rounds 5]
        [-- SERVE FLAGS]

Starts `tinyvllm serve` with its default flags (the path users run; flags after `--` are passed on), then
per round: a short request alone (its TTFT), then a decoding request, a long prompt --gap seconds later
(default 1 s; on a GPU, less than the long prefill takes), and the short request again --gap after that.
A step computes at most long_prefill_token_threshold tokens of one prompt, so the short one is admitted in
the step after it arrives instead of waiting for the whole prefill. Reported per round and as median and
spread: the short TTFT alone and beside, their ratio (target <= 2), the long prompt's TTFT, and the decoding
request's inter-token gaps (median and longest: target longest <= 2x median). Also the server's step time
against its chunk size, from a few prompts alone: what sizes the device's defaults.
Writes bench/results/long_prefill-<device>-<time>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import free_port, start_server, stop_server  # noqa: E402

SHORT = 40   # tokens of the short prompt: a chat turn


def stream_times(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """Send one streaming completion; returns (time to first token, gaps between the tokens) in seconds."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,   # no "model": the
            "ignore_eos": True}                                                              # one it serves
    start, arrivals = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    return arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])]


def in_thread(results: dict, key: str, *args) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.__setitem__(key, stream_times(*args)))
    thread.start()
    return thread


def one_round(url: str, rng: np.random.Generator, vocab: int, long: int, decode_tokens: int, gap: float) -> dict:
    """Fresh random prompts each round: nothing is a prefix-cache hit."""
    def prompt(n: int) -> list[int]:
        return rng.integers(100, vocab, n).tolist()
    alone, _ = stream_times(url, prompt(SHORT), 1)
    results: dict = {}
    decoding = in_thread(results, "decoding", url, prompt(SHORT), decode_tokens)
    time.sleep(gap)
    long_one = in_thread(results, "long", url, prompt(long), 1)
    time.sleep(gap)
    beside, _ = stream_times(url, prompt(SHORT), 1)
    long_one.join()
    decoding.join()
    gaps = results["decoding"][1]
    return {"short_ttft_alone_s": alone, "short_ttft_beside_s": beside, "ratio": beside / alone,
            "long_ttft_s": results["long"][0], "decode_gap_median_s": statistics.median(gaps),
            "decode_gap_max_s": max(gaps), "decode_gap_ratio": max(gaps) / statistics.median(gaps)}


def step_times(url: str, rng: np.random.Generator, vocab: int, sizes: list[int]) -> dict:
    """TTFT of one prompt of each size alone (its prefill is one step when it fits one): median of 3."""
    return {size: statistics.median(stream_times(url, rng.integers(100, vocab, size).tolist(), 1)[0]
                                    for _ in range(3)) for size in sizes}


def summary(rounds: list[dict]) -> dict:
    return {key: {"median": statistics.median(r[key] for r in rounds), "min": min(r[key] for r in rounds),
                  "max": max(r[key] for r in rounds)} for key in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="default", help="'default' or a model directory")
    parser.add_argument("--long", type=int, default=4000, help="tokens of the long prompt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gap", type=float, default=1.0,
                        help="seconds between the arrivals (shorter than the long prompt's prefill)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON here instead of bench/results/")
    parser.add_argument("serve_flags", nargs="*", help="after --: flags for `tinyvllm serve` (default: none)")
    args = parser.parse_args()
    from tinyvllm.formats.checkpoints import resolve_model
    from tinyvllm.formats.config import load_config
    vocab = load_config(resolve_model(args.model)).vocab_size
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tinyvllm", "serve", "--model", args.model, "--device", args.device,
               "--port", str(port), "--no-ui", *args.serve_flags]
    rng = np.random.default_rng(args.seed)
    decode_tokens = 60 if args.device == "cpu" else 400   # outlasts the long prompt's prefill
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        server = start_server(command, url, log)
        try:
            stream_times(url, rng.integers(100, vocab, args.long).tolist(), 1)   # warm up every kernel shape
            steps = step_times(url, rng, vocab, [1, 16, 64, 256])
            rounds = []
            for i in range(args.rounds):
                rounds.append(one_round(url, rng, vocab, args.long, decode_tokens, args.gap))
                r = rounds[-1]
                print(f"round {i + 1}: short TTFT alone {r['short_ttft_alone_s']:.3f} s, beside a {args.long}-token "
                      f"prompt {r['short_ttft_beside_s']:.3f} s ({r['ratio']:.2f}x); "
                      f"long TTFT {r['long_ttft_s']:.2f} s; "
                      f"decode gap median {r['decode_gap_median_s']:.3f} s, longest {r['decode_gap_max_s']:.3f} s "
                      f"({r['decode_gap_ratio']:.2f}x)", flush=True)
        finally:
            stop_server(server)
    for size, seconds in steps.items():
        print(f"a {size}-token prompt alone: first token in {seconds:.3f} s")
    result = {"benchmark": "long_prefill", "device": args.device, "model": args.model, "serve_command": command,
              "long_prompt": args.long, "short_prompt": SHORT, "gap_s": args.gap, "seed": args.seed,
              "cpu_cores": os.cpu_count(),
              "ttft_of_a_prompt_alone_s": steps, "rounds": rounds, "summary": summary(rounds)}
    if args.device == "cuda":
        from bench.gpu_common import machine
        result["machine"] = machine()
    from bench.gpu_common import write_result
    write_result(f"long_prefill-{args.device}", result, args.out)


if __name__ == "__main__":
    main()
