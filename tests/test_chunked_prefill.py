"""Chapter 7's token budget on the CPU: prompts longer than a step go through prefill in chunks.

A chunk's queries attend to the sequence's K/V already in the paged pool (a cached prefix, earlier
chunks) plus their own causal block. Checked against one unchunked prefill (the NumPy oracle and
transformers for a 6,000-token prompt on the default model; one engine prefill on a tiny random model
for chunk boundaries inside a block, on a block edge and after a prefix-cache hit), and on random
workloads (hypothesis): every request finishes with the tokens it gets alone, no step computes more
than its budget, every block comes back. Prefix caching: a hit needs equal token ids, not only an equal
hash; a preempted sequence counts its cached prefix again when it is readmitted.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.chunking import chunked_logits
from tests.numeric import rel_err
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine import prefix_cache
from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
from tinyvllm.engine.prefix_cache import PrefixCachingBlockManager
from tinyvllm.engine.sequence import Sequence
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.step_plan import BLOCK_SIZE
from tinyvllm.model.model import Model
from tinyvllm.model.decode import decode_batch
from tinyvllm.model.prefill import prefill_batch

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return Model(tiny_model_dir, "cpu", max_num_batched_tokens=512)


@pytest.mark.parametrize("chunks", [[37, 37, 26], [32, 32, 36], [1, 99], [16, 16, 16, 52], [99, 1]],
                         ids=["inside a block", "on block edges", "one token first", "block by block", "one token last"])
def test_chunk_boundaries_give_the_logits_of_one_prefill(tiny, chunks, rng):
    ids = rng.integers(0, tiny.cfg.vocab_size, 100).tolist()
    whole = chunked_logits(tiny, ids, [100])
    assert rel_err(chunked_logits(tiny, ids, chunks), whole) < 1e-5


def sequence(seq_id: int, token_ids: list[int]) -> Sequence:
    """A sequence without a model or a tokenizer: what a block manager's lookup reads."""
    return Sequence(seq_id, token_ids, SamplingParams(), 64, set(), None)


def test_a_chunk_after_a_prefix_cache_hit_gives_the_logits_of_one_prefill(tiny, rng):
    """The first prompt fills 3 blocks and names them; the second shares them and prefills its tail in
    two chunks, one ending inside a block."""
    shared = rng.integers(0, tiny.cfg.vocab_size, 3 * BLOCK_SIZE).tolist()
    first, second = shared + [1, 2, 3], shared + rng.integers(0, tiny.cfg.vocab_size, 40).tolist()
    blocks = PrefixCachingBlockManager(50)
    pool = PagedKVPool(tiny.cfg, tiny.ops, 50)
    prefill_batch(tiny, pool, [plan_prefill(blocks, 0, first)])
    blocks.cache_full_blocks(sequence(0, first))
    assert blocks.admit(1, blocks.lookup(sequence(1, second))) == 3 * BLOCK_SIZE
    tail = []
    for start, count in ((48, 21), (69, 19)):
        tail.append(prefill_batch(tiny, pool, [plan_prefill(blocks, 1, second, start, count)], all_logits=True))
    whole = chunked_logits(tiny, second, [len(second)])
    assert rel_err(np.concatenate(tail), whole[48:]) < 1e-5


