"""SamplingParams validation and the sampler's distribution, checked against torch with a chi-square test."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tinyvllm import SamplingParams, TinyVLLMError
from tinyvllm.sampling import sample

DRAWS = 20_000
# A fixed logits vector without ties, so top-k has one answer
LOGITS = np.array([2.0, 1.5, 1.2, 0.7, 0.3, 0.0, -0.4, -1.0, -1.8, -3.0], dtype=np.float32)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2),
    ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(TinyVLLMError, match=field):
        SamplingParams(**{field: value})


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
