"""What a served batch-1 step runs on the GPU besides the CUDA graph replay, each part timed on the GPU alone.

With async scheduling (chapter 7) the host's work hides behind the GPU's, so what separates the served step from
the graph replay is GPU work: the inputs' copies, the feed of the step before's tokens, the draw (argmax) and the
tokens' copy back, and the hand-offs between the replay's stream and the current one. Each part is queued behind
a graph replay, so the GPU is busy when it is launched and the host's launch cost does not count; median of 100
(50 for the replays). The served chain is the whole hand-off as a step runs it.
Writes bench/results/served_step_parts-<time>.json.

    python bench/served_step_parts.py   (a synthetic Llama-3.2-1B; needs a GPU)
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_common import machine, write_result  # noqa: E402


def main() -> None:
    import cupy as cp

    from tinyvllm import LLM, SamplingParams
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.sampler import argmax_rows
    model_dir = synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    llm = LLM(str(model_dir), device="cuda")
    llm.generate([list(range(100, 612))], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    g = llm.engine.runner.graphs
    logits = g.logits[:1]

    def t(fn, stream=None, n=100):
        """GPU time alone: the stream is kept busy by a graph replay queued first."""
        s = stream or cp.cuda.get_current_stream()
        ts = []
        for _ in range(n):
            g.graphs[1].launch(s)
            a = s.record()
            fn()
            b = s.record()
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) * 1000)
        return statistics.median(ts)
    tok = argmax_rows(logits)
    res = {"argmax_axis1_us": t(lambda: logits.argmax(axis=1)), "argmax_1d_us": t(lambda: logits[0].argmax()),
           "argmax_rows_us": t(lambda: argmax_rows(logits)),
           "host_copy_us": t(lambda: cuda_ops.HostCopy(tok)), "empty_us": t(lambda: None)}
    with g.stream:
        res["upload_us"] = t(lambda: g._upload(1, 48), g.stream)
        res["feed_kernel_us"] = t(lambda: g.feed_kernel(g.fed[:1], tok, g.ids[:1]), g.stream)
        res["replay_us"] = t(lambda: g.graphs[1].launch(g.stream), g.stream, 50)
        res["two_replays_us"] = t(lambda: (g.graphs[1].launch(g.stream), g.graphs[1].launch(g.stream)), g.stream, 50)
        res["upload_feed_replay_us"] = t(lambda: (g._upload(1, 48), g.feed_kernel(g.fed[:1], tok, g.ids[:1]),
                                                  g.graphs[1].launch(g.stream)), g.stream, 50)

    def served_chain():   # the replay on its stream, the draw and the copy on the current one, two event waits
        current = cp.cuda.get_current_stream()
        g.stream.wait_event(current.record())
        with g.stream:
            g._upload(1, 48)
            g.feed_kernel(g.fed[:1], tok, g.ids[:1])
            g.graphs[1].launch(g.stream)
        current.wait_event(g.stream.record())
        cuda_ops.HostCopy(argmax_rows(logits))
    res["served_chain_us"] = t(served_chain, None, 50)
    for key, us in res.items():
        print(f"    {key:<24} {us:9.1f} us")
    write_result("served_step_parts", {"benchmark": "served_step_parts", "machine": machine(), "model": str(model_dir),
                                       "gpu_us": res})


if __name__ == "__main__":
    main()
