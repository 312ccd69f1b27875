"""Chapter 7: the step plan — what the scheduler decided, in the only form the model reads.

The scheduler owns the KV blocks: before a step runs it has admitted, preempted, freed and allocated.
What is left for the model is arithmetic on this plan, one SeqStep per sequence in the step:

    token_ids    the tokens to compute: a whole prompt, its uncached tail, or the one newest token
    start        the position of token_ids[0]; the pool already holds the K/V of positions 0 .. start - 1
    slots        the pool slot each new token's K/V go to: block_table[p // 16] * 16 + p % 16
    block_table  the sequence's physical blocks, covering positions 0 .. start + len(token_ids) - 1

    sampling     how its next token is drawn, when this step ends its prompt or decodes (else None)
    proposed     chapter 10: how many of the last token_ids are proposals to verify (speculative decoding);
                 the step then samples at each of the last proposed + 1 positions, not only the last

and, for the whole plan, draft_layers (chapter 10): when set, the verifications' proposals are placeholders that
the runner drafts in the step itself, with the model's first draft_layers layers (early exit) or with all the
draft_layers layers of the draft model it holds (draft_model.py).

The model never calls the block manager, so what it computes cannot disagree with what was allocated:
vLLM v1's SchedulerOutput and nano-vllm's prepare_prefill/prepare_decode draw the same line. The model
runner (runner.py) takes the plan and gives back a StepOutput: the sampled ids and logprobs, on the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

BLOCK_SIZE = 16            # tokens per block: the one source (the kernels get it through NVRTC's -D)
PENDING_TOKEN = -1         # a decode's input not yet on the host: the step before drew it on the device, and the
                           # runner feeds it in there (async scheduling, engine.py)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


@dataclass
class Sampling:
    """How one sequence's next token is drawn: its request's SamplingParams (temperature, top_k, top_p,
    min_p, the penalties, logprobs), its own seeded generator, the tokens the penalties look at, and
    which tokens may come next at all (structured outputs: a (vocab,) bool mask; None: any token)."""
    params: object
    rng: np.random.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    allowed: np.ndarray | None = None


@dataclass
class SeqStep:
    token_ids: list[int]
    start: int
    slots: list[int]
    block_table: list[int] = field(default_factory=list)  # empty for chapter 5's contiguous cache
    sampling: Sampling | None = None   # None: nothing to sample (a chunk that does not end its prompt)
    proposed: int = 0                  # the last `proposed` token_ids are guesses the step verifies

    @property
    def proposals(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.proposed:]

    @property
    def end(self) -> int:
        """Tokens in the pool once this step has run: attention of the last new token reads all of them."""
        return self.start + len(self.token_ids)


@dataclass
class StepPlan:
    prefills: list[SeqStep] = field(default_factory=list)  # prompts (or their uncached tails): one batched prefill
    verifies: list[SeqStep] = field(default_factory=list)  # decodes with proposals: chunks that ride in the prefill
    decodes: list[SeqStep] = field(default_factory=list)   # one token each: one batched decode
    draft_layers: int = 0   # chapter 10: > 0, the verifies' proposals are placeholders the runner drafts (early exit,
                            # or a draft model)

    @property
    def steps(self) -> list[SeqStep]:
        """Every SeqStep of the plan, in the order of the logits' rows and of the StepOutput's entries."""
        return self.prefills + self.verifies + self.decodes


def step_inputs(steps: list[SeqStep]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The columns every forward pass reads, one row per token of the plan, in its order: the token ids,
    their positions and their pool slots (int32). A decode is a one-token SeqStep: the same three columns."""
    ids = np.fromiter(chain.from_iterable(s.token_ids for s in steps), np.int32)
    positions = np.fromiter(chain.from_iterable(range(s.start, s.end) for s in steps), np.int32)
    slots = np.fromiter(chain.from_iterable(s.slots for s in steps), np.int32)
    return ids, positions, slots


@dataclass
class StepOutput:
    """What a step gives back, on the host, one entry per SeqStep of the plan (plan.steps' order)."""
    tokens: list[list[int]]                   # the ids it emits: one, several after a verification (chapter 10),
                                              # none where nothing was sampled or it failed (vLLM's sampled_token_ids)
    logprobs: list[list[tuple] | None]        # where asked, per emitted id: (logprob, rank, top ids, top logprobs)
    errors: dict[int, Exception] = field(default_factory=dict)   # entry -> why its sampling failed (its alone)
