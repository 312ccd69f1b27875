"""Chapter 6 on the CPU: the block manager (property-based), paged attention's NumPy twin on shuffled
blocks, pool sizing, and greedy generation through the paged cache vs the contiguous cache and transformers."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.numeric import randn, rel_err, torch_attention
from tinyvllm.engine.block_manager import (
    BLOCK_SIZE,
    BlockManager,
    OutOfBlocks,
    blocks_for,
    plan_decode,
    plan_prefill,
    slot_mapping,
)
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.backend import numpy_ops
from tinyvllm.model.decode import decode_batch, decode_step
from tinyvllm.model.kv_pool import ContiguousKVCache, PagedKVPool, bytes_per_block, pool_blocks
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill, prefill_batch

LENGTHS = [1, 15, 16, 17, 255, 4097]


# ---------------------------------------------------------------- the block manager

def check_invariants(bm: BlockManager) -> None:
    """Every block is either free or in use, never both, never lost; a used block's count = its users."""
    used = [b for table in bm.tables.values() for b in table]
    assert len(set(bm.free_blocks)) == len(bm.free_blocks), "a block is on the free list twice"
    assert not set(used) & set(bm.free_blocks), "a block is both free and in a table"
    assert set(used) | set(bm.free_blocks) == set(range(bm.num_blocks)), "a block was lost"
    for b in set(used):
        assert bm.ref_counts[b] == used.count(b)
    for seq, table in bm.tables.items():
        assert len(table) == blocks_for(bm.lengths[seq]), f"sequence {seq}: {len(table)} blocks for {bm.lengths[seq]}"


operations = st.lists(st.tuples(st.sampled_from(["allocate", "append", "free"]), st.integers(0, 7),
                                st.integers(1, 70)), max_size=200)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), ops=operations)
def test_block_manager_never_double_books_never_loses_a_block(num_blocks, ops):
    bm, slots_of = BlockManager(num_blocks), {}
    for op, seq, n in ops:
        if op == "allocate" and seq not in bm.tables:
            if bm.can_allocate(n):
                slots_of[seq] = list(bm.allocate(seq, n))
            else:
                with pytest.raises(OutOfBlocks):
                    bm.allocate(seq, n)
        elif op == "append" and seq in bm.tables:
            if bm.can_append(seq):
                slots_of[seq].append(bm.append_slot(seq))
            else:
                with pytest.raises(OutOfBlocks):
                    bm.append_slot(seq)
        elif op == "free" and seq in bm.tables:
            bm.free(seq)
            del slots_of[seq]
        check_invariants(bm)
        all_slots = [s for slots in slots_of.values() for s in slots]
        assert len(all_slots) == len(set(all_slots)), "two tokens share a slot"
        for seq, slots in slots_of.items():  # the slot mapping agrees with the slots handed out
            assert list(bm.slot_mapping(seq, 0, bm.lengths[seq])) == slots
    for seq in list(bm.tables):
        bm.free(seq)
    assert bm.num_free == num_blocks and sorted(bm.free_blocks) == list(range(num_blocks))


def test_slot_mapping_follows_the_block_table():
    bm = BlockManager(10)
    bm.allocate(0, 5)
    bm.allocate(1, 40)            # blocks 1, 2, 3
    bm.free(0)                    # block 0 goes to the back of the free list
    bm.allocate(2, 20)            # blocks 4, 5
    assert bm.tables == {1: [1, 2, 3], 2: [4, 5]}
    assert list(bm.slot_mapping(1, 14, 4)) == [1 * 16 + 14, 1 * 16 + 15, 2 * 16 + 0, 2 * 16 + 1]
    assert list(bm.slot_mapping(2, 16, 4)) == [5 * 16 + 0, 5 * 16 + 1, 5 * 16 + 2, 5 * 16 + 3]
    np.testing.assert_array_equal(bm.block_tables([2, 1]), [[4, 5, -1], [1, 2, 3]])


def test_a_new_block_only_when_the_last_is_full():
    bm = BlockManager(3)
    bm.allocate(0, 16)
    assert bm.num_free == 2
    bm.append_slot(0)             # token 16 opens block 2 of the sequence
    assert bm.num_free == 1
    for _ in range(15):
        bm.append_slot(0)         # tokens 17..31 fill it
    assert bm.num_free == 1 and bm.lengths[0] == 32


