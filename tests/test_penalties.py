"""Presence, frequency and repetition penalties against vLLM's rule, stated here in NumPy on its own:

    repetition: a token seen in the prompt or the output has logit / r if the logit is > 0, else logit * r
    then, over the output so far:  logit -= frequency * count + presence * (count > 0)

applied before greedy's argmax and before temperature / top-k / top-p. The engine runs on a tiny random
model whose logits are replaced by a designed row, so the penalty visibly changes which token wins.
"""
from __future__ import annotations

import numpy as np
import pytest

import tinyvllm.model.runner
import tinyvllm.model.sampler
from tinyvllm import LLM, SamplingParams
from tinyvllm.model.sampler import apply_penalties

MAX_TOKENS = 12


def vllm_rule(logits: np.ndarray, prompt: list[int], output: list[int], presence: float = 0.0,
              frequency: float = 0.0, repetition: float = 1.0) -> np.ndarray:
    z = logits.astype(np.float64)
    seen = np.zeros(len(z), dtype=bool)
    seen[prompt + output] = True
    z = np.where(seen, np.where(z > 0, z / repetition, z * repetition), z)
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(z))
    return z - frequency * counts - presence * (counts > 0)


def expected_greedy(row: np.ndarray, prompt: list[int], penalties: dict, n: int = MAX_TOKENS) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(vllm_rule(row, prompt, out, **penalties))))
    return out


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", num_blocks=64)


def designed_row(vocab: int, seed: int, shift: float) -> np.ndarray:
    """Noise, and five clear favourites 0.4 apart (ids 100..104): without penalties id 100 always wins."""
    row = np.random.default_rng(seed).standard_normal(vocab).astype(np.float32)
    row[100:105] = [5.0, 4.6, 4.2, 3.8, 3.4]
    return row + np.float32(shift)


@pytest.fixture
def logits_row(llm, monkeypatch):
    """Every logits row the model computes is replaced by one designed row (the real forward pass still
    runs, so the cache is filled as usual)."""
    holder = {}
    real_prefill, real_decode = tinyvllm.model.runner.prefill_batch, llm.engine.runner.decode

    def replace(logits):
        return np.broadcast_to(holder["row"], logits.shape).copy()

    monkeypatch.setattr(tinyvllm.model.runner, "prefill_batch", lambda *a, **k: replace(real_prefill(*a, **k)))
    monkeypatch.setattr(llm.engine.runner, "decode", lambda *a, **k: replace(real_decode(*a, **k)))

    def use(row: np.ndarray) -> np.ndarray:
        holder["row"] = row
        return row
    return use


CASES = {  # name: (penalties, logit shift: positive favourites, or every logit negative)
    "presence": (dict(presence=1.5), 0.0),
    "frequency": (dict(frequency=0.7), 0.0),
    "negative presence and frequency": (dict(presence=-0.5, frequency=0.3), 0.0),
    "repetition, positive logits": (dict(repetition=1.3), 0.0),
    "repetition, negative logits": (dict(repetition=1.3), -20.0),
    "all three": (dict(presence=0.4, frequency=0.2, repetition=1.15), 0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_penalties_follow_vllms_rule_greedy_and_sampled(llm, logits_row, case):
    """Four requests in one batch: greedy and top_k=1 sampling (the sampler's path), each with and without
    the penalties. The penalized ones follow the rule; the others keep choosing id 100."""
    penalties, shift = CASES[case]
    seed = 1000 + list(CASES).index(case)
    row = logits_row(designed_row(llm.model_config.vocab_size, seed, shift))
    prompt = [7, 101, 30, 100, 55]  # holds two favourites: repetition acts from the first token
    expected = expected_greedy(row, prompt, penalties)
    assert expected != [100] * MAX_TOKENS, f"{case}: the penalty should change the tokens (seed {seed})"
    named = dict(presence_penalty=penalties.get("presence", 0.0), frequency_penalty=penalties.get("frequency", 0.0),
                 repetition_penalty=penalties.get("repetition", 1.0))
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **named),
              SamplingParams(temperature=0.7, top_k=1, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True, **named),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=1, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)]
    outs = llm.generate([prompt] * 4, params)
    assert outs[0].token_ids == expected, f"{case} greedy (seed {seed})"
    assert outs[1].token_ids == expected, f"{case} sampled with top_k=1 (seed {seed})"
    assert outs[2].token_ids == outs[3].token_ids == [100] * MAX_TOKENS, "rows without penalties were changed"


def test_apply_penalties_on_random_rows_equals_the_rule():
    seed = 20240611
    rng = np.random.default_rng(seed)
    for _ in range(50):
        vocab = int(rng.integers(5, 300))
        logits = (rng.standard_normal(vocab) * 4).astype(np.float32)
        prompt = rng.integers(0, vocab, int(rng.integers(1, 20))).tolist()
        output = rng.integers(0, vocab, int(rng.integers(0, 30))).tolist()
        presence, frequency = rng.uniform(-2, 2, 2)
        repetition = float(rng.uniform(0.5, 2.0))
        params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                                repetition_penalty=repetition)
        ours = apply_penalties(logits, params, prompt, output)
        want = vllm_rule(logits, prompt, output, presence, frequency, repetition)
        assert ours.dtype == np.float32 and np.abs(ours - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), \
            f"seed {seed}"
        assert not np.shares_memory(ours, logits), "the raw logits must survive (logprobs read them)"


def test_plain_greedy_rows_never_reach_the_per_row_sampler(llm, monkeypatch):
    """The fast path: greedy rows without penalties take the batch's one argmax, never sample()."""
    def refuse(*args):
        raise AssertionError("a plain greedy row reached the per-kind sampler")
    monkeypatch.setattr(tinyvllm.model.sampler, "sample_rows_on_device", refuse)
    monkeypatch.setattr(tinyvllm.model.sampler, "draw_rows_on_device", refuse)
    monkeypatch.setattr(tinyvllm.model.sampler, "draw_at", refuse)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -2.01),
                                          ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                                          ("presence_penalty", float("nan")), ("frequency_penalty", "1")])
def test_bad_penalties_name_the_field(field, value):
    from tinyvllm import TinyVLLMError
    with pytest.raises(TinyVLLMError, match=field):
        SamplingParams(**{field: value})
