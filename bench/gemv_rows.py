"""Where gemv stops paying: a decode step of 1 to 64 rows, weights streamed by gemv (CUDA cores or tensor cores) or
multiplied by cuBLAS.

gemv (chapter 5) and the fused layer (chapter 8) read every weight once and multiply it by each of the step's
rows, kept in registers; cuBLAS tiles the rows onto tensor cores. At one row gemv wins by far; each extra row
adds 8 multiply-adds per 16-byte weight load on CUDA cores, so somewhere cuBLAS catches up. GEMV_DECODE_ROWS
(backend/constants.py) is that crossing, and this script measures it: the same paged decode step (synthetic
Llama-3.2-1B, 512-token context per sequence, one CUDA graph replay per step) at each batch of --rows, in
four modes, whatever GEMV_DECODE_ROWS and MMA_GEMV_ROWS say (the script sets them for each): the fused layer and
the unfused layer on gemv, for up to GEMV_MAX_ROWS rows (all the kernels take), the unfused layer on gemv_mma (the
tensor cores, chapter 8) for up to 64, and the unfused layer on cuBLAS.
Writes bench/results/gemv_rows-<time>.json.

    python bench/gemv_rows.py [--model DIR] [--context 512] [--steps 64] [--rows 1,2,4,8,...]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode import floor_ms, measure_machine, ms_per_step  # noqa: E402
from bench.gpu_common import write_result  # noqa: E402


def sweep(model, rows: list[int], context: int, steps: int, bandwidth: float) -> list[dict]:
    from tinyvllm.model import decode
    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.backend.constants import GEMV_DECODE_ROWS, GEMV_MAX_ROWS, MMA_GEMV_MAX_TILES, MMA_GEMV_ROWS
    out = []
    for batch in rows:
        row = {"batch": batch, "floor_ms": floor_ms(model, context, batch, bandwidth)}
        for mode, fused, gemv_rows, mma_rows in (("fused", True, GEMV_MAX_ROWS, 0), ("gemv", False, GEMV_MAX_ROWS, 0),
                                                 ("mma", False, 0, 8 * MMA_GEMV_MAX_TILES), ("cublas", False, 0, 0)):
            if batch > (gemv_rows or mma_rows or batch):
                continue   # past the kernels' rows every mode is cuBLAS's
            model.fused_decode = fused
            decode.GEMV_DECODE_ROWS = cuda_ops.GEMV_DECODE_ROWS = gemv_rows
            cuda_ops.MMA_GEMV_ROWS = mma_rows
            row[mode] = ms_per_step(model, batch, context, steps)[0]
        decode.GEMV_DECODE_ROWS = cuda_ops.GEMV_DECODE_ROWS = GEMV_DECODE_ROWS
        cuda_ops.MMA_GEMV_ROWS = MMA_GEMV_ROWS
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
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16,24,32,48,64", help="batch sizes, comma-separated")
    args = parser.parse_args(argv)
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.model import Model
    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    batches = [int(b) for b in args.rows.split(",")]
    model = Model(model_dir, device="cuda", max_num_batched_tokens=max(args.context, *batches))
    machine, bandwidth = measure_machine("cuda")
    rows = sweep(model, batches, args.context, args.steps, bandwidth)
    fastest = {r["batch"]: min((m for m in ("fused", "gemv", "mma", "cublas") if m in r), key=r.get) for r in rows}
    result = {"benchmark": "gemv_rows", "machine": machine, "model": str(model_dir), "context": args.context,
              "steps": args.steps, "copy_bandwidth_gb_s": bandwidth / 1e9, "rows": rows, "fastest": fastest}
    path = write_result("gemv_rows", result)
    print("fastest mode per batch:", fastest)
    return path


if __name__ == "__main__":
    main()
