"""The prefill attention kernel's tile shapes, swept on the GPU (chapter 3): which shape the constants pick.

Every variant compiles kernels/prefill_attention.cu with other values of its launch constants (rows per warp,
query rows per block, keys per tile, K/V stages, blocks per SM), is checked against PyTorch's attention in
float32 on fresh random inputs (output poisoned with NaN first), and is timed on one layer of Llama 3.2 1B
(32 query heads, 8 K/V heads, head_dim 64): a whole prompt, and a chunk late in a long prompt through a block
table. PyTorch's own bf16 attention (scaled_dot_product_attention: what transformers calls) is timed on the
same inputs. Writes bench/results/attention_tiles-<time>.json.

    python bench/attention_tiles.py [--tokens 1024 4096] [--baseline OLD.cu]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_common import machine, time_gpu, write_result  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
# (rows per warp, query rows per block, keys per tile, K/V stages, blocks per SM): the first is the constants'
VARIANTS = [(16, 128, 64, 2, 2), (16, 64, 64, 2, 4), (32, 128, 64, 2, 1), (16, 256, 64, 2, 1)]


def compile_variant(source: str, shape: tuple[int, ...]):
    import cupy as cp

    from tinyvllm.model.backend.constants import KERNEL_CONSTANTS, prefill_smem
    from tinyvllm.model.backend.cuda_ops import KERNELS_DIR
    warp_rows, tile, key_tile, stages, blocks = shape
    constants = {**KERNEL_CONSTANTS, "PREFILL_WARP_ROWS": warp_rows, "PREFILL_TILE": tile,
                 "PREFILL_KEY_TILE": key_tile, "PREFILL_KV_STAGES": stages, "PREFILL_BLOCKS_PER_SM": blocks,
                 "PREFILL_THREADS": tile // warp_rows * 32}
    options = ("-std=c++17", f"-I{KERNELS_DIR}", *(f"-D{k}={v}" for k, v in constants.items()))
    module = cp.RawModule(code=source, options=options)
    smem = prefill_smem(HEAD_DIM, constants)  # the launcher's own formula, with this variant's tiles
    kernels = {}
    for name in ("prefill_attention", "chunk_attention"):
        k = module.get_function(f"{name}_d{HEAD_DIM}")
        k.max_dynamic_shared_size_bytes = smem
        kernels[name] = k
    return kernels, smem, tile, tile // warp_rows * 32


def bf16(x):
    """float32 CuPy array -> bf16 bits (round to nearest even)."""
    import cupy as cp
    bits = x.astype(cp.float32).view(cp.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cp.uint16)


def to_torch(bits):
    import torch
    return torch.as_tensor(bits.view(np.int16) if isinstance(bits, np.ndarray) else bits, device="cuda").view(
        torch.bfloat16)


def reference(q, k, v, start: int):
    """float32 causal GQA attention: query i at position start + i sees keys 0 .. start + i. q (T, H, D)."""
    import torch
    T, S = q.shape[0], k.shape[0]
    k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * HEAD_DIM ** -0.5
    visible = torch.arange(S, device="cuda")[None, :] <= start + torch.arange(T, device="cuda")[:, None]
    return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, -torch.inf).softmax(-1), v.float())


def run_variant(kernels, grid: tuple, threads: int, smem: int, qkv, pool, table, T: int, start: int) -> tuple:
    import cupy as cp
    out = cp.full((T, HEADS * HEAD_DIM), 0x7FC0, dtype=cp.uint16)  # NaN: every element must be written
    scale, stride = np.float32(HEAD_DIM ** -0.5), np.int32(qkv.shape[1])
    if start == 0:
        args = (qkv, out, np.int32(T), np.int32(HEADS), np.int32(KV_HEADS), stride, np.int32(out.shape[1]), scale)
        launch = lambda: kernels["prefill_attention"](grid, (threads,), args, shared_mem=smem)  # noqa: E731
    else:
        k_cache, v_cache = pool
        args = (qkv, k_cache, v_cache, table, np.int32(start), out, np.int32(T), np.int32(HEADS),
                np.int32(KV_HEADS), stride, np.int32(out.shape[1]), scale)
        launch = lambda: kernels["chunk_attention"](grid, (threads,), args, shared_mem=smem)  # noqa: E731
    launch()
    cp.cuda.Device().synchronize()
    return out, time_gpu(launch, repeats=20)


def main() -> None:
    import cupy as cp
    import torch

    from tinyvllm.model.step_plan import BLOCK_SIZE
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--chunk", type=int, nargs=2, default=[30720, 2048], metavar=("START", "TOKENS"),
                        help="a chunk of TOKENS queries after START tokens already in the pool")
    parser.add_argument("--baseline", type=Path, help="another prefill_attention.cu to time beside (an older one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from tinyvllm.model.backend.cuda_ops import KERNELS_DIR
    source = (KERNELS_DIR / "prefill_attention.cu").read_text()
    sources = [("current", source, v) for v in VARIANTS]
    if args.baseline:  # an older file: its own launch grid, (query tiles, heads)
        sources.insert(0, ("baseline", args.baseline.read_text(), (16, 128, 64, 2, 1)))
    print(f"seed {args.seed}")
    rng = cp.random.default_rng(args.seed)
    cases = [(T, 0) for T in args.tokens] + [(args.chunk[1], args.chunk[0])]
    rows = []
    for T, start in cases:
        S = start + T
        qkv = bf16(rng.standard_normal((T, (HEADS + 2 * KV_HEADS) * HEAD_DIM), dtype=cp.float32))
        # the prefix's keys and values, and the chunk's own (stored in the pool first, as the engine does)
        k_all = bf16(rng.standard_normal((S, KV_HEADS, HEAD_DIM), dtype=cp.float32))
        v_all = bf16(rng.standard_normal((S, KV_HEADS, HEAD_DIM), dtype=cp.float32))
        k_all[start:] = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].reshape(T, KV_HEADS, HEAD_DIM)
        v_all[start:] = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].reshape(T, KV_HEADS, HEAD_DIM)
        blocks = -(-S // BLOCK_SIZE)
        table = cp.asarray(np.random.default_rng(args.seed).permutation(blocks), dtype=cp.int32)  # scattered
        k_cache = cp.zeros((blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=cp.uint16)
        v_cache = cp.zeros_like(k_cache)
        slots = (table[cp.arange(S) // BLOCK_SIZE] * BLOCK_SIZE + cp.arange(S) % BLOCK_SIZE)
        k_cache[slots], v_cache[slots] = k_all, v_all
        q = to_torch(qkv[:, :HEADS * HEAD_DIM]).view(T, HEADS, HEAD_DIM)
        ref = reference(q, to_torch(k_all).view(S, KV_HEADS, HEAD_DIM), to_torch(v_all).view(S, KV_HEADS, HEAD_DIM),
                        start)
        # FLOPs of the visible (query, key) pairs, QK^T and PV: 4 * head_dim each
        pairs = T * start + T * (T + 1) / 2
        flop = 4 * HEAD_DIM * HEADS * pairs
        qt = to_torch(qkv[:, :HEADS * HEAD_DIM].copy()).view(T, HEADS, HEAD_DIM).transpose(0, 1)[None]
        kt, vt = (to_torch(x).view(S, KV_HEADS, HEAD_DIM).transpose(0, 1)[None] for x in (k_all, v_all))
        if start == 0:  # transformers either passes K/V heads to sdpa as they are, or repeats them (repeat_kv)
            gqa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qt, kt, vt, is_causal=True, enable_gqa=True)
            kr, vr = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (kt, vt))
            repeated = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qt, kr, vr, is_causal=True)
            torch_seconds = min(time_gpu(gqa, repeats=20), time_gpu(repeated, repeats=20))
            rows.append({"tokens": T, "start": start, "variant": "torch sdpa (bf16)", "seconds": torch_seconds,
                         "tflops": flop / torch_seconds / 1e12})
            print(f"T {T:6d} start {start:6d} torch sdpa                {torch_seconds * 1e3:8.3f} ms "
                  f"{flop / torch_seconds / 1e12:6.1f} TFLOP/s")
        for label, src, shape in sources:
            try:
                kernels, smem, tile, threads = compile_variant(src, shape)
            except Exception as e:  # a shape that does not compile (too many registers, too much shared memory)
                print(f"{label} {shape}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            grid = (-(-T // tile), HEADS) if label == "baseline" else (HEADS, -(-T // tile))
            out, seconds = run_variant(kernels, grid, threads, smem, qkv, (k_cache, v_cache), table, T, start)
            got = to_torch(out).view(T, HEADS, HEAD_DIM).float()
            error = float((got - ref).norm() / ref.norm()) if not torch.isnan(got).any() else float("nan")
            rows.append({"tokens": T, "start": start, "variant": label, "shape": shape, "seconds": seconds,
                         "tflops": flop / seconds / 1e12, "relative_error": error,
                         "registers": kernels["prefill_attention"].num_regs})
            print(f"T {T:6d} start {start:6d} {label:8s} {str(shape):18s} {seconds * 1e3:8.3f} ms "
                  f"{flop / seconds / 1e12:6.1f} TFLOP/s  err {error:.1e}  regs {rows[-1]['registers']}")
            assert error < 1e-2, f"{label} {shape}: relative error {error} (seed {args.seed})"
    write_result("attention_tiles", {"benchmark": "attention_tiles", "machine": machine(), "seed": args.seed,
                                            "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                            "shape_fields": ["warp_rows", "tile", "key_tile", "kv_stages",
                                                             "blocks_per_sm"], "results": rows})


if __name__ == "__main__":
    main()
