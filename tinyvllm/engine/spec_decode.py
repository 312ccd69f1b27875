"""Chapter 10: speculative decoding — more than one token per step, and never a different answer.

Decode reads every weight to compute ONE token per sequence (chapter 5: bound by memory bandwidth). If
someone guesses the next k tokens, one forward pass can check all of them: the newest token and the k
guesses go through the model as a chunk (chunked prefill's path, chapter 7), and the logits at its k + 1
positions say what the model would have produced at each. The guesses are kept while they match (the
model runner's verify(), model/sampler.py), the first mismatch is replaced by the model's own token, and
the K/V of the rejected guesses are dropped (BlockManager.truncate). A step then emits from 1 to k + 1
tokens for about the cost of one when decode is memory-bound — and the same tokens decoding would emit.

A proposer makes the guesses. Here: prompt lookup (n-gram matching), which needs no model at all. It
shines when the answer repeats its input (editing a text, answering about a document, code): the last
few tokens of the sequence are looked up in what came before, and what followed them there is proposed.
And early exit (self-speculation): the model's own first layers guess, in the step itself (model/early_exit.py);
here it only says how many guesses, as placeholders the model runner fills in. A draft model (vLLM's "draft_model"):
a second, smaller model with the same vocabulary guesses, in the step too, from its own KV pool (model/draft_model.py);
placeholders again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens that may follow seq's tokens (fewer, or none, when it has no guess)."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's "ngram" method): find the sequence's last n tokens earlier in its prompt and
    output, trying n = max_n first, then shorter; propose the tokens that followed the most recent match."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = np.asarray(seq.token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # every window of n tokens that has a token after it (so not the last n tokens themselves)
            matches = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[-n:]).all(axis=1))
            if len(matches):
                follow = matches[-1] + n   # the most recent: the text nearest to where we are
                return tokens[follow:follow + k].tolist()
        return []


DRAFTED = 0   # a placeholder proposal: the model runner replaces it with its draft's guess (early exit, draft model)


class EarlyExitProposer:
    """Self-speculation ("early_exit", LayerSkip's name): the guesses are the argmax of the model's first
    num_draft_layers layers followed by its final norm and LM head. They need the model, which runs in the step,
    so the scheduler plans k placeholders (their slots, their place in the budget) and the step's plan tells
    the runner to draft them (StepPlan.draft_layers, from num_draft_layers: a proposer without that attribute
    proposes real tokens): the plan stays one call through the one door."""

    def __init__(self, num_draft_layers: int):
        self.num_draft_layers = num_draft_layers

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return [DRAFTED] * k   # always k guesses: the draft has one for every position


class DraftModelProposer(EarlyExitProposer):
    """A draft model (vLLM's "draft_model"): the guesses are the argmax of a second, smaller model that shares the
    target's vocabulary, all num_draft_layers of its layers. The model runner holds it and its KV pool
    (model/draft_model.py), so, as for early exit, the scheduler plans placeholders and the runner drafts them."""


# Never lose (chapter 10): a verification of k proposals costs more than a decode step, so a sequence whose proposals
# are kept less often than this (per device, k = 4) stops proposing for a while.
#   cpu:  a verification costs about 2.5 decode steps; speculation broke even at an acceptance of 0.38 and gained 1.33x
#         at 0.65 (bench/results/spec-decode-cpu-20261203-071701.json).
#   cuda: H200, default model, verification as graphed decode rows: free-form text (acceptance 0.43, 0.38, 0.40) lost
#         at batch 1, 8 and 16 (x0.98, x0.81, x0.73), grounded text (0.60-0.63) won (x1.66, x1.25, x1.17)
#         (spec-decode-cuda-20261203-142824.json, -142827, -142831).
MIN_ACCEPTANCE = {"cpu": 0.4, "cuda": 0.5}
MIN_EVIDENCE = 8     # proposed tokens before a sequence's rate is trusted
REST_STEPS = 16      # decode steps without proposals before it tries again (the text may start repeating later)


# Never lose at large batch: a verification pays while its step is memory-bound (its k + 1 rows per sequence read
# the weights once, as one row would). With many sequences decoding, the step is compute-bound already: each guess
# then costs about a token's full arithmetic, and the rejected ones are work thrown away. So with more than this
# many sequences decoding in a step, none proposes (vLLM's disable_by_batch_size). What sets it, for k = 4:
#   cuda: measured on the H200 (default model, grounded text, the acceptance gate's best case): x1.25 at 8, x1.17 at
#         16, x0.62 at 32 (spec-decode-cuda-20261203-142827.json, -142831, -140946): a step of 32 sequences' 5 rows
#         each is past the GPU's memory-bound range for this model.
#   cpu:  measured on 2 shared cores, SmolLM2-135M (python bench/verify_cost.py --rounds 6,
#         bench/results/verify-cost-cpu-20261203-130124.json): up to batch 8 a 4-guess verification costs 1.3-1.7
#         decode steps; from batch 16 decode's tokens/s stop growing and it costs 2.7-3.7, about what it emits on
#         average at best (3.6 tokens on grounded text), so it cannot win there.
MAX_SPECULATING_BATCH = {"cpu": 8, "cuda": 16}


class SpeculationGate:
    """Per sequence: its proposed and kept tokens since it last rested; a sequence under min_acceptance (its
    device's MIN_ACCEPTANCE) after MIN_EVIDENCE proposed tokens rests REST_STEPS steps (plain decoding), then starts
    counting afresh."""

    def __init__(self, min_acceptance: float = MIN_ACCEPTANCE["cpu"]):
        self.min_acceptance = min_acceptance
        self.counts: dict[int, tuple[int, int]] = {}   # seq_id -> (proposed, kept)
        self.resting: dict[int, int] = {}              # seq_id -> decode steps left without proposals

    def allows(self, seq_id: int) -> bool:
        """Whether seq_id may propose this step; a resting sequence's step counts towards its rest."""
        if seq_id not in self.resting:
            return True
        self.resting[seq_id] -= 1
        if self.resting[seq_id] <= 0:
            del self.resting[seq_id]
        return False

    def record(self, seq_id: int, proposed: int, kept: int) -> None:
        total, accepted = self.counts.get(seq_id, (0, 0))
        total, accepted = total + proposed, accepted + kept
        if total >= MIN_EVIDENCE and accepted < self.min_acceptance * total:
            self.resting[seq_id] = REST_STEPS
            self.counts.pop(seq_id, None)
        else:
            self.counts[seq_id] = (total, accepted)

    def forget(self, seq_id: int) -> None:
        self.counts.pop(seq_id, None)
        self.resting.pop(seq_id, None)


def make_proposer(config: EngineConfig, draft_model_layers: int = 0) -> Proposer | None:
    """The proposer the settings ask for (speculative_method, checked by EngineConfig); None: speculation off.
    draft_model_layers: with draft_model, the layers of the draft model the runner loaded."""
    if config.speculative_method is None:
        return None
    if config.speculative_method == "early_exit":
        return EarlyExitProposer(config.num_draft_layers)
    if config.speculative_method == "draft_model":
        return DraftModelProposer(draft_model_layers)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


@dataclass
class SpecDecodeStats:
    """Counted per verification (one sequence's proposals checked in one step), as vLLM's spec-decode metrics."""
    verifications: int = 0   # sequence-steps that verified proposals
    proposed: int = 0        # proposed tokens
    accepted: int = 0        # of which kept (the bonus token of each verification is not counted here)
    accepted_per_position: list[int] = field(default_factory=list)   # [j]: proposals kept at position j (0 first)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification emits on average: its accepted proposals and the bonus token (1 to k + 1)."""
        return 1 + self.accepted / self.verifications if self.verifications else 0.0

    def add(self, proposed: int, emitted: int) -> None:
        self.verifications += 1
        self.proposed += proposed
        self.accepted += emitted - 1
        self.accepted_per_position += [0] * (emitted - 1 - len(self.accepted_per_position))
        for position in range(emitted - 1):   # kept proposals are a prefix: positions 0 .. emitted - 2
            self.accepted_per_position[position] += 1
