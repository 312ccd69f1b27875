"""SamplingParams validation and the sampler's distribution, checked against torch with a chi-square test."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tinyvllm import SamplingParams, TinyVLLMError
from tinyvllm.engine.sampling import rng_for
from tinyvllm.model.sampler import sample

DRAWS = 20_000
# A fixed logits vector without ties, so top-k has one answer
LOGITS = np.array([2.0, 1.5, 1.2, 0.7, 0.3, 0.0, -0.4, -1.0, -1.8, -3.0], dtype=np.float32)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "0.7"),
    ("temperature", True), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", float("nan")), ("top_p", "1"),
    ("top_k", -2), ("top_k", 5.0), ("top_k", True), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("-inf")),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 16.0), ("max_tokens", False), ("max_tokens", "16"),
    ("seed", 2**64), ("seed", -2**63 - 1), ("seed", 1.0), ("seed", "42"), ("seed", True),
    ("n", 0), ("n", 17), ("n", 2.0), ("n", None),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", True),
    ("stop", 5), ("stop", ["a", None]), ("stop_token_ids", 2), ("stop_token_ids", [2, -1]), ("stop_token_ids", [2.0]),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(TinyVLLMError, match=field) as error:
        SamplingParams(**{field: value})
    assert "\n" not in str(error.value)


def test_numbers_of_other_types_are_taken_as_python_numbers():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int64(-7), max_tokens=np.int32(4), n=2)
    assert (p.temperature, p.top_k, p.seed, p.max_tokens) == (0.5, 3, -7, 4)
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.seed) is int


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-6, 9.99e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    """As vLLM: below 1e-5 a temperature is greedy (dividing logits by 1e-320 would give inf - inf = nan)."""
    assert SamplingParams(temperature=temperature).temperature == 0
    rng = np.random.default_rng(3)
    for _ in range(20):
        logits = rng.standard_normal(1000).astype(np.float32)
        assert sample(logits, SamplingParams(temperature=temperature), rng) == int(np.argmax(logits))
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # from 1e-5 on it samples


def test_greedy_with_several_samples_is_refused():
    with pytest.raises(TinyVLLMError, match="n must be 1"):
        SamplingParams(n=2, temperature=0)


@pytest.mark.parametrize("seed", [-1, 2**63 - 1, -2**63, 0, 2**64 - 1])
def test_any_64_bit_seed_works_and_reproduces(seed):
    def draws(s):
        rng = rng_for(SamplingParams(seed=s).seed)
        return [sample(LOGITS, SamplingParams(temperature=1.0), rng) for _ in range(100)]

    assert draws(seed) == draws(seed), f"seed {seed}"
    assert draws(seed) != draws(12345), f"seed {seed} draws like seed 12345"


def test_child_params_are_vllms_parallel_sampling():
    parent = SamplingParams(n=4, temperature=0.8, seed=2**63 - 1, top_k=7, logprobs=2, presence_penalty=0.5)
    children = [parent.child(i) for i in range(parent.n)]
    assert [c.seed for c in children] == [2**63 - 1 + i for i in range(4)]  # seed + i, past int64 too
    assert all(c.n == 1 and (c.temperature, c.top_k, c.logprobs, c.presence_penalty) == (0.8, 7, 2, 0.5)
               for c in children)
    assert SamplingParams(n=3).child(2).seed is None and parent.n == 4  # no seed: each draws freely


def test_good_sampling_params_are_kept():
    p = SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=None, stop="END")
    assert p.stop == ["END"] and p.stop_token_ids == []
    assert SamplingParams(stop=["", "a"]).stop == ["a"]  # an empty stop string would stop at once


# ---------------------------------------------------------------- greedy

def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for vocab in (2, 17, 49152):
        for _ in range(20):
            logits = rng.standard_normal(vocab, dtype=np.float32) * 5
            assert sample(logits, SamplingParams(temperature=0), rng) == int(np.argmax(logits))


def test_top_k_1_is_greedy():
    rng = np.random.default_rng(1)
    for _ in range(200):
        logits = rng.standard_normal(300, dtype=np.float32)
        assert sample(logits, SamplingParams(temperature=1.0, top_k=1), rng) == int(np.argmax(logits))


def test_tiny_temperature_is_greedy_and_finite():
    rng = np.random.default_rng(2)
    logits = np.array([1000.0, 999.0, -1000.0], dtype=np.float32)  # exp(1000/1e-4) overflows unless shifted
    assert all(sample(logits, SamplingParams(temperature=1e-4), rng) == 0 for _ in range(50))


def test_seed_reproduces():
    def draws(seed):
        rng = np.random.default_rng(seed)
        return [sample(LOGITS, SamplingParams(temperature=1.0), rng) for _ in range(200)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


# ---------------------------------------------------------------- the distribution

def expected_distribution(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                          min_p: float = 0.0) -> np.ndarray:
    """vLLM's sampler written in torch: temperature, min-p on the full distribution, then top-k, then top-p
    over what is left (renormalized), each cut as -inf logits."""
    z = torch.tensor(logits, dtype=torch.float64) / temperature
    if min_p > 0:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < min_p * probs.max(), -math.inf)
    if top_k > 0:
        z = z.masked_fill(z < z.topk(top_k).values[-1], -math.inf)
    if top_p < 1:
        probs, order = z.softmax(-1).sort()  # ascending: drop the least likely while their mass <= 1 - top_p
        drop = probs.cumsum(-1) <= 1 - top_p
        drop[-1] = False  # the most likely token always stays
        z[order[drop]] = -math.inf
    return z.softmax(-1).numpy()


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic over the categories with nonzero expected count."""
    expected = probs * counts.sum()
    nonzero = expected > 0
    return float(np.sum((counts[nonzero] - expected[nonzero]) ** 2 / expected[nonzero]))


