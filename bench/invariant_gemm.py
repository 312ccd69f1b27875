"""The batch-invariant GEMM (chapter 7, kernels/gemm_invariant.cu) against cuBLAS, on the model's shapes.

For each number of rows T (a decode batch, or a prefill step's tokens) and each projection of Llama 3.2 1B
(qkv, o, gate_up, down, and the LM head up to 256 rows): the time of cuBLAS (gemm_cublas, the default mode above
one row), of the default mode's gemm (gemv at one row), and of gemm_invariant with every candidate block tile —
CUDA events, median of --repeat launches queued back to back (behind op_timer.hold_gpu). Every tile's output is
compared bit for bit with the first one's (the kernel's claim: the tile changes which elements a block computes,
never an element's sum) and with cuBLAS's within bf16 rounding. Then per T: the tile the engine uses
(constants.INVARIANT_GEMM_TILES), the fastest tile, and the rate of each against cuBLAS, for a whole layer
(qkv + o + gate_up + down). The engine's tile table comes from this run.

--ablate: what holds the kernel back instead. Three copies of kernels/gemm_invariant.cu compiled side by side —
as it is, without its tensor-core work (the cp.async pipeline alone), without its refills (the products on
whatever the shared tiles hold) — timed over 20 back-to-back launches on decode shapes (1 and 256 rows) and prefill ones
(8,192 rows); if the whole equals the sum of its parts, the copies and the products do not overlap.

    python bench/invariant_gemm.py [--rows 1,8,16,32,64,128,256,1024,4096,8192] [--repeat 20] [--ablate]

Writes bench/results/invariant_gemm-<time>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_common import machine, time_gpu, write_result  # noqa: E402
from tinyvllm.model.backend.constants import GemmTile, INVARIANT_GEMM_TILES, invariant_gemm_tile  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}  # (N, K) of Llama 3.2 1B
LAYER = ("qkv", "o", "gate_up", "down")
LM_HEAD_MAX_ROWS = 256  # prefill computes logits for each sequence's last token only
CANDIDATES = tuple(dict.fromkeys([tile for _, tile in INVARIANT_GEMM_TILES] + [
    GemmTile(1, 1, 1, 1, 256, 6), GemmTile(1, 2, 1, 1, 256, 6), GemmTile(1, 2, 1, 1, 128, 8),
    GemmTile(1, 4, 1, 1, 256, 4), GemmTile(1, 4, 2, 1, 128, 4), GemmTile(2, 4, 2, 2, 64, 4),
    GemmTile(2, 4, 4, 2, 32, 4), GemmTile(4, 2, 2, 4, 32, 4), GemmTile(2, 4, 4, 4, 64, 3)]))


def name(tile: GemmTile) -> str:
    return f"{tile.rows}x{tile.cols} {tile.warps_m}x{tile.warps_n} warps bk{tile.bk} s{tile.stages}"


def bf16_random(shape: tuple[int, int], rng: np.random.Generator, scale: float = 1.0):
    import cupy as cp
    bits = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32) >> 16
    return cp.asarray(bits.astype(np.uint16))


def measure(T: int, shape: str, rng: np.random.Generator, repeat: int) -> dict:
    import cupy as cp

    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.gemm import gemm_cublas
    N, K = SHAPES[shape]
    x, w = bf16_random((T, K), rng), bf16_random((N, K), rng, K ** -0.5)
    out = cp.empty((T, N), np.uint16)
    row = {"T": T, "shape": shape, "N": N, "K": K,
           "cublas_ms": 1e3 * time_gpu(lambda: gemm_cublas(x, w, out), repeat, queued=True),
           "default_ms": 1e3 * time_gpu(lambda: cuda_ops.gemm(x, w, out), repeat, queued=True)}
    reference = cp.asnumpy(out).astype(np.uint32) << 16   # the default mode's result, as float32 bits
    first, tiles = None, {}
    for tile in CANDIDATES:
        if tile.smem > 227 * 1024:
            continue
        out.fill(0x7FC0)   # NaN: an element the kernel forgets to write fails the comparison
        cuda_ops.gemm_invariant_tiled(x, w, out, tile)
        got = cp.asnumpy(out)
        first = got if first is None else first
        err = (got.astype(np.uint32) << 16).view(np.float32) - reference.view(np.float32)
        tiles[name(tile)] = {"ms": 1e3 * time_gpu(lambda: cuda_ops.gemm_invariant_tiled(x, w, out, tile), repeat,
                                                  queued=True),
                             "same_bits_as_first_tile": bool(np.array_equal(got, first)),
                             "max_abs_diff_from_cublas": float(np.nanmax(np.abs(err))) if np.isfinite(err).all()
                             else float("nan")}
    row["tiles"] = tiles
    row["engine_tile"] = name(invariant_gemm_tile(T))
    row["fastest_tile"] = min(tiles, key=lambda k: tiles[k]["ms"])
    return row


def summarize(rows: list[dict]) -> list[dict]:
    """Per T, a whole layer (LAYER's four products): cuBLAS, the engine's tile, the fastest tile per shape."""
    summary = []
    for T in sorted({r["T"] for r in rows}):
        layer = [r for r in rows if r["T"] == T and r["shape"] in LAYER]
        cublas = sum(r["cublas_ms"] for r in layer)
        engine = sum(r["tiles"][r["engine_tile"]]["ms"] for r in layer)
        fastest = sum(r["tiles"][r["fastest_tile"]]["ms"] for r in layer)
        summary.append({"T": T, "layer_cublas_ms": cublas, "layer_default_ms": sum(r["default_ms"] for r in layer),
                        "layer_engine_tile_ms": engine, "layer_fastest_tiles_ms": fastest,
                        "engine_rate_of_cublas": cublas / engine, "fastest_rate_of_cublas": cublas / fastest})
    return summary


ABLATIONS = {"whole": ("", ""),
             "copies only": ("        compute_stage(s % STAGES, s * BK);",
                             "        if (K < 0) compute_stage(s % STAGES, s * BK);"),
             "products only": ("        if (next < steps) load_stage(next % STAGES, next * BK);",
                               "        if (next < steps && K < 0) load_stage(next % STAGES, next * BK);")}
SMALL, MID, LARGE = GemmTile(1, 4, 1, 1, 128, 4), GemmTile(2, 4, 2, 2, 64, 4), GemmTile(2, 4, 4, 4, 32, 3)
ABLATION_CASES = ((SMALL, 1, 2048, 8192), (SMALL, 1, 16384, 2048), (MID, 256, 16384, 2048), (LARGE, 256, 16384, 2048),
                  (LARGE, 8192, 16384, 2048), (LARGE, 8192, 3072, 2048))  # (tile, T, N, K)


def ablate() -> list[dict]:
    """Microseconds per launch of each ABLATIONS copy of the kernel on each ABLATION_CASES shape (K < 0 never holds:
    the branch it guards is compiled but never taken)."""
    import cupy as cp

    from tinyvllm.model.backend.cuda_ops import KERNELS_DIR, NVRTC_OPTIONS
    source = (KERNELS_DIR / "gemm_invariant.cu").read_text()
    rows = []
    for label, (old, new) in ABLATIONS.items():
        assert old in source, f"{label}: the line it edits is gone from gemm_invariant.cu"
        for tile, T, N, K in ABLATION_CASES:
            name = (f"gemm_invariant<{tile.warps_m}, {tile.warps_n}, {tile.tm}, {tile.tn}, {tile.bk}, {tile.row_stride}, "
                    f"{tile.stages}, false>")
            kernel = cp.RawModule(code=source.replace(old, new), options=NVRTC_OPTIONS,
                                  name_expressions=(name,)).get_function(name)
            kernel.max_dynamic_shared_size_bytes = tile.smem
            x = cp.random.randint(0, 2**14, (T, K), dtype=cp.int32).astype(cp.uint16)
            w = cp.random.randint(0, 2**14, (N, K), dtype=cp.int32).astype(cp.uint16)
            out = cp.empty((T, N), cp.uint16)
            launch = (((-(-N // tile.cols), -(-T // tile.rows)), (tile.threads,),
                       (x, w, out, np.int32(T), np.int32(K), np.int32(N), np.int32(N))), {"shared_mem": tile.smem})
            seconds = time_gpu(lambda: [kernel(*launch[0], **launch[1]) for _ in range(20)], 5, 1) / 20
            rows.append({"variant": label, "tile": name, "T": T, "N": N, "K": K, "us": seconds * 1e6,
                         "tflop_s": 2 * T * N * K / seconds / 1e12, "weight_gb_s": 2 * N * K / seconds / 1e9})
            print(f"{label:>13}, T {T} N {N} K {K}: {seconds * 1e6:8.1f} us, {rows[-1]['tflop_s']:6.1f} TFLOP/s, "
                  f"weights at {rows[-1]['weight_gb_s']:7.1f} GB/s")
    return rows


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128,256,1024,4096,8192")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--ablate", action="store_true", help="time the kernel without its copies, its products")
    args = parser.parse_args(argv)
    if args.ablate:
        return write_result("invariant_gemm_ablation", {"benchmark": "invariant_gemm_ablation", "machine": machine(),
                                                         "rows": ablate()})
    rng = np.random.default_rng(0)
    rows = []
    for T in (int(t) for t in args.rows.split(",")):
        for shape in SHAPES:
            if shape == "lm_head" and T > LM_HEAD_MAX_ROWS:
                continue
            row = measure(T, shape, rng, args.repeat)
            rows.append(row)
            fastest = row["tiles"][row["fastest_tile"]]
            print(f"T {T:5d} {shape:8s} cuBLAS {row['cublas_ms']:.4f} ms, default {row['default_ms']:.4f}, engine tile "
                  f"{row['tiles'][row['engine_tile']]['ms']:.4f} ({row['engine_tile']}), fastest {fastest['ms']:.4f} "
                  f"({row['fastest_tile']}); same bits in every tile: "
                  f"{all(t['same_bits_as_first_tile'] for t in row['tiles'].values())}")
    summary = summarize(rows)
    for s in summary:
        print(f"T {s['T']:5d} layer: cuBLAS {s['layer_cublas_ms']:.4f} ms, engine tiles {s['layer_engine_tile_ms']:.4f} "
              f"({s['engine_rate_of_cublas']:.2f} of cuBLAS's rate), fastest tiles {s['layer_fastest_tiles_ms']:.4f} "
              f"({s['fastest_rate_of_cublas']:.2f})")
    return write_result("invariant_gemm", {"benchmark": "invariant_gemm", "machine": machine(),
                                           "candidates": [name(t) for t in CANDIDATES], "rows": rows,
                                           "summary": summary})


if __name__ == "__main__":
    main()
