"""Same request, same answer? Greedy outputs of a few prompts alone and inside a batch, in the default
mode and with LLM(batch_invariant=True): where the first differing token appears, and what the mode costs.

For each mode: --prompts prompts of random token ids (seeded), each run alone for --max-tokens greedy
tokens (ignore_eos), then all of them again inside one batch of --batch requests (the rest random prompts
of the same lengths' range, the targets at random rows); per prompt, the index of the first token that
differs (None: all the same), the seconds each pass took, and the batch-1 decode time per token of the
prompts alone (median and range over them: the mode's cost where it should cost least). Chapter 7's figure reads the result file
(chapters/ch07_batching/invariance_figure.py).

    python bench/batch_invariance.py [--model DIR] [--device auto] [--prompts 6] [--batch 64] [--max-tokens 48]
        [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from bench.gpu_common import machine, thread_settings, write_result  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def run_mode(model_dir: str, device: str, invariant: bool, prompts: list[list[int]], targets: list[int],
             max_tokens: int) -> dict:
    from tinyvllm import LLM, SamplingParams
    llm = LLM(model_dir, device=device, max_num_seqs=len(prompts), enable_prefix_caching=False,
              batch_invariant=invariant)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params)   # warm-up: kernels compiled before the clock starts
    start = time.perf_counter()
    alone_outputs = [llm.generate([prompts[t]], params)[0] for t in targets]
    alone_s = time.perf_counter() - start
    alone = [o.outputs[0].token_ids for o in alone_outputs]
    tpot = sorted(o.timings["time_per_output_token_s"] for o in alone_outputs)
    start = time.perf_counter()
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    batch_s = time.perf_counter() - start
    firsts = [first_difference(a, together[t]) for a, t in zip(alone, targets)]
    same = sum(f is None for f in firsts)
    print(f"{'batch-invariant' if invariant else 'default':>15}: {same} of {len(targets)} prompts keep their "
          f"{max_tokens} tokens; first differences at {[f for f in firsts if f is not None]}; alone "
          f"{alone_s:.2f} s, the batch {batch_s:.2f} s; batch-1 decode {1e3 * statistics.median(tpot):.2f} ms/token "
          f"({1e3 * tpot[0]:.2f}-{1e3 * tpot[-1]:.2f})")
    return {"first_difference": firsts, "same": same, "alone_seconds": alone_s, "batch_seconds": batch_s,
            "batch1_s_per_token": {"median": statistics.median(tpot), "min": tpot[0], "max": tpot[-1],
                                   "all": tpot}}


def host(device: str) -> dict:
    """The GPU's record on cuda; on the CPU the cores and NumPy's BLAS (library, version, kernel family, threads)."""
    if device == "cuda":
        return machine()
    try:
        from threadpoolctl import threadpool_info
        blas = [{k: lib.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
                for lib in threadpool_info() if lib["user_api"] == "blas"]
    except ImportError:
        blas = "threadpoolctl not installed"
    return {"cpu_cores": os.cpu_count(), "numpy": np.__version__, "blas": blas, "threads": thread_settings(),
            "load_average_at_start": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model directory (default: a synthetic Llama 3.2 1B)")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args()
    from tinyvllm.formats.checkpoints import resolve_model, synth_model
    from tinyvllm.model.backend import resolve_device
    device = resolve_device(args.device)
    model_dir = str(resolve_model(args.model) if args.model else synth_model("llama-3.2-1b",
                                                                             Path(tempfile.mkdtemp()) / "llama"))
    rng = np.random.default_rng(args.seed)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = [rng.integers(0, vocab, int(rng.integers(20, 200))).tolist() for _ in range(args.batch)]
    targets = sorted(rng.choice(args.batch, args.prompts, replace=False).tolist())
    modes = {name: run_mode(model_dir, device, invariant, prompts, targets, args.max_tokens)
             for name, invariant in (("default", False), ("batch_invariant", True))}
    result = {"benchmark": "batch_invariance", "model": model_dir, "device": device, "machine": host(device),
              "command": " ".join(["python", "bench/batch_invariance.py", *sys.argv[1:]]),
              "workload": {"prompts": args.prompts, "batch": args.batch, "max_tokens": args.max_tokens,
                           "seed": args.seed, "targets": targets}, "modes": modes,
              "batch1_cost": modes["batch_invariant"]["batch1_s_per_token"]["median"]
              / modes["default"]["batch1_s_per_token"]["median"]}
    print(f"the mode's batch-1 decode costs {result['batch1_cost']:.2f}x the default's")
    write_result(f"batch_invariance-{device}", result, args.out)


if __name__ == "__main__":
    main()
