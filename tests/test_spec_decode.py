"""Chapter 10: speculative decoding never changes the answer.

The claim: with speculation on, every request gets the tokens (and logprobs) it gets with speculation off,
greedy or seeded sampling alike, whatever the proposer guesses. It is checked bit for bit in the batch-invariant
mode (model/batch_invariant.py: a row's arithmetic does not depend on how many rows its pass has, so the
verification chunk's logits are the decode steps' logits), and for the tokens in the default mode. Random prompts
and sampling settings come from the `rng` fixture (the seed is printed with any failure); the batches mix
sequences that speculate with sequences that do not, and run with preemption, prefix caching and chunked prefill.
Two proposers drive it: prompt lookup (what a user runs) and a replay of the answer with random corruptions
(every proposal is then right or wrong on purpose, under sampling too). A deliberately broken acceptance rule
shows that the comparison can fail.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import tinyvllm.model.sampler as sampler
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.prefix_cache import PrefixCachingBlockManager
from tinyvllm.engine.sequence import Sequence
from tinyvllm.engine.spec_decode import NgramProposer, SpecDecodeStats
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.sampler import verify
from tinyvllm.model.step_plan import BLOCK_SIZE

K = 4           # proposals per step in these tests
VOCAB = 1000    # prompts draw ids below it


# ---- the parts: the acceptance rule, the proposer, the rollback ----

def test_verify_keeps_proposals_while_the_target_agrees_and_draws_once_per_emitted_token():
    drawn = []

    def target(j, accepted):
        drawn.append((j, list(accepted)))
        return [5, 6, 9, 1, 2][j]

    assert verify(target, [5, 6, 7, 8]) == [5, 6, 9]          # 2 kept, the target's 9 replaces the 7
    assert drawn == [(0, []), (1, [5]), (2, [5, 6])]          # a draw per emitted token, each after the kept ones
    assert verify(lambda j, a: [5, 6, 9, 1, 2][j], [5, 6, 9, 1]) == [5, 6, 9, 1, 2]   # all kept: k + 1 tokens
    assert verify(lambda j, a: 3, []) == [3]                  # no proposals: plain decoding


def test_ngram_proposes_what_followed_the_most_recent_match_longest_suffix_first():
    class Seq:
        def __init__(self, ids):
            self.token_ids = ids

    ngram = NgramProposer(min_n=1, max_n=3)
    assert ngram.propose(Seq([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]), 2) == [7, 8]   # the most recent of two
    assert ngram.propose(Seq([4, 2, 3, 5, 6, 1, 2, 3]), 3) == [5, 6, 1]             # "2 3" matches: n = 2
    assert ngram.propose(Seq([4, 5, 6, 7]), 3) == []                                  # nothing repeats
    assert ngram.propose(Seq([1, 2, 1]), 4) == [2, 1]                                 # what there is, up to k
    assert NgramProposer(min_n=2, max_n=3).propose(Seq([1, 5, 6, 1]), 2) == []        # a 1-gram is too short


def test_truncate_gives_back_the_blocks_only_dropped_tokens_used():
    blocks = BlockManager(8)
    blocks.allocate(0, 20)
    blocks.extend(0, 20)                      # 40 tokens: 3 blocks
    first_two = blocks.tables[0][:2]
    blocks.truncate(0, 17)
    assert (blocks.lengths[0], blocks.tables[0], blocks.num_free) == (17, first_two, 6)
    blocks.truncate(0, 16)
    assert (len(blocks.tables[0]), blocks.num_free) == (1, 7)
    with pytest.raises(TinyVLLMError):
        blocks.truncate(0, 17)                # only shorter: a rollback never invents tokens


def test_truncate_never_cuts_a_block_named_in_the_prefix_cache():
    blocks = PrefixCachingBlockManager(8)
    blocks.allocate(0, 40)
    blocks.cache_full_blocks(Sequence(0, list(range(40)), SamplingParams(), 64, set(), None))   # blocks 0, 1 named
    blocks.truncate(0, 2 * BLOCK_SIZE)        # the partial third block goes
    assert blocks.num_free == 6
    with pytest.raises(TinyVLLMError, match="prefix cache"):
        blocks.truncate(0, 2 * BLOCK_SIZE - 1)


def test_spec_stats_count_acceptance_and_tokens_per_verification():
    stats = SpecDecodeStats()
    stats.add(proposed=4, emitted=5)
    stats.add(proposed=4, emitted=1)
    assert (stats.acceptance_rate, stats.mean_accepted_length) == (0.5, 3.0)


# ---- settings ----

@pytest.mark.parametrize("settings, message", [
    (dict(speculative_method="medusa"), "speculative_method must be one of ngram"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens must be a positive"),
    (dict(prompt_lookup_min=5, prompt_lookup_max=3), "prompt_lookup_min .5. must not exceed"),
])
def test_a_wrong_speculation_setting_is_one_line(settings, message):
    with pytest.raises(TinyVLLMError, match=message) as caught:
        EngineConfig(**settings)
    assert "\n" not in str(caught.value)


def test_the_cli_has_the_speculation_flags():
    import argparse

    from tinyvllm.entrypoints.cli import add_engine_flags, engine_config
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    config = engine_config(parser.parse_args(["--speculative-method", "ngram", "--num-speculative-tokens", "3",
                                              "--prompt-lookup-max", "5", "--prompt-lookup-min", "1"]))
    assert (config.speculative_method, config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min) == ("ngram", 3, 5, 1)
    assert engine_config(parser.parse_args([])).speculative_method is None   # off by default
    config = engine_config(parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                              '"prompt_lookup_max": 5, "prompt_lookup_min": 1}']))
    assert (config.speculative_method, config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min) == ("ngram", 3, 5, 1)


@pytest.mark.parametrize("speculative_config, settings, message", [
    ({"method": "ngram", "k": 3}, {}, r"unknown keys \['k'\]; the keys are \['method'"),
    ('{"method": ngram}', {}, "is not JSON"),
    (["ngram"], {}, "must be an object"),
    ({"method": "ngram", "num_speculative_tokens": 3}, {"num_speculative_tokens": 5}, "given both"),
    ({"method": "eagle"}, {}, "speculative_method must be one of ngram"),
])
def test_a_wrong_speculative_config_is_one_line(speculative_config, settings, message):
    from tinyvllm.engine.engine_config import with_speculative_config
    with pytest.raises(TinyVLLMError, match=message) as caught:
        EngineConfig(**with_speculative_config(settings, speculative_config))
    assert "\n" not in str(caught.value)


def test_speculative_config_sets_what_the_flags_set():
    from tinyvllm.engine.engine_config import with_speculative_config
    given = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    assert with_speculative_config({"max_num_seqs": 8}, given) == {
        "max_num_seqs": 8, "speculative_method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}


def test_the_cli_refuses_a_bad_speculative_config_in_one_line():
    from tests.test_cli import assert_user_error, tinyvllm
    assert_user_error(tinyvllm("generate", "hi", "--speculative-config", "{ngram}", check=False), "not JSON")


# ---- the engine: the same answer with speculation on ----

class ReplayProposer:
    """Proposes the answer itself (known from a run without speculation), each token replaced by another with
    probability `noise`: every proposal is right or wrong on purpose, whatever the sampling."""

    def __init__(self, answers: dict[tuple, list[int]], noise: float, seed: int):
        self.answers, self.noise, self.rng = answers, noise, np.random.default_rng(seed)

    def propose(self, seq, k: int) -> list[int]:
        future = self.answers[tuple(seq.prompt_ids)][len(seq.output_ids):][:k]
        return [self.wrong(t) if self.rng.random() < self.noise else t for t in future]

    def wrong(self, token: int) -> int:
        return (token + int(self.rng.integers(1, VOCAB))) % VOCAB   # never the token itself


def random_prompts(rng, count: int) -> list[list[int]]:
    """Half repeat a random piece of text several times (prompt lookup finds matches), half are random."""
    prompts = []
    for i in range(count):
        piece = rng.integers(3, VOCAB, int(rng.integers(4, 12))).tolist()
        text = piece * int(rng.integers(2, 5)) if i % 2 == 0 else rng.integers(3, VOCAB, 20).tolist()
        prompts.append(text + rng.integers(3, VOCAB, int(rng.integers(1, 6))).tolist())
    return prompts


def random_params(rng, count: int, max_tokens: int = 24) -> list[SamplingParams]:
    """Greedy and seeded sampling with every knob: temperature, top-k, top-p, min-p, penalties, logprobs."""
    params = []
    for _ in range(count):
        greedy = rng.random() < 0.4
        params.append(SamplingParams(
            temperature=0.0 if greedy else float(rng.choice([0.3, 0.7, 1.0])),
            top_k=int(rng.choice([0, 5, 50])), top_p=float(rng.choice([1.0, 0.9])),
            min_p=float(rng.choice([0.0, 0.05])), seed=int(rng.integers(2**31)),
            repetition_penalty=float(rng.choice([1.0, 1.2])), frequency_penalty=float(rng.choice([0.0, 0.3])),
            presence_penalty=float(rng.choice([0.0, 0.4])), logprobs=int(rng.choice([0, 3])),
            max_tokens=int(rng.integers(1, max_tokens)), ignore_eos=True))
    return params


def mixed_params(rng, count: int) -> list[SamplingParams]:
    """random_params, but requests 0 and 2 (repetitive prompts) greedy with long answers: a random model's greedy
    answer soon repeats itself, so prompt lookup's guesses are kept there (under sampling, seldom)."""
    params = random_params(rng, count)
    params[0] = params[2] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    return params


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    """Every request through the engine together: per request (output ids, logprob entries, finish reason)."""
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(5000):
        if not llm.engine.has_work():
            break
        llm.engine.step()
    assert not llm.engine.has_work(), "requests left unfinished"
    blocks = llm.engine.scheduler.block_manager
    assert not blocks.tables, "blocks were not all given back"
    return [(s.output_ids, logprob_rows(s.logprobs), s.finish_reason) for s in seqs]