def test_out_of_blocks_is_a_clear_error():
    bm = BlockManager(2)
    bm.allocate(0, 32)
    with pytest.raises(OutOfBlocks, match="needs a new block at token 32"):
        bm.append_slot(0)
    with pytest.raises(OutOfBlocks, match="need 1 blocks"):
        bm.allocate(1, 3)
    assert bm.lengths[0] == 32 and bm.num_free == 0   # a refused request changes nothing


# ---------------------------------------------------------------- paged attention (NumPy twin)

def fragmented_pool(rng, lengths, kv_heads, head_dim, spare_blocks=5, in_order=False):
    """A NaN pool whose blocks are handed out in random order (in_order: one after another, so each sequence's
    blocks follow each other in the pool): (k_pool, v_pool, tables, per-sequence (k, v))."""
    num_blocks = sum(blocks_for(n) for n in lengths) + spare_blocks
    order = list(range(num_blocks))[::-1] if in_order else list(rng.permutation(num_blocks))  # pop() takes the last
    k_pool = np.full((num_blocks * BLOCK_SIZE, kv_heads, head_dim), np.nan, np.float32)
    v_pool = k_pool.copy()
    width = max(blocks_for(n) for n in lengths)
    tables, seqs = np.full((len(lengths), width), -1, np.int32), []
    for row, n in enumerate(lengths):
        table = [order.pop() for _ in range(blocks_for(n))]
        tables[row, :len(table)] = table
        k, v = randn(rng, n, kv_heads, head_dim, scale=2.0), randn(rng, n, kv_heads, head_dim)
        t = np.arange(n)
        slots = np.asarray(table)[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
        k_pool[slots], v_pool[slots] = k, v
        seqs.append((k, v))
    return k_pool, v_pool, tables, seqs


@pytest.mark.parametrize("in_order", [False, True], ids=["blocks gathered", "blocks in order: one slice"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (9, 3, 64), (8, 1, 128)])
def test_paged_attention_twin_equals_contiguous_attention(heads, kv_heads, head_dim, in_order, rng):
    k_pool, v_pool, tables, seqs = fragmented_pool(rng, LENGTHS, kv_heads, head_dim, in_order=in_order)
    n, q_cols = len(seqs), heads * head_dim
    qkv = randn(rng, n, q_cols + 2 * kv_heads * head_dim, scale=2.0)
    lengths = np.array(LENGTHS, np.int32)
    paged = np.full((n, q_cols), np.nan, np.float32)
    numpy_ops.paged_attention(qkv, k_pool, v_pool, tables, lengths, paged, heads)
    # the same keys laid out contiguously, read by chapter 5's decode attention
    k_flat, v_flat = np.concatenate([k for k, _ in seqs]), np.concatenate([v for _, v in seqs])
    starts = np.concatenate([[0], np.cumsum(LENGTHS)[:-1]]).astype(np.int32)
    contiguous = np.full((n, q_cols), np.nan, np.float32)
    numpy_ops.decode_attention(qkv, k_flat, v_flat, starts, lengths, contiguous, heads)
    np.testing.assert_allclose(paged, contiguous, rtol=1e-5, atol=1e-5)  # the same sums, another order
    for b, (k, v) in enumerate(seqs):  # and both equal torch's attention
        expected = torch_attention(qkv[b, :q_cols].reshape(1, heads, head_dim), k, v, len(k) - 1)[0]
        assert rel_err(paged[b], expected) < 1e-5


# ---------------------------------------------------------------- the paged cache in the engine

@pytest.fixture(scope="module")
def smol(default_model_dir):
    return Model(default_model_dir, "cpu", max_num_batched_tokens=512)


@pytest.mark.slow   # the default model decoded twice
def test_paged_decode_equals_contiguous_decode(smol):
    """Three sequences through a fragmented pool: 24 one-block sequences filled it and every other one
    left, so the free blocks are 0, 2, 4, ... and each sequence's blocks are physically apart. Every slot
    not written since is NaN, so reading a wrong slot poisons the logits."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, smol.cfg.vocab_size, n).tolist() for n in (15, 33, 70)]
    nexts = rng.integers(0, smol.cfg.vocab_size, (4, 3)).tolist()
    paged, blocks = PagedKVPool(smol.cfg, smol.ops, num_blocks=24), BlockManager(24)
    for filler in range(24):
        blocks.allocate(100 + filler, BLOCK_SIZE)
    for filler in range(0, 24, 2):            # the even blocks come back; the odd ones stay taken
        blocks.free(100 + filler)
    assert sorted(blocks.free_blocks) == list(range(0, 24, 2))
    paged.k[:], paged.v[:] = np.nan, np.nan
    for s in range(3):
        prefill_batch(smol, paged, [plan_prefill(blocks, s, prompts[s])])
    contiguous = ContiguousKVCache(smol.cfg, smol.ops, num_seqs=3, max_len=80)
    for s in range(3):
        prefill(smol, prompts[s], cache=contiguous, seq=s)
    tables = [blocks.tables[s] for s in range(3)]
    assert [len(t) for t in tables] == [1, 3, 5] and all(b % 2 == 0 for t in tables for b in t), tables
    for table in tables[1:]:                  # logical neighbours are never physical neighbours
        assert all(abs(b - a) > 1 for a, b in zip(table, table[1:])), table
    for step in nexts:
        a = decode_batch(smol, paged, plan_decode(blocks, [0, 1, 2], step[:3]))
        b = decode_step(smol, step[:3], contiguous, [0, 1, 2])
        assert rel_err(a, b) < 1e-6
    first, second = blocks.tables[0]          # sequence 0's token 16 opened a block away from its first
    assert second % 2 == 0 and abs(second - first) > 1
    for s in range(3):
        slots = slot_mapping(blocks.tables[s], 0, blocks.lengths[s])
        for layer in (0, smol.cfg.num_hidden_layers - 1):
            for x, y in zip((paged.k[layer, slots], paged.v[layer, slots]), contiguous.view(s, layer)):
                # the decoded tokens' K/V went through two attention twins that sum in another order (whole rows,
                # and chapter 5's kernel chunks), and a prompt's GEMMs may be summed otherwise at another T
                assert rel_err(x, y) < 1e-5, f"sequence {s}, layer {layer}: relative error {rel_err(x, y):.1e}"


def test_pool_sizing_on_the_cpu(smol):
    per_block = bytes_per_block(smol.cfg, 4)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 K/V heads of 64, float32
    assert pool_blocks(smol.cfg, smol.ops, 1.0, cpu_bytes=10 * per_block + 5) == 10
    with pytest.raises(TinyVLLMError, match="no memory left for the KV cache"):
        pool_blocks(smol.cfg, smol.ops, 1.0, cpu_bytes=per_block - 1)


@pytest.fixture(scope="module")
def small_pool_llm(default_model_dir):
    from tinyvllm import LLM
    return LLM(default_model_dir, device="cpu", num_blocks=6)  # 96 tokens


@pytest.mark.slow   # a long generation on a small pool
def test_a_request_longer_than_the_pool_runs_to_what_the_pool_holds(small_pool_llm):
    """The context window is lowered to the pool's 96 tokens (vLLM's rule: max_tokens is capped by the
    window), so a request asking for more is not refused: it stops with "length" when the pool is full."""
    from tinyvllm import SamplingParams
    ids = list(range(10, 60))
    assert small_pool_llm.max_model_len == 96
    [out] = small_pool_llm.generate([ids], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert len(ids) + len(out.token_ids) == 96 and out.outputs[0].finish_reason == "length"
    assert small_pool_llm.engine.scheduler.block_manager.num_free == 6


@pytest.mark.slow   # a long generation on a small pool
def test_running_out_mid_generation_preempts_and_returns_every_block(small_pool_llm):
    """Two requests in a 6-block pool: each needs 6 blocks by its end, so one is preempted when the pool
    runs dry (chapter 7's answer to running out), recomputed later, and both end as they would alone."""
    from tinyvllm import SamplingParams
    llm, params = small_pool_llm, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    prompts = [list(range(10, 50)), list(range(60, 100))]      # 40 + 50 tokens each: 6 blocks by the end
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    together = llm.generate(prompts, params)
    assert [o.token_ids for o in together] == alone
    assert sum(o.timings["preemptions"] for o in together) >= 1
    assert llm.engine.scheduler.block_manager.num_free == 6 and not llm.engine.scheduler.block_manager.tables


@pytest.mark.slow
def test_greedy_through_the_paged_cache_equals_transformers(default_model_dir, small_pool_llm):
    """Prompts whose blocks land out of order in a small pool, against transformers' greedy generate."""
    from tests.test_reference import hf_greedy, load_hf, up_to_stop
    from tinyvllm import SamplingParams
    llm, hf = small_pool_llm, load_hf(default_model_dir)
    for question in ("Name a color.", "What is 2+2?", "Say hello."):
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=96 - len(ids)))[0].token_ids
        theirs = up_to_stop(hf_greedy(hf, ids, 96 - len(ids)), set(llm.stop_token_ids))
        assert ours == theirs, question
        assert llm.engine.scheduler.block_manager.num_free == 6
