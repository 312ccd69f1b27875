"""Chapter 7 on the CPU: continuous batching must not change anyone's answer.

- 16 prompts of different lengths generated together give each the greedy tokens it gets alone;
- the same with preemption forced by a tiny pool, and with prefix caching on a shared system prompt;
- a soak test on a tiny random model: 1,000 requests arriving at random steps, random lengths.
"""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.sequence import Status

QUESTIONS = ["What is 2+2?", "Name a color.", "Say hello.", "Capital of France?", "Why is the sea salty?",
             "Write a haiku about autumn.", "List three prime numbers.", "What is Python?",
             "Translate 'good morning' to French.", "How many legs does a spider have?",
             "Give me a synonym for happy.", "What does a CPU do?", "Tell me a fun fact about cats.",
             "Spell 'necessary' backwards.", "What is the boiling point of water?", "Suggest a name for a dog."]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, device="cpu", num_blocks=400)


@pytest.fixture(scope="module")
def prompts(llm):
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [p + p[-5:] * (i % 4) for i, p in enumerate(ids)]  # lengths spread further apart


@pytest.fixture(scope="module")
def alone(llm, prompts):
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


@pytest.mark.slow   # the `alone` fixture generates sixteen prompts one by one: minutes on two cores
def test_sixteen_prompts_together_equal_each_alone(llm, prompts, alone):
    together = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == alone
    engine = llm.engine
    steps = engine.trace_since(engine.steps - len(max(alone, key=len)) - 2)
    assert max(len(s.decode) for s in steps) == 16          # really batched: all 16 decoding at once
    assert llm.engine.scheduler.block_manager.num_free == 400


@pytest.mark.slow
def test_preemption_in_a_tiny_pool_changes_no_answer(default_model_dir, prompts, alone):
    tiny = LLM(default_model_dir, device="cpu", num_blocks=24)  # room for ~6 of the 16 at once
    outs = tiny.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert sum(o.timings["preemptions"] for o in outs) > 0, "the pool was meant to run out"
    assert tiny.engine.scheduler.block_manager.num_free == 24 and not tiny.engine.scheduler.block_manager.tables


