"""Chapter 10: speculative decoding with a draft model (vLLM's "draft_model" method, model/draft_model.py).

A second model with the target's vocabulary guesses, from a KV pool of its own that shares the target's block
tables. The claims checked here: the answer is plain decoding's (bit for bit in the batch-invariant mode, greedy and
seeded sampling alike; the greedy tokens in the default mode); the draft's pool holds every token the target's does
(a draft that IS the target then keeps every guess, and its pool equals the target's, bit for bit, at every computed
position after every step, through chunked prefill, prefix-cache hits, preemption and steps that do not speculate);
a draft that misses tokens is caught by those checks; a wrong draft is refused at startup in one line. Random prompts
and settings come from the `rng` fixture (the seed is printed with any failure).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import tinyvllm.model.draft_model as draft_model
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.engine_config import EngineConfig, speculative_settings, with_speculative_config
from tinyvllm.engine.spec_decode import SpecDecodeStats
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.step_plan import BLOCK_SIZE

from tests.test_spec_decode import K, VOCAB, differences, make_llm, mixed_params, random_params, random_prompts, run


def speculating(model_dir, draft_dir, invariant: bool = True, **settings) -> LLM:
    return make_llm(model_dir, invariant, speculative_config={"method": "draft_model", "model": str(draft_dir),
                                                              "num_speculative_tokens": K}, **settings)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A 1-layer draft with the tiny target's vocabulary and tokenizer; the target's seed, so its embedding and first
    layer are the target's (synth_model draws the tensors in order): some guesses are kept, others not."""
    from tests.conftest import TINY_DIMS
    from tinyvllm.formats.checkpoints import synth_model
    return synth_model("smollm2-135m", tmp_path_factory.mktemp("draft") / "one-layer", seed=7,
                       **{**TINY_DIMS, "num_hidden_layers": 1})


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return make_llm(tiny_model_dir)


@pytest.fixture(scope="module")
def drafted(tiny_model_dir, small_draft):
    return speculating(tiny_model_dir, small_draft)


# ---- settings: vLLM's shape, and one line for what is wrong ----

def test_speculative_config_in_vllms_shape():
    assert speculative_settings({"method": "draft_model", "model": "d", "num_speculative_tokens": 3}) == {
        "speculative_method": "draft_model", "speculative_model": "d", "num_speculative_tokens": 3}
    assert speculative_settings({"model": "d"}) == {"speculative_model": "d", "speculative_method": "draft_model"}
    assert speculative_settings({"model": "[ngram]"}) == {"speculative_method": "ngram"}   # vLLM's older spelling