def test_decodes_riding_in_the_prefill_pass_give_what_two_passes_give(tiny, rng):
    """One pass for a step (the engine's rule): a new prompt, a chunk continuing an earlier one, and two
    decoding sequences as extra rows, against the same step run as a prefill pass and a decode pass.
    Step buffers and free pool slots hold NaN, so a row that reads what it should not shows."""
    vocab = tiny.cfg.vocab_size
    decoding = [rng.integers(0, vocab, n).tolist() for n in (20, 33)]   # prompts already in the pool
    started, fresh = rng.integers(0, vocab, 50).tolist(), rng.integers(0, vocab, 41).tolist()
    results = {}
    for mode in ("one pass", "two passes"):
        blocks, pool = BlockManager(40), PagedKVPool(tiny.cfg, tiny.ops, 40)
        pool.k[...], pool.v[...] = np.nan, np.nan
        for seq, ids in enumerate(decoding):
            prefill_batch(tiny, pool, [plan_prefill(blocks, seq, ids)])
        prefill_batch(tiny, pool, [plan_prefill(blocks, 2, started, 0, 30)])   # its first chunk
        for buffer in tiny.buffers.values():
            buffer.fill(np.nan)
        prefills = [plan_prefill(blocks, 2, started, 30, 20), plan_prefill(blocks, 3, fresh)]
        decodes = plan_decode(blocks, [0, 1], [7, 9])
        if mode == "one pass":
            logits = prefill_batch(tiny, pool, prefills, decodes=decodes)
        else:
            logits = np.concatenate([prefill_batch(tiny, pool, prefills), decode_batch(tiny, pool, decodes)])
        results[mode] = logits, pool.k.copy(), pool.v.copy()
    (one, k1, v1), (two, k2, v2) = results["one pass"], results["two passes"]
    assert one.shape == (4, vocab) and np.isfinite(one).all(), "two prompts' last rows, then the two decodes"
    assert rel_err(one, two) < 1e-5, f"one pass vs two: relative error {rel_err(one, two):.1e}"
    for a, b, name in ((k1, k2, "K"), (v1, v2, "V")):
        written = ~np.isnan(a)   # the same slots written (the rest still NaN), close as a whole: the two passes'
        assert (written == ~np.isnan(b)).all(), f"the pool's {name}: not the same slots written"
        err = rel_err(a[written], b[written])   # GEMMs may round one small element 1e-4 apart
        assert err < 1e-5, f"the pool's {name}: relative error {err:.1e}"


@pytest.mark.slow
def test_a_prompt_longer_than_the_step_buffers_matches_the_oracle_and_transformers(default_model_dir, rng):
    """LLM with a budget (and step buffers) of 256 tokens prefills a 1,500-token prompt in 6 chunks, the
    last ending inside a block. (A 6,000-token prompt in chunks of 1,024 behaves the same and takes
    minutes on two cores: the oracle alone needs 2.5 of them.)"""
    import torch

    from tests.test_reference import load_hf
    from tinyvllm.formats.config import load_config
    from tinyvllm.model.weights import load_weights
    from tinyvllm.reference import ReferenceModel
    llm = LLM(default_model_dir, device="cpu", max_num_batched_tokens=256, long_prefill_token_threshold=256,
              num_blocks=200)
    assert llm.model.max_num_batched_tokens == 256
    ids = rng.integers(3, llm.model_config.vocab_size, 1500).tolist()
    out = llm.generate([ids], GREEDY)[0].token_ids
    trace = llm.engine.trace_since(0)
    assert [t.chunks for t in trace[:6]] == [[256]] * 5 + [[1500 - 5 * 256]]
    cfg = load_config(default_model_dir)
    oracle = ReferenceModel(cfg, load_weights(default_model_dir, cfg).views)
    cache, expected = oracle.new_cache(len(ids) + len(out)), []
    logits = oracle.forward(ids, cache, all_logits=False)
    for _ in out:
        expected.append(int(np.argmax(logits)))
        logits = oracle.forward([expected[-1]], cache, all_logits=False)
    assert out == expected, "greedy tokens after a chunked prefill differ from the oracle's"
    ours = chunked_logits(llm.model, ids, [256] * 5 + [220], all_logits=False)[-1]
    with torch.no_grad():
        hf = load_hf(default_model_dir)(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].numpy()
    assert rel_err(ours, hf) < 1e-4


