"""A prompt's logits computed chunk by chunk through a paged pool: what chunked prefill does, without the scheduler."""
from __future__ import annotations

import numpy as np

from tinyvllm.engine.block_manager import BlockManager, plan_prefill
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.step_plan import BLOCK_SIZE
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch


def chunked_logits(model: Model, ids: list[int], chunks: list[int], blocks=None, seq: int = 0,
                   all_logits: bool = True) -> np.ndarray:
    """Every position's logits of `ids` (each chunk's last with all_logits=False), computed chunk by chunk
    (sizes `chunks`) through a paged pool."""
    blocks = blocks or BlockManager(-(-len(ids) // BLOCK_SIZE))
    pool = PagedKVPool(model.cfg, model.ops, blocks.num_blocks)
    nan = np.nan if pool.k.dtype == np.float32 else 0x7FC0   # float32 NaN on the CPU, bf16 NaN bits on a GPU
    pool.k[:], pool.v[:] = nan, nan                  # a slot read before it is written poisons the logits
    start = blocks.lengths.get(seq, 0)
    out = []
    for count in chunks:
        out.append(prefill_batch(model, pool, [plan_prefill(blocks, seq, ids, start, count)], all_logits))
        start += count
    return model.ops.xp.concatenate(out)
