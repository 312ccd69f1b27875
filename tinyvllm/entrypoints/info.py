"""Chapter 2: `python -m tinyvllm info` — the config and the memory map a run allocates: the weights in the
engine's layout, the step buffers (and, from chapter 6, the KV cache pool)."""
from __future__ import annotations

from dataclasses import asdict

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.formats.config import load_config
from tinyvllm.model.memory_map import DTYPES, memory_map
from tinyvllm.model.weights import open_checkpoint


def describe(model: str, device: str, step_tokens: int | None = None,
             num_blocks: int | None = None) -> tuple[dict, str]:
    """The memory map a run on `device` would allocate (step_tokens None: the engine's default step size):
    (JSON-able report, human-readable text)."""
    model_dir = resolve_model(model)
    cfg = load_config(model_dir)
    open_checkpoint(model_dir, cfg)  # validate the files, so info also answers "is my checkpoint ok?"
    step_tokens = EngineConfig(max_num_batched_tokens=step_tokens).step_tokens(device, cfg)
    plan = memory_map(cfg, device, step_tokens, num_blocks)
    by_kind = plan.bytes_by_kind()
    report = {"model_dir": str(model_dir), "device": device, "config": asdict(cfg),
              "weights": [{**asdict(r), "sources": plan.sources[r.name]} for r in plan.weights],
              "buffers": [asdict(r) for r in plan.buffers], "step_tokens": step_tokens,
              "weights_by_kind": by_kind, "weights_bytes": plan.weights_bytes,
              "buffers_bytes": plan.buffers_bytes, "total_bytes": plan.weights_bytes + plan.buffers_bytes,
              "kv_cache": plan.kv_cache}
    lines = [f"model  {model_dir}", *(f"  {k:<24} {v}" for k, v in asdict(cfg).items()),
             f"\nweights: one {DTYPES[device]} blob of {_mib(plan.weights_bytes)} "
             f"({', '.join(f'{k} {_mib(v)}' for k, v in by_kind.items())}); fused rows come from the "
             "checkpoint's tensors in the order listed",
             *_table(report["weights"]), f"\nbuffers for a step of {step_tokens} tokens: one blob of "
             f"{_mib(plan.buffers_bytes)}", *_table(report["buffers"]),
             f"\ntotal {_mib(report['total_bytes'])}", _pool_line(plan.kv_cache)]
    return report, "\n".join(lines)


def _table(regions: list[dict]) -> list[str]:
    rows = [f"  {'offset':>12}  {'bytes':>12}  {'dtype':<5} {'shape':<16} name"]
    for r in regions:
        sources = f"  <- {', '.join(s.rsplit('.', 2)[-2] for s in r['sources'])}" if "sources" in r else ""
        rows.append(f"  {r['offset']:>12,}  {r['nbytes']:>12,}  {r['dtype']:<5} {str(list(r['shape'])):<16} "
                    f"{r['name']}{sources}")
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _pool_line(plan: dict) -> str:
    head = (f"kv cache: blocks of {plan['block_size']} tokens, {_mib(plan['bytes_per_block'])} per block "
            f"({plan['bytes_per_token']:,} bytes per token)")
    if plan["num_blocks"] is None:
        return head + "; the pool is sized at run time: gpu_memory_utilization x GPU memory, minus the above"
    return head + f"; {plan['num_blocks']:,} blocks = {_mib(plan['pool_bytes'])}, {plan['tokens']:,} tokens"