@pytest.mark.slow   # a dozen random workloads
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_workloads_finish_within_the_budget_with_the_tokens_they_get_alone(tiny_model_dir, data):
    """Prompt lengths up to 150, budgets from 8 to 64 tokens, a long-prefill cap from 1 token to the
    budget, pools from just enough for the longest request to plenty, prefix caching on or off."""
    budget = data.draw(st.integers(8, 64), label="budget")
    cap = data.draw(st.integers(1, budget), label="long_prefill_token_threshold")
    lengths = data.draw(st.lists(st.integers(1, 150), min_size=1, max_size=8), label="prompt lengths")
    caching = data.draw(st.booleans(), label="prefix caching")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 1000, 40).tolist()      # some prompts share a prefix: prefix-cache hits
    prompts = [(shared if rng.random() < 0.5 else [])[:n] + rng.integers(0, 1000, n).tolist() for n in lengths]
    prompts = [p[:150] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
    need = max(-(-(len(p) + params.max_tokens) // BLOCK_SIZE) for p in prompts)
    num_blocks = data.draw(st.integers(need, 4 * need), label="blocks")
    alone = LLM(str(tiny_model_dir), device="cpu", num_blocks=64, enable_prefix_caching=False)
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]
    llm = LLM(str(tiny_model_dir), device="cpu", num_blocks=num_blocks, max_num_batched_tokens=budget,
              long_prefill_token_threshold=cap, enable_prefix_caching=caching, max_num_seqs=4)
    seqs = [llm.add_request(p, params) for p in prompts]
    for _ in range(5000):
        if not llm.engine.has_work():
            break
        llm.engine.step()
    assert not llm.engine.has_work(), "requests left unfinished"
    assert [s.output_ids for s in seqs] == expected
    for t in llm.engine.trace_since(0):
        assert sum(t.chunks) + len(t.decode) <= budget, f"step {t.step} computed past the budget"
        assert max(t.chunks, default=0) <= cap, f"step {t.step}: one prompt took more than the cap"
    blocks = llm.engine.scheduler.block_manager
    assert blocks.num_free == num_blocks and not blocks.tables, "blocks were not all given back"


def test_a_short_prompt_starts_beside_a_long_one_and_nobody_stops_decoding(tiny_model_dir, rng):
    """A 600-token prompt arrives while a sequence decodes; a short one arrives two steps later. With a
    cap of 32 tokens per prompt and step, the short one starts in the very next step (the budget left
    beside the long prompt's chunk), the decoding one gets a token every step, and all three answer as
    alone. Without the cap the long prompt would take the whole budget until its prefill is done."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 4, 4)]  # 30: outlasts
    prompts = [rng.integers(0, 1000, n).tolist() for n in (20, 600, 10)]                            # the prefill
    alone = LLM(str(tiny_model_dir), device="cpu", num_blocks=64, enable_prefix_caching=False)
    expected = [alone.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    llm = LLM(str(tiny_model_dir), device="cpu", num_blocks=64, max_num_batched_tokens=128,
              long_prefill_token_threshold=32, enable_prefix_caching=False)
    engine = llm.engine
    seqs = [engine.add_request(prompts[0], params[0])]
    engine.step()
    seqs.append(engine.add_request(prompts[1], params[1]))
    engine.step()
    engine.step()
    seqs.append(engine.add_request(prompts[2], params[2]))
    engine.step()
    assert seqs[2].output_ids, "the short prompt waited: it should start in the step after it arrived"
    while engine.has_work():
        engine.step()
    trace = engine.trace_since(0)
    long_steps = [t for t in trace if seqs[1].seq_id in t.prefill]
    assert len(long_steps) == -(-600 // 32) and all(max(t.chunks) <= 32 for t in long_steps)
    assert all(seqs[0].seq_id in t.decode for t in long_steps), "a step passed without the decoding sequence"
    assert [s.output_ids for s in seqs] == expected


def test_a_hash_collision_is_not_a_hit(monkeypatch, rng):
    """Every block hashes alike: only equal token ids (and an equal parent block) may share K/V."""
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: 42)
    blocks = PrefixCachingBlockManager(20)
    a = rng.integers(0, 1000, 3 * BLOCK_SIZE + 1).tolist()
    plan_prefill(blocks, 0, a)
    blocks.cache_full_blocks(sequence(0, a))
    other = blocks.lookup(sequence(1, [t + 1 for t in a]))   # different tokens, the same (colliding) hashes
    assert other.tokens == 0 and blocks.admit(1, other) == 0
    assert blocks.lookup(sequence(2, a)).tokens == BLOCK_SIZE  # the same first block is a real hit; the next
                                                               # blocks' hash points at block 0, whose parent differs


def test_a_preempted_sequence_recounts_its_cached_prefix(tiny_model_dir, rng):
    """Prefix caching on, a pool too small for every request: a preempted sequence is readmitted with
    num_cached and num_computed counted again, never more than its tokens, and answers as alone."""
    prompts = [rng.integers(0, 1000, 40).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = LLM(str(tiny_model_dir), device="cpu", num_blocks=64, enable_prefix_caching=False)
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]
    llm = LLM(str(tiny_model_dir), device="cpu", num_blocks=12, max_num_seqs=4, max_num_batched_tokens=48)
    seqs = [llm.add_request(p, params) for p in prompts]
    readmitted = []
    while llm.engine.has_work():
        llm.engine.step()
        for s in llm.engine.scheduler.running:
            assert s.num_cached <= s.num_computed <= len(s)
        readmitted += [s for s in seqs if s.preemptions and s.status.value == "running" and s not in readmitted]
    assert readmitted, "the pool was meant to run out"
    assert [s.output_ids for s in seqs] == expected
