"""Chapter 2: `python -m tinyvllm info` — the config and the memory map of weights and buffers (and, from
chapter 6, the KV cache pool)."""
from __future__ import annotations

from dataclasses import asdict

from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.formats.config import load_config
from tinyvllm.model.buffers import Region, blob_size, plan_buffers
from tinyvllm.model.kv_pool import CPU_KV_CACHE_BYTES, bytes_per_block
from tinyvllm.model.step_plan import BLOCK_SIZE
from tinyvllm.model.weights import open_checkpoint, plan_weights, weight_kind


def describe(model: str, device: str, step_tokens: int, num_blocks: int | None = None) -> tuple[dict, str]:
    """The memory map a run on `device` would use: (JSON-able report, human-readable text)."""
    model_dir = resolve_model(model)
    cfg = load_config(model_dir)
    open_checkpoint(model_dir, cfg)  # validate the files, so info also answers "is my checkpoint ok?"
    dtype = "bf16" if device == "cuda" else "f32"
    weights, buffers = plan_weights(cfg, dtype), plan_buffers(cfg, step_tokens, dtype)
    by_kind = bytes_by_kind(weights)
    report = {"model_dir": str(model_dir), "device": device, "config": asdict(cfg),
              "weights": [asdict(r) for r in weights], "buffers": [asdict(r) for r in buffers],
              "weights_by_kind": by_kind, "weights_bytes": blob_size(weights),
              "buffers_bytes": blob_size(buffers), "total_bytes": blob_size(weights) + blob_size(buffers),
              "kv_cache": kv_cache_plan(cfg, device, num_blocks)}
    lines = [f"model  {model_dir}", *(f"  {k:<24} {v}" for k, v in asdict(cfg).items()),
             f"\nweights: one {dtype} blob of {_mib(blob_size(weights))} "
             f"({', '.join(f'{k} {_mib(v)}' for k, v in by_kind.items())})",
             *_table(weights), f"\nbuffers for a step of {step_tokens} tokens: one blob of "
             f"{_mib(blob_size(buffers))}", *_table(buffers),
             f"\ntotal {_mib(report['total_bytes'])}", _pool_line(report["kv_cache"])]
    return report, "\n".join(lines)


def bytes_by_kind(regions: list[Region]) -> dict[str, int]:
    """Weight bytes per kind (embedding, attention, mlp, norm), in the order they first appear."""
    totals: dict[str, int] = {}
    for r in regions:
        totals[weight_kind(r.name)] = totals.get(weight_kind(r.name), 0) + r.nbytes
    return totals


def _table(regions: list[Region]) -> list[str]:
    rows = [f"  {'offset':>12}  {'bytes':>12}  {'dtype':<5} {'shape':<16} name"]
    rows += [f"  {r.offset:>12,}  {r.nbytes:>12,}  {r.dtype:<5} {str(list(r.shape)):<16} {r.name}" for r in regions]
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def kv_cache_plan(cfg, device: str, num_blocks: int | None) -> dict:
    """The paged KV cache pool (chapter 6): blocks, bytes per block, tokens it holds."""
    per_block = bytes_per_block(cfg, 2 if device == "cuda" else 4)
    if num_blocks is None and device == "cpu":
        num_blocks = CPU_KV_CACHE_BYTES // per_block
    plan = {"block_size": BLOCK_SIZE, "bytes_per_block": per_block, "bytes_per_token": per_block // BLOCK_SIZE,
            "num_blocks": num_blocks}
    if num_blocks is not None:
        plan.update(pool_bytes=num_blocks * per_block, tokens=num_blocks * BLOCK_SIZE)
    return plan


def _pool_line(plan: dict) -> str:
    head = (f"kv cache: blocks of {plan['block_size']} tokens, {_mib(plan['bytes_per_block'])} per block "
            f"({plan['bytes_per_token']:,} bytes per token)")
    if plan["num_blocks"] is None:
        return head + "; the pool is sized at run time: gpu_memory_utilization x GPU memory, minus the above"
    return head + f"; {plan['num_blocks']:,} blocks = {_mib(plan['pool_bytes'])}, {plan['tokens']:,} tokens"
