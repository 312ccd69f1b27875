"""Chapter 5: turning logits into the next token, with vLLM's SamplingParams.

temperature 0 is greedy (argmax); otherwise the logits are divided by the temperature, cut by top-k and
min-p, then by top-p among the survivors (vLLM's order), renormalized and drawn from.

It all runs where the logits are (NumPy or CuPy: the same code), so a GPU never copies a 128K-entry
logits row to the host: only the chosen id comes back. The randomness is one uniform number per token
from the request's own seeded generator on the host, turned into a token by inverting the kept
tokens' cumulative distribution — so a seed gives the same tokens on every run.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.errors import TinyVLLMError


@dataclass
class SamplingParams:
    temperature: float = 1.0        # vLLM's default; 0 means greedy
    top_p: float = 1.0              # keep the smallest set of tokens whose probability sums to >= top_p
    top_k: int = 0                  # keep the k most likely tokens; 0 (or -1) keeps all
    min_p: float = 0.0              # drop tokens less likely than min_p x the most likely one
    seed: int | None = None         # same seed, same prompt, same device -> same tokens
    max_tokens: int | None = 16     # vLLM's default; None runs to the context window
    stop: list[str] | str | None = None          # strings that end the output (not included in it)
    stop_token_ids: list[int] | None = None      # extra token ids that end the output
    ignore_eos: bool = False        # keep going past the model's stop tokens (benchmarks)

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 0, f"top_k must be -1, 0 (all) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise TinyVLLMError(message)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])


def sample(logits, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a (vocab,) logits vector, a NumPy or CuPy array."""
    xp = array_module(logits)
    if params.temperature == 0:
        return int(xp.argmax(logits))
    z = logits.astype(xp.float64) / params.temperature  # float64: exp of large logits stays accurate
    probs = xp.exp(z - z.max())
    probs /= probs.sum()
    if params.top_k <= 0 and params.min_p == 0 and params.top_p == 1:  # nothing to cut: no sort needed
        order, cdf, kept = None, xp.cumsum(probs), len(probs)
    else:
        order = xp.argsort(-probs, kind="stable") if xp is np else xp.argsort(-probs)  # most likely first
        sorted_probs = probs[order]
        keep = xp.ones(sorted_probs.shape, dtype=bool)
        if params.top_k > 0:
            keep[params.top_k:] = False
        if params.min_p > 0:
            keep &= sorted_probs >= params.min_p * sorted_probs[0]
        if params.top_p < 1:  # as vLLM: top-p measures mass among the tokens top-k and min-p kept
            mass = xp.where(keep, sorted_probs, 0.0) / sorted_probs[keep].sum()
            keep &= (xp.cumsum(mass) - mass) < params.top_p  # keep a token if the mass before it is below top_p
        cdf, kept = xp.cumsum(xp.where(keep, sorted_probs, 0.0)), int(keep.sum())
    u = rng.random() * float(cdf[-1])  # the one number that crosses from the host
    i = min(int(xp.searchsorted(cdf, u, side="right")), kept - 1)  # never past the kept tokens
    return int(i if order is None else order[i])


def array_module(a):
    """numpy for NumPy arrays, cupy for CuPy arrays (without importing CuPy on the CPU)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy
