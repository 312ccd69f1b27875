"""CPU decode speed: tinyvllm's NumPy engine against HF transformers, same machine, weights and prompt.

    python bench/cpu_decode.py [--tokens 128] [--chunk 16]

Both engines decode greedily for exactly --tokens steps (no stop on EOS) after the same chat prompt,
in one process. Their decode loops take turns, --chunk steps at a time, so a neighbour that loads the
CPU for a while slows both, not one. Before each turn the script sleeps --settle seconds: the thread
pool that just worked (OpenBLAS's or torch's OpenMP one) spins on for a moment and would slow the other.
Decoding one token reads every weight once, so the floor per token is the weight bytes divided by the
copy bandwidth measured in the same run. Also records the peak memory of `python -m tinyvllm generate`.
Writes bench/results/cpu_decode-<date>-<time>.json; asserts nothing.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.utils import logging as hf_logging

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench.decode import weight_bytes_per_step  # noqa: E402
from tinyvllm.engine.block_manager import plan_decode, plan_prefill  # noqa: E402
from tinyvllm.entrypoints.llm import LLM  # noqa: E402
from tinyvllm.model.decode import decode_batch  # noqa: E402
from tinyvllm.model.op_timer import OpTimer, timed_ops  # noqa: E402
from tinyvllm.model.prefill import prefill_batch  # noqa: E402

PROMPT = "What is the capital of France?"
PREFILLS = 7  # timed prefill calls per engine, after one warm-up call each
TARGETS = {"ratio_max": 0.7, "floor_ratio_max": 1.2, "peak_rss_mb_max": 1500}  # decode vs transformers, vs the
# floor (weights / copy bandwidth); the CLI's memory


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    meminfo = Path("/proc/meminfo").read_text()
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return {
        "cpu": next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.startswith("model name")), "?"),
        "cores": os.cpu_count(),
        "ram_gb": round(int(meminfo.split()[1]) / 2**20, 1),  # MemTotal is in KiB
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numpy_blas": f"{blas['name']} {blas.get('version', '')}".strip(),
        "numpy_threads": os.environ.get("OPENBLAS_NUM_THREADS") or "default (one per core)",
        "thread_settings": {name: os.environ.get(name, "default") for name in
                            ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),  # other processes share the cores: read the numbers with it
    }


def source_version() -> dict:
    """The commit measured, and whether tinyvllm/ had uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD") or None,
            "tinyvllm_modified": bool(git("status", "--porcelain", "tinyvllm"))}


def copy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes read + written per second by one large np.copyto: what streaming memory can do here."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)  # both touched once before timing, so no page faults are timed
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * nbytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Tinyvllm:
    """What LLM.stream runs: the engine's prefill into the paged KV cache, then one decode step per token."""
    name = "tinyvllm"
    seq = 0  # the sequence id this benchmark uses in the LLM's pool

    def __init__(self, llm: LLM, ids: list[int], steps: int):
        self.llm, self.ids, self.steps = llm, ids, steps

    def prefill(self) -> int:
        blocks = self.llm.engine.scheduler.block_manager  # the engine's own books and pool: what a request would use
        if self.seq in blocks.lengths:  # each call starts a fresh sequence
            blocks.free(self.seq)
        step = plan_prefill(blocks, self.seq, self.ids)
        return int(np.argmax(prefill_batch(self.llm.model, self.llm.engine.pool, [step])[0]))

    def step(self, token: int) -> int:
        plan = plan_decode(self.llm.engine.scheduler.block_manager, [self.seq], [token])
        return int(np.argmax(decode_batch(self.llm.model, self.llm.engine.pool, plan)[0]))


