"""Chapter 6: the block manager — KV cache memory handed out in blocks of 16 tokens, like pages.

Chapter 5's contiguous cache gives every sequence max_len slots up front; most of them stay empty,
because nobody knows in advance how long an answer will be. Here the pool is cut into blocks of
BLOCK_SIZE token slots and a sequence gets a block only when it needs one: at most 15 slots per
sequence are ever wasted.

    block table of a sequence:  logical block 0, 1, 2, ...  ->  physical block 7, 2, 9, ...
    slot of token t:            table[t // 16] * 16 + t % 16

One block id serves every layer: the pool holds, per layer, the same (num_blocks * 16) slots, so one
table per sequence is enough. The block manager only keeps the books; the K/V memory is the model's
PagedKVPool, which reads the tables and slots handed to it in a step plan (plan_prefill, plan_decode). Reference counts let chapter 7 share a block between sequences whose
prompts start the same way (prefix caching): a block returns to the free list when its count is 0.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.step_plan import BLOCK_SIZE, blocks_for
from tinyvllm.model.step_plan import SeqStep


@dataclass
class PrefixHit:
    """What one lookup found for a new sequence: the cached blocks its leading tokens can share (none
    without prefix caching). The scheduler looks a sequence up once per admission and passes this on."""
    blocks: list[int] = field(default_factory=list)
    queried: int = 0                   # tokens looked up: the whole sequence

    @property
    def tokens(self) -> int:
        """Leading tokens whose K/V are already in the pool: they cost no budget and no prefill."""
        return len(self.blocks) * BLOCK_SIZE


class OutOfBlocks(TinyVLLMError):
    """The pool has no free block left (chapter 7's scheduler preempts a sequence when this happens)."""


def slot_mapping(block_table: list[int], start: int, count: int) -> np.ndarray:
    """Physical slots of tokens start .. start + count - 1 of a sequence whose blocks are block_table:
    token t is at offset t % 16 of physical block block_table[t // 16]. int32, as the kernels read it."""
    positions = np.arange(start, start + count)
    table = np.asarray(block_table, dtype=np.int64)
    return (table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).astype(np.int32)


class BlockManager:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise TinyVLLMError(f"the KV cache pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks = deque(range(num_blocks))  # O(1) to take from the left and give back on the right
        self.ref_counts = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}        # sequence id -> its physical blocks, in order
        self.lengths: dict[int, int] = {}             # sequence id -> tokens it holds

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens) <= self.num_free

    def allocate(self, seq: int, num_tokens: int) -> np.ndarray:
        """Blocks for a new sequence's first num_tokens tokens (its prompt); returns their slots."""
        if seq in self.tables:
            raise TinyVLLMError(f"sequence {seq} already has blocks; free it first")
        if not self.can_allocate(num_tokens):
            raise OutOfBlocks(f"{num_tokens} tokens need {blocks_for(num_tokens)} blocks of {BLOCK_SIZE}; "
                              f"{self.num_free} of {self.num_blocks} are free")
        self.tables[seq] = [self._take() for _ in range(blocks_for(num_tokens))]
        self.lengths[seq] = num_tokens
        return self.slot_mapping(seq, 0, num_tokens)

    def can_append(self, seq: int) -> bool:
        """True if the next token fits: its slot is in the last block, or a free block is left."""
        return self.lengths[seq] % BLOCK_SIZE != 0 or self.num_free > 0

    def append_slot(self, seq: int) -> int:
        """The slot of sequence seq's next token, taking a new block when the last one is full.
        (Plain Python: decode calls it for every running sequence at every step.)"""
        length, table = self.lengths[seq], self.tables[seq]
        if length % BLOCK_SIZE == 0:
            if not self.num_free:
                raise OutOfBlocks(f"sequence {seq} needs a new block at token {length}; "
                                  f"all {self.num_blocks} blocks are taken")
            table.append(self._take())
        self.lengths[seq] = length + 1
        return table[length // BLOCK_SIZE] * BLOCK_SIZE + length % BLOCK_SIZE

    def extend(self, seq: int, count: int) -> np.ndarray:
        """Slots for `count` more tokens of a sequence that has blocks, taking new blocks as needed."""
        needed = blocks_for(self.lengths[seq] + count) - len(self.tables[seq])
        if needed > self.num_free:
            raise OutOfBlocks(f"sequence {seq} needs {needed} new blocks at token {self.lengths[seq]}; "
                              f"{self.num_free} of {self.num_blocks} are free")
        self.tables[seq] += [self._take() for _ in range(needed)]
        self.lengths[seq] += count
        return self.slot_mapping(seq, self.lengths[seq] - count, count)

    # What the scheduler (chapter 7) plans with: how many free blocks a step would consume
    def blocks_to_append(self, seq: int) -> int:
        """1 if the sequence's next token opens a new block, else 0."""
        return int(self.lengths[seq] % BLOCK_SIZE == 0)

    def blocks_to_extend(self, seq: int, count: int) -> int:
        """New blocks for `count` more tokens of a sequence that has blocks (the next chunk of its prompt)."""
        return blocks_for(self.lengths[seq] + count) - len(self.tables[seq])

    def lookup(self, seq) -> PrefixHit:
        """The cached blocks a new sequence (a Sequence) can share; without prefix caching, none."""
        return PrefixHit(queried=len(seq))

    def blocks_to_admit(self, hit: PrefixHit, num_tokens: int) -> int:
        """Free blocks the first num_tokens tokens of a new sequence take: all but the hit's shared ones,
        plus the shared ones nobody used (with prefix caching they count as free now, and will not once shared)."""
        return blocks_for(num_tokens) - len(hit.blocks) + sum(self.ref_counts[b] == 0 for b in hit.blocks)

    def admit(self, seq: int, hit: PrefixHit) -> int:
        """Start a sequence on its hit's blocks; returns how many of its tokens they hold (none, here)."""
        return 0

    def free(self, seq: int) -> None:
        """Give back a finished (or aborted) sequence's blocks; a shared block stays until its last user goes."""
        for block in self.tables.pop(seq):
            self._release(block)
        del self.lengths[seq]

    def truncate(self, seq: int, num_tokens: int) -> None:
        """Keep only the first num_tokens tokens of a sequence (chapter 10: the K/V of rejected proposals are
        dropped); the blocks past them go back. The slots of dropped tokens in its last block are simply
        written again by the next tokens: only lengths says what a block holds."""
        if not 0 <= num_tokens <= self.lengths[seq]:
            raise TinyVLLMError(f"sequence {seq} holds {self.lengths[seq]} tokens; cannot keep {num_tokens}")
        table, keep = self.tables[seq], blocks_for(num_tokens)
        for block in table[keep:]:
            self._release(block)
        if keep < len(table):   # a new list: a table only ever grows, and whoever copied this one (a CUDA graph's
            self.tables[seq] = table[:keep]   # device tables) knows by its identity that it must copy it afresh
        self.lengths[seq] = num_tokens

    def slot_mapping(self, seq: int, start: int, count: int) -> np.ndarray:
        """The physical slots of tokens start .. start + count - 1 of a sequence (what the kernels write to)."""
        return slot_mapping(self.tables[seq], start, count)

    def block_tables(self, seqs: list[int]) -> np.ndarray:
        """The tables of several sequences as one (n, longest) int32 array, padded with -1, for a kernel."""
        tables = np.full((len(seqs), max(len(self.tables[s]) for s in seqs)), -1, dtype=np.int32)
        for row, s in enumerate(seqs):
            tables[row, :len(self.tables[s])] = self.tables[s]
        return tables

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        """One user fewer; a block nobody uses is free again."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)


# The step plan of the sequences a step runs (chapter 7's scheduler builds it; chapter 6 calls these directly)

def plan_prefill(blocks: BlockManager, seq: int, token_ids: list[int], start: int = 0,
                 count: int | None = None) -> SeqStep:
    """Blocks for tokens start .. start + count - 1 of sequence seq (all the rest by default; those before
    `start` are in the pool already: a cached prefix, or earlier chunks), taken now; returns the plan the
    model reads for them."""
    count = len(token_ids) - start if count is None else count
    slots = blocks.extend(seq, count) if seq in blocks.tables else blocks.allocate(seq, count)
    return SeqStep(token_ids[start:start + count], start, slots, blocks.tables[seq])


def plan_decode(blocks: BlockManager, seqs: list[int], tokens: list[int]) -> list[SeqStep]:
    """One more token for each running sequence seqs[b] (tokens[b], its newest, not yet cached): its slot,
    a new block taken when the last one is full."""
    return [SeqStep([token], blocks.lengths[s], [blocks.append_slot(s)], blocks.tables[s])
            for s, token in zip(seqs, tokens)]


def plan_verify(blocks: BlockManager, seq: int, token: int, proposals: list[int]) -> SeqStep:
    """Chapter 10: a running sequence's newest token and the k tokens proposed after it, as one chunk: k + 1 slots,
    new blocks taken as needed (those of rejected proposals go back after the step: truncate)."""
    start = blocks.lengths[seq]
    slots = blocks.extend(seq, 1 + len(proposals))
    return SeqStep([token, *proposals], start, slots, blocks.tables[seq], proposed=len(proposals))
