"""The course's side of chapter 10: the four pieces of speculative decoding as small functions on plain lists
and arrays, each the reference answer to an exercise of exercises.py.

Two of them are the engine's own code called through a thin adapter (the n-gram proposer and the greedy
acceptance rule of tinyvllm/engine/spec_decode.py and tinyvllm/model/sampler.py); the rollback is the
arithmetic of BlockManager.truncate on one table; the rejection-sampling rule is the general form (a draft
distribution q, not one-hot) that the engine needs only once a draft model proposes, written here so that
its proof can be checked by a statistical test.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from tinyvllm.engine.spec_decode import NgramProposer
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.sampler import verify as engine_verify   # bound at import: the checkpoint reroutes sampler.verify
from tinyvllm.model.step_plan import BLOCK_SIZE


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens, longest n first
    (the engine's NgramProposer.propose, on a plain list)."""
    return NgramProposer(min_n, max_n).propose(SimpleNamespace(token_ids=list(tokens)), k)


def accept_greedy(proposals: list[int], target: list[int]) -> list[int]:
    """The tokens one verification emits: the proposals the target's argmax agrees with, then the target's own
    token (the engine's sampler.verify with the argmax of each row)."""
    if len(target) != len(proposals) + 1:
        raise TinyVLLMError(f"{len(proposals)} proposals need {len(proposals) + 1} target tokens, got {len(target)}")
    return engine_verify(lambda j, accepted: int(target[j]), list(proposals))


def rejection_sample(p: np.ndarray, q: np.ndarray, x: int, rng: np.random.Generator) -> tuple[int, bool]:
    """Leviathan et al.'s rule for one position: the draft drew x from q; keep it with probability
    min(1, p[x] / q[x]), else draw from the residual max(0, p - q), normalized. Returns (token, kept)."""
    if rng.random() < min(1.0, p[x] / q[x]):
        return int(x), True
    residual = np.maximum(p - q, 0.0)
    return int(rng.choice(len(p), p=residual / residual.sum())), False


def rollback_block_table(table: list[int], length: int, drop: int,
                         block_size: int = BLOCK_SIZE) -> tuple[list[int], list[int]]:
    """The block table of a sequence of `length` tokens after its last `drop` tokens are dropped, and the
    blocks that no longer hold any of its tokens (BlockManager.truncate's arithmetic): (new table, freed)."""
    if not 0 <= drop <= length:
        raise TinyVLLMError(f"cannot drop {drop} of {length} tokens")
    if len(table) != -(-length // block_size):
        raise TinyVLLMError(f"a table of {len(table)} blocks does not hold {length} tokens of {block_size} a block")
    keep = -(-(length - drop) // block_size)   # blocks_for, with any block size
    return list(table[:keep]), list(table[keep:])


# ---- the statistics that check 10.3 (the graders, the checkpoint and the notebook use the same) ----

def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with df degrees of freedom: 1 - the regularized lower incomplete gamma
    P(df/2, x/2), from its power series (no SciPy needed)."""
    s, z = df / 2, x / 2
    if z <= 0:
        return 1.0
    if z > s + 40 * np.sqrt(s) + 200:   # far in the tail: below 1e-30
        return 0.0
    term = total = 1.0 / s
    n = 0
    while term > total * 1e-16:
        n += 1
        term *= z / (s + n)
        total += term
    lower = np.exp(s * np.log(z) - z - math.lgamma(s)) * total
    return float(max(0.0, 1.0 - lower))


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test that `counts` were drawn from `probs`: the probability of a statistic at least this
    large if they were. Tokens of probability 0 must have count 0 (else the p-value is 0)."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    if np.any(counts[probs == 0] > 0):
        return 0.0
    live = probs > 0
    expected = counts.sum() * probs[live]
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(live.sum()) - 1)


def draw_many(rule, p: np.ndarray, q: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, int]:
    """n positions of speculative sampling with `rule` (rejection_sample's signature): each time the draft
    draws x from q, the rule answers. Returns the counts of the emitted tokens and how many x were kept."""
    rng = np.random.default_rng(seed)
    counts, kept = np.zeros(len(p), np.int64), 0
    drafts = rng.choice(len(q), size=n, p=q)
    for x in drafts:
        token, accepted = rule(p, q, int(x), rng)
        counts[token] += 1
        kept += bool(accepted)
    return counts, kept
