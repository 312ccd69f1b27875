"""The Python API end to end on the default model: chat, raw prompts, streaming, stop strings, limits, seeds,
n samples per request, one request's failure kept to itself, and the seed and temperature flags of the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import tinyvllm.model.sampler
from tinyvllm import LLM, SamplingParams, TinyVLLMError
from tinyvllm.entrypoints.llm import CompletionOutput, RequestOutput

POEM = [{"role": "user", "content": "Write a poem about the sea."}]
# Replies made of multi-byte characters that the model spells one UTF-8 fragment per token
NON_ASCII_CHATS = ["How do you write 'cat' in Japanese? Answer with the word only.",
                   "Write the word 'hello' in Chinese characters."]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    llm = LLM("default", device="cpu")
    assert llm.model_dir == default_model_dir
    return llm


@pytest.fixture(scope="module")
def poem(llm):
    """40 greedy tokens of a poem, no stop strings: the text every stop-string test cuts."""
    out = llm.chat(POEM, SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.outputs[0].finish_reason == "length" and "\n" in out.text
    return out


def stream_text(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> tuple[list[str], RequestOutput]:
    """The chunks LLM.stream yields, and the finished RequestOutput."""
    out = RequestOutput(None, prompt_ids, [CompletionOutput()])
    return list(llm.stream(prompt_ids, params, out)), out


def test_chat_answers_the_capital_of_france(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.text
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(messages)
    assert out.outputs[0].finish_reason == "stop" and out.token_ids[-1] in llm.stop_token_ids
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])  # the stop token is not part of the text


def test_generate_raw_prompts_in_order(llm):
    prompts = ["The capital of France is", "One, two, three, four,"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert [o.prompt for o in outs] == prompts
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)  # raw: no template, no special tokens
        assert out.outputs[0].finish_reason == "length" and len(out.token_ids) == 6
        assert out.text == llm.tokenizer.decode(out.token_ids)
    assert "Paris" in outs[0].text
    assert "five" in outs[1].text.lower()
    # token ids in, same tokens out
    [by_ids] = llm.generate([outs[0].prompt_token_ids], SamplingParams(temperature=0, max_tokens=6))
    assert by_ids.token_ids == outs[0].token_ids and by_ids.prompt is None


@pytest.mark.parametrize("question", NON_ASCII_CHATS)
def test_stream_never_splits_a_character(llm, question):
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    chunks, out = stream_text(llm, ids, SamplingParams(temperature=0, max_tokens=48))
    text = out.outputs[0].text
    # the test means something only if the model answered in valid UTF-8 that some tokens cut mid-character
    assert out.outputs[0].finish_reason == "stop"
    assert llm.tokenizer.decode_bytes(out.token_ids[:-1]).decode("utf-8") == text
    assert any(ord(c) > 0x7F for c in text)
    cut = [t for t in out.token_ids if "\ufffd" in llm.tokenizer.decode([t])]
    assert cut, "no token ended mid-character; pick a prompt whose reply does"
    assert "".join(chunks) == text
    assert not [c for c in chunks if "\ufffd" in c]


def test_stream_holds_back_partial_utf8_of_forced_tokens(llm, monkeypatch):
    """Force the sampler to emit the tokens of an emoji-heavy string: every yielded chunk is whole characters."""
    target = "🙂 café 日本語 🚀🚀 ok"
    forced = llm.tokenizer.encode(target) + [llm.stop_token_ids[0]]
    assert any("\ufffd" in llm.tokenizer.decode([t]) for t in forced)  # some tokens hold partial characters
    script = iter(forced)
    monkeypatch.setattr(tinyvllm.model.sampler, "sample_rows_on_device",
                        lambda logits, params, rngs: np.array([next(script)]))
    chunks, out = stream_text(llm, llm.tokenizer.encode("Hi"), SamplingParams(temperature=1.0, max_tokens=64))
    assert out.outputs[0].text == "".join(chunks) == target
    assert not [c for c in chunks if "\ufffd" in c]
    assert len(chunks) > 3  # streamed piece by piece, not in one final flush


@pytest.mark.parametrize("stop", ["ocean", "ows pl", ",\n", ["dreams", "where"]])
def test_stop_string_cuts_exactly_where_it_begins(llm, poem, stop):
    full = poem.text
    stops = [stop] if isinstance(stop, str) else stop
    first = min(full.find(s) for s in stops if s in full)  # the earliest stop string in the text wins
    assert first > 0, f"{stop!r} does not occur in {full!r}"
    chunks, out = stream_text(llm, poem.prompt_token_ids, SamplingParams(temperature=0, max_tokens=40, stop=stop))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == "".join(chunks) == full[:first]
    assert out.token_ids == poem.token_ids[:len(out.token_ids)]  # the same tokens, up to the stop


def test_stop_string_through_chat(llm, poem):
    [out] = llm.chat(POEM, SamplingParams(temperature=0, max_tokens=40, stop="where"))
    assert out.outputs[0].finish_reason == "stop" and out.text == poem.text[:poem.text.find("where")]


def test_stop_string_that_never_appears_changes_nothing(llm, poem):
    [out] = llm.chat(POEM, SamplingParams(temperature=0, max_tokens=12, stop=["@@@", "zebra crossing"]))
    assert out.outputs[0].finish_reason == "length"
    assert out.text == llm.tokenizer.decode(poem.token_ids[:12])  # held-back text is released at the end


def test_stop_token_ids_end_the_output_and_stay_out_of_the_text(llm, poem):
    stop_at = 6
    token = poem.token_ids[stop_at]
    first = poem.token_ids.index(token)
    [out] = llm.chat(POEM, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[token]))
    assert out.outputs[0].finish_reason == "stop"
    assert out.token_ids == poem.token_ids[:first + 1]
    assert out.text == llm.tokenizer.decode(poem.token_ids[:first])


def test_max_tokens_ends_with_length(llm):
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=3))
    assert out.outputs[0].finish_reason == "length"
    assert len(out.token_ids) == 3


def test_seed_reproduces_and_another_seed_differs(llm):
    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=0.8, seed=seed, max_tokens=16, ignore_eos=True)
        return llm.chat(POEM, params)[0].token_ids

    first, again, other = run(1234), run(1234), run(4321)
    assert len(first) == 16
    assert first == again
    assert first != other


def test_prompt_longer_than_the_context_window_is_refused(llm):
    window = llm.max_model_len
    with pytest.raises(TinyVLLMError, match="context window"):
        llm.generate([[5] * window], SamplingParams(max_tokens=1))
    with pytest.raises(TinyVLLMError, match="context window"):
        llm.generate("hello " * window, SamplingParams(max_tokens=1))
    with pytest.raises(TinyVLLMError, match="context window"):
        next(llm.stream([5] * (window + 10), SamplingParams(max_tokens=1)))


@pytest.mark.parametrize("prompt_ids, message", [([], "empty"), ([1, 49152], "outside the vocabulary"),
                                                 ([-1], "outside the vocabulary")])
def test_bad_prompt_ids_are_refused(llm, prompt_ids, message):
    with pytest.raises(TinyVLLMError, match=message):
        next(llm.stream(prompt_ids, SamplingParams(max_tokens=1)))


# ---------------------------------------------------------------- seeds and tiny temperatures

@pytest.mark.parametrize("seed", [-1, 2**63 - 1, -2**63])
def test_extreme_seeds_work_and_reproduce(llm, seed):
    params = SamplingParams(temperature=0.9, seed=seed, max_tokens=10, ignore_eos=True)
    first, again = (llm.chat(POEM, params)[0].token_ids for _ in range(2))
    assert len(first) == 10 and first == again, f"seed {seed}"


def test_tiny_temperature_equals_greedy(llm, poem):
    for temperature in (1e-320, 1e-6):
        [out] = llm.chat(POEM, SamplingParams(temperature=temperature, seed=9, max_tokens=12))
        assert out.token_ids == poem.token_ids[:12], f"temperature {temperature}"


# ---------------------------------------------------------------- n samples per request

def test_n_samples_are_the_children_seed_plus_index(llm):
    """vLLM's parallel sampling: sample i is the request run alone with n=1 and seed + i."""
    seed = 2**63 - 3  # the last children's seeds pass int64's end: still accepted, still reproducible
    params = SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
    [out] = llm.chat(POEM, params)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.token_ids == out.outputs[0].token_ids
    for i, sample_i in enumerate(out.outputs):
        [alone] = llm.chat(POEM, SamplingParams(temperature=1.0, seed=seed + i, max_tokens=8, ignore_eos=True))
        assert sample_i.token_ids == alone.token_ids and sample_i.text == alone.text, f"sample {i} (seed {seed + i})"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "the samples should differ"


