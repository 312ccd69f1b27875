"""Chapters 5 and 6: the KV pools — where every layer's K and V live between steps.

Decode produces one token per step, and its attention needs the K and V of every earlier token.
Recomputing them costs a whole prefill per token; keeping them costs memory:

    2 (K and V) x layers x kv_heads x head_dim x bytes  per token
    = 2 x 16 x 8 x 64 x 2 = 32 KiB per token for Llama 3.2 1B in bf16

Both pools hold, per layer, a flat list of token *slots*: (layers, slots, kv_heads, head_dim). The
kernels only ever see slot numbers (store_kv writes token t to slots[t]); the pools differ in how a
sequence's slots are found again:
  - ContiguousKVCache (chapter 5): sequence s owns slots s * max_len onwards, in a row. It hands out its
    own slots, since chapter 5 has no scheduler yet.
  - PagedKVPool (chapter 6): 16-token blocks, found through each sequence's block table. The scheduler's
    block manager (tinyvllm/engine/) decides who holds which block; the pool is only the memory.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.config import LlamaConfig
from tinyvllm.model.step_plan import BLOCK_SIZE, SeqStep

CPU_KV_CACHE_BYTES = 2**30  # 1 GiB: ~23,000 tokens of SmolLM2-135M in float32


class KVPool:
    """K and V of every layer: (layers, num_slots, kv_heads, head_dim) each, on the model's device."""

    def __init__(self, cfg: LlamaConfig, ops, num_slots: int, what: str, fix: str):
        """what names the pool and fix the setting that shrinks it, for the error when it cannot fit."""
        self.ops = ops
        shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_dim)
        check_memory(2 * math.prod(shape) * np.dtype(ops.DTYPE).itemsize, ops, what, fix)
        self.k, self.v = ops.xp.zeros(shape, ops.DTYPE), ops.xp.zeros(shape, ops.DTYPE)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class ContiguousKVCache(KVPool):
    """Chapter 5: every sequence owns max_len slots in a row, in every layer."""
    attention = "decode_attention"  # the backend op that reads this layout (chapter 6's reads blocks)

    def __init__(self, cfg: LlamaConfig, ops, num_seqs: int, max_len: int):
        super().__init__(cfg, ops, num_seqs * max_len, f"a KV cache of {num_seqs} sequences x {max_len} tokens",
                         "ask for fewer sequences or a shorter max_len")
        self.num_seqs, self.max_len = num_seqs, max_len
        self.lengths = {seq: 0 for seq in range(num_seqs)}  # tokens cached so far, per sequence

    def append(self, seq: int, count: int) -> np.ndarray:
        """Room for `count` more tokens of sequence `seq`: their slots (positions lengths[seq] onwards)."""
        start = self.lengths[seq]
        if start + count > self.max_len:
            raise TinyVLLMError(f"sequence {seq} needs {start + count} tokens of KV cache but holds "
                                f"{self.max_len}; ask for fewer tokens")
        self.lengths[seq] += count
        return seq * self.max_len + np.arange(start, start + count, dtype=np.int32)

    def plan_prefill(self, seq: int, token_ids: list[int]) -> SeqStep:
        """The step plan of a prompt (or more tokens) for sequence `seq`, its slots taken now."""
        start = self.lengths[seq]
        return SeqStep(list(token_ids), start, self.append(seq, len(token_ids)))

    def plan_decode(self, seqs: list[int], tokens: list[int]) -> list[SeqStep]:
        """One new token per sequence: tokens[b] (not yet cached) is sequence seqs[b]'s newest."""
        return [self.plan_prefill(s, [t]) for s, t in zip(seqs, tokens)]

    def where(self, steps: list[SeqStep], lengths: np.ndarray) -> tuple:
        """decode_attention's inputs: row b reads slots starts[b] .. starts[b] + lengths[b] - 1."""
        starts = np.asarray([int(s.slots[0]) - s.start for s in steps], dtype=np.int32)  # the row's first slot
        return self.ops.to_device(starts), self.ops.to_device(np.asarray(lengths, dtype=np.int32))

    chunk_attention = "decode_attention"  # a prompt after cached tokens: one decode query per row

    def chunk_where(self, step: SeqStep) -> tuple:
        """Where the queries of a chunk find their keys: row i reads its sequence's first start + i + 1 slots."""
        T = len(step.token_ids)
        starts = np.full(T, int(step.slots[0]) - step.start, dtype=np.int32)
        lengths = np.arange(step.start + 1, step.end + 1, dtype=np.int32)
        return self.ops.to_device(starts), self.ops.to_device(lengths)

    def view(self, seq: int, layer: int):
        """(K, V) of one sequence in one layer: (lengths[seq], kv_heads, head_dim) each."""
        rows = slice(seq * self.max_len, seq * self.max_len + self.lengths[seq])
        return self.k[layer, rows], self.v[layer, rows]


