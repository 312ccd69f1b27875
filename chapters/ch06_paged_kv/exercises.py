"""Chapter 6 exercises: the block allocator and the slot lookup of the paged KV cache, in plain Python.

Both are graded on the CPU. Fill them in, then:

    make grade CH=6                   # the graders: a score table
    make chapter-6 IMPL=student       # the chapter's checkpoint, with your BlockManager and slot_mapping
                                      # planning every step of the engine's PagedKVPool
    .venv/bin/python -m pytest tests/test_ch06_exercises.py --impl=student -x
                                      # the graders alone: the first failure, with its traceback

`--impl student` replaces tinyvllm.engine.block_manager.BlockManager and tinyvllm.engine.block_manager.slot_mapping with
yours; the checkpoint (and chapter 7's Scheduler) then builds your class, plan_prefill and plan_decode
call its methods, and its slot lookups call your function. The model only reads the plans they return.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.engine import block_manager
from tinyvllm.engine.block_manager import BLOCK_SIZE, OutOfBlocks, blocks_for  # noqa: F401  (for your solution)

REFERENCE = {
    "BlockManager": "tinyvllm.engine.block_manager:BlockManager",
    "slot_mapping": "tinyvllm.engine.block_manager:slot_mapping",
}


def slot_mapping(block_table: list[int], start: int, count: int) -> np.ndarray:
    """Physical slots of tokens start .. start + count - 1 of a sequence whose blocks are block_table:
    token t is at offset t % 16 of physical block block_table[t // 16]. int32, as the kernels read it.

    Exercise 6.2. The pool is a flat list of num_blocks * BLOCK_SIZE token slots; physical block b owns
    slots b * 16 .. b * 16 + 15. A sequence's block_table lists its physical blocks in order (logical
    block 0 first), so token t sits in slot

        block_table[t // 16] * 16 + t % 16

    Example: block_table [7, 2, 9], start 14, count 4 -> tokens 14, 15, 16, 17 -> [126, 127, 32, 33].

    Return a NumPy int32 array of shape (count,) (count may be 0). block_table may be a list or a NumPy
    int array; it may have more entries than the tokens need (a padded row ends with -1): read only the
    blocks that tokens start .. start + count - 1 fall in. No Python loop over tokens: NumPy integer
    arithmetic on np.arange(start, start + count) does it in one go.
    """
    raise NotImplementedError("Exercise 6.2: slot_mapping")


class BlockManager:
    """Exercise 6.1: hands out the pool's blocks to sequences, 16 token slots at a time.

    The state, as public attributes (the engine and the graders read them; keep these names and types):
      num_blocks   int: blocks in the pool, ids 0 .. num_blocks - 1.
      free_blocks  collections.deque of the free block ids. A new manager holds 0, 1, ..., num_blocks - 1
                   in that order. Blocks are taken from the LEFT (popleft) and given back on the RIGHT
                   (append): both O(1). A list's pop(0) moves every other entry, O(num_blocks) per call;
                   the graders time it on a pool of 2^22 blocks.
      ref_counts   list[int], one per block: how many sequences use it (0 for a free block; 1 when a
                   sequence takes it; chapter 7 shares prompt blocks between sequences, so a block goes
                   back to the free list only when its count drops to 0).
      tables       dict {sequence id: list of its physical block ids, logical block 0 first}.
      lengths      dict {sequence id: tokens it holds}. plan_decode reads lengths[seq] as the position of
                   the sequence's next token, before append_slot moves it on.

    Invariants after every call: every block is either on the free list or in some table, never both,
    never twice on the free list, never lost; a sequence of L tokens holds exactly ceil(L / 16) blocks
    (blocks_for(L)); its slots are slot_mapping(tables[seq], 0, L). A step plan hands the model
    tables[seq] itself, not a copy, and chapter 7's CUDA graphs recognise the list to copy only its new
    blocks: grow a running sequence's table in place (append, +=); a new list costs a full rewrite.

    Chapter 7's scheduler also calls five planning methods, blocks_to_append, blocks_to_extend,
    lookup, blocks_to_admit and admit, and speculative decoding calls truncate (with its helper _release).
    They are not part of this exercise and are written for you at the end of the class (they read `lengths`,
    `tables` and `ref_counts`), so `make chapter-7 IMPL=student` runs on your class too.
    """

    def __init__(self, num_blocks: int):
        """An empty pool of num_blocks blocks (raise TinyVLLMError if num_blocks < 1)."""
        raise NotImplementedError("Exercise 6.1: BlockManager.__init__")

    @property
    def num_free(self) -> int:
        """How many blocks are free: O(1)."""
        raise NotImplementedError("Exercise 6.1: BlockManager.num_free")

    def can_allocate(self, num_tokens: int) -> bool:
        """True if a new sequence of num_tokens tokens would get its blocks now."""
        raise NotImplementedError("Exercise 6.1: BlockManager.can_allocate")

    def allocate(self, seq: int, num_tokens: int) -> np.ndarray:
        """Blocks for a new sequence's first num_tokens tokens (its prompt); returns their slots.

        Takes blocks_for(num_tokens) blocks from the left of the free list, in that order, as the
        sequence's table; sets their ref counts to 1 and lengths[seq] = num_tokens. Returns
        slot_mapping(table, 0, num_tokens) (call the module-level function). Raises TinyVLLMError if
        seq already has blocks, and OutOfBlocks if too few blocks are free — in both cases before
        changing anything: a refused request leaves the manager exactly as it was.
        """
        raise NotImplementedError("Exercise 6.1: BlockManager.allocate")

    def can_append(self, seq: int) -> bool:
        """True if seq's next token fits: its slot is in the last block, or a free block is left."""
        raise NotImplementedError("Exercise 6.1: BlockManager.can_append")

    def append_slot(self, seq: int) -> int:
        """The slot (an int) of sequence seq's next token, taking a new block when the last one is full.

        What plan_decode calls for every running sequence at every step. A sequence of L tokens gets a new block exactly when L % 16 == 0 (its blocks are full), taken
        from the left of the free list and appended to its table. If none is free, raise OutOfBlocks
        and change nothing (lengths[seq] stays L). Otherwise lengths[seq] becomes L + 1.
        (It is extend(seq, 1) with one slot.)
        """
        raise NotImplementedError("Exercise 6.1: BlockManager.append_slot")

    def extend(self, seq: int, count: int) -> np.ndarray:
        """Slots for `count` more tokens of a sequence that has blocks, taking new blocks as needed.

        What plan_prefill calls for a sequence that already has blocks (a prompt after its cached
        prefix, chapter 7). A sequence of L tokens needs blocks_for(L + count) - len(its table) new
        blocks, taken from the left of the free list and appended to its table in that order. If fewer are free, raise OutOfBlocks and change nothing.
        Otherwise lengths[seq] becomes L + count; return the slots of tokens L .. L + count - 1 (int32).
        """
        raise NotImplementedError("Exercise 6.1: BlockManager.extend")

    def free(self, seq: int) -> None:
        """Give back a finished (or aborted) sequence's blocks; a shared block stays until its last user goes.

        For each block of the table, in table order: ref count - 1, and if it reaches 0, append the block
        to the right of the free list. Then forget seq (its table and its length).
        """
        raise NotImplementedError("Exercise 6.1: BlockManager.free")

    def slot_mapping(self, seq: int, start: int, count: int) -> np.ndarray:
        """The physical slots of tokens start .. start + count - 1 of a sequence (what the kernels write to):
        the module-level slot_mapping on its table."""
        raise NotImplementedError("Exercise 6.1: BlockManager.slot_mapping")

    def block_tables(self, seqs: list[int]) -> np.ndarray:
        """The tables of several sequences as one (n, longest) int32 array, padded with -1, for a kernel:
        row i is seqs[i]'s table, in the order seqs gives."""
        raise NotImplementedError("Exercise 6.1: BlockManager.block_tables")

    # ---- given, not an exercise: what chapter 7's scheduler plans with, the engine's own methods ----
    blocks_to_append = block_manager.BlockManager.blocks_to_append
    blocks_to_extend = block_manager.BlockManager.blocks_to_extend
    lookup = block_manager.BlockManager.lookup
    blocks_to_admit = block_manager.BlockManager.blocks_to_admit
    admit = block_manager.BlockManager.admit
    truncate = block_manager.BlockManager.truncate
    _release = block_manager.BlockManager._release