@pytest.mark.parametrize("speculative_config, message", [
    ({"method": "draft_model"}, "draft_model needs the draft"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
    ({"method": "ngram", "model": "d"}, "is draft_model's, but speculative_method is 'ngram'"),
    ({"method": "draft_model", "model": "d", "num_draft_layers": 2}, "num_draft_layers is early_exit's"),
])
def test_a_wrong_draft_model_config_is_one_line(speculative_config, message):
    with pytest.raises(TinyVLLMError, match=message) as caught:
        EngineConfig(**with_speculative_config({}, speculative_config))
    assert "\n" not in str(caught.value)


def test_a_draft_with_another_vocabulary_or_none_at_all_is_refused(tiny_model_dir, tiny_llama_dir, tmp_path):
    with pytest.raises(TinyVLLMError, match="a vocabulary of 128256 tokens, the model 49152; a draft_model must share"):
        speculating(tiny_model_dir, tiny_llama_dir)
    with pytest.raises(TinyVLLMError, match="draft model path .* does not exist; give speculative_config's \"model\""):
        speculating(tiny_model_dir, tmp_path / "nope")


@pytest.mark.parametrize("config, words", [
    ('{"method": "draft_model", "num_speculative_tokens": 2}', ["draft_model needs the draft"]),
    ('{"method": "draft_model", "model": "LLAMA"}', ["vocabulary of 128256 tokens"]),
])
def test_the_cli_refuses_a_wrong_draft_in_one_line(tiny_model_dir, tiny_llama_dir, config, words):
    from tests.test_cli import assert_user_error, tinyvllm
    assert_user_error(tinyvllm("generate", "hi", "--model", str(tiny_model_dir), "--device", "cpu",
                               "--speculative-config", config.replace("LLAMA", str(tiny_llama_dir)), check=False),
                      *words)


def test_the_pool_counts_both_models_blocks(tiny_model_dir, small_draft):
    """With a draft, a block of the budget is one block in each pool: fewer blocks for the same memory."""
    from tinyvllm.formats.config import load_config
    from tinyvllm.model.backend import load_backend
    from tinyvllm.model.kv_pool import bytes_per_block, pool_blocks
    cfg, draft_cfg, ops = load_config(tiny_model_dir), load_config(small_draft), load_backend("cpu")
    both = bytes_per_block(cfg, 4) + bytes_per_block(draft_cfg, 4)
    assert pool_blocks(cfg, ops, 1.0, cpu_bytes=10 * both + 5, draft_cfg=draft_cfg) == 10
    assert pool_blocks(cfg, ops, 1.0, cpu_bytes=10 * both + 5) > 10


# ---- the same answer ----

@pytest.mark.parametrize("round", range(2))
def test_a_draft_model_gives_the_answer_of_plain_decoding(plain, drafted, rng, round):
    """Random prompts and settings (greedy and seeded sampling, penalties, logprobs), one batch: bit for bit the same
    ids, logprobs and finish reasons as without speculation; some guesses kept, some not."""
    prompts, params = random_prompts(rng, 8), mixed_params(rng, 8)
    before = SpecDecodeStats(**vars(drafted.engine.spec_stats))
    want, got = run(plain, prompts, params), run(drafted, prompts, params)
    assert not differences(want, got)
    stats = drafted.engine.spec_stats
    assert stats.proposed > before.proposed, "nothing was speculated"


def test_a_draft_model_in_the_default_mode_gives_the_same_greedy_tokens(tiny_model_dir, small_draft, rng):
    prompts = random_prompts(rng, 6)
    params = [replace(p, temperature=0.0, seed=None) for p in mixed_params(rng, 6)]
    want = run(make_llm(tiny_model_dir, invariant=False), prompts, params)
    llm = speculating(tiny_model_dir, small_draft, invariant=False)
    assert not differences(want, run(llm, prompts, params), exact=False)
    assert llm.engine.spec_stats.proposed > 0, "nothing was speculated"


# ---- the draft's KV: complete, or caught ----

def stale_draft_kv(llm: LLM) -> list[str]:
    """Where a draft that is the target itself holds other K/V than the target, at the computed positions of the
    running sequences (in the batch-invariant mode they must be equal, bit for bit)."""
    target, draft = llm.engine.pool, llm.engine.runner.draft.pool
    blocks, found = llm.engine.scheduler.block_manager, []
    for seq in llm.engine.scheduler.running:
        positions = np.arange(seq.num_computed)
        slots = np.asarray(blocks.tables[seq.seq_id])[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        for name in ("k", "v"):
            same = (getattr(target, name)[:, slots] == getattr(draft, name)[:, slots]).all(axis=(0, 2, 3))
            if not same.all():
                found.append(f"sequence {seq.seq_id}: the draft's {name} differs at positions "
                             f"{positions[~same].tolist()[:8]} of {seq.num_computed}")
    return found


def self_drafting_run(model_dir, rng) -> tuple[LLM, list[str], list, list]:
    """The target as its own draft, greedy, a batch through a small pool (preemption), a small budget (prompt chunks,
    guesses cut short), prompts sharing a prefix, run twice (the second time, prefix-cache hits), and no speculation
    while more than 2 sequences decode (plain decode steps in between). After every step: stale_draft_kv.
    Returns the LLM, the problems found, and the answers with and without speculation."""
    llm = speculating(model_dir, model_dir, num_blocks=16, max_num_seqs=5, max_num_batched_tokens=24,
                      long_prefill_token_threshold=10, enable_prefix_caching=True)
    llm.engine.scheduler.max_speculating_batch = 2
    shared = (rng.integers(3, VOCAB, 7).tolist() * 3)[:20]
    prompts = [shared + p for p in random_prompts(rng, 6)]
    # 30-40 tokens each: 5 running sequences need more than the 16 blocks (preemption in every seed)
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(30, 41)), ignore_eos=True) for _ in prompts]
    want = run(make_llm(model_dir, num_blocks=64), prompts, params)
    problems, got = [], []
    for _ in range(2):
        seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        while llm.engine.has_work():
            llm.engine.step()
            problems += [f"step {llm.engine.steps}: {p}" for p in stale_draft_kv(llm)]
        got += [(s.output_ids, None, s.finish_reason) for s in seqs]
    assert not llm.engine.scheduler.block_manager.tables and llm.engine.scheduler.block_manager.num_free == 16
    return llm, problems, want * 2, got