@pytest.mark.slow   # the default model generating
def test_prefix_caching_on_a_shared_system_prompt(default_model_dir):
    system = {"role": "system", "content": "You are a terse assistant for a hardware store. " * 6}
    convs = [[system, {"role": "user", "content": q}] for q in QUESTIONS[:6]]
    plain = LLM(default_model_dir, device="cpu", num_blocks=200)
    cached = LLM(default_model_dir, device="cpu", num_blocks=200, enable_prefix_caching=True)
    expected = [o.token_ids for o in plain.chat(convs, GREEDY)]
    first = cached.chat(convs[:1], GREEDY)                 # fills the cache with the system prompt's blocks
    rest = cached.chat(convs[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == expected
    system_blocks = len(cached.tokenizer.apply_chat_template(convs[0][:1])) // 16
    assert cached.engine.scheduler.cache_stats.hits >= 5 * system_blocks * 16   # in tokens
    blocks = cached.engine.scheduler.block_manager
    assert blocks.num_free == 200 and not blocks.tables     # cached blocks are evictable, so they count as free


@pytest.mark.slow
def test_soak_thousand_requests_random_arrivals(tiny_llama_dir):
    """A tiny model, 1,000 requests with random prompt and output lengths arriving over the steps: every
    one completes with exactly its tokens, nobody is overtaken at admission, the pool ends full."""
    llm = LLM(tiny_llama_dir, device="cpu", num_blocks=120, max_num_seqs=48, max_num_batched_tokens=512)
    engine, rng = llm.engine, np.random.default_rng(0)
    arrivals = np.sort(rng.integers(0, 600, 1000))
    pending, seqs, admitted, preempted = list(range(1000)), [], [], 0
    step = 0
    while pending or engine.has_work():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            prompt = rng.integers(0, llm.model_config.vocab_size, int(rng.integers(1, 200))).tolist()
            params = SamplingParams(temperature=float(rng.choice([0, 0.8])), max_tokens=int(rng.integers(1, 40)),
                                    ignore_eos=True, seed=i)
            seqs.append(llm.add_request(prompt, params))
        engine.step()
        admitted += [s for s in engine.trace[-1].prefill if s not in admitted]
        preempted += len(engine.trace[-1].preempted)  # counted as it happens: the trace keeps recent steps only
        step += 1
    assert all(s.status is Status.FINISHED and len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert admitted == sorted(admitted), "a request was admitted before one that arrived earlier"
    assert llm.engine.scheduler.block_manager.num_free == 120 and not llm.engine.scheduler.block_manager.tables
    assert preempted, "the soak was meant to preempt"


def test_graph_inputs_written_incrementally_equal_a_full_rewrite():
    """CUDA-graph decode keeps its host inputs between steps and rewrites only what changed; after
    random admissions, decodes, departures, preemptions (a freed sequence comes back with new blocks) and
    rollbacks (a table cut, then grown again with other blocks), every row must still hold exactly its
    sequence's table, slot, position, length and fed row."""
    from tinyvllm.engine.block_manager import BLOCK_SIZE, BlockManager, blocks_for, plan_decode
    from tinyvllm.model.cuda_graphs import DecodeInputs, buckets
    rng = np.random.default_rng(0)
    blocks, scratch = BlockManager(num_blocks=4000), 4000
    host = DecodeInputs(rows=64, width=64, scratch_block=scratch)
    host.tables[:] = -7                                  # poison: a row never written shows up
    running: list[int] = []
    for step in range(300):
        for s in rng.choice(10_000, rng.integers(0, 3), replace=False).tolist():  # admissions
            if s not in blocks.lengths and len(running) < 60:
                blocks.allocate(s, int(rng.integers(1, 200)))
                running.append(s)
        if running and rng.random() < 0.1:               # a departure or a preemption shifts the rows
            s = running.pop(int(rng.integers(len(running))))
            blocks.free(s)
            if rng.random() < 0.5:                       # preempted: back with the same id, new blocks
                blocks.allocate(s, int(rng.integers(1, 200)))
                running.insert(int(rng.integers(len(running) + 1)), s)
        if not running:
            continue
        if rng.random() < 0.3:   # a verification (chapter 10): k more tokens' blocks written, the rejected dropped
            s = running[int(rng.integers(len(running)))]
            k = int(rng.integers(1, 40))
            blocks.extend(s, k)
            host.fill(plan_decode(blocks, running, [0] * len(running)), next(b for b in buckets(64) if b >= len(running)))
            blocks.truncate(s, blocks.lengths[s] - int(rng.integers(0, k + 2)))
        before = {s: blocks.lengths[s] for s in running}
        tokens = rng.integers(0, 32, len(running)).tolist()
        size = next(b for b in buckets(64) if b >= len(running))
        fed = rng.integers(-1, 64, len(running)).tolist() if rng.random() < 0.5 else None   # async scheduling's rows
        columns = host.fill(plan_decode(blocks, running, tokens), size, fed)
        assert columns == max(blocks_for(before[s] + 1) for s in running)
        for row, s in enumerate(running):
            table = blocks.tables[s]
            assert host.tables[row, :len(table)].tolist() == table
            p = before[s]
            assert host.vectors[:, row].tolist() == [tokens[row], p, table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE,
                                                     p + 1, -1 if fed is None else fed[row]]
        for row in range(len(running), size):            # padding rows: one token in the scratch block
            assert host.tables[row, 0] == scratch
            assert host.vectors[:, row].tolist() == [0, 0, scratch * BLOCK_SIZE, 1, -1]


def test_a_scheduler_that_admits_nobody_is_an_error_not_a_hang(default_model_dir, monkeypatch):
    """A broken admit() (as a student's first attempt may be) must stop the loop with a clear message."""
    from tinyvllm.engine import scheduler
    from tinyvllm.errors import TinyVLLMError
    llm = LLM(default_model_dir, device="cpu", num_blocks=40)
    monkeypatch.setattr(scheduler, "admit", lambda sched, step, free, budget: None)
    with pytest.raises(TinyVLLMError, match="runs nothing while 1 requests wait"):
        llm.generate([[1, 2, 3]], GREEDY)