def test_n_samples_next_to_single_requests(llm):
    outs = llm.generate(["The sea is", "One, two,"], [SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=11, ignore_eos=True),
                                                      SamplingParams(temperature=0, max_tokens=5)])
    assert [len(o.outputs) for o in outs] == [3, 1]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for o in outs for c in o.outputs)
    assert llm.engine.scheduler.block_manager.num_free == llm.engine.pool.num_blocks


@pytest.mark.slow   # the default model generating
def test_n_samples_share_the_prompt_through_the_prefix_cache(default_model_dir, llm):
    """With prefix caching, samples 1..n-1 find the prompt's full blocks cached by sample 0: they are not
    recomputed, and the tokens are those of the same request without a cache."""
    system = {"role": "system", "content": "You are a poet of the sea who answers in short verses. " * 4}
    chat = [system, POEM[0]]
    prompt_blocks = (len(llm.tokenizer.apply_chat_template(chat)) - 1) // 16
    assert prompt_blocks >= 3
    params = SamplingParams(n=3, temperature=0.8, seed=77, max_tokens=6, ignore_eos=True)
    cached = LLM(default_model_dir, device="cpu", num_blocks=64, enable_prefix_caching=True)
    [out] = cached.chat(chat, params)
    assert cached.engine.scheduler.cache_stats.hits == 2 * prompt_blocks * 16   # tokens of the shared blocks
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in llm.chat(chat, params)[0].outputs]


