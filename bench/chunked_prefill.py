"""What chunked prefill buys: the running sequences' inter-token latency while a long prompt arrives.

    python bench/chunked_prefill.py [--model DIR] [--device cuda] [--decoders 32] [--long 32000] [--chunk 2048]

32 sequences decode; then a 32,000-token prompt arrives. Unchunked (a step budget that holds the whole
prompt), its prefill is one step and every running sequence waits for it; chunked (a budget of 2,048
tokens), each step computes the 32 decode tokens and a 2,016-token chunk. Reported per mode: the running
sequences' inter-token latency (p50, p99, max) from the long prompt's arrival until its first token, the
long prompt's time to first token, and the number of steps its prefill took. Default model: a synthetic
Llama 3.2 1B (random weights, the real shapes). Also: prompt tokens per second of a 4,096-token prompt in
one step, and of a 32,768-token prompt in chunks. Writes bench/results/chunked_prefill-<time>.json.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(model_dir: str, device: str, decoders: int, long: int, budget: int, seed: int = 0) -> dict:
    from tinyvllm import LLM, SamplingParams
    llm = LLM(model_dir, device=device, max_model_len=long + 1024, max_num_batched_tokens=budget,
              long_prefill_token_threshold=budget, enable_prefix_caching=False, max_num_seqs=decoders + 1,
              gpu_memory_utilization=0.8)   # the budget alone sets the chunk: no long-prefill cap
    engine, rng = llm.engine, np.random.default_rng(seed)
    vocab = llm.model_config.vocab_size
    llm.generate([rng.integers(0, vocab, 64).tolist()] * 2, SamplingParams(temperature=0, max_tokens=4))  # warm up
    keep = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)   # outlasts the long prefill
    running = [engine.add_request(rng.integers(0, vocab, 128).tolist(), keep) for _ in range(decoders)]
    while not all(s.output_ids for s in running):      # every decoder past its prefill
        engine.step()
    for _ in range(5):                                 # steady decoding (graphs captured)
        engine.step()
    long_seq = engine.add_request(rng.integers(0, vocab, long).tolist(), SamplingParams(temperature=0, max_tokens=1))
    arrival, first_step = time.perf_counter(), engine.steps
    gaps, last = [], {id(s): arrival for s in running}
    while long_seq.first_token_time is None:
        seen = {id(s): len(s.output_ids) for s in running}
        engine.step()
        now = time.perf_counter()
        for s in running:                              # a sequence that got a token: the gap since its last
            if len(s.output_ids) > seen[id(s)]:
                gaps.append(now - last[id(s)])
                last[id(s)] = now
    ttft = long_seq.first_token_time - arrival
    steps = engine.steps - first_step
    for s in running:
        engine.abort(s)
    llm.close()
    gaps_ms = np.array(gaps) * 1e3
    return {"budget": budget, "long_prompt_ttft_s": ttft, "steps_until_first_token": steps,
            "decoder_itl_ms": {"p50": float(np.percentile(gaps_ms, 50)), "p99": float(np.percentile(gaps_ms, 99)),
                               "max": float(gaps_ms.max()), "count": int(len(gaps_ms))}}


def prefill_rate(model_dir: str, device: str, length: int, budget: int, seed: int = 1) -> dict:
    """Prompt tokens per second of one `length`-token prompt prefilled in chunks of `budget` (its first token)."""
    from tinyvllm import LLM, SamplingParams
    rng, one = np.random.default_rng(seed), SamplingParams(temperature=0, max_tokens=1)
    with LLM(model_dir, device=device, max_model_len=length + 16, max_num_batched_tokens=budget,
             long_prefill_token_threshold=budget, enable_prefix_caching=False, gpu_memory_utilization=0.8) as llm:
        vocab = llm.model_config.vocab_size
        llm.generate([rng.integers(0, vocab, min(length, budget)).tolist()], one)   # warm up (kernels compile)
        best = float("inf")
        for _ in range(3):
            prompt = rng.integers(0, vocab, length).tolist()
            start = time.perf_counter()
            llm.generate([prompt], one)
            best = min(best, time.perf_counter() - start)
    return {"prompt": length, "budget": budget, "seconds": best, "tokens_per_s": length / best}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--decoders", type=int, default=32)
    parser.add_argument("--long", type=int, default=32_000)
    parser.add_argument("--chunk", type=int, default=2048)
    args = parser.parse_args()
    from tinyvllm.formats.checkpoints import synth_model
    model_dir = args.model or str(synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama"))
    unchunked = -(-(args.long + args.decoders) // 16) * 16   # one step holds the whole prompt and the decodes
    rows = {}
    for name, budget in (("chunked", args.chunk), ("unchunked", unchunked)):
        rows[name] = run(model_dir, args.device, args.decoders, args.long, budget)
        r = rows[name]
        print(f"{name:9s} budget {budget:6d}: long prompt TTFT {r['long_prompt_ttft_s']:.3f} s in "
              f"{r['steps_until_first_token']} steps; decoders' ITL p50 {r['decoder_itl_ms']['p50']:.1f} ms, "
              f"p99 {r['decoder_itl_ms']['p99']:.1f} ms, max {r['decoder_itl_ms']['max']:.1f} ms")
    rates = [prefill_rate(model_dir, args.device, 4096, 4096), prefill_rate(model_dir, args.device, 8 * 4096, args.chunk)]
    for r in rates:
        print(f"prefill of {r['prompt']} tokens in chunks of {r['budget']}: {r['tokens_per_s']:,.0f} tokens/s")
    print(f"  per-token rate, chunked long prompt / 4096-token prompt: {rates[1]['tokens_per_s'] / rates[0]['tokens_per_s']:.2f}")
    result = {"benchmark": "chunked_prefill", "model": model_dir, "device": args.device, "prefill_rates": rates,
              "workload": {"decoders": args.decoders, "decoder_prompt": 128, "long_prompt": args.long,
                           "chunk_budget": args.chunk},
              "results": rows}
    if args.device == "cuda":
        from bench.gpu_common import machine, write_result
        result["machine"] = machine()
        write_result("chunked_prefill", result)


if __name__ == "__main__":
    main()
