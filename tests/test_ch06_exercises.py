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
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.numeric import rel_err, same
from tinyvllm.engine import block_manager
from tinyvllm.engine.block_manager import BLOCK_SIZE, OutOfBlocks, blocks_for
from tinyvllm.errors import TinyVLLMError


def state(bm) -> tuple:
    """Everything a refused call must leave untouched."""
    return (list(bm.free_blocks), list(bm.ref_counts), {s: list(t) for s, t in bm.tables.items()},
            dict(bm.lengths))


def check_against_shadow(bm, num_blocks: int, slots_of: dict[int, list[int]]) -> None:
    """The manager's state against the grader's own record: slots_of[seq] = the slots handed out, in token order."""
    same(dict(bm.lengths), {s: len(slots) for s, slots in slots_of.items()}, "lengths (the tokens handed out)")
    same(sorted(bm.tables), sorted(slots_of), "the sequences that have tables")
    needed = sum(blocks_for(len(slots)) for slots in slots_of.values())
    same(bm.num_free, num_blocks - needed, f"num_free (the sequences hold {needed} of {num_blocks} blocks)")
    free = list(bm.free_blocks)
    same(len(free), bm.num_free, f"len(free_blocks) against num_free (free_blocks {free})")
    twice = sorted(b for b, c in Counter(free).items() if c > 1)
    assert not twice, f"blocks {twice} are on the free list twice: {free}"
    used = [b for t in bm.tables.values() for b in t]
    shared = sorted(b for b, c in Counter(used).items() if c > 1)
    assert not shared, f"blocks {shared} are in two tables (or twice in one): {bm.tables}"
    both = sorted(set(used) & set(free))
    assert not both, f"blocks {both} are both free and in a table: free {free}, tables {bm.tables}"
    lost = sorted(set(range(num_blocks)) - set(used) - set(free))
    assert not lost, f"blocks {lost} were lost: neither free ({free}) nor in a table ({bm.tables})"
    same({b: bm.ref_counts[b] for b in used}, {b: 1 for b in used}, "the ref counts of the blocks in tables")
    same({b: bm.ref_counts[b] for b in free}, {b: 0 for b in free}, "the ref counts of the free blocks")
    every_slot = [s for slots in slots_of.values() for s in slots]
    twice = sorted(s for s, c in Counter(every_slot).items() if c > 1)
    assert not twice, f"slots {twice[:5]} were each given to two live tokens"
    for seq, slots in slots_of.items():
        t = np.arange(len(slots))
        table = bm.tables[seq]
        same(len(table), blocks_for(len(slots)), f"sequence {seq}: blocks for its {len(slots)} tokens")
        same(slots, np.asarray(table)[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE,
             f"sequence {seq}: the slots handed out against its table {table} (table[t // 16] * 16 + t % 16)")
        same(bm.slot_mapping(seq, 0, len(slots)), slots, f"sequence {seq}: slot_mapping(seq, 0, {len(slots)})")


operations = st.lists(st.tuples(st.sampled_from(["allocate", "append", "append", "extend", "free"]),
                                st.integers(0, 6), st.integers(1, 70)), max_size=150)


def refuses(call, error: type, what: str, bm) -> None:
    """call() must raise `error` and leave every field of the manager as it was."""
    before = state(bm)
    try:
        call()
    except error:
        pass
    else:
        raise AssertionError(f"{what}: expected {error.__name__}, but the call went through")
    same(state(bm), before, f"{what}: refused, so (free list, ref counts, tables, lengths) must not change")


@pytest.fixture
def hypothesis_prints_examples(monkeypatch):
    """schemathesis' pytest plugin (installed for tests/test_server_fuzz.py) swaps hypothesis' printer for one
    that prints nothing, to save time on huge API schemas; a failing program would then be reported with its
    arguments blank. Put the real printer back for this test."""
    import hypothesis.core
    from hypothesis.vendor import pretty
    monkeypatch.setattr(hypothesis.core, "RepresentationPrinter", pretty.RepresentationPrinter)


@pytest.mark.ch6
@pytest.mark.usefixtures("hypothesis_prints_examples")
# `impl` is a function-scoped fixture, but stateless: sharing it between examples is fine. On a failure,
# hypothesis shrinks the program to a minimal one and reports that one failure (not every distinct bug it
# met on the way), with no reproduction blob and no explain phase.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          print_blob=False, report_multiple_bugs=False,
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(num_blocks=st.integers(1, 20), program=operations)
def test_BlockManager_never_double_books_never_loses_a_block(impl, num_blocks, program):
    bm, done = impl("BlockManager")(num_blocks), []
    try:
        run_program(bm, num_blocks, program, done)
    except Exception as e:  # noqa: BLE001  (say which call went wrong, on the first line)
        calls = "; ".join(done if len(done) <= 8 else ["..."] + done[-6:])  # shrunk by hypothesis: short
        problem = str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}"
        raise AssertionError(f"{problem} (BlockManager({num_blocks}), then {calls})") from None


