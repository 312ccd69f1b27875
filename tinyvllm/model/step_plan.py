"""Chapter 7: the step plan — what the scheduler decided, in the only form the model reads.

The scheduler owns the KV blocks: before a step runs it has admitted, preempted, freed and allocated.
What is left for the model is arithmetic on this plan, one SeqStep per sequence in the step:

    token_ids    the tokens to compute: a whole prompt, its uncached tail, or the one newest token
    start        the position of token_ids[0]; the pool already holds the K/V of positions 0 .. start - 1
    slots        the pool slot each new token's K/V go to: block_table[p // 16] * 16 + p % 16
    block_table  the sequence's physical blocks, covering positions 0 .. start + len(token_ids) - 1

The model never calls the block manager, so what it computes cannot disagree with what was allocated:
vLLM v1's SchedulerOutput and nano-vllm's prepare_prefill/prepare_decode draw the same line.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqStep:
    token_ids: list[int]
    start: int
    slots: list[int]
    block_table: list[int] = field(default_factory=list)  # empty for chapter 5's contiguous cache

    @property
    def end(self) -> int:
        """Tokens in the pool once this step has run: attention of the last new token reads all of them."""
        return self.start + len(self.token_ids)


@dataclass
class StepPlan:
    prefills: list[SeqStep] = field(default_factory=list)  # prompts (or their uncached tails): one batched prefill
    decodes: list[SeqStep] = field(default_factory=list)   # one token each: one batched decode