class Transformers:
    name = "transformers"

    def __init__(self, model: LlamaForCausalLM, ids: list[int]):
        self.model, self.ids = model, torch.tensor([ids])
        # transformers 5.24 renamed past_key_values to cache; an unknown keyword would be silently ignored
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def prefill(self) -> int:
        self.cache = DynamicCache()
        # logits_to_keep=1: the last position's logits only, as tinyvllm's prefill computes
        out = self.model(self.ids, **{self.cache_arg: self.cache}, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    def step(self, token: int) -> int:
        out = self.model(torch.tensor([[token]]), **{self.cache_arg: self.cache}, use_cache=True)
        return int(out.logits[0, -1].argmax())


def run_interleaved(engines: list, steps: int, chunk: int, warmup: int, settle: float) -> dict[str, dict]:
    """Prefill each engine PREFILLS times, the engines taking turns call by call (timed: the median, after one
    warm-up call each, which pays for first touches — BLAS's threads, scratch buffers, pages of the KV pool never
    written), then decode `steps` tokens in alternating chunks; warm-up steps excluded."""
    prefill_s: dict[str, list[float]] = {e.name: [] for e in engines}
    for turn in range(PREFILLS + 1):
        for e in engines:
            time.sleep(settle)
            seconds = _timed(e.prefill)             # each call starts a fresh cache
            if turn:
                prefill_s[e.name].append(seconds)
    state = {e.name: {"prefill_ms": 1e3 * statistics.median(prefill_s[e.name]), "tokens": [e.prefill()],
                      "step_s": []} for e in engines}
    for begin in range(0, warmup + steps, chunk):
        for e in engines:
            s = state[e.name]
            time.sleep(settle)
            for _ in range(min(chunk, warmup + steps - begin)):
                start = time.perf_counter()
                s["tokens"].append(e.step(s["tokens"][-1]))
                s["step_s"].append(time.perf_counter() - start)
    results = {}
    for name, s in state.items():
        times = s["step_s"][warmup:]
        results[name] = {"prefill_ms": round(s["prefill_ms"], 2),
                         "decode_ms_per_token_median": round(1e3 * statistics.median(times), 2),
                         "decode_ms_per_token_mean": round(1e3 * statistics.mean(times), 2),
                         "decode_ms_per_token_min": round(1e3 * min(times), 2),
                         "tokens": s["tokens"]}
    return results


def op_profile(engine: Tinyvllm, token: int, steps: int = 40) -> dict[str, float]:
    """Where one tinyvllm decode step's time goes: ms per step in each backend op (op_timer), and the rest
    (planning, Python between the ops, the read-back); `steps` more tokens after the timed ones. The layer runs
    unfused here: on the CPU chapter 8's fused twins are these same ops in the same order, and apart they show
    the GEMMs (the floor's share) apart from everything else."""
    model = engine.llm.model
    model.fused_decode = False
    try:
        def decode():
            nonlocal token
            token = engine.step(token)
        return _ms_per_call_by_op(model, decode, steps)
    finally:
        del model.fused_decode                      # back to the class's default


def prefill_op_profile(engine: Tinyvllm, calls: int = 5) -> dict[str, float]:
    """The same for the prompt's prefill (each call a fresh sequence, as the timed ones): ms per prefill by op."""
    return _ms_per_call_by_op(engine.llm.model, engine.prefill, calls)


def _ms_per_call_by_op(model, fn, calls: int) -> dict[str, float]:
    with timed_ops(model) as timer:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        total = time.perf_counter() - start
    seconds = timer.totals()
    profile = {name: round(1e3 * s / calls, 3) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}
    profile["rest"] = round(1e3 * (total - sum(seconds.values())) / calls, 3)
    return profile


class _FirstCallRecorder(OpTimer):
    """An OpTimer that also keeps a copy of each op's first call (its function and arguments), to replay it warm."""

    def __init__(self, ops):
        super().__init__(ops)
        self.first_calls: dict[str, tuple] = {}

    def _timed(self, name, fn, args, kwargs):
        if name not in self.first_calls:
            self.first_calls[name] = (fn, copy.deepcopy(args), kwargs)   # copies: replaying must not touch the engine
        return super()._timed(name, fn, args, kwargs)


def op_us_in_step_and_warm(engine: Tinyvllm, token: int, steps: int = 20, repeats: int = 200) -> dict[str, dict]:
    """Each non-GEMM op's mean microseconds a call inside decode steps (unfused layer, as op_profile), and the same
    call (layer 0's, on copies of its arguments) repeated in a warm loop: the difference is what the weights
    streaming through the caches between two ops costs each call."""
    model = engine.llm.model
    model.fused_decode = False
    original = model.ops
    model.ops = recorder = _FirstCallRecorder(original)
    try:
        token = engine.step(token)                  # records the first calls; not timed
        recorder.calls.clear()
        for _ in range(steps):
            token = engine.step(token)
    finally:
        model.ops = original
        del model.fused_decode
    in_step: dict[str, list[float]] = {}
    for name, seconds in recorder.seconds():
        in_step.setdefault(name, []).append(seconds)
    table = {}
    for name, (fn, args, kwargs) in recorder.first_calls.items():
        if name in ("gemm", "embedding"):  # a GEMM costs its weights streaming by, which a warm loop would not do
            continue
        fn(*args, **kwargs)
        warm = [_timed(lambda: fn(*args, **kwargs)) for _ in range(repeats)]
        table[name] = {"in_step_us": round(1e6 * statistics.mean(in_step[name]), 1),
                       "warm_us": round(1e6 * statistics.mean(warm), 1)}
    return table


def peak_rss_of_generate(model: str) -> dict:
    """Peak resident memory of the CLI answering a short prompt, in its own process."""
    command = ["-m", "tinyvllm", "generate", PROMPT, "--max-tokens", "64", "--model", model]
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True)
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux reports KiB
    return {"command": shlex.join(["python", *command]), "returncode": proc.returncode,
            "peak_rss_mb": round(peak_kib / 1024, 1)}