def logprob_rows(entries) -> list | None:
    return None if entries is None else [sorted((t, e.logprob, e.rank) for t, e in d.items()) for d in entries]


def differences(want: list, got: list, exact: bool = True) -> list[str]:
    """Where two runs' outputs differ: token ids, finish reasons, and logprobs (bitwise, or within 1e-4)."""
    found = []
    for i, ((ids_a, lp_a, why_a), (ids_b, lp_b, why_b)) in enumerate(zip(want, got)):
        if ids_a != ids_b or why_a != why_b:
            found.append(f"request {i}: {ids_a} ({why_a}) without speculation, {ids_b} ({why_b}) with it")
        elif lp_a is not None and (lp_a != lp_b if exact else not all(
                np.allclose([x[1] for x in a], [x[1] for x in b], atol=1e-4) for a, b in zip(lp_a, lp_b))):
            found.append(f"request {i}: the same tokens, other logprobs")
    return found


def make_llm(model_dir, invariant: bool = True, **settings) -> LLM:
    return LLM(str(model_dir), device="cpu", num_blocks=settings.pop("num_blocks", 128), batch_invariant=invariant,
               **settings)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return make_llm(tiny_model_dir)


@pytest.fixture(scope="module")
def speculating(tiny_model_dir):
    return make_llm(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=K, prompt_lookup_min=1)