def test_stream_and_add_request_take_one_sample(llm):
    with pytest.raises(TinyVLLMError, match="child"):
        next(llm.stream([1, 2, 3], SamplingParams(n=2, temperature=1.0)))
    assert not llm.engine.has_work()


# ---------------------------------------------------------------- one request's failure is its own

BAD = 3  # the request that fails: sampled (it goes through sample_rows()), the only one asking for logprobs


@pytest.fixture(scope="module")
def eight_requests(llm):
    """8 chat requests, greedy and sampled (seeded) in turn, and the tokens each gets without any fault."""
    questions = ["What is 2+2?", "Name a color.", "Say hello.", "Capital of France?", "Why is the sea salty?",
                 "Write a haiku.", "List three primes.", "What is Python?"]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = [SamplingParams(temperature=0.8 * (i % 2), top_k=5, seed=100 + i, max_tokens=8, ignore_eos=True,
                             logprobs=2 if i == BAD else None) for i in range(8)]
    return prompts, params, [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("fault", ["sample", "append", "logprobs"])
def test_a_failure_in_one_sequence_fails_it_alone(llm, eight_requests, monkeypatch, caplog, fault):
    """8 requests in one batch; the chosen one fails at its third token (in the sampler, in its own
    bookkeeping, or in the batch's logprobs, which fails the rows that asked for them). The others get
    exactly the tokens they get without the fault, and the pool is whole afterwards."""
    prompts, params, expected = eight_requests
    bad, calls = BAD, {"n": 0}

    def third_call_fails(real):
        def wrapped(*args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected fault\nwith a second line")
            return real(*args)
        return wrapped

    if fault == "sample":   # the bad request's third token fails to draw, in a batch or alone
        real_rows = tinyvllm.model.sampler.sample_rows_on_device

        def sample_rows(logits, params, rngs):
            if any(p.seed == 100 + bad for p in params):
                if calls["n"] == 2:
                    raise RuntimeError("injected fault\nwith a second line")
                calls["n"] += 1
            return real_rows(logits, params, rngs)
        monkeypatch.setattr(tinyvllm.model.sampler, "sample_rows_on_device", sample_rows)
    elif fault == "logprobs":
        monkeypatch.setattr(tinyvllm.model.sampler, "raw_logprobs", third_call_fails(tinyvllm.model.sampler.raw_logprobs))
    seqs = [llm.add_request(p, s) for p, s in zip(prompts, params)]
    if fault == "append":
        seqs[bad].append = third_call_fails(seqs[bad].append)
    with caplog.at_level("ERROR", logger="tinyvllm.engine.engine"):
        while llm.engine.has_work():
            llm.engine.step()
    assert seqs[bad].finish_reason == "error" and seqs[bad].error == "RuntimeError: injected fault"
    assert seqs[bad].output_ids == expected[bad][:2]
    for i, seq in enumerate(seqs):
        if i != bad:
            assert seq.output_ids == expected[i] and seq.finish_reason == "length", f"request {i} (seed {100 + i})"
    assert llm.engine.scheduler.block_manager.num_free == llm.engine.pool.num_blocks and not llm.engine.scheduler.block_manager.tables
    [record] = [r for r in caplog.records if r.name == "tinyvllm.engine.engine"]
    assert record.exc_info and f"sequence {seqs[bad].seq_id}" in record.getMessage()


# ---------------------------------------------------------------- limits that fit the pool

def test_max_model_len_is_what_the_pool_holds(default_model_dir, caplog):
    """A pool of 5 blocks holds 80 tokens: that becomes the context window (one log line says so), and a
    request without max_tokens runs to it instead of being refused."""
    with caplog.at_level("INFO", logger="tinyvllm"):
        small = LLM(default_model_dir, device="cpu", num_blocks=5)
    assert small.max_model_len == small.engine.max_model_len == 80
    assert [r.levelname for r in caplog.records if "max_model_len" in r.getMessage()] == ["INFO"]
    prompt = small.tokenizer.apply_chat_template(POEM)
    for max_tokens in (None, 1000):
        [out] = small.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        assert len(prompt) + len(out.token_ids) == 80 and out.outputs[0].finish_reason == "length"
    assert small.engine.scheduler.block_manager.num_free == 5
    with pytest.raises(TinyVLLMError, match="context window is 80"):
        small.generate([[5] * 80], SamplingParams(max_tokens=1))


# ---------------------------------------------------------------- the command line

def test_cli_takes_a_negative_seed(default_model_dir):
    from tests.test_cli import tinyvllm as cli
    args = ("generate", "Tell me a story.", "--seed", "-1", "--temperature", "0.9", "--max-tokens", "6", "--json",
            "--device", "cpu")
    first, again = (json.loads(cli(*args).stdout) for _ in range(2))
    assert len(first["token_ids"]) >= 1 and first["token_ids"] == again["token_ids"]


def test_cli_chat_takes_a_negative_seed(default_model_dir):
    from tests.test_cli import ROOT
    run = subprocess.run([sys.executable, "-m", "tinyvllm", "chat", "--seed", "-9223372036854775808",
                          "--max-tokens", "4", "--device", "cpu"], cwd=ROOT, input="Hello!\n", capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-2000:]


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, words", [
    (["--temperature", "nan"], ["temperature", "nan"]), (["--temperature", "inf"], ["temperature"]),
    (["--seed", "18446744073709551616"], ["seed"]), (["--seed", "1.5"], ["--seed"]),
])
def test_cli_bad_seed_or_temperature_is_one_line(command, flags, words):
    from tests.test_cli import assert_user_error
    from tests.test_cli import tinyvllm as cli
    assert_user_error(cli(command, *(["hi"] if command == "generate" else []), *flags, check=False), *words)
