"""Prefill speed on the GPU: a synthetic Llama-3.2-1B checkpoint, prompts of 128, 1024 and 4096 tokens.

Reports tokens/s and achieved TFLOP/s against the bf16 GEMM rate measured in the same run, a
per-kernel time table (where the time goes), and HF transformers (bf16, its default attention) on the
same weights and prompts. Writes bench/results/prefill-<time>.json.

    python bench/prefill.py [--model DIR] [--lengths 128 1024 4096]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_common import bf16_gemm_rate, copy_bandwidth, machine, time_gpu, write_result  # noqa: E402


def flops(cfg, T: int) -> float:
    """GEMM flops (2 per multiply-add) over every layer + the causal attention's QK^T and PV."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    per_token = 2 * cfg.num_hidden_layers * (h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h)
    attention = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * T * (T + 1) / 2
    return per_token * T + attention + 2 * h * cfg.vocab_size  # + the last position's lm_head


def hf_prefill_seconds(model_dir: Path, lengths: list[int]) -> dict[int, float]:
    import torch
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).cuda().eval()
    out = {}
    for T in lengths:
        ids = torch.randint(0, hf.config.vocab_size, (1, T), device="cuda", generator=None)
        with torch.no_grad():
            out[T] = time_gpu(lambda: hf(ids, logits_to_keep=1), repeats=5)
    del hf
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Llama checkpoint dir (default: a synthetic Llama-3.2-1B)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    args = parser.parse_args()
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.model import Model
    from tinyvllm.model.op_timer import timed_ops
    from tinyvllm.model.prefill import prefill

    model_dir = Path(args.model) if args.model else synth_model("llama-3.2-1b", Path(tempfile.mkdtemp()) / "llama")
    model = Model(model_dir, device="cuda", max_num_batched_tokens=max(args.lengths))
    peak_flops, bandwidth = bf16_gemm_rate(), copy_bandwidth()
    rows, rng = [], np.random.default_rng(0)
    for T in args.lengths:
        ids = rng.integers(0, model.cfg.vocab_size, T).tolist()
        seconds = time_gpu(lambda: prefill(model, ids), repeats=5)
        with timed_ops(model) as timer:
            prefill(model, ids)
        kernels = timer.totals()
        achieved = flops(model.cfg, T) / seconds
        rows.append({"tokens": T, "seconds": seconds, "tokens_per_s": T / seconds, "tflops": achieved / 1e12,
                     "fraction_of_gemm_rate": achieved / peak_flops,
                     "kernel_seconds": {k: round(v, 6) for k, v in kernels.items()},
                     "host_and_gaps_seconds": seconds - sum(kernels.values())})
        print(f"T={T:5d}: {seconds * 1e3:8.2f} ms  {T / seconds:10.0f} tok/s  {achieved / 1e12:6.1f} TFLOP/s "
              f"({achieved / peak_flops:.0%} of the measured bf16 GEMM rate)")
        for k, v in rows[-1]["kernel_seconds"].items():
            print(f"    {k:<18} {v * 1e3:8.3f} ms  {v / seconds:6.1%}")
    hf = hf_prefill_seconds(model_dir, args.lengths)
    for row in rows:
        row["hf_seconds"] = hf[row["tokens"]]
        row["speedup_vs_hf"] = hf[row["tokens"]] / row["seconds"]
        print(f"T={row['tokens']:5d}: transformers {row['hf_seconds'] * 1e3:8.2f} ms -> tinyvllm is "
              f"{row['speedup_vs_hf']:.2f}x")
    result = {"benchmark": "prefill", "machine": machine(), "model": str(model_dir), "config": vars(model.cfg),
              "bf16_gemm_tflops_measured": peak_flops / 1e12, "copy_bandwidth_gb_s": bandwidth / 1e9,
              "results": rows}
    write_result("prefill", result)


if __name__ == "__main__":
    main()