@pytest.mark.parametrize("round", range(3))
def test_prompt_lookup_gives_the_answer_of_plain_decoding(plain, speculating, rng, round):
    """Random prompts and settings, one batch: bit for bit the same ids, logprobs and finish reasons."""
    prompts, params = random_prompts(rng, 8), mixed_params(rng, 8)
    before = SpecDecodeStats(**vars(speculating.engine.spec_stats))
    want, got = run(plain, prompts, params), run(speculating, prompts, params)
    assert not differences(want, got)
    stats = speculating.engine.spec_stats
    assert stats.proposed > before.proposed and stats.accepted > before.accepted, "nothing was speculated"


@pytest.mark.parametrize("noise", [0.0, 0.3, 1.0])
def test_any_proposals_give_the_answer_of_plain_decoding(plain, speculating, rng, noise):
    """Proposals right (noise 0: every one accepted, k + 1 tokens per step), wrong (1: none), or mixed,
    under greedy and sampled decoding: the answer is plain decoding's, and the counts say what happened."""
    prompts, params = random_prompts(rng, 6), random_params(rng, 6)
    want = run(plain, prompts, params)
    speculating.engine.scheduler.proposer = ReplayProposer(
        {tuple(p): ids for p, (ids, _, _) in zip(prompts, want)}, noise, int(rng.integers(2**31)))
    speculating.engine.spec_stats = stats = SpecDecodeStats()
    try:
        got = run(speculating, prompts, params)
    finally:
        speculating.engine.scheduler.proposer = NgramProposer(1, speculating.engine.config.prompt_lookup_max)
    assert not differences(want, got)
    assert stats.proposed > 0
    if noise == 0:
        assert stats.acceptance_rate == 1
    if noise == 1:
        assert stats.accepted == 0 and stats.mean_accepted_length == 1