def run_program(bm, num_blocks: int, program, done: list[str]) -> None:
    """Run (op, seq, n) calls, checking the manager against the grader's shadow after each; `done` logs them.

    The shadow, slots_of[seq], is the slots handed out to each live sequence, in token order."""
    slots_of: dict[int, list[int]] = {}
    for op, seq, n in program:
        free_before = num_blocks - sum(blocks_for(len(s)) for s in slots_of.values())
        if op == "allocate" and seq not in slots_of:
            done.append(f"allocate({seq}, {n})")
            fits = blocks_for(n) <= free_before
            same(bm.can_allocate(n), fits, f"can_allocate({n}) with {free_before} blocks free")
            if fits:
                slots = bm.allocate(seq, n)
                assert isinstance(slots, np.ndarray) and slots.dtype == np.int32, \
                    f"allocate must return int32 NumPy slots, got {type(slots).__name__} {getattr(slots, 'dtype', '')}"
                slots_of[seq] = [int(s) for s in slots]
            else:
                refuses(lambda: bm.allocate(seq, n), OutOfBlocks, f"{blocks_for(n)} blocks asked, {free_before} free",
                        bm)
        elif op == "allocate":
            done.append(f"allocate({seq}, {n})")
            refuses(lambda: bm.allocate(seq, n), TinyVLLMError, f"sequence {seq} already has blocks", bm)
        elif op == "append" and seq in slots_of:
            done.append(f"append_slot({seq})")
            length = len(slots_of[seq])
            fits = length % BLOCK_SIZE != 0 or free_before > 0
            same(bm.can_append(seq), fits, f"can_append({seq}) at {length} tokens, {free_before} blocks free")
            if fits:
                slots_of[seq].append(int(bm.append_slot(seq)))
            else:
                refuses(lambda: bm.append_slot(seq), OutOfBlocks, f"token {length} needs a block, none free", bm)
        elif op == "extend" and seq in slots_of:
            done.append(f"extend({seq}, {n})")
            length = len(slots_of[seq])
            if blocks_for(length + n) - blocks_for(length) <= free_before:
                slots = bm.extend(seq, n)
                assert isinstance(slots, np.ndarray) and slots.dtype == np.int32, \
                    f"extend must return an int32 NumPy array, got {type(slots).__name__} {getattr(slots, 'dtype', '')}"
                slots_of[seq] += [int(s) for s in slots]
            else:
                refuses(lambda: bm.extend(seq, n), OutOfBlocks,
                        f"{blocks_for(length + n) - blocks_for(length)} new blocks needed, {free_before} free", bm)
        elif op == "free" and seq in slots_of:
            done.append(f"free({seq})")
            bm.free(seq)
            del slots_of[seq]
        else:
            continue  # a call the program cannot make now (append to a sequence that does not exist)
        check_against_shadow(bm, num_blocks, slots_of)
        if slots_of:
            seqs = sorted(slots_of, reverse=True)
            tables = bm.block_tables(seqs)
            width = max(blocks_for(len(slots_of[s])) for s in seqs)
            assert isinstance(tables, np.ndarray) and tables.dtype == np.int32, "block_tables must return int32"
            same(tables.shape, (len(seqs), width), f"block_tables({seqs}).shape")
            for row, s in zip(tables, seqs):
                same(row, bm.tables[s] + [-1] * (width - len(bm.tables[s])), f"block_tables({seqs}), the row of {s}")
    for seq in list(slots_of):
        done.append(f"free({seq})")
        bm.free(seq)
    same(sorted(bm.free_blocks), list(range(num_blocks)), "the free list once every sequence is freed (sorted)")
    same(bm.num_free, num_blocks, "num_free once every sequence is freed")
    assert not bm.tables and not bm.lengths, f"every sequence was freed: tables {bm.tables}, lengths {bm.lengths} left"
    assert not any(bm.ref_counts), f"every sequence was freed: ref counts {bm.ref_counts}"


