"""Chapter 2: one allocation, many named views — the layout shared by weights and activation buffers.

A GPU allocation is slow and fragments memory, so the engine makes one blob for all weights and one
for all activation buffers, each sized for the largest step up front and reused by every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.formats.config import LlamaConfig

ALIGN = 256  # bytes: cuBLAS and vector loads want every array to start on an aligned address


@dataclass(frozen=True)
class Region:
    name: str
    shape: tuple[int, ...]
    dtype: str       # "bf16" or "f32"
    offset: int      # bytes from the start of the blob
    nbytes: int


ITEMSIZE = {"bf16": 2, "f32": 4}


def lay_out(arrays: list[tuple[str, tuple[int, ...], str]]) -> list[Region]:
    """Place (name, shape, dtype) arrays back to back, each start rounded up to ALIGN bytes."""
    regions, offset = [], 0
    for name, shape, dtype in arrays:
        nbytes = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        regions.append(Region(name, tuple(shape), dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return regions


def blob_size(regions: list[Region]) -> int:
    """Bytes the blob needs: up to the end of the last region (padding included)."""
    return regions[-1].offset + regions[-1].nbytes if regions else 0


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 blob whose first byte sits on an ALIGN-byte address.

    cudaMalloc hands out 256-byte-aligned memory; NumPy promises only 16 bytes, so we allocate
    ALIGN bytes more and start at the first aligned address: aligned offsets are then aligned addresses.
    """
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes]


def carve(blob, regions: list[Region]) -> dict:
    """Named views into a 1-D uint8 blob (NumPy or CuPy): bf16 as uint16 bits, f32 as float32."""
    np_dtype = {"bf16": np.uint16, "f32": np.float32}
    return {r.name: blob[r.offset:r.offset + r.nbytes].view(np_dtype[r.dtype]).reshape(r.shape)
            for r in regions}


def plan_buffers(cfg: LlamaConfig, step_tokens: int, dtype: str) -> list[Region]:
    """Every activation buffer of one step of up to `step_tokens` tokens: one row per token.

    The logits are not among them: they are the step's result, which the caller keeps (to sample, to
    compare) while the next step reuses these buffers, so each step returns them in a new array."""
    h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
    return lay_out([
        ("residual", (step_tokens, h), "f32"),              # x, carried from layer to layer: fp32 so 2 adds
                                                           # per layer do not each round to bf16
        ("normed", (step_tokens, h), dtype),                # RMSNorm(x): input of the next GEMM
        ("qkv", (step_tokens, qkv), dtype),                 # Q, K, V side by side: one GEMM writes all three
        ("attn_out", (step_tokens, cfg.q_size), dtype),
        ("delta", (step_tokens, h), dtype),                 # o_proj / down_proj output, added to the residual
        ("gate_up", (step_tokens, 2 * cfg.intermediate_size), dtype),  # gate and up: one GEMM
        ("mlp_act", (step_tokens, cfg.intermediate_size), dtype),
    ])
