"""The Python API end to end on the default model: chat, raw prompts, streaming, stop strings, limits, seeds."""
from __future__ import annotations

import pytest

import tinyvllm.engine
from tinyvllm import LLM, SamplingParams, TinyVLLMError
from tinyvllm.llm import CompletionOutput, RequestOutput

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
    monkeypatch.setattr(tinyvllm.engine, "sample", lambda logits, params, rng: next(script))
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
