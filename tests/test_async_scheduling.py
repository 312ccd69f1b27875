"""Chapter 7: async scheduling — step N + 1 planned and launched before step N's tokens are read back (engine.py).

The engine turns it on where it pays, on a GPU; here it is turned on by hand (engine.runs_ahead) on the CPU, where
the pipeline is the same code: the plan with PENDING_TOKEN inputs, the runner's Feed, the tokens drawn in launch. The
claims: the tokens are those of one step at a time (bit for bit, in the batch-invariant mode, through greedy and
seeded sampling, stop tokens, max_tokens, preemption, chunked prefill and prefix caching); the engine does run ahead
(each test counts the fed launches, so a pipeline that never engages fails); requests that need their tokens on the
host (penalties, logprobs, structured outputs) still get theirs; an abort while a step runs ahead loses nothing of the
others; the prefix cache names a block only with its real tokens. Random prompts and settings come from the `rng`
fixture (the seed is printed with any failure).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.prefix_cache import extend_chain
from tinyvllm.engine.sequence import Status
from tinyvllm.model.step_plan import BLOCK_SIZE

VOCAB = 1000   # prompts draw ids below it


def make_llm(model_dir, ahead: bool, **settings) -> LLM:
    """A CPU engine in the batch-invariant mode (a row's numbers do not depend on the rows beside: running ahead
    changes which rows share a step), running ahead or not; it counts the launches fed from the step before."""
    llm = LLM(str(model_dir), device="cpu", batch_invariant=True, num_blocks=settings.pop("num_blocks", 128),
              **settings)
    llm.engine.runs_ahead = ahead
    runner, llm.fed = llm.engine.runner, 0
    launch = runner.launch

    def counting(plan, feed=None):
        llm.fed += feed is not None
        return launch(plan, feed)
    runner.launch = counting
    return llm


def random_prompts(rng, count: int, shared: int = 0) -> list[list[int]]:
    """`shared` tokens common to all (a system prompt: prefix-cache hits), then 3 to 60 of their own."""
    head = rng.integers(3, VOCAB, shared).tolist()
    return [head + rng.integers(3, VOCAB, int(rng.integers(3, 60))).tolist() for _ in range(count)]


def plain_params(rng, count: int, vocab_size: int) -> list[SamplingParams]:
    """Greedy, sampled and cut, seeded; each with a twentieth of the vocabulary as stop tokens (a random model stops
    early at some) and its own max_tokens: every way a sequence ends."""
    params = []
    for i in range(count):
        greedy = rng.random() < 0.4
        params.append(SamplingParams(
            temperature=0.0 if greedy else float(rng.choice([0.5, 1.0])), top_k=int(rng.choice([0, 8])),
            top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(2**31)),
            stop_token_ids=rng.integers(3, vocab_size, vocab_size // 20).tolist(), max_tokens=int(rng.integers(1, 40)),
            ignore_eos=True))
    return params


def run(llm: LLM, prompts, params) -> list[tuple]:
    """Every request together, step by step: per request (output ids, finish reason); the pool whole afterwards."""
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    while llm.engine.has_work():
        llm.engine.step()
    blocks = llm.engine.scheduler.block_manager
    assert not blocks.tables and blocks.num_free == blocks.num_blocks, "blocks were not all given back"
    assert all(s.pending == 0 for s in seqs), "a token counted as on its way never arrived"
    return [(s.output_ids, s.finish_reason, s.preemptions) for s in seqs]


# the small pool: 8 blocks of 16 for 12 prompts of 3 to 59 tokens, a third of them asking for 40 tokens without stop
# tokens, so that sequences outgrow the pool (random lengths alone once gave a run without preemption)
@pytest.mark.parametrize("settings", [
    {},                                                     # room for everyone: decodes and admissions
    {"num_blocks": 8, "max_num_batched_tokens": 32},        # a small pool (preemption) and chunked prompts
    {"num_blocks": 40, "enable_prefix_caching": True},      # a shared system prompt found in the cache
])
def test_running_ahead_gives_the_tokens_of_one_step_at_a_time(tiny_model_dir, rng, settings):
    prompts = random_prompts(rng, 12, shared=2 * BLOCK_SIZE if settings.get("enable_prefix_caching") else 0)
    one_at_a_time, ahead = make_llm(tiny_model_dir, False, **settings), make_llm(tiny_model_dir, True, **settings)
    params = plain_params(rng, 12, ahead.model_config.vocab_size)
    if "num_blocks" in settings and settings["num_blocks"] < 20:
        params[::3] = [replace(p, max_tokens=40, stop_token_ids=[]) for p in params[::3]]
    want, got = run(one_at_a_time, prompts, params), run(ahead, prompts, params)
    assert [w[:2] for w in want] == [g[:2] for g in got]
    assert one_at_a_time.fed == 0 and ahead.fed > ahead.engine.steps // 2, \
        f"ran ahead at {ahead.fed} of {ahead.engine.steps} steps"
    reasons = {w[1] for w in want}
    assert reasons == {"stop", "length"}, f"every way to end should be tried, got {reasons}"
    if "num_blocks" in settings and settings["num_blocks"] < 20:
        assert any(w[2] for w in want) and any(g[2] for g in got), "the small pool should preempt"


def test_requests_that_need_their_tokens_on_the_host_still_get_them(tiny_model_dir, rng):
    """Penalties count the output on the host and logprobs are read there: a step with one of them is sampled in
    finish, and the step after it waits for its tokens. The answers are the same; the others still run ahead."""
    one_at_a_time, ahead = make_llm(tiny_model_dir, False), make_llm(tiny_model_dir, True)
    prompts, params = random_prompts(rng, 8), plain_params(rng, 8, ahead.model_config.vocab_size)
    params[1] = SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3, max_tokens=6, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, logprobs=2, max_tokens=4, ignore_eos=True)
    params[6] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)   # runs on after those two end
    want, got = run(one_at_a_time, prompts, params), run(ahead, prompts, params)
    assert [w[:2] for w in want] == [g[:2] for g in got]
    assert 0 < ahead.fed < ahead.engine.steps, f"ran ahead at {ahead.fed} of {ahead.engine.steps} steps"


def test_an_abort_while_a_step_runs_ahead_loses_nothing_of_the_others(tiny_model_dir, rng):
    prompts = random_prompts(rng, 4)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 4
    want = run(make_llm(tiny_model_dir, False), prompts, params)
    llm = make_llm(tiny_model_dir, True)
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    while not (llm.engine.ahead and seqs[2] in llm.engine.ahead.step.decodes):
        llm.engine.step()
    kept = list(seqs[2].output_ids)
    llm.engine.abort(seqs[2])      # its token of the step in flight, and of the one ahead, are dropped
    while llm.engine.has_work():
        llm.engine.step()
    assert seqs[2].status is Status.FINISHED and seqs[2].output_ids == kept
    for i in (0, 1, 3):
        assert seqs[i].output_ids == want[i][0], f"request {i}"
    assert not llm.engine.scheduler.block_manager.tables


def test_the_prefix_cache_names_a_block_only_with_its_real_tokens(tiny_model_dir, rng):
    """Running ahead, a decode's input token is on the device when its block fills: the block is named later, once the
    host has it. Every chain of hashes must be the one the final tokens give, and a prompt that repeats a whole answer
    finds its blocks."""
    llm = make_llm(tiny_model_dir, True, enable_prefix_caching=True)
    prompts = random_prompts(rng, 3)
    seqs = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=int(rng.integers(40, 70)), ignore_eos=True))
            for p in prompts]
    while llm.engine.has_work():
        llm.engine.step()
    for seq in seqs:
        chain: list[int] = []
        extend_chain(chain, seq.token_ids, len(seq.block_hashes))
        assert seq.block_hashes == chain, f"sequence {seq.seq_id}: a block named before its tokens were known"
        assert len(seq.block_hashes) >= (len(seq) - 2) // BLOCK_SIZE   # named at most a block late
    again = llm.add_request(seqs[0].token_ids + [7], SamplingParams(max_tokens=1))
    llm.engine.step()
    assert again.num_cached >= (len(seqs[0]) - 2) // BLOCK_SIZE * BLOCK_SIZE


def test_the_engine_runs_ahead_on_a_gpu_only(tiny_model_dir):
    """On the CPU the model computes while the host waits: nothing to hide, and the setting leaves it off."""
    llm = LLM(str(tiny_model_dir), device="cpu", num_blocks=32)
    assert llm.engine.config.async_scheduling and not llm.engine.runs_ahead