@pytest.mark.ch6
def test_BlockManager_hands_out_blocks_in_free_list_order(impl):
    """Hand-derived: blocks come from the left of the free list, freed blocks go to its right, in table order."""
    bm = impl("BlockManager")(6)
    same(bm.free_blocks, [0, 1, 2, 3, 4, 5], "a new BlockManager(6)'s free list")
    same(bm.num_free, 6, "a new BlockManager(6)'s num_free")
    same(bm.allocate(0, 20), list(range(20)), "allocate(0, 20): blocks 0 and 1 (4 tokens in block 1), its slots")
    same(bm.allocate(1, 16), list(range(32, 48)), "allocate(1, 16): block 2, full, its slots")
    bm.free(0)
    same(bm.free_blocks, [3, 4, 5, 0, 1], "the free list after free(0): blocks 0, 1 back on the right, in table order")
    same(bm.ref_counts, [0, 0, 1, 0, 0, 0], "ref_counts after free(0)")
    same(bm.allocate(2, 33), list(range(48, 81)), "allocate(2, 33): blocks 3, 4, 5 (16 + 16 + 1 tokens), its slots")
    same(bm.append_slot(1), 0, "append_slot(1): token 16 of sequence 1 opens block 0 (the free list's left), slot")
    same(bm.tables, {1: [2, 0], 2: [3, 4, 5]}, "tables")
    same(bm.lengths, {1: 17, 2: 33}, "lengths")
    same(bm.free_blocks, [1], "the free list")
    same(bm.ref_counts, [1, 0, 1, 1, 1, 1], "ref_counts")
    same(bm.block_tables([2, 1]), [[3, 4, 5], [2, 0, -1]], "block_tables([2, 1]) (rows in the order asked, -1 padded)")
    same(bm.slot_mapping(2, 30, 3), [78, 79, 80], "slot_mapping(2, 30, 3)")
    bm.free(2)
    same(bm.free_blocks, [1, 3, 4, 5], "the free list after free(2)")


@pytest.mark.ch6
def test_BlockManager_takes_a_new_block_only_when_the_last_is_full(impl):
    bm = impl("BlockManager")(3)
    same(bm.allocate(7, 16), list(range(16)), "allocate(7, 16): block 0, full")
    same((bm.num_free, bm.can_append(7)), (2, True), "(num_free, can_append(7)) after allocate(7, 16)")
    same(bm.append_slot(7), 16, "append_slot(7) at 16 tokens: token 16 opens block 1, slot")
    same(bm.num_free, 1, "num_free after token 16 opened block 1")
    same([bm.append_slot(7) for _ in range(15)], list(range(17, 32)), "tokens 17..31 fill block 1: their slots")
    same((bm.num_free, bm.lengths[7], bm.tables[7]), (1, 32, [0, 1]), "(num_free, lengths[7], tables[7]) at 32 tokens")
    same((bm.append_slot(7), bm.num_free), (32, 0), "(append_slot(7), num_free): token 32 opens block 2")
    same(bm.can_append(7), True, "can_append(7) at 33 tokens, no block free (token 33 still fits in block 2)")
    slot = bm.append_slot(7)
    assert isinstance(slot, (int, np.integer)), f"append_slot must return an int, got {type(slot).__name__}"


