"""gemv at 1 row, with other kernel constants, against cuBLAS on Llama 3.2 1B's five projection shapes: the weights
cycled past L2 and each launch timed as its share of a CUDA graph (bench/cublaslt_algos.py's harness). One kernel
alone: bench/step_constants.py then decides on the whole step (GEMV_LOADS 2 and 4 tie here on gate_up, and part by 4%
there).

    python bench/gemv_one_row.py OUT.json [NAME=VALUE ...]      (an NVIDIA GPU)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.kernel_bench import parse_defines, set_constants  # noqa: E402


def main(path: str, defines: dict[str, int]) -> None:
    print("constants:", set_constants(defines))    # before cuda_ops is imported
    import cupy as cp

    from bench.cublaslt_algos import SHAPES, STREAMED_BYTES, bf16_bits, graph_us
    from tinyvllm.model import gemm
    from tinyvllm.model.backend import cuda_ops
    rows = []
    for name, N, K in SHAPES:
        copies = max(2, -int(-STREAMED_BYTES // (N * K * 2)))
        weights, x = bf16_bits((copies, N, K)), bf16_bits((1, K))
        out = cp.empty((1, N), "float32" if name == "head" else "uint16")
        gemv_us = graph_us(lambda i: cuda_ops.gemv(x, weights[i], out), copies)
        cublas_us = graph_us(lambda i: gemm.gemm_cublas(x, weights[i], out), copies)
        rows.append({"shape": name, "gemv_us": gemv_us, "cublas_us": cublas_us, "gemv_gbs": N * K * 2 / gemv_us / 1e3})
        print(f"{name:8s} gemv {gemv_us:8.2f} us ({N * K * 2 / gemv_us / 1e3:5.0f} GB/s)  cublas {cublas_us:8.2f} us",
              flush=True)
        weights = None
        cp.get_default_memory_pool().free_all_blocks()
    Path(path).write_text(json.dumps({"defines": defines, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], parse_defines(sys.argv[2:]))
