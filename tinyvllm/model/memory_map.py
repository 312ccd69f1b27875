"""Chapters 2 and 6: the memory map the engine allocates — the weight blob in the engine's own layout (Q/K/V
and gate/up fused, in execution order), the step buffers, and the KV cache pool — for `info` to print.

The same planning functions the model and the pool call, so what `info` shows is what a run allocates.
"""
from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.formats.config import LlamaConfig
from tinyvllm.model.buffers import Region, blob_size, plan_buffers
from tinyvllm.model.kv_pool import CPU_KV_CACHE_BYTES, bytes_per_block
from tinyvllm.model.model import engine_weight_sources, plan_engine_weights
from tinyvllm.model.step_plan import BLOCK_SIZE
from tinyvllm.model.weights import weight_kind

DTYPES = {"cpu": "f32", "cuda": "bf16"}   # what each device's weights and buffers hold


@dataclass
class MemoryMap:
    weights: list[Region]                # the weight blob, engine layout
    sources: dict[str, list[str]]        # engine weight -> the HF tensors stacked into it, by rows
    buffers: list[Region]                # the step buffers, for step_tokens rows
    kv_cache: dict                       # the paged pool: block size, bytes per block, blocks (None: sized at run time)

    @property
    def weights_bytes(self) -> int:
        return blob_size(self.weights)

    @property
    def buffers_bytes(self) -> int:
        return blob_size(self.buffers)

    def bytes_by_kind(self) -> dict[str, int]:
        return bytes_by_kind(self.weights, self.sources)


def bytes_by_kind(regions: list[Region], sources: dict[str, list[str]] | None = None) -> dict[str, int]:
    """Weight bytes per kind (embedding, attention, mlp, norm), in the order they first appear. Regions named
    as HF tensors (chapter 2's plan), or as the engine's weights with their sources."""
    totals: dict[str, int] = {}
    for r in regions:
        kind = weight_kind(sources[r.name][0] if sources else r.name)
        totals[kind] = totals.get(kind, 0) + r.nbytes
    return totals


def memory_map(cfg: LlamaConfig, device: str, step_tokens: int, num_blocks: int | None = None) -> MemoryMap:
    """What a run on `device` with step buffers of step_tokens rows allocates. num_blocks None: the CPU's
    pool is CPU_KV_CACHE_BYTES; a GPU's is sized at run time from the memory left."""
    dtype = DTYPES[device]
    per_block = bytes_per_block(cfg, 2 if dtype == "bf16" else 4)
    if num_blocks is None and device == "cpu":
        num_blocks = CPU_KV_CACHE_BYTES // per_block
    kv = {"block_size": BLOCK_SIZE, "bytes_per_block": per_block, "bytes_per_token": per_block // BLOCK_SIZE,
          "num_blocks": num_blocks}
    if num_blocks is not None:
        kv.update(pool_bytes=num_blocks * per_block, tokens=num_blocks * BLOCK_SIZE)
    return MemoryMap(plan_engine_weights(cfg, dtype), engine_weight_sources(cfg),
                     plan_buffers(cfg, step_tokens, dtype), kv)