class PagedKVPool(KVPool):
    """Chapter 6: (num_blocks + 1) * 16 slots per layer; a sequence's token t is in slot
    block_table[t // 16] * 16 + t % 16. One block more than the block manager hands out: a scratch block
    that padding rows of a CUDA graph's batch (chapter 7) write to and read from, so they never touch a
    real sequence's K/V."""
    attention = "paged_attention"  # the backend op that reads keys through block tables

    def __init__(self, cfg: LlamaConfig, ops, num_blocks: int):
        if num_blocks < 1:
            raise TinyVLLMError(f"the KV cache pool needs at least one block, got {num_blocks}")
        super().__init__(cfg, ops, (num_blocks + 1) * BLOCK_SIZE, f"a KV cache pool of {num_blocks} blocks",
                         "lower --num-blocks (num_blocks), or leave it out to size the pool from memory")
        self.num_blocks, self.scratch_block = num_blocks, num_blocks

    chunk_attention = "chunk_attention"  # a prompt after cached tokens (or earlier chunks): through its table

    def chunk_where(self, step: SeqStep) -> tuple:
        """chunk_attention's inputs for one chunk: its sequence's block table, and its first position."""
        return self.ops.to_device(np.asarray(step.block_table, dtype=np.int32)), step.start

    def where(self, steps: list[SeqStep], lengths: np.ndarray) -> tuple:
        """paged_attention's inputs: row b's block table (padded with -1, never read past lengths[b])."""
        tables = np.full((len(steps), max(len(s.block_table) for s in steps)), -1, dtype=np.int32)
        for b, s in enumerate(steps):
            tables[b, :len(s.block_table)] = s.block_table
        return self.ops.to_device(tables), self.ops.to_device(np.asarray(lengths, dtype=np.int32))


def bytes_per_block(cfg: LlamaConfig, itemsize: int) -> int:
    """K and V of 16 tokens in every layer."""
    return 2 * cfg.num_hidden_layers * BLOCK_SIZE * cfg.num_key_value_heads * cfg.head_dim * itemsize


def pool_blocks(cfg: LlamaConfig, ops, gpu_memory_utilization: float, cpu_bytes: int = CPU_KV_CACHE_BYTES,
                draft_cfg: LlamaConfig | None = None) -> int:
    """How many blocks fit in the memory left for the KV cache on this backend: on a GPU, what is left of
    gpu_memory_utilization x its memory; on the CPU, cpu_bytes. With a draft model (draft_cfg, chapter 10) a block
    is one in each pool: the draft's pool has as many blocks as the target's (model/draft_model.py)."""
    per_block = sum(bytes_per_block(c, np.dtype(ops.DTYPE).itemsize) for c in (cfg, draft_cfg) if c is not None)
    if ops.xp.__name__ == "cupy":
        if not 0 < gpu_memory_utilization <= 1:
            raise TinyVLLMError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        free, total = gpu_memory(ops)
        budget = gpu_memory_utilization * total - (total - free)
    else:  # a fixed size, but never more than the host can give (less one block: the pool's scratch block)
        budget = min(cpu_bytes, host_memory_available() - per_block)
    blocks = int(budget // per_block)
    if blocks < 1:
        fix = "raise gpu_memory_utilization or give num_blocks" if ops.xp.__name__ == "cupy" else "free some memory"
        raise TinyVLLMError(f"no memory left for the KV cache ({budget / 2**30:.2f} GiB for blocks of "
                            f"{per_block / 2**20:.2f} MiB); {fix}")
    return blocks


def gpu_memory(ops) -> tuple[int, int]:
    """(free, total) bytes of the GPU, where memory CuPy holds for reuse counts as free: it keeps the memory
    of freed arrays (an LLM deleted earlier in this process) cached in its pool, and the device counts it
    as used, but the arrays allocated next reuse it."""
    free, total = ops.xp.cuda.runtime.memGetInfo()
    return free + ops.xp.get_default_memory_pool().free_bytes(), total


def host_memory_available() -> int:
    """Bytes of RAM the kernel can still hand out: Linux's MemAvailable (free memory and the page cache it
    can drop) plus free swap; where there is no /proc/meminfo (macOS), all of the physical memory."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        kib = {name: int(value.split()[0]) for name, value in (line.split(":", 1) for line in lines)}
        return (kib["MemAvailable"] + kib.get("SwapFree", 0)) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(needed: int, ops, what: str, fix: str) -> None:
    """Refuse, before allocating, what this backend's memory cannot hold: a PiB-sized array would otherwise
    fail deep inside NumPy or CuPy, or be granted lazily and get the process killed when it fills up."""
    if ops.xp.__name__ == "cupy":
        available, where = gpu_memory(ops)[0], "GPU memory is free"
    else:
        available, where = host_memory_available(), "host memory is available"
    if needed > available:
        raise TinyVLLMError(f"{what} needs {human_bytes(needed)}, but only {human_bytes(available)} of {where}; "
                            f"{fix}")


def human_bytes(n: int) -> str:
    """1536 -> "1.5 KiB": binary units up to EiB."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    k = 0
    while k < len(units) - 1 and n >= 1024 ** (k + 1):
        k += 1
    return f"{n} B" if k == 0 else f"{n / 1024 ** k:.1f} {units[k]}"
