"""Chapter 5: what a request asks of sampling — vLLM's SamplingParams, checked once when it arrives — and the
logprobs it reads back.

temperature 0 is greedy; otherwise temperature, top-k, min-p and top-p shape the distribution a token is
drawn from, after the penalties (presence, frequency, repetition) change the logits of tokens already seen,
as in vLLM. The arithmetic runs where the logits are, in the model runner's sampler (model/sampler.py);
the randomness comes from each request's own seeded generator (rng_for), so a seed gives the same tokens
on every run.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from numbers import Integral, Real

import numpy as np

from tinyvllm.engine.structured.params import StructuredOutputsParams
from tinyvllm.errors import TinyVLLMError

GREEDY_BELOW = 1e-5                 # vLLM's _SAMPLING_EPS: a smaller temperature is greedy (logits / T overflows)
MAX_LOGPROBS = 20                   # vLLM's default max_logprobs: top tokens reported per generated token
MAX_N = 16                          # samples per request
SEEDS = range(-2**63, 2**64)        # any int64 (vLLM, OpenAI), and what seed + i of a child reaches past it
PENALTY_RANGE = (-2.0, 2.0)         # presence and frequency penalties (OpenAI's range)
MIN_REPETITION_PENALTY = 0.01       # a positive logit / a smaller penalty can overflow float32 (then NaN)


@dataclass
class SamplingParams:
    temperature: float = 1.0        # vLLM's default; 0 (or below GREEDY_BELOW) means greedy
    top_p: float = 1.0              # keep the smallest set of tokens whose probability sums to >= top_p
    top_k: int = 0                  # keep the k most likely tokens; 0 (or -1) keeps all
    min_p: float = 0.0              # drop tokens less likely than min_p x the most likely one
    seed: int | None = None         # same seed, same prompt, same device -> same tokens
    max_tokens: int | None = 16     # vLLM's default; None runs to the context window
    stop: list[str] | str | None = None          # strings that end the output (not included in it)
    stop_token_ids: list[int] | None = None      # extra token ids that end the output
    ignore_eos: bool = False        # keep going past the model's stop tokens (benchmarks)
    n: int = 1                      # independent samples of the same prompt (LLM.generate fans them out)
    presence_penalty: float = 0.0   # subtracted once from every token the output already holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output so far
    repetition_penalty: float = 1.0  # > 1 discourages every token seen in the prompt or the output
    logprobs: int | None = None     # report the k likeliest tokens (and the sampled one) per output token
    structured_outputs: StructuredOutputsParams | None = None   # a JSON schema, regex, choice or grammar (chapter 11)

    def __post_init__(self):
        self.temperature = _real("temperature", self.temperature, lambda t: t >= 0, ">= 0")
        self.top_p = _real("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1]")
        self.top_k = _integer("top_k", self.top_k, lambda k: k >= -1, "-1, 0 (all) or positive")
        self.min_p = _real("min_p", self.min_p, lambda p: 0 <= p <= 1, "in [0, 1]")
        self.seed = _integer("seed", self.seed, lambda s: s in SEEDS, "from -2**63 to 2**64 - 1",
                             optional=True)
        self.max_tokens = _integer("max_tokens", self.max_tokens, lambda m: m >= 1, ">= 1", optional=True)
        self.n = _integer("n", self.n, lambda n: 1 <= n <= MAX_N, f"from 1 to {MAX_N}")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _real(name, getattr(self, name), lambda p: low <= p <= high, f"in [{low}, {high}]"))
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty,
                                        lambda r: r >= MIN_REPETITION_PENALTY, f">= {MIN_REPETITION_PENALTY}")
        self.logprobs = _integer("logprobs", self.logprobs, lambda k: 0 <= k <= MAX_LOGPROBS,
                                 f"from 0 to {MAX_LOGPROBS}", optional=True)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise TinyVLLMError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r:.80}")
        if not isinstance(self.ignore_eos, bool):
            raise TinyVLLMError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = [_integer("stop_token_ids", t, lambda t: t >= 0, ">= 0 in every entry")
                               for t in _as_list("stop_token_ids", self.stop_token_ids)]
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # as vLLM: a temperature this small is greedy, not a division by ~0
        if self.n > 1 and self.temperature == 0:
            raise TinyVLLMError(f"n must be 1 when sampling greedily (temperature 0), got n={self.n}; "
                                "the samples would all be the same")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def child(self, i: int) -> SamplingParams:
        """The params of sample i of an n-sample request (vLLM's parallel sampling): n=1, and seed + i
        when a seed is given, so each sample is reproducible and differs from its siblings."""
        if self.n == 1:
            return self   # already checked: a request's one sample skips a second validation
        return replace(self, n=1, seed=None if self.seed is None else self.seed + i)


def _real(name: str, value, ok: Callable[[float], bool], rule: str) -> float:
    """A finite number (an int is fine, a bool or a string is not) that passes ok(); as a float."""
    if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise TinyVLLMError(f"{name} must be a number {rule}, got {value!r}")
    return float(value)


def _integer(name: str, value, ok: Callable[[int], bool], rule: str, optional: bool = False) -> int | None:
    """An integer (not a float, not a bool) that passes ok(); None allowed when optional."""
    if value is None and optional:
        return None
    if not isinstance(value, Integral) or isinstance(value, bool) or not ok(int(value)):
        raise TinyVLLMError(f"{name} must be {'None or ' if optional else ''}an integer {rule}, got {value!r}")
    return int(value)


def _as_list(name: str, value) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise TinyVLLMError(f"{name} must be a list, got {value!r}")
    return list(value)


def _stop_strings(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else _as_list("stop", stop)
    if not all(isinstance(s, str) for s in stops):
        raise TinyVLLMError(f"stop must be a string or a list of strings, got {stop!r}")
    return [s for s in stops if s]  # an empty stop string would stop at once


def rng_for(seed: int | None) -> np.random.Generator:
    """A request's own generator. NumPy takes seeds >= 0: a negative int64 maps to its unsigned twin."""
    return np.random.default_rng(None if seed is None else seed % 2**64)


# ---- logprobs (vLLM's raw_logprobs: from the model's logits, before penalties, temperature, top-k/p) ----

@dataclass
class Logprob:
    logprob: float          # natural log of the token's probability under the model
    rank: int               # 1 + how many tokens have a strictly higher logprob (1: the likeliest)
    decoded_token: str      # the token alone, as text


LOGPROB_FLOOR = -9999.0   # vLLM's: a token a structured output's mask forbids has logprob -inf, which JSON cannot say


def logprob_entries(token: int, logprob: float, rank: int, top_ids: np.ndarray, top_values: np.ndarray,
                    k: int, decode: Callable[[int], str]) -> dict[int, Logprob]:
    """One generated token's entry (host side): the sampled token, then the k likeliest (k or k+1 in all).
    Every token more likely than one of the top k is itself in the top k, so their ranks count there."""
    order = np.lexsort((top_ids, -top_values))[:k]  # most likely first; ties by the smaller id
    ids, values = top_ids[order], np.maximum(top_values[order], LOGPROB_FLOOR)
    entries = {token: Logprob(max(float(logprob), LOGPROB_FLOOR), int(rank), decode(token))}
    for i, v in zip(ids.tolist(), values.tolist()):
        entries.setdefault(i, Logprob(v, 1 + int((values > v).sum()), decode(i)))
    return entries
