"""Where gemv stops paying: a decode step of 1 to 16 rows, weights streamed by gemv or multiplied by cuBLAS.

gemv (chapter 5) and the fused layer (chapter 8) read every weight once and multiply it by each of the step's
rows, kept in registers; cuBLAS tiles the rows onto tensor cores. At one row gemv wins by far; each extra row
adds 8 multiply-adds per 16-byte weight load on CUDA cores, so somewhere cuBLAS catches up. GEMV_DECODE_ROWS
(backend/constants.py) is that crossing, and this script measures it: the same paged decode step (synthetic
Llama-3.2-1B, 512-token context per sequence, one CUDA graph replay per step) at every batch of 1 to 16 rows in
three modes, whatever GEMV_DECODE_ROWS says (the script sets it for each): the fused layer and the unfused layer
on gemv, for up to GEMV_MAX_ROWS rows (all the kernels take), and the unfused layer on cuBLAS.
Writes bench/results/gemv_rows-<time>.json.

    python bench/gemv_rows.py [--model DIR] [--context 512] [--steps 64] [--max-rows 16]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import floor_ms, measure_machine, ms_per_step  # noqa: E402
from bench.gpu_common import write_result  # noqa: E402


def sweep(model, rows: range, context: int, steps: int, bandwidth: float) -> list[dict]:
    from tinyvllm.model import decode
    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.backend.constants import GEMV_DECODE_ROWS, GEMV_MAX_ROWS
    out = []
    for batch in rows:
        row = {"batch": batch, "floor_ms": floor_ms(model, context, batch, bandwidth)}
        for mode, fused, gemv_rows in (("fused", True, GEMV_MAX_ROWS), ("gemv", False, GEMV_MAX_ROWS),
                                       ("cublas", False, 0)):
            if gemv_rows and batch > GEMV_MAX_ROWS:
                continue   # past the kernels' rows every mode is cuBLAS's
            model.fused_decode = fused
            decode.GEMV_DECODE_ROWS = cuda_ops.GEMV_DECODE_ROWS = gemv_rows
            row[mode] = ms_per_step(model, batch, context, steps)[0]
        decode.GEMV_DECODE_ROWS = cuda_ops.GEMV_DECODE_ROWS = GEMV_DECODE_ROWS
        model.fused_decode = True
        print(row, flush=True)
        out.append(row)
        model.ops.free_cached_memory()
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--max-rows", type=int, default=16)
    args = parser.parse_args(argv)
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.model import Model
    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    model = Model(model_dir, device="cuda", max_num_batched_tokens=max(args.context, args.max_rows))
    machine, bandwidth = measure_machine("cuda")
    rows = sweep(model, range(1, args.max_rows + 1), args.context, args.steps, bandwidth)
    fastest = {r["batch"]: min((m for m in ("fused", "gemv", "cublas") if m in r), key=r.get) for r in rows}
    result = {"benchmark": "gemv_rows", "machine": machine, "model": str(model_dir), "context": args.context,
              "steps": args.steps, "copy_bandwidth_gb_s": bandwidth / 1e9, "rows": rows, "fastest": fastest}
    path = write_result("gemv_rows", result)
    print("fastest mode per batch:", fastest)
    return path


if __name__ == "__main__":
    main()
