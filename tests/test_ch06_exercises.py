"""Chapter 6 graders: the block allocator (Exercise 6.1) and the logical -> physical slot lookup (6.2), on the CPU.

BlockManager is driven by random programs of allocate / append / extend / free (hypothesis) and checked after
every call against a shadow that the grader keeps itself: which tokens each sequence holds and which slots it was
given. From those alone follow how many blocks must be free, when OutOfBlocks must be raised, and that no
slot is handed out twice; the manager's own state (free list, tables, ref counts) must agree with them.
Hand-derived cases pin down the order blocks are handed out in, ref counts, refusals that change nothing,
and O(1) takes and gives (timed on a pool of 2^22 blocks). Finally the class plans the steps (the slots
and tables a PagedKVPool is read through) and must decode like chapter 5's contiguous cache. slot_mapping is checked on hand-derived
tables and against a plain Python loop on random ones.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.numeric import rel_err
from tinyvllm.engine import block_manager
from tinyvllm.engine.block_manager import BLOCK_SIZE, OutOfBlocks, blocks_for
from tinyvllm.errors import TinyVLLMError


def state(bm) -> tuple:
    """Everything a refused call must leave untouched."""
    return (list(bm.free_blocks), list(bm.ref_counts), {s: list(t) for s, t in bm.tables.items()},
            dict(bm.lengths))


def check_against_shadow(bm, num_blocks: int, slots_of: dict[int, list[int]]) -> None:
    """The manager's state against the grader's own record: slots_of[seq] = the slots handed out, in token order."""
    assert dict(bm.lengths) == {s: len(slots) for s, slots in slots_of.items()}, "lengths != tokens handed out"
    assert set(bm.tables) == set(slots_of), "tables are kept for the wrong sequences"
    needed = sum(blocks_for(len(slots)) for slots in slots_of.values())
    assert bm.num_free == num_blocks - needed, f"{bm.num_free} blocks free; the sequences need {needed} of {num_blocks}"
    free = list(bm.free_blocks)
    assert len(free) == bm.num_free and len(set(free)) == len(free), "a block is on the free list twice"
    used = [b for t in bm.tables.values() for b in t]
    assert len(set(used)) == len(used), "a block is in two tables (or twice in one)"
    assert not set(used) & set(free), "a block is both free and in a table"
    assert set(used) | set(free) == set(range(num_blocks)), "a block was lost (neither free nor in a table)"
    assert [bm.ref_counts[b] for b in used] == [1] * len(used), "a block in use must have ref count 1 here"
    assert [bm.ref_counts[b] for b in free] == [0] * len(free), "a free block must have ref count 0"
    every_slot = [s for slots in slots_of.values() for s in slots]
    assert len(set(every_slot)) == len(every_slot), "two live tokens were given the same slot"
    for seq, slots in slots_of.items():
        t = np.arange(len(slots))
        table = bm.tables[seq]
        assert len(table) == blocks_for(len(slots)), f"sequence {seq}: {len(table)} blocks for {len(slots)} tokens"
        assert list(np.asarray(table)[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE) == slots, \
            f"sequence {seq}: the slots handed out are not table[t // 16] * 16 + t % 16"
        assert list(bm.slot_mapping(seq, 0, len(slots))) == slots, f"sequence {seq}: slot_mapping disagrees"


operations = st.lists(st.tuples(st.sampled_from(["allocate", "append", "append", "extend", "free"]),
                                st.integers(0, 6), st.integers(1, 70)), max_size=150)


@pytest.mark.ch6
# `impl` is a function-scoped fixture, but stateless: sharing it between examples is fine
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_blocks=st.integers(1, 20), program=operations)
def test_BlockManager_never_double_books_never_loses_a_block(impl, num_blocks, program):
    bm, slots_of = impl("BlockManager")(num_blocks), {}
    for op, seq, n in program:
        free_before = num_blocks - sum(blocks_for(len(s)) for s in slots_of.values())
        if op == "allocate" and seq not in slots_of:
            fits = blocks_for(n) <= free_before
            assert bm.can_allocate(n) == fits, f"can_allocate({n}) with {free_before} free blocks"
            if fits:
                slots = bm.allocate(seq, n)
                assert isinstance(slots, np.ndarray) and slots.dtype == np.int32, "allocate returns int32 slots"
                slots_of[seq] = [int(s) for s in slots]
            else:
                before = state(bm)
                with pytest.raises(OutOfBlocks):
                    bm.allocate(seq, n)
                assert state(bm) == before, "a refused allocate changed the manager"
        elif op == "allocate":
            before = state(bm)
            with pytest.raises(TinyVLLMError):
                bm.allocate(seq, n)  # the sequence already has blocks
            assert state(bm) == before, "a refused allocate changed the manager"
        elif op == "append" and seq in slots_of:
            fits = len(slots_of[seq]) % BLOCK_SIZE != 0 or free_before > 0
            assert bm.can_append(seq) == fits, f"can_append at {len(slots_of[seq])} tokens, {free_before} free"
            if fits:
                slots_of[seq].append(int(bm.append_slot(seq)))
            else:
                before = state(bm)
                with pytest.raises(OutOfBlocks):
                    bm.append_slot(seq)
                assert state(bm) == before, "a refused append_slot changed the manager"
        elif op == "extend" and seq in slots_of:
            length = len(slots_of[seq])
            if blocks_for(length + n) - blocks_for(length) <= free_before:
                slots = bm.extend(seq, n)
                assert isinstance(slots, np.ndarray) and slots.dtype == np.int32, "extend returns int32 slots"
                slots_of[seq] += [int(s) for s in slots]
            else:
                before = state(bm)
                with pytest.raises(OutOfBlocks):
                    bm.extend(seq, n)
                assert state(bm) == before, "a refused extend changed the manager"
        elif op == "free" and seq in slots_of:
            bm.free(seq)
            del slots_of[seq]
        check_against_shadow(bm, num_blocks, slots_of)
        if slots_of:
            seqs = sorted(slots_of, reverse=True)
            tables = bm.block_tables(seqs)
            width = max(blocks_for(len(slots_of[s])) for s in seqs)
            assert tables.dtype == np.int32 and tables.shape == (len(seqs), width)
            for row, s in zip(tables, seqs):
                np.testing.assert_array_equal(row, bm.tables[s] + [-1] * (width - len(bm.tables[s])))
    for seq in list(slots_of):
        bm.free(seq)
    assert bm.num_free == num_blocks and sorted(bm.free_blocks) == list(range(num_blocks)), "blocks missing at the end"
    assert not bm.tables and not bm.lengths and not any(bm.ref_counts)


@pytest.mark.ch6
def test_BlockManager_hands_out_blocks_in_free_list_order(impl):
    """Hand-derived: blocks come from the left of the free list, freed blocks go to its right, in table order."""
    bm = impl("BlockManager")(6)
    assert list(bm.free_blocks) == [0, 1, 2, 3, 4, 5] and bm.num_free == 6
    assert list(bm.allocate(0, 20)) == list(range(20))     # blocks 0 and 1 (4 tokens in block 1)
    assert list(bm.allocate(1, 16)) == list(range(32, 48))    # block 2, full
    bm.free(0)
    assert list(bm.free_blocks) == [3, 4, 5, 0, 1] and bm.ref_counts == [0, 0, 1, 0, 0, 0]
    assert list(bm.allocate(2, 33)) == list(range(48, 81))    # blocks 3, 4, 5 (16 + 16 + 1 tokens)
    assert bm.append_slot(1) == 0                             # token 16 of sequence 1 opens block 0, freed earlier
    assert bm.tables == {1: [2, 0], 2: [3, 4, 5]} and bm.lengths == {1: 17, 2: 33}
    assert list(bm.free_blocks) == [1] and bm.ref_counts == [1, 0, 1, 1, 1, 1]
    np.testing.assert_array_equal(bm.block_tables([2, 1]), [[3, 4, 5], [2, 0, -1]])
    np.testing.assert_array_equal(bm.slot_mapping(2, 30, 3), [78, 79, 80])
    bm.free(2)
    assert list(bm.free_blocks) == [1, 3, 4, 5]


@pytest.mark.ch6
def test_BlockManager_takes_a_new_block_only_when_the_last_is_full(impl):
    bm = impl("BlockManager")(3)
    assert list(bm.allocate(7, 16)) == list(range(16))
    assert bm.num_free == 2 and bm.can_append(7)
    assert bm.append_slot(7) == 16                  # token 16 opens block 1
    assert bm.num_free == 1
    assert [bm.append_slot(7) for _ in range(15)] == list(range(17, 32))  # tokens 17..31 fill it
    assert bm.num_free == 1 and bm.lengths[7] == 32 and bm.tables[7] == [0, 1]
    assert bm.append_slot(7) == 32 and bm.num_free == 0
    assert bm.can_append(7)                         # token 33 still fits in block 2
    assert isinstance(bm.append_slot(7), (int, np.integer))


@pytest.mark.ch6
def test_BlockManager_extend_takes_the_blocks_a_run_of_tokens_needs(impl):
    bm = impl("BlockManager")(5)
    bm.allocate(0, 10)                              # block 0
    bm.allocate(1, 3)                               # block 1
    assert bm.extend(0, 6).tolist() == list(range(10, 16)) and bm.num_free == 3   # fills block 0 exactly
    assert bm.extend(0, 20).tolist() == list(range(32, 52)) and bm.tables[0] == [0, 2, 3]
    before = state(bm)
    with pytest.raises(OutOfBlocks):
        bm.extend(1, 30)                            # 33 tokens need 3 blocks: 2 more, 1 free
    assert state(bm) == before
    assert bm.extend(1, 29).tolist() == list(range(19, 32)) + list(range(64, 80))  # exactly the last block
    assert bm.lengths == {0: 36, 1: 32} and bm.num_free == 0
    assert bm.extend(0, 0).tolist() == [] and bm.lengths[0] == 36


@pytest.mark.ch6
def test_BlockManager_refuses_without_changing_anything(impl):
    """OutOfBlocks (a TinyVLLMError) when the pool is full, and a refused call leaves every field as it was."""
    cls = impl("BlockManager")
    with pytest.raises(TinyVLLMError):
        cls(0)
    bm = cls(3)
    bm.allocate(0, 40)                              # blocks 0..2, 8 slots left in block 2
    assert bm.num_free == 0 and not bm.can_allocate(1)
    before = state(bm)
    with pytest.raises(OutOfBlocks):
        bm.allocate(1, 1)
    assert state(bm) == before and 1 not in bm.tables and 1 not in bm.lengths
    with pytest.raises(TinyVLLMError):
        bm.allocate(0, 5)                           # sequence 0 already has blocks
    assert state(bm) == before
    for _ in range(8):
        bm.append_slot(0)                           # fills block 2 to 48 tokens
    assert not bm.can_append(0)
    before = state(bm)
    with pytest.raises(OutOfBlocks):
        bm.append_slot(0)
    assert state(bm) == before and bm.lengths[0] == 48
    bm.free(0)
    assert list(bm.free_blocks) == [0, 1, 2] and bm.can_allocate(48) and not bm.can_allocate(49)


@pytest.mark.ch6
def test_BlockManager_ref_counts_keep_a_shared_block(impl):
    """What chapter 7's prefix cache does: a second sequence shares the first's full blocks (count 2).
    Freeing one user keeps a shared block; freeing the last returns it."""
    bm = impl("BlockManager")(8)
    bm.allocate(0, 40)                              # blocks 0, 1 full; block 2 holds 8 tokens
    bm.allocate(1, 1)                               # block 3
    bm.tables[1] = bm.tables[0][:2] + bm.tables[1]  # sequence 1 = sequence 0's first 32 tokens + 1 of its own
    bm.lengths[1] = 33
    for b in (0, 1):
        bm.ref_counts[b] += 1
    assert bm.ref_counts == [2, 2, 1, 1, 0, 0, 0, 0]
    assert bm.num_free == 4, (f"num_free is {bm.num_free} with blocks 0-3 in use (0 and 1 by two sequences): "
                              "count the free list, not num_blocks minus the table entries (a shared block is one block)")
    bm.free(0)
    assert bm.ref_counts == [1, 1, 0, 1, 0, 0, 0, 0] and list(bm.free_blocks) == [4, 5, 6, 7, 2]
    assert bm.num_free == 5, f"num_free is {bm.num_free} after block 2 came back: 5 are free"
    bm.free(1)
    assert bm.ref_counts == [0] * 8 and list(bm.free_blocks) == [4, 5, 6, 7, 2, 0, 1, 3]


def seconds_per_cycle(cls, num_blocks: int, cycles: int = 200) -> float:
    """Best of 5: a one-token sequence allocated and freed (one block taken and given back), with others alive."""
    bm = cls(num_blocks)
    for s in range(8):
        bm.allocate(-1 - s, 64)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for seq in range(cycles):
            bm.allocate(seq, 1)
            bm.free(seq)
        best = min(best, (time.perf_counter() - start) / cycles)
    return best


@pytest.mark.ch6
def test_BlockManager_takes_and_gives_blocks_in_constant_time(impl):
    """Taking and giving back a block costs the same in a pool of 2^10 and of 2^22 blocks (a list's pop(0)
    or a scan of the free list costs ~150 times more in the big pool)."""
    cls = impl("BlockManager")
    small, big = seconds_per_cycle(cls, 2**10), seconds_per_cycle(cls, 2**22)
    assert big < 10 * small, (f"allocate + free: {small * 1e6:.1f} us in a pool of 2^10 blocks, {big * 1e6:.1f} us "
                              "in one of 2^22: something is O(num_blocks) (list.pop(0)? a scan of the free list?)")


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from tinyvllm.model.model import Model
    return Model(tiny_model_dir, "cpu", max_step_tokens=128)


@pytest.mark.ch6
def test_BlockManager_plans_steps_that_decode_like_the_contiguous_cache(impl, tiny_model, rng):
    """Your class planning the steps (the slots and tables the model reads): three sequences in a pool
    fragmented by a freed one, ten decode steps; the logits must equal chapter 5's contiguous cache's."""
    from tinyvllm.model.decode import decode_batch, decode_step
    from tinyvllm.model.kv_pool import ContiguousKVCache, PagedKVPool
    from tinyvllm.model.prefill import prefill, prefill_batch
    model, blocks = tiny_model, impl("BlockManager")(7)  # exactly what the three need at the end
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (9, 16, 37)]
    paged = PagedKVPool(model.cfg, model.ops, num_blocks=7)
    paged.k[:], paged.v[:] = np.nan, np.nan         # a slot read before it is written poisons the logits
    blocks.allocate(99, 20)                         # a sequence takes two blocks ...
    prefill_batch(model, paged, [block_manager.plan_prefill(blocks, 0, prompts[0])])
    blocks.free(99)                                 # ... and gives them back: the last two blocks taken are these
    for s in (1, 2):
        prefill_batch(model, paged, [block_manager.plan_prefill(blocks, s, prompts[s])])
    contiguous = ContiguousKVCache(model.cfg, model.ops, num_seqs=3, max_len=60)
    for s in range(3):
        prefill(model, prompts[s], cache=contiguous, seq=s)
    for _ in range(10):
        tokens = rng.integers(0, model.cfg.vocab_size, 3).tolist()
        a = decode_batch(model, paged, block_manager.plan_decode(blocks, [0, 1, 2], tokens))
        b = decode_step(model, tokens, contiguous, [0, 1, 2])
        assert rel_err(a, b) < 1e-6, "the paged pool's logits differ from the contiguous cache's"
    assert blocks.lengths == {0: 19, 1: 26, 2: 47}


# ---------- Exercise 6.2: slot_mapping ----------

HAND_DERIVED = {  # (block_table, start, count): the slots, worked out by hand
    "crosses a block edge": ([7, 2, 9], 14, 4, [126, 127, 32, 33]),
    "partial last block": ([7, 2, 9], 0, 40, [*range(112, 128), *range(32, 48), *range(144, 152)]),
    "one token": ([3], 0, 1, [48]),
    "second block only": ([5, 0], 16, 16, list(range(16))),
    "starts mid-block": ([4, 9, 6], 21, 5, [149, 150, 151, 152, 153]),
    "padded row": ([4, 1, -1, -1], 5, 20, [*range(69, 80), *range(16, 25)]),
    "shuffled table": ([12, 3, 40, 0], 30, 20, [62, 63, *range(640, 656), 0, 1]),
    "no tokens": ([0, 1], 3, 0, []),
}


@pytest.mark.ch6
@pytest.mark.parametrize("case", HAND_DERIVED)
def test_slot_mapping_hand_derived(impl, case):
    table, start, count, expected = HAND_DERIVED[case]
    slots = impl("slot_mapping")(table, start, count)
    assert isinstance(slots, np.ndarray), f"expected a NumPy array, got {type(slots).__name__}"
    assert slots.dtype == np.int32, f"dtype {slots.dtype}: the kernels read int32 slots"
    assert slots.shape == (count,)
    assert slots.tolist() == expected


@pytest.mark.ch6
@pytest.mark.parametrize("as_array", [False, True])
def test_slot_mapping_matches_a_plain_loop_on_random_tables(impl, as_array, rng):
    """Random tables (block ids up to 2^27 - 1: the last slot is 2^31 - 1, int32's largest), random windows."""
    f = impl("slot_mapping")
    for _ in range(50):
        tokens = int(rng.integers(1, 2000))
        table = rng.choice(2**27, size=blocks_for(tokens), replace=False).tolist()
        table[int(rng.integers(len(table)))] = 2**27 - 1
        start = int(rng.integers(0, tokens))
        count = int(rng.integers(0, tokens - start + 1))
        expected = [table[t // 16] * 16 + t % 16 for t in range(start, start + count)]
        padded = table + [-1] * int(rng.integers(0, 4))
        got = f(np.array(padded, np.int32) if as_array else padded, start, count)
        assert got.dtype == np.int32 and got.tolist() == expected, \
            f"table of {len(table)} blocks, start {start}, count {count}"
