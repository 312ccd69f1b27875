"""The decode step with other kernel constants, in one process, the values taking turns: which value of a -D constant
makes the step the engine runs faster. bench/kernel_bench.py --define times one kernel alone, and a kernel alone can
mislead: GEMV_LOADS 2 and 4 tie on gate_up's gemv yet part by 4% on the whole batch-1 step (chapter 8).

Each round sets each --define in turn (kernel_bench.set_constants: the kernels recompile with it) and times
bench/decode.py's ms_per_step for every --batches size, with the unfused layer and with the engine's choice of layer
(CUDA graphs on a GPU; decode_batch on the CPU); --rounds rounds, the median and every round's figure. Different
processes of the same code can differ by several percent on a GPU, which is why the values share one process.
Writes bench/results/step_constants-<time>.json (or --out).

    python bench/step_constants.py --define GEMV_LOADS=4 --define GEMV_LOADS=2 [--model DIR] [--batches 1]
        [--context 512] [--steps 64] [--rounds 3] [--device cuda|cpu] [--out PATH]
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
from bench.kernel_bench import parse_defines, set_constants  # noqa: E402
from tinyvllm.errors import TinyVLLMError  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="bench/step_constants.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--define", action="append", required=True, metavar="NAME=VALUE[,NAME=VALUE]",
                        help="one setting of the constants (give two or more); commas join constants set together")
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batches", default="1", help="batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the JSON here instead of bench/results/")
    args = parser.parse_args(argv)
    try:
        settings = {item: parse_defines(item.split(",")) for item in args.define}   # a mistake: one line, exit 2
    except TinyVLLMError as e:
        parser.exit(2, f"error: {e}\n")
    batches = [int(b) for b in args.batches.split(",")]
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.model import Model
    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    model = Model(model_dir, device=args.device, max_num_batched_tokens=max(args.context, *batches))
    machine, bandwidth = measure_machine(args.device)
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, defines in settings.items():
            set_constants(defines)
            for batch in batches:
                for layer in ("unfused", None):
                    key = f"{name}, batch {batch}, {layer or 'engine'}"
                    runs.setdefault(key, []).append(ms_per_step(model, batch, args.context, args.steps, layer)[0])
    rows = {}
    for key, ms in runs.items():
        batch = int(key.split("batch ")[1].split(",")[0])
        floor = floor_ms(model, args.context, batch, bandwidth)
        rows[key] = {"ms_per_step": statistics.median(ms), "runs": ms, "ratio_to_floor": statistics.median(ms) / floor}
        print(f"{key:<40} {rows[key]['ms_per_step']:.3f} ms ({rows[key]['ratio_to_floor']:.2f}x the floor); "
              f"rounds {', '.join(f'{m:.3f}' for m in ms)}")
    return write_result("step_constants", {"benchmark": "step_constants", "machine": machine, "model": str(model_dir),
                                           "device": args.device, "context": args.context, "steps": args.steps,
                                           "copy_bandwidth_gb_s": bandwidth / 1e9, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