def test_the_gate_rests_a_sequence_whose_guesses_are_mostly_wrong():
    from tinyvllm.engine.spec_decode import MIN_ACCEPTANCE, MIN_EVIDENCE, REST_STEPS, SpeculationGate
    gate = SpeculationGate(MIN_ACCEPTANCE["cpu"])
    kept_enough = int(np.ceil(MIN_ACCEPTANCE["cpu"] * MIN_EVIDENCE))
    gate.record(1, MIN_EVIDENCE, kept_enough)        # at the threshold: keeps proposing
    gate.record(2, MIN_EVIDENCE - 1, 0)              # too little evidence yet
    gate.record(3, MIN_EVIDENCE, kept_enough - 1)    # under it: rests
    assert gate.allows(1) and gate.allows(2)
    assert [gate.allows(3) for _ in range(REST_STEPS + 1)] == [False] * REST_STEPS + [True]
    gate.record(3, 1, 0)                             # counts start afresh after the rest
    assert gate.allows(3)
    gate.forget(1)
    assert gate.counts.keys() == {2, 3}


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_always_wrong_guesses_cost_few_verifications(plain, speculating, rng, noise):
    """A proposer always right verifies at every step; one always wrong, after MIN_EVIDENCE proposed tokens,
    rests REST_STEPS steps between tries: at most 2 verifications per REST_STEPS + 2 tokens, and the same answer."""
    from tinyvllm.engine.spec_decode import MIN_EVIDENCE, REST_STEPS
    prompts = random_prompts(rng, 1)
    greedy = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    want = run(plain, prompts, [greedy])
    speculating.engine.scheduler.proposer = ReplayProposer({tuple(prompts[0]): want[0][0]}, noise,
                                                           int(rng.integers(2**31)))
    speculating.engine.spec_stats = stats = SpecDecodeStats()
    try:
        got = run(speculating, prompts, [greedy])
    finally:
        speculating.engine.scheduler.proposer = NgramProposer(1, speculating.engine.config.prompt_lookup_max)
    assert not differences(want, got)
    tries = -(-MIN_EVIDENCE // K)   # verifications before the rate is trusted
    if noise == 1:
        assert stats.verifications <= tries * -(-80 // (REST_STEPS + tries)), stats
    else:
        assert stats.acceptance_rate == 1 and stats.verifications >= 80 // (K + 1), stats


def test_metrics_export_what_speculation_did():
    """vLLM's counters on /metrics, moved by the engine's cumulative counts: proposals, tokens, kept, per position."""
    from tinyvllm.engine.core_messages import Stats
    from tinyvllm.entrypoints.metrics import Metrics
    stats, metrics = SpecDecodeStats(), Metrics("m")
    for proposed, emitted in ((4, 5), (4, 1), (3, 3)):
        stats.add(proposed, emitted)
        metrics.engine_stats(Stats(spec_decode_num_drafts=stats.verifications,
                                   spec_decode_num_draft_tokens=stats.proposed,
                                   spec_decode_num_accepted_tokens=stats.accepted,
                                   spec_decode_accepted_per_position=tuple(stats.accepted_per_position)))
    text = metrics.render().decode()

    def sample(name: str) -> float:
        prefix = name if "{" in name else name + "{"   # a name with its labels, or summed over them
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))
    assert (sample("vllm:spec_decode_num_drafts_total"), sample("vllm:spec_decode_num_draft_tokens_total"),
            sample("vllm:spec_decode_num_accepted_tokens_total")) == (3, 11, 6)
    assert stats.accepted_per_position == [2, 2, 1, 1]
    for position, kept in enumerate(stats.accepted_per_position):
        assert sample(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{position}"') \
            == kept, position


def test_a_stop_token_or_max_tokens_inside_an_accepted_run_ends_the_output_there(plain, speculating, rng):
    """Proposals all right, so a step accepts up to K tokens: the stop token (a token of the answer chosen
    at random) and max_tokens fall inside such runs, and nothing past them is emitted."""
    prompts = random_prompts(rng, 6)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    answers = [ids for ids, _, _ in run(plain, prompts, [greedy] * 6)]
    # odd rows stop at a token of their answer (max_tokens = the answer's length, so the stop comes first), even rows
    # at a random max_tokens: both endings happen for every seed
    params = [SamplingParams(temperature=0, max_tokens=30 if i % 2 else int(rng.integers(2, 30)), ignore_eos=True,
                             stop_token_ids=[int(rng.choice(a[1:]))] if i % 2 else None)
              for i, a in enumerate(answers)]
    want = run(plain, prompts, params)
    speculating.engine.scheduler.proposer = ReplayProposer({tuple(p): a for p, a in zip(prompts, answers)}, 0, 0)
    try:
        got = run(speculating, prompts, params)
    finally:
        speculating.engine.scheduler.proposer = NgramProposer(1, speculating.engine.config.prompt_lookup_max)
    assert not differences(want, got)
    assert any(why == "stop" for _, _, why in got) and any(why == "length" for _, _, why in got)


@pytest.mark.slow   # many generations, with and without speculation
def test_preemption_prefix_caching_and_chunked_prefill_keep_the_answer(tiny_model_dir, plain, rng):
    """A pool too small for the batch (sequences are preempted and recomputed), prompts sharing a prefix
    (prefix-cache hits), a small step budget (prompts in chunks; proposals cut to what is left), proposals
    right and wrong in every step (the replay proposer). After
    every step, each block named in the prefix cache holds the sequence's own tokens, never a rejected one;
    every step stays within the budget."""
    budget = 24
    llm = make_llm(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=K, prompt_lookup_min=1,
                   num_blocks=14, max_num_seqs=6, max_num_batched_tokens=budget, long_prefill_token_threshold=10,
                   enable_prefix_caching=True)
    shared = (rng.integers(3, VOCAB, 7).tolist() * 3)[:20]
    prompts = [shared + p for p in random_prompts(rng, 8)]
    params = [replace(p, max_tokens=40) for p in random_params(rng, 8)]   # 6 running need 30 blocks, 14 exist
    want = run(plain, prompts, params)
    llm.engine.scheduler.proposer = ReplayProposer({tuple(p): ids for p, (ids, _, _) in zip(prompts, want)}, 0.3,
                                                   int(rng.integers(2**31)))   # guesses every step, kept or not
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    blocks = llm.engine.scheduler.block_manager
    while llm.engine.has_work():
        llm.engine.step()
        for seq in llm.engine.scheduler.running:
            for i, block in enumerate(blocks.tables[seq.seq_id]):
                if block in blocks.content:       # named in the cache: full of this sequence's computed tokens
                    assert i < blocks.lengths[seq.seq_id] // BLOCK_SIZE
                    assert blocks.content[block][1] == tuple(seq.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
    got = [(s.output_ids, logprob_rows(s.logprobs), s.finish_reason) for s in seqs]
    assert not differences(want, got)
    trace = llm.engine.trace_since(0)
    assert any(t.preempted for t in trace), "no preemption: the pool is too big for this test"
    assert sum(map(len, (t.chunks for t in trace))) > len(prompts), "no prompt was chunked"
    assert llm.engine.scheduler.cache_stats.hits > 0 and llm.engine.spec_stats.accepted > 0
    for t in trace:
        assert sum(t.chunks) + len(t.decode) + sum(t.proposed) <= budget, f"step {t.step} overran"
    assert not blocks.tables


def test_blocks_filled_by_verifications_serve_later_prompts_from_the_prefix_cache(tiny_model_dir, plain, rng):
    """A finished answer's blocks, filled a guess at a time, are found by a prompt that repeats it: their K/V
    must be those of its tokens (a rejected guess's K/V there would change the next answer)."""
    llm = make_llm(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=K, prompt_lookup_min=1)
    prompt = (rng.integers(3, VOCAB, 9).tolist() * 4)[:34]
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=2)
    [(answer, _, _)] = run(llm, [prompt], [greedy])
    follow_up = prompt + answer + rng.integers(3, VOCAB, 3).tolist()
    want, got = run(plain, [follow_up], [greedy]), run(llm, [follow_up], [greedy])
    assert not differences(want, got)
    hit, prompt_blocks = llm.engine.scheduler.cache_stats.hits, -(-len(prompt) // BLOCK_SIZE)
    assert hit > prompt_blocks * BLOCK_SIZE, f"only {hit} tokens were found cached: no block of the answer's alone"
    assert llm.engine.spec_stats.accepted > 0


def test_the_default_mode_gives_the_same_greedy_tokens(tiny_model_dir, rng):
    """Without the batch-invariant mode the verification chunk sums in other orders than decode steps: the
    logprobs may move in their last bits, and greedy tokens stay (unless two logits tie to ~1e-6). A sampled
    token may not: a draw that falls within rounding of a boundary between two tokens picks the other one,
    as it may without speculation when a batch changes size; the batch-invariant mode's identity is exact."""
    prompts = random_prompts(rng, 6)
    params = [replace(p, temperature=0.0, seed=None) for p in mixed_params(rng, 6)]   # greedy, penalties and all
    want = run(make_llm(tiny_model_dir, invariant=False), prompts, params)
    llm = make_llm(tiny_model_dir, invariant=False, speculative_method="ngram", prompt_lookup_min=1)
    assert not differences(want, run(llm, prompts, params), exact=False)
    assert llm.engine.spec_stats.proposed > 0, "nothing was speculated"   # kept or not: a random 1-layer draft may miss all


# ---- the comparison can fail: broken acceptance rules are caught ----

def accept_everything(target, proposals):
    """Wrong: trusts the proposer."""
    return [*proposals, target(len(proposals), proposals)]


def draw_every_position(target, proposals):
    """Wrong under sampling: the right tokens for greedy, but it draws at all k + 1 positions up front,
    so a seeded sequence's later draws come from other numbers than plain decoding's."""
    drawn = [target(j, proposals[:j]) for j in range(len(proposals) + 1)]
    kept = next((j for j, (d, p) in enumerate(zip(drawn, proposals)) if d != p), len(proposals))
    return drawn[:kept + 1]


@pytest.mark.parametrize("broken", [accept_everything, draw_every_position], ids=lambda f: f.__name__)
def test_a_broken_acceptance_rule_is_caught(plain, speculating, rng, monkeypatch, broken):
    prompts = random_prompts(rng, 8)
    params = [SamplingParams(temperature=0.0 if broken is accept_everything else 0.3, seed=int(rng.integers(2**31)),
                             max_tokens=24, ignore_eos=True) for _ in prompts]
    want = run(plain, prompts, params)
    monkeypatch.setattr(sampler, "verify", broken)
    assert differences(want, run(speculating, prompts, params)), f"{broken.__name__} went unnoticed"


def test_a_structured_output_is_never_speculated_and_still_matches(speculating, rng, monkeypatch):
    """Its mask covers the next position only, so the scheduler gives it no proposals; its output matches the
    regex (re.fullmatch, not ours), beside greedy sequences that may speculate."""
    import re

    from tinyvllm import StructuredOutputsParams
    pattern, verified = r"[ab]{3,12}", []
    schedule = speculating.engine.scheduler.schedule

    def recording():
        step = schedule()
        verified.extend(s.params.structured_outputs is not None for s in step.verifies)
        return step
    monkeypatch.setattr(speculating.engine.scheduler, "schedule", recording)
    params = [SamplingParams(temperature=1.0, seed=int(rng.integers(1 << 30)), max_tokens=16,
                             structured_outputs=StructuredOutputsParams(regex=pattern))] + \
        [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3
    outs = speculating.generate(random_prompts(rng, 4), params)
    assert not any(verified), "a structured output got proposals"
    assert re.fullmatch(pattern, outs[0].outputs[0].text), outs[0].outputs[0].text


# ---- early exit (self-speculation): the model's first layers draft, the whole model verifies ----

def early_exit(model_dir, layers: int = 1, invariant: bool = True, **settings) -> LLM:
    return make_llm(model_dir, invariant, speculative_config={"method": "early_exit", "num_speculative_tokens": K,
                                                              "num_draft_layers": layers}, **settings)


@pytest.mark.parametrize("layers, message", [
    (None, "early_exit needs num_draft_layers"),
    (0, "num_draft_layers must be a positive"),
    (2, "num_draft_layers must be 1 to 1 for this model of 2 layers"),
])
def test_a_wrong_draft_depth_is_one_line(tiny_model_dir, layers, message):
    config = {"method": "early_exit", "num_draft_layers": layers}
    with pytest.raises(TinyVLLMError, match=message) as caught:
        LLM(str(tiny_model_dir), device="cpu", speculative_config={k: v for k, v in config.items() if v is not None})
    assert "\n" not in str(caught.value)


def test_the_cli_refuses_a_draft_as_deep_as_the_model_in_one_line(tiny_model_dir):
    from tests.test_cli import assert_user_error, tinyvllm
    assert_user_error(tinyvllm("generate", "hi", "--model", str(tiny_model_dir), "--device", "cpu",
                               "--speculative-config", '{"method": "early_exit", "num_draft_layers": 2}', check=False),
                      "num_draft_layers must be 1 to 1")


@pytest.fixture(scope="module")
def self_speculating(tiny_model_dir):
    return early_exit(tiny_model_dir)


@pytest.mark.parametrize("round", range(2))
def test_early_exit_gives_the_answer_of_plain_decoding(plain, self_speculating, rng, round):
    """Random prompts and settings (greedy and seeded sampling, penalties, logprobs), one batch: bit for bit the same
    ids, logprobs and finish reasons as without speculation, whatever the one-layer draft guesses."""
    prompts, params = random_prompts(rng, 8), mixed_params(rng, 8)
    before = SpecDecodeStats(**vars(self_speculating.engine.spec_stats))
    want, got = run(plain, prompts, params), run(self_speculating, prompts, params)
    assert not differences(want, got)
    assert self_speculating.engine.spec_stats.proposed > before.proposed, "nothing was speculated"


def test_early_exit_in_the_default_mode_gives_the_same_greedy_tokens(tiny_model_dir, rng):
    prompts = random_prompts(rng, 6)
    params = [replace(p, temperature=0.0, seed=None) for p in mixed_params(rng, 6)]
    want = run(make_llm(tiny_model_dir, invariant=False), prompts, params)
    llm = early_exit(tiny_model_dir, invariant=False)
    assert not differences(want, run(llm, prompts, params), exact=False)
    assert llm.engine.spec_stats.proposed > 0, "nothing was speculated"   # a random 1-layer draft may miss every guess


def test_the_drafts_kv_is_the_verifications_so_the_draft_needs_no_cache(tmp_path, rng, monkeypatch):
    """The draft writes layers < L of the slots the verification then overwrites, all layers: for those layers
    and the same tokens it writes the same K/V (bit for bit in the batch-invariant mode), which is why the draft
    needs no cache of its own. A 3-layer model, a 2-layer draft: layer 1's K/V depend on the context too."""
    import tinyvllm.model.runner as runner
    from tests.conftest import TINY_DIMS
    from tinyvllm.formats.checkpoints import synth_model
    model_dir = synth_model("smollm2-135m", tmp_path / "three", seed=5, **{**TINY_DIMS, "num_hidden_layers": 3})
    llm = early_exit(model_dir, layers=2)
    drafted = []

    def recording(model, pool, plan):
        plan = with_drafts(model, pool, plan)
        slots = [slot for s in plan.verifies for slot in s.slots[:s.proposed]]   # positions p .. p + k - 1
        drafted.append((slots, [(pool.k[i][slots].copy(), pool.v[i][slots].copy()) for i in range(2)]))
        return plan
    with_drafts = runner.with_drafts
    monkeypatch.setattr(runner, "with_drafts", recording)
    llm.add_request(random_prompts(rng, 1)[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while not drafted:
        llm.engine.step()
    slots, written = drafted[0]
    for layer, (k, v) in enumerate(written):
        assert np.array_equal(llm.engine.pool.k[layer][slots], k) and np.array_equal(llm.engine.pool.v[layer][slots], v)


def test_early_exit_on_the_default_model_gives_the_answer_of_plain_decoding(default_model_dir):
    """SmolLM2-135M (30 layers), a 24-layer draft, three prompts in one batch: bit for bit in the batch-invariant mode."""
    plain = make_llm(default_model_dir, num_blocks=32)
    prompts = [plain.tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):",
                                                          "Once upon a time, a small robot")]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)] * len(prompts)
    want = run(plain, prompts, params)
    llm = early_exit(default_model_dir, layers=24, num_blocks=32)
    assert not differences(want, run(llm, prompts, params))
    assert llm.engine.spec_stats.proposed > 0


# ---- never lose at large batch ----

def test_a_large_batch_proposes_nothing_and_a_small_one_does(self_speculating, rng, monkeypatch):
    """More than max_speculating_batch sequences decoding (MAX_SPECULATING_BATCH: the step is compute-bound):
    nobody proposes; once the longer answers run alone, they do."""
    scheduler, planned = self_speculating.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        step = schedule()
        planned.append((len(step.decodes) + len(step.verifies), len(step.verifies)))
        return step
    monkeypatch.setattr(scheduler, "schedule", recording)
    monkeypatch.setattr(scheduler, "max_speculating_batch", 3)
    params = [SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True) for tokens in (6, 8, 10, 30, 30)]
    run(self_speculating, random_prompts(rng, 5), params)
    assert all(not verifying for decoding, verifying in planned if decoding > 3), planned
    assert any(verifying for decoding, verifying in planned if decoding <= 3), "a small batch never proposed"
