"""Chapter 6: the paged KV cache — one pool of 16-token blocks for every sequence, read through block tables.

Per layer the pool is (num_blocks * 16, kv_heads, head_dim): the same flat list of token slots as
chapter 5's cache, so store_kv and prefill do not change — only which slot a token gets (the block
manager decides) and how decode attention finds a sequence's keys (through its block table).

The pool is sized once, from memory: on a GPU, what is left of gpu_memory_utilization x the device's
memory after the weights and buffers (vLLM's rule); on the CPU, a fixed budget.
"""
from __future__ import annotations

import numpy as np

from tinyvllm import block_manager
from tinyvllm.block_manager import BLOCK_SIZE
from tinyvllm.config import LlamaConfig
from tinyvllm.errors import TinyVLLMError

CPU_KV_CACHE_BYTES = 2**30  # 1 GiB: ~23,000 tokens of SmolLM2-135M in float32


def bytes_per_block(cfg: LlamaConfig, itemsize: int) -> int:
    """K and V of 16 tokens in every layer."""
    return 2 * cfg.num_hidden_layers * BLOCK_SIZE * cfg.num_key_value_heads * cfg.head_dim * itemsize


def pool_blocks(cfg: LlamaConfig, ops, gpu_memory_utilization: float = 0.9,
                cpu_bytes: int = CPU_KV_CACHE_BYTES) -> int:
    """How many blocks fit in the memory left for the KV cache on this backend."""
    per_block = bytes_per_block(cfg, np.dtype(ops.DTYPE).itemsize)
    if ops.xp.__name__ == "cupy":
        if not 0 < gpu_memory_utilization <= 1:
            raise TinyVLLMError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        free, total = ops.xp.cuda.runtime.memGetInfo()
        # CuPy keeps the memory of freed arrays (an LLM deleted earlier in this process) cached in its pool:
        # the device counts it as used, but the arrays allocated next reuse it, so here it counts as free
        free += ops.xp.get_default_memory_pool().free_bytes()
        budget = gpu_memory_utilization * total - (total - free)
    else:
        budget = cpu_bytes
    blocks = int(budget // per_block)
    if blocks < 1:
        raise TinyVLLMError(f"no memory left for the KV cache ({budget / 2**30:.2f} GiB for blocks of "
                            f"{per_block / 2**20:.2f} MiB); raise gpu_memory_utilization or give num_blocks")
    return blocks


class PagedKVCache:
    attention = "paged_attention"  # the backend op that reads keys through block tables

    def __init__(self, cfg: LlamaConfig, ops, num_blocks: int, prefix_caching: bool = False):
        self.ops, self.num_blocks = ops, num_blocks
        # one block more than the manager hands out: a scratch block that padding rows of a CUDA graph's
        # batch (chapter 7) may write to and read from, so they never touch a real sequence's K/V
        self.scratch_block = num_blocks
        shape = (cfg.num_hidden_layers, (num_blocks + 1) * BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.k, self.v = ops.xp.zeros(shape, ops.DTYPE), ops.xp.zeros(shape, ops.DTYPE)
        if prefix_caching:  # chapter 7: full blocks named by hash, shared between prompts
            from tinyvllm.prefix_cache import PrefixCachingBlockManager
            self.blocks = PrefixCachingBlockManager(num_blocks)
        else:
            self.blocks = block_manager.BlockManager(num_blocks)  # through the module: Exercise 6.1 plugs in here
        self.lengths = self.blocks.lengths  # tokens cached per sequence: the block manager keeps the count

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def append(self, seq: int, count: int) -> np.ndarray:
        """Room for `count` more tokens of sequence `seq` (new or running): their slots."""
        if seq not in self.lengths:
            return self.blocks.allocate(seq, count)
        return self.blocks.extend(seq, count)

    def append_token(self, seq: int) -> int:
        """The slot of one more token of a running sequence (decode's fast path)."""
        return self.blocks.append_slot(seq)

    def lookup(self, seqs: list[int], lengths=None) -> tuple:
        """Each decoding sequence's block table (padded with -1) and length, uploaded once per step."""
        lengths = np.asarray([self.lengths[s] for s in seqs] if lengths is None else lengths, dtype=np.int32)
        return self.ops.to_device(self.blocks.block_tables(seqs)), self.ops.to_device(lengths)

    def free(self, seq: int) -> None:
        self.blocks.free(seq)

    def view(self, seq: int, layer: int):
        """(K, V) of one sequence in one layer, gathered from its blocks: (lengths[seq], kv_heads, head_dim)."""
        slots = self.ops.to_device(self.blocks.slot_mapping(seq, 0, self.lengths[seq]))
        return self.k[layer, slots], self.v[layer, slots]
