"""SamplingParams(logprobs=k): per generated token, the sampled token and the k likeliest, with vLLM's raw
logprobs (the model's log-softmax, before penalties, temperature and top-k/p), checked against transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from tinyvllm import LLM, Logprob, SamplingParams
from tinyvllm.engine.sampling import logprob_entries
from tinyvllm.model.sampler import raw_logprobs

QUESTION = [{"role": "user", "content": "Write a poem about the sea."}]
MAX_ERROR = 1e-3    # logprob error against transformers' float32 log-softmax
TIE = 1e-4          # logprobs closer than this may be ordered differently by two float32 computations


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, device="cpu")


@pytest.fixture(scope="module")
def hf(default_model_dir):
    return LlamaForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


def hf_logprobs(hf, prompt: list[int], output: list[int]) -> np.ndarray:
    """(len(output), vocab): transformers' log-softmax for each generated token, by teacher forcing."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits, dim=-1).numpy()


def check_against(reference: np.ndarray, token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int,
                  decode) -> int:
    """Every token's entry against the reference; returns how many sampled tokens were outside the top k."""
    outside = 0
    assert len(logprobs) == len(token_ids)
    for t, (token, entry, ref) in enumerate(zip(token_ids, logprobs, reference)):
        top = [int(i) for i in np.argsort(-ref, kind="stable")[:k]]
        assert token in entry, f"token {t}: the sampled token {token} is missing"
        assert list(entry)[0] == token, "the sampled token comes first, as in vLLM"
        assert set(entry) - ({token} - set(top)) == set(top), f"token {t}: top-{k} ids differ"
        assert list(entry)[1:] == [i for i in top if i != token], f"token {t}: not likeliest first"
        outside += token not in top
        for i, lp in entry.items():
            assert abs(lp.logprob - ref[i]) <= MAX_ERROR, f"token {t}, id {i}: {lp.logprob} vs {ref[i]}"
            low, high = 1 + int((ref > ref[i] + TIE).sum()), 1 + int((ref > ref[i] - TIE).sum())
            assert low <= lp.rank <= high, f"token {t}, id {i}: rank {lp.rank}, transformers says {low}..{high}"
            assert lp.decoded_token == decode([i])
    return outside


def test_greedy_logprobs_match_transformers(llm, hf):
    [out] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12, logprobs=5))
    ref = hf_logprobs(hf, out.prompt_token_ids, out.token_ids)
    completion = out.outputs[0]
    assert check_against(ref, completion.token_ids, completion.logprobs, 5, llm.tokenizer.decode) == 0
    assert all(entry[token].rank == 1 for token, entry in zip(completion.token_ids, completion.logprobs))


@pytest.mark.slow   # transformers beside the engine
@pytest.mark.parametrize("seed", [3, 11])
def test_sampled_logprobs_are_raw_and_match_transformers(llm, hf, seed):
    """Temperature, top-k and a repetition penalty change the draw, not the reported logprobs (vLLM's
    raw_logprobs); a hot temperature draws tokens outside the top 1, which are reported as an extra entry."""
    params = SamplingParams(temperature=1.5, top_k=50, repetition_penalty=1.3, seed=seed, max_tokens=24,
                            ignore_eos=True, logprobs=1)
    [out] = llm.chat(QUESTION, params)
    ref = hf_logprobs(hf, out.prompt_token_ids, out.token_ids)
    outside = check_against(ref, out.token_ids, out.outputs[0].logprobs, 1, llm.tokenizer.decode)
    assert outside > 0, f"seed {seed}: every sampled token was the likeliest; the k+1 case went untested"


def test_logprobs_zero_is_the_sampled_token_alone(llm):
    [out] = llm.chat(QUESTION, SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=0))
    assert [list(e) for e in out.outputs[0].logprobs] == [[t] for t in out.token_ids]


def test_no_logprobs_unless_asked(llm):
    [out] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=3))
    assert out.outputs[0].logprobs is None


def test_logprobs_follow_the_tokens_step_by_step_in_a_mixed_batch(llm):
    """The server reads seq.logprobs as tokens arrive: after every step it has one entry per output token,
    only for the sequences that asked, whatever else shares the batch."""
    prompt = llm.tokenizer.apply_chat_template(QUESTION)
    asked = [llm.add_request(prompt, SamplingParams(temperature=t, seed=1, max_tokens=5, logprobs=k))
             for t, k in [(0, 2), (0.8, 0), (0.8, 20)]]
    plain = [llm.add_request(prompt, SamplingParams(temperature=t, seed=1, max_tokens=5)) for t in (0, 0.8)]
    while llm.engine.has_work():
        llm.engine.step()
        assert all(len(s.logprobs) == len(s.output_ids) for s in asked)
    assert all(s.logprobs is None for s in plain)
    assert all(len(e) == 20 + (e[t].rank > 20) for t, e in zip(asked[2].output_ids, asked[2].logprobs))


def test_ranks_count_strictly_higher_logprobs_with_ties():
    """Tokens 1 and 2 tie: both have rank 3 (two tokens are strictly likelier); the sampled token 3 has rank 5."""
    logits = np.array([[3.0, 1.0, 1.0, 0.0, 5.0]], dtype=np.float32)
    top, values, chosen, ranks = raw_logprobs(logits, [3], k=3)
    entry = logprob_entries(3, chosen[0], ranks[0], top[0], values[0], 3, str)
    z = logits[0].astype(np.float64)
    expected = z - np.log(np.exp(z).sum())
    assert list(entry)[:3] == [3, 4, 0] and list(entry)[3] in (1, 2)
    assert {i: e.rank for i, e in entry.items()} == {3: 5, 4: 1, 0: 2, list(entry)[3]: 3}
    for i, e in entry.items():
        assert abs(e.logprob - expected[i]) < 1e-6 and e.decoded_token == str(i)


def test_k_larger_than_the_vocabulary_reports_every_token():
    logits = np.array([[0.5, -1.0, 2.0]], dtype=np.float32)
    top, values, chosen, ranks = raw_logprobs(logits, [1], k=20)
    entry = logprob_entries(1, chosen[0], ranks[0], top[0], values[0], 20, str)
    assert list(entry) == [1, 2, 0] and [e.rank for e in entry.values()] == [3, 1, 2]


def test_logprobs_give_the_bytes_of_a_token_that_splits_a_character(tiny_llama_dir):
    """Llama 3's tokenizer writes a rare character ("🦙", 4 bytes) as several tokens: each token's `bytes`
    must be its own bytes (its text alone is a replacement character), and text_offset must count the
    characters before it, not the replacement characters."""
    from tinyvllm.engine.sampling import Logprob
    from tinyvllm.entrypoints import openai_protocol as api
    from tinyvllm.formats.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(tiny_llama_dir)
    text = "a🦙 龘b"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode_bytes([i]) for i in ids]
    assert any(len(p) and p.decode("utf-8", errors="replace") != p.decode("utf-8", errors="ignore")
               for p in pieces), f"no token splits a character here: {pieces}"
    entries = [{i: Logprob(-1.0, 1, tokenizer.decode([i]))} for i in ids]
    chat = api.chat_logprobs(ids, entries, 1, tokenizer)["content"]
    assert [bytes(c["bytes"]) for c in chat] == pieces and b"".join(bytes(c["bytes"]) for c in chat) == text.encode()
    offsets = api.completion_logprobs(ids, entries, 0, tokenizer)["text_offset"]
    expected, before = [], b""
    for piece in pieces:   # the characters wholly before each token
        expected.append(len(before.decode("utf-8", errors="ignore")))
        before += piece
    assert offsets == expected and offsets[-1] == text.index("b")
