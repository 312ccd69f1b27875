"""Batch-1 decode as the engine serves it (LLM.generate, default flags) against the CUDA graph replay alone.

bench/decode.py times the graph of a decode step; a user waits for the whole engine step around it: the
scheduler, the step's inputs copied and the replay queued (runner.launch), the wait for the GPU with the
sampling and the read-back of the token (runner.finish), the bookkeeping. This runs a 512-token prompt
for 256 greedy tokens, five times, with each phase timed per call (median), and replays the bucket-1 graph
alone; it also prints the engine's measured choice of layer per graph bucket (chapter 8). Twice: with async
scheduling (the default: the next step is planned and launched while this one runs, engine.py) and without.
Then, with the default flags, batches of 1, 8 and 64 (--batches): that many different 512-token prompts generating
256 tokens each, the median of the engine's decode steps (each `engine.step` call's wall time) against the
step's floor (every weight once, each sequence's K/V at the run's mean context, 640 tokens, at the copy bandwidth
measured in the same run) and the bucket's graph replayed alone.
Writes bench/results/served_path-<time>.json.

    python bench/served_path.py [--model DIR] [--batches 1,8,64]   (default: a synthetic Llama-3.2-1B)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import kv_bytes_per_step, weight_bytes_per_step  # noqa: E402
from bench.gpu_common import copy_bandwidth, machine, write_result  # noqa: E402

TOKENS, CONTEXT, RUNS = 256, 512, 5


def timed(obj, name: str, key: str, times: dict) -> None:
    """Wrap obj.name so each call's wall time lands in times[key]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        times.setdefault(key, []).append(time.perf_counter() - start)
        return result
    setattr(obj, name, wrapper)


def served(model_dir: Path, ahead: bool) -> dict:
    """ms per token of LLM.generate at batch 1 (RUNS runs), with async scheduling on or off, each phase timed per call,
    and the bucket-1 graph replayed alone."""
    from tinyvllm import LLM, SamplingParams
    llm = LLM(str(model_dir), device="cuda", async_scheduling=ahead)
    engine, runner = llm.engine, llm.engine.runner
    prompt, params = list(range(100, 100 + CONTEXT)), SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)           # warm-up: the bucket-1 graphs captured and timed
    times: dict[str, list[float]] = {}
    for obj, name in ((engine.scheduler, "schedule"), (runner, "launch"), (runner, "finish"), (engine, "step")):
        timed(obj, name, name, times)
    runs = []
    for _ in range(RUNS):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        runs.append(1e3 * (time.perf_counter() - start) / TOKENS)
    result = {"async_scheduling": ahead, "llm_ms_per_token_runs": runs,
              "llm_ms_per_token_median": statistics.median(runs),
              "graph_replay_ms_median": replay_ms(runner, 1),
              "per_call_us_median": {k: 1e6 * statistics.median(v) for k, v in times.items()},
              "layer_timings_ms_per_bucket": {str(k): v for k, v in runner.graphs.timings.items()}}
    result["served_over_graph"] = result["llm_ms_per_token_median"] / result["graph_replay_ms_median"]
    llm.close()
    return result


def replay_ms(runner, bucket: int) -> float:
    """Median GPU time of the bucket's decode graph replayed alone, 50 times, on the engine's stream."""
    import cupy as cp
    graph, stream, replays = runner.graphs.graphs[bucket], runner.graphs.stream, []
    for _ in range(50):
        start = stream.record()
        graph.launch(stream)
        end = stream.record()
        end.synchronize()
        replays.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(replays)


def served_batches(model_dir: Path, batches: list[int], bandwidth: float) -> list[dict]:
    """Per batch: `batch` different prompts through LLM.generate with default flags, RUNS runs; the median decode step
    (engine.step wall time: the prefill steps are a handful of the ~TOKENS steps, so the median is a decode step)
    against the floor at the run's mean context and the bucket's graph replayed alone."""
    from tinyvllm import LLM, SamplingParams
    llm = LLM(str(model_dir), device="cuda")
    engine, runner, rows = llm.engine, llm.engine.runner, []
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    mean_context = CONTEXT + TOKENS // 2
    for batch in batches:
        prompts = [list(range(100 + 1000 * i, 100 + 1000 * i + CONTEXT)) for i in range(batch)]  # no shared prefix
        llm.generate(prompts, params, use_tqdm=False)         # warm-up: the bucket's graphs captured and timed
        times: dict[str, list[float]] = {}
        runs = []
        timed(engine, "step", "step", times)
        for _ in range(RUNS):
            times.clear()
            llm.generate(prompts, params, use_tqdm=False)
            runs.append(1e3 * statistics.median(times["step"]))
        del engine.step                                       # the class's own method again
        floor = 1e3 * (weight_bytes_per_step(llm.model) + batch * kv_bytes_per_step(llm.model_config, mean_context))
        floor /= bandwidth
        bucket = next(b for b in runner.graphs.buckets if b >= batch)
        step = statistics.median(runs)
        rows.append({"batch": batch, "step_ms_runs": runs, "step_ms_median": step, "floor_ms": floor,
                     "ratio_to_floor": step / floor, "graph_bucket": bucket,
                     "graph_replay_ms_median": replay_ms(runner, bucket)})
        print(f"batch {batch:3d} served: decode step {step:.3f} ms (runs {', '.join(f'{r:.3f}' for r in runs)}), "
              f"floor {floor:.3f} ms -> {step / floor:.2f}x; "
              f"graph {bucket} alone {rows[-1]['graph_replay_ms_median']:.3f} ms")
    llm.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--batches", default="1,8,64", help="batch sizes for the served decode step (default 1,8,64)")
    args = parser.parse_args()
    from tinyvllm.formats.checkpoints import synth_model
    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    bandwidth = copy_bandwidth()   # first, as decode.py does: measured after the engines it read 14% low on an H100
    modes = [served(model_dir, ahead) for ahead in (True, False)]
    for mode in modes:
        gap = mode["llm_ms_per_token_median"] - mode["graph_replay_ms_median"]
        print(f"async scheduling {'on ' if mode['async_scheduling'] else 'off'}: served "
              f"{mode['llm_ms_per_token_median']:.3f} ms/token (runs "
              f"{', '.join(f'{r:.3f}' for r in mode['llm_ms_per_token_runs'])}); graph replay "
              f"{mode['graph_replay_ms_median']:.3f} ms; gap {gap:.3f} ms ({mode['served_over_graph']:.3f}x)")
        for key, us in mode["per_call_us_median"].items():
            print(f"    {key:<10} {us:8.1f} us per call")
    batches = served_batches(model_dir, [int(b) for b in args.batches.split(",") if b], bandwidth)
    write_result("served_path", {"benchmark": "served_path", "machine": machine(), "model": str(model_dir),
                                 "copy_bandwidth_gb_s": bandwidth / 1e9, "modes": modes, "batches": batches})


if __name__ == "__main__":
    main()
