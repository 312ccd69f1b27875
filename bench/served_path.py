"""Batch-1 decode as the engine serves it (LLM.generate, default flags) against the CUDA graph replay alone.

bench/decode.py times the graph of a decode step; a user waits for the whole engine step around it: the
scheduler, the step's inputs copied and the replay queued (runner.launch), the wait for the GPU with the
sampling and the read-back of the token (runner.finish), the bookkeeping. This runs a 512-token prompt
for 256 greedy tokens, five times, with each phase timed per call (median), and replays the bucket-1 graph
alone; it also prints the engine's measured choice of layer per graph bucket (chapter 8). Twice: with async
scheduling (the default: the next step is planned and launched while this one runs, engine.py) and without.
Writes bench/results/served_path-<time>.json.

    python bench/served_path.py [--model DIR]   (default: a synthetic Llama-3.2-1B)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_common import machine, write_result  # noqa: E402

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
    import cupy as cp

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
    graph, stream, replays = runner.graphs.graphs[1], runner.graphs.stream, []
    for _ in range(50):
        start = stream.record()
        graph.launch(stream)
        end = stream.record()
        end.synchronize()
        replays.append(cp.cuda.get_elapsed_time(start, end))
    result = {"async_scheduling": ahead, "llm_ms_per_token_runs": runs,
              "llm_ms_per_token_median": statistics.median(runs),
              "graph_replay_ms_median": statistics.median(replays),
              "per_call_us_median": {k: 1e6 * statistics.median(v) for k, v in times.items()},
              "layer_timings_ms_per_bucket": {str(k): v for k, v in runner.graphs.timings.items()}}
    result["served_over_graph"] = result["llm_ms_per_token_median"] / result["graph_replay_ms_median"]
    llm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    args = parser.parse_args()
    from tinyvllm.formats.checkpoints import synth_model
    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    modes = [served(model_dir, ahead) for ahead in (True, False)]
    for mode in modes:
        gap = mode["llm_ms_per_token_median"] - mode["graph_replay_ms_median"]
        print(f"async scheduling {'on ' if mode['async_scheduling'] else 'off'}: served "
              f"{mode['llm_ms_per_token_median']:.3f} ms/token (runs "
              f"{', '.join(f'{r:.3f}' for r in mode['llm_ms_per_token_runs'])}); graph replay "
              f"{mode['graph_replay_ms_median']:.3f} ms; gap {gap:.3f} ms ({mode['served_over_graph']:.3f}x)")
        for key, us in mode["per_call_us_median"].items():
            print(f"    {key:<10} {us:8.1f} us per call")
    write_result("served_path", {"benchmark": "served_path", "machine": machine(), "model": str(model_dir),
                                 "modes": modes})


if __name__ == "__main__":
    main()