@pytest.mark.ch6
def test_BlockManager_extend_takes_the_blocks_a_run_of_tokens_needs(impl):
    bm = impl("BlockManager")(5)
    bm.allocate(0, 10)                              # block 0
    bm.allocate(1, 3)                               # block 1
    same(bm.extend(0, 6), list(range(10, 16)), "extend(0, 6) at 10 tokens: fills block 0 exactly, its slots")
    same(bm.num_free, 3, "num_free after extend(0, 6) (no new block)")
    same(bm.extend(0, 20), list(range(32, 52)), "extend(0, 20) at 16 tokens: blocks 2 and 3, its slots")
    same(bm.tables[0], [0, 2, 3], "tables[0] after extend(0, 20)")
    refuses(lambda: bm.extend(1, 30), OutOfBlocks, "extend(1, 30): 33 tokens need 3 blocks, 2 more, 1 free", bm)
    same(bm.extend(1, 29), list(range(19, 32)) + list(range(64, 80)),
         "extend(1, 29): exactly the last block, its slots")
    same((bm.lengths, bm.num_free), ({0: 36, 1: 32}, 0), "(lengths, num_free) after extend(1, 29)")
    same(bm.extend(0, 0), [], "extend(0, 0)")
    same(bm.lengths[0], 36, "lengths[0] after extend(0, 0)")


@pytest.mark.ch6
def test_BlockManager_refuses_without_changing_anything(impl):
    """OutOfBlocks (a TinyVLLMError) when the pool is full, and a refused call leaves every field as it was."""
    cls = impl("BlockManager")
    try:
        cls(0)
    except TinyVLLMError:
        pass
    else:
        raise AssertionError("BlockManager(0) must raise TinyVLLMError: a pool needs at least one block")
    bm = cls(3)
    bm.allocate(0, 40)                              # blocks 0..2, 8 slots left in block 2
    same((bm.num_free, bm.can_allocate(1)), (0, False), "(num_free, can_allocate(1)) with all 3 blocks taken")
    refuses(lambda: bm.allocate(1, 1), OutOfBlocks, "allocate(1, 1) with no block free", bm)
    assert 1 not in bm.tables and 1 not in bm.lengths, "a refused allocate(1, ...) must not record sequence 1"
    refuses(lambda: bm.allocate(0, 5), TinyVLLMError, "allocate(0, 5): sequence 0 already has blocks", bm)
    for _ in range(8):
        bm.append_slot(0)                           # fills block 2 to 48 tokens
    same(bm.can_append(0), False, "can_append(0) at 48 tokens (3 full blocks, none free)")
    refuses(lambda: bm.append_slot(0), OutOfBlocks, "append_slot(0) at 48 tokens, none free", bm)
    bm.free(0)
    same(bm.free_blocks, [0, 1, 2], "the free list after free(0)")
    same((bm.can_allocate(48), bm.can_allocate(49)), (True, False), "(can_allocate(48), can_allocate(49)) of 3 blocks")


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
    same(bm.ref_counts, [2, 2, 1, 1, 0, 0, 0, 0], "ref_counts with blocks 0 and 1 shared")
    assert bm.num_free == 4, (f"num_free is {bm.num_free} with blocks 0-3 in use (0 and 1 by two sequences): "
                              "count the free list, not num_blocks minus the table entries (a shared block is one block)")
    bm.free(0)
    same(bm.ref_counts, [1, 1, 0, 1, 0, 0, 0, 0], "ref_counts after free(0): the shared blocks keep one user")
    same(bm.free_blocks, [4, 5, 6, 7, 2], "the free list after free(0): only block 2 (count 0) comes back")
    assert bm.num_free == 5, f"num_free is {bm.num_free} after block 2 came back: 5 are free"
    bm.free(1)
    same(bm.ref_counts, [0] * 8, "ref_counts after free(1)")
    same(bm.free_blocks, [4, 5, 6, 7, 2, 0, 1, 3], "the free list after free(1): its blocks in table order")