def warn_if_busy(when: str) -> None:
    """A figure measured while other processes hold the cores is theirs as much as ours: say so."""
    load, cores = os.getloadavg()[0], os.cpu_count()
    if load > cores:
        print(f"warning: load average {load:.1f} on {cores} cores {when}: these timings include other work; "
              "measure on a quiet machine", file=sys.stderr)


def measure(args) -> dict:
    warn_if_busy("at the start")
    rss = peak_rss_of_generate(args.model)  # first: the only child, so RUSAGE_CHILDREN is its own peak
    report = {"benchmark": "cpu_decode", "machine": machine(), "source": source_version(), "peak_rss_generate": rss}
    bandwidth = copy_bandwidth()

    hf_logging.disable_progress_bar()
    llm = LLM(args.model, device="cpu")
    # Every timed prefill takes blocks never used before (the block manager hands them out in order), and the
    # pool is np.zeros: pages the OS maps at their first write, each then a page fault (~10 ms for a layer's K
    # and V on a 2-core VM). transformers' cache reuses memory it already touched; a server has touched its
    # pool after one pass. Written once here, both engines are timed in that steady state.
    llm.engine.pool.k.fill(0)
    llm.engine.pool.v.fill(0)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    hf = LlamaForCausalLM.from_pretrained(llm.model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    engines = [Tinyvllm(llm, ids, args.warmup + args.tokens), Transformers(hf, ids)]
    with torch.inference_mode():
        results = run_interleaved(engines, args.tokens, args.chunk, args.warmup, args.settle)
    time.sleep(args.settle)
    profile = op_profile(engines[0], results["tinyvllm"]["tokens"][-1])
    # before prefill_op_profile starts a fresh sequence: the same context as the decode profile's
    per_call = op_us_in_step_and_warm(engines[0], results["tinyvllm"]["tokens"][-1])
    prefill_profile = prefill_op_profile(engines[0])
    report["machine"]["load_average_at_end"] = os.getloadavg()
    warn_if_busy("at the end")

    cfg, weight_bytes = llm.model_config, weight_bytes_per_step(llm.model)
    floor_ms = 1e3 * weight_bytes / bandwidth
    for r in results.values():
        r["floor_over_median"] = round(floor_ms / r["decode_ms_per_token_median"], 3)  # 1.0 = at the limit
    ours, theirs = results["tinyvllm"], results["transformers"]
    ratio = ours["decode_ms_per_token_median"] / theirs["decode_ms_per_token_median"]
    context = len(ids) + args.warmup + args.tokens
    report.update({
        "workload": {"model": args.model, "model_dir": str(llm.model_dir), "prompt": PROMPT,
                     "chat_template": True, "prompt_tokens": len(ids), "generated_tokens": args.tokens,
                     "warmup_tokens": args.warmup, "chunk": args.chunk, "settle_s": args.settle,
                     "prefill_timing": f"median of {PREFILLS} calls per engine, taking turns call by call",
                     "greedy": True, "stop_on_eos": False, "dtype": "float32"},
        "tinyvllm_method": "as LLM.stream runs it: the engine's prefill into the paged KV cache, then per "
                           "token decode_step (NumPy backend); per-step wall time",
        "transformers_method": "manual greedy loop: LlamaForCausalLM(token, cache=DynamicCache()), eager "
                               "attention, torch.inference_mode, float32; per-step wall time",
        "tinyvllm": ours, "transformers": theirs,
        "tinyvllm_op_profile_ms_per_step": profile,
        "tinyvllm_prefill_op_profile_ms": prefill_profile,
        "tinyvllm_decode_op_us_per_call_in_step_and_warm": per_call,
        "ratio_tinyvllm_over_transformers": round(ratio, 3),
        "greedy_tokens_identical": f"{sum(a == b for a, b in zip(ours['tokens'], theirs['tokens']))}"
                                   f"/{len(ours['tokens'])}",
        "memory_floor": {"weight_bytes_per_decode_step": weight_bytes,
                         "kv_cache_bytes_read_at_last_step": 2 * cfg.num_hidden_layers * context * cfg.kv_size * 4,
                         "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
                         "floor_ms_per_token": round(floor_ms, 2)},
        "targets": {**TARGETS, "ratio_met": ratio <= TARGETS["ratio_max"],
                    "floor_met": ours["decode_ms_per_token_median"] <= TARGETS["floor_ratio_max"] * floor_ms,
                    "prefill_met": ours["prefill_ms"] <= theirs["prefill_ms"],
                    "peak_rss_met": rss["peak_rss_mb"] < TARGETS["peak_rss_mb_max"]},
    })
    return report


def summary(report: dict) -> str:
    m, w, floor = report["machine"], report["workload"], report["memory_floor"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, load average "
             f"{m['load_average_at_start'][0]:.1f} -> {m['load_average_at_end'][0]:.1f}",
             f"prompt {w['prompt_tokens']} tokens, {w['generated_tokens']} decode steps timed",
             "                 ms/token median   mean   prefill ms   floor/median"]
    for name in ("tinyvllm", "transformers"):
        r = report[name]
        lines.append(f"  {name:13s} {r['decode_ms_per_token_median']:13.1f} {r['decode_ms_per_token_mean']:7.1f}"
                     f" {r['prefill_ms']:11.1f} {r['floor_over_median']:12.2f}")
    rss = report["peak_rss_generate"]
    lines += [f"ratio tinyvllm / transformers: {report['ratio_tinyvllm_over_transformers']} "
              f"(target <= {TARGETS['ratio_max']})",
              f"floor: {floor['weight_bytes_per_decode_step'] / 1e6:.0f} MB of weights / "
              f"{floor['copy_bandwidth_gb_s']:.1f} GB/s copy = {floor['floor_ms_per_token']:.1f} ms/token",
              f"greedy tokens identical: {report['greedy_tokens_identical']}",
              "one tinyvllm decode step, ms per op: " + ", ".join(
                  f"{name} {ms:.2f}" for name, ms in report["tinyvllm_op_profile_ms_per_step"].items()),
              "one tinyvllm prefill of the prompt, ms per op: " + ", ".join(
                  f"{name} {ms:.2f}" for name, ms in report["tinyvllm_prefill_op_profile_ms"].items()),
              "a decode op's call, us in the step / warm: " + ", ".join(
                  f"{name} {t['in_step_us']:.0f} / {t['warm_us']:.0f}"
                  for name, t in report["tinyvllm_decode_op_us_per_call_in_step_and_warm"].items()),
              f"peak RSS of `{rss['command']}`: {rss['peak_rss_mb']} MB (target < {TARGETS['peak_rss_mb_max']})"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' or a HF-layout Llama directory")
    ap.add_argument("--tokens", type=int, default=128, help="decode steps timed per engine")
    ap.add_argument("--chunk", type=int, default=16, help="steps per engine before switching to the other")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps run first and not timed")
    ap.add_argument("--settle", type=float, default=0.3, help="seconds of sleep before each turn")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    report = measure(args)
    print(summary(report))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cpu_decode-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