def test_a_draft_that_is_the_target_keeps_every_guess_and_holds_the_targets_kv(tiny_model_dir, rng):
    """A draft whose K/V were stale anywhere would guess other tokens than the target at some step: every guess is
    kept only if its pool holds the target's K/V, and it does, after every step (preemption, chunks, cache hits)."""
    llm, problems, want, got = self_drafting_run(tiny_model_dir, rng)
    assert not differences(want, got)
    assert not problems, problems[:5]
    trace, stats = llm.engine.trace_since(0), llm.engine.spec_stats
    assert stats.proposed > 0 and stats.acceptance_rate == 1, vars(stats)
    assert any(t.preempted for t in trace), "no preemption: the pool is too big for this test"
    assert sum(map(len, (t.chunks for t in trace))) > len(want), "no prompt was chunked"
    assert llm.engine.scheduler.cache_stats.hits > 0, "no prefix-cache hit"
    assert any(t.decode and not any(t.proposed) for t in trace), "every step speculated: no plain decode step"


def follows_without_decodes(self, plan):
    """Broken: the decodes' tokens never reach the draft's pool."""
    last = [draft_model.SeqStep([s.token_ids[-1]], s.end - 1, [s.slots[-1]], s.block_table) for s in plan.verifies]
    if plan.prefills or last:
        draft_model.prefill_batch(self.model, self.pool, plan.prefills, decodes=last, logits=False)


def follows_without_the_last_guess(self, plan):
    """Broken: when all k guesses are kept, the draft's pool lacks the last one."""
    if plan.prefills or plan.decodes:
        draft_model.prefill_batch(self.model, self.pool, plan.prefills, decodes=plan.decodes, logits=False)


def follows_nothing(self, plan):
    """Broken: the draft sees only what it drafts."""


@pytest.mark.parametrize("broken", [follows_without_decodes, follows_without_the_last_guess, follows_nothing],
                         ids=lambda f: f.__name__)
def test_a_draft_that_misses_tokens_is_caught(tiny_model_dir, rng, monkeypatch, broken):
    monkeypatch.setattr(draft_model.DraftModel, "follow", broken)
    llm, problems, want, got = self_drafting_run(tiny_model_dir, rng)
    assert not differences(want, got)   # a stale draft guesses worse, never changes the answer
    # the pool comparison catches every broken follower; its guesses need not suffer (one stale key of a random tiny
    # model may leave every argmax as it was), so acceptance is checked only where nothing of the decodes is followed
    assert problems, f"{broken.__name__} went unnoticed"
    if broken is not follows_without_the_last_guess:
        assert llm.engine.spec_stats.acceptance_rate < 1, f"{broken.__name__}: every guess kept from a stale pool"


# ---- sampled requests ----

def test_sampled_requests_with_a_self_draft_match_plain_decoding(plain, tiny_model_dir, rng):
    """Seeded sampling against a point-mass draft (its argmax): the draws are plain decoding's, so the tokens too;
    a draft that is the target keeps its guess wherever the draw lands on the argmax."""
    llm = speculating(tiny_model_dir, tiny_model_dir)
    prompts, params = random_prompts(rng, 6), random_params(rng, 6, max_tokens=30)
    assert not differences(run(plain, prompts, params), run(llm, prompts, params))
    assert llm.engine.spec_stats.proposed > 0