@pytest.mark.ch6
def test_BlockManager_grows_a_table_in_place(impl):
    """A step plan hands the model tables[seq] itself, and chapter 7's CUDA graphs recognise that list to copy
    only its new blocks: append_slot and extend must grow the list that is there, not replace it."""
    bm = impl("BlockManager")(8)
    bm.allocate(0, 16)
    table = bm.tables[0]
    bm.append_slot(0)                               # token 16 opens block 1
    assert bm.tables[0] is table, "append_slot put a new list in tables[0]: append to the one that is there"
    bm.extend(0, 40)                                # tokens 17..56: blocks 2 and 3
    assert bm.tables[0] is table, "extend put a new list in tables[0]: extend the one that is there (+=)"
    same(table, [0, 1, 2, 3], "tables[0] after allocate(0, 16), append_slot(0), extend(0, 40)")


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
    return Model(tiny_model_dir, "cpu", max_num_batched_tokens=128)


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
    for step in range(10):
        tokens = rng.integers(0, model.cfg.vocab_size, 3).tolist()
        a = decode_batch(model, paged, block_manager.plan_decode(blocks, [0, 1, 2], tokens))
        b = decode_step(model, tokens, contiguous, [0, 1, 2])
        err = rel_err(a, b)
        assert err < 1e-6, (f"decode step {step}: the logits through your block manager's slots and tables differ "
                            f"from chapter 5's contiguous cache (relative error {err:.1e}; NaN: a slot read before "
                            "it was written)")
    same(blocks.lengths, {0: 19, 1: 26, 2: 47}, "lengths after the prompts (9, 16, 37 tokens) and 10 decode steps")


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
    same(slots.shape, (count,), f"slot_mapping({table}, {start}, {count}).shape")
    same(slots, expected, f"slot_mapping({table}, {start}, {count}) ({case})")


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
        kind = "an int32 array" if as_array else "a list"
        assert isinstance(got, np.ndarray) and got.dtype == np.int32, \
            f"expected an int32 NumPy array, got {type(got).__name__} {getattr(got, 'dtype', '')}"
        same(got, expected, f"a table of {len(table)} blocks ({kind}, padded with {len(padded) - len(table)} -1s), "
                            f"start {start}, count {count}")


def seconds_per_token(f, count: int) -> float:
    """Best of 5: the time slot_mapping takes per token for a run of `count` tokens."""
    table = np.arange(blocks_for(count), dtype=np.int32)[::-1].copy()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        f(table, 0, count)
        best = min(best, time.perf_counter() - start)
    return best / count


@pytest.mark.ch6
def test_slot_mapping_has_no_python_loop_over_tokens(impl):
    """Vectorized, a run of 2^16 tokens costs far less per token than a run of 16 (the fixed cost of a call is
    shared); a Python loop costs the same per token at any length. Chapter 7 maps whole prompts every step."""
    f = impl("slot_mapping")
    short, long = seconds_per_token(f, 16), seconds_per_token(f, 2**16)
    assert long < short / 5, (f"{short * 1e9:.0f} ns per token for 16 tokens, {long * 1e9:.0f} ns per token for 2^16: "
                              "a Python loop over the tokens? Use NumPy arithmetic on np.arange(start, start + count)")

