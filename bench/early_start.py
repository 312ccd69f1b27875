"""Chapter 8's early start (programmatic dependent launch): the graph-replayed decode step with gemv launched early
and launched the usual way, alternating in one process.

A gemv launched early starts while the kernel before it (a norm, attention, SwiGLU) still runs, asks L2 for its
weight rows, then waits for that kernel's output (kernels/gemv.cu, cuda_ops.launch_early). Each round captures the
batch-1 step's graph both ways (the unfused layer, the one gemv runs in, and the engine's own choice), then times
--steps replays of each (bench/decode.py's ms_per_step); --rounds rounds, the median and every round's figure, and
the floor measured in the same run. Writes bench/results/early_start-<time>.json.

    python bench/early_start.py [--model DIR] [--context 512] [--steps 64] [--rounds 3]   (an NVIDIA GPU, Hopper+)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import floor_ms, measure_machine, ms_per_step  # noqa: E402
from bench.gpu_common import write_result  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.model import Model
    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    model = Model(model_dir, device="cuda", max_num_batched_tokens=args.context)
    machine, bandwidth = measure_machine("cuda")
    floor = floor_ms(model, args.context, 1, bandwidth)
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for early in (True, False):
            cuda_ops.GEMV_EARLY_START = early
            for layer in ("unfused", None):
                key = f"{layer or 'engine'}, {'early' if early else 'usual'}"
                runs.setdefault(key, []).append(ms_per_step(model, 1, args.context, args.steps, layer=layer)[0])
    rows = {key: {"ms_per_token": statistics.median(ms), "runs": ms, "ratio_to_floor": statistics.median(ms) / floor}
            for key, ms in runs.items()}
    for key, row in rows.items():
        print(f"{key:<18} {row['ms_per_token']:.3f} ms ({row['ratio_to_floor']:.2f}x the floor {floor:.3f}); "
              f"rounds {', '.join(f'{m:.3f}' for m in row['runs'])}")
    return write_result("early_start", {"benchmark": "early_start", "machine": machine, "model": str(model_dir),
                                        "context": args.context, "steps": args.steps, "floor_ms": floor,
                                        "copy_bandwidth_gb_s": bandwidth / 1e9, "rows": rows})


if __name__ == "__main__":
    main()
