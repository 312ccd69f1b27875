"""Chapter 7, serving: the engine as the live page (`python -m tinyvllm serve`, at /) draws it — the KV
pool block by block, and the running and waiting queues with each sequence's length and blocks.

The engine core takes a snapshot only when the API side asks for one (a Snapshot command: at most every
250 ms, and only while a page watches), so a step that nobody watches costs one `if`. A snapshot is
plain lists and numbers, sent in the next Report; the API process makes the JSON, not the engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # for the hints only: the API process imports this file and needs no scheduler
    from tinyvllm.engine.scheduler import Scheduler
    from tinyvllm.engine.sequence import Sequence

GRID_BLOCKS = 4096   # blocks described one by one: a GPU pool of 300,000 blocks is counted, not drawn


def take_snapshot(scheduler: Scheduler, names: dict[int, str]) -> dict:
    """The pool's first GRID_BLOCKS blocks (reference count, and whether the prefix cache names them) and
    both queues. names: sequence id -> request id, as the API side knows them."""
    blocks = scheduler.block_manager
    shown = min(blocks.num_blocks, GRID_BLOCKS)
    named = getattr(blocks, "hash_of", {})   # prefix caching: full blocks a later prompt can find
    return {"num_blocks": blocks.num_blocks, "free": blocks.num_free,
            "refs": blocks.ref_counts[:shown],                 # 0 free (or cached, unused), 2+ shared
            "cached": [b for b in range(shown) if b in named],
            "running": [describe(s, names, blocks.tables.get(s.seq_id, [])) for s in scheduler.running],
            "waiting": [describe(s, names, []) for s in scheduler.waiting]}


def describe(seq: Sequence, names: dict[int, str], table: list[int]) -> dict:
    """One sequence: its tokens (prompt, output, already in the pool, found in the prefix cache) and blocks.
    The table is the block manager's own list: it is pickled at once, before the next step can change it."""
    return {"id": names.get(seq.seq_id, str(seq.seq_id)), "prompt": len(seq.prompt_ids),
            "output": len(seq.output_ids), "computed": seq.num_computed, "cached": seq.num_cached,
            "preemptions": seq.preemptions, "blocks": table}