def chi_square_critical(df: int, z: float = 4.75) -> float:
    """The chi-square quantile by the Wilson-Hilferty approximation (accurate to ~1% for df >= 3).

    z = 4.75 is the one-sided normal quantile for p = 1e-6: a correct sampler fails a given case about once
    in a million runs, while a wrong distribution pushes the statistic up by about DRAWS x its chi-square
    divergence (hundreds for the mistakes checked below)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


CASES = {  # name: (sampling params, a plausible wrong distribution the test must be able to tell apart)
    "temperature 1": (dict(temperature=1.0), dict(temperature=0.8)),
    "temperature 0.5": (dict(temperature=0.5), dict(temperature=1.0)),
    "temperature 1.7": (dict(temperature=1.7), dict(temperature=1.0)),
    "top_k 3": (dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_k=4)),
    "top_p 0.8": (dict(temperature=0.9, top_p=0.8), dict(temperature=0.9, top_p=0.9)),
    "min_p 0.15": (dict(temperature=1.0, min_p=0.15), dict(temperature=1.0, min_p=0.25)),
    "top_k 5 + top_p 0.9": (dict(temperature=0.8, top_k=5, top_p=0.9), dict(temperature=0.8, top_k=5)),
    "min_p 0.1 + top_p 0.85": (dict(temperature=1.3, min_p=0.1, top_p=0.85), dict(temperature=1.3, min_p=0.1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampler_draws_from_the_right_distribution(case):
    params, wrong = CASES[case]
    probs, wrong_probs = expected_distribution(LOGITS, **params), expected_distribution(LOGITS, **wrong)
    rng = np.random.default_rng(1234)
    sp = SamplingParams(**params)
    counts = np.bincount([sample(LOGITS, sp, rng) for _ in range(DRAWS)], minlength=len(LOGITS))
    assert counts[probs == 0].sum() == 0, f"drew filtered-out tokens: {counts} vs {probs.round(4)}"
    critical = chi_square_critical(int((probs > 0).sum()) - 1)
    stat = chi_square(counts, probs)
    assert stat < critical, f"{case}: chi-square {stat:.1f} >= {critical:.1f}; counts {counts}, expected " \
                            f"{(probs * DRAWS).round(0)}"
    # the test has power: the same draws reject a near-miss distribution (a draw it forbids, or a large statistic)
    impossible = (counts[wrong_probs == 0] > 0).any()
    assert impossible or chi_square(counts, wrong_probs) > chi_square_critical(int((wrong_probs > 0).sum()) - 1)


@pytest.mark.parametrize("vocab", [128256, 49152, 2048, 1025, 1000, 997, 7])
def test_argmax_in_pieces_is_numpys_argmax_ties_nans_and_infs_included(rng, vocab):
    """argmax_rows goes through the backend's argmax, which cuts each row into pieces of ARGMAX_PIECE (the last one
    short); the first index of the maximum must come out, as NumPy's, with ties everywhere, NaNs (NumPy's argmax
    returns the first NaN), an all -inf row and the maximum in the last, short piece."""
    from tinyvllm.model.sampler import argmax_rows
    for rows in (1, 5):
        tied = rng.integers(-3, 3, (rows, vocab)).astype(np.float32)
        tied[0, rng.integers(0, vocab, 2)] = np.nan
        tied[-1] = -np.inf
        plain = rng.standard_normal((rows, vocab)).astype(np.float32)
        plain[0, -1] = 10
        for logits in (tied, plain):
            assert argmax_rows(logits).tolist() == logits.argmax(axis=1).tolist()
