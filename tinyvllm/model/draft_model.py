"""Chapter 10: a draft model — a second, smaller model guesses, from a KV pool of its own.

vLLM's "draft_model" method (the setting of Leviathan et al. 2023 and Chen et al. 2023): a small model that shares
the target's tokenizer (SmolLM2-135M for SmolLM2-1.7B, Llama 3.2 1B for Llama 3.1 8B) guesses k tokens greedily,
and the target verifies them as it verifies any proposer's. Unlike early exit (early_exit.py), the draft's K/V
are not the target's: other weights, other K/V. So the draft needs a KV cache of its own, and that cache must hold
every token the target's holds, or the draft would attend to stale K/V and guess worse (worse guesses only: the
target verifies every one, so the output never changes).

Its pool mirrors the target's: the same number of blocks of the same 16 tokens. Then the scheduler's block tables
and slots index both pools, and nothing outside the model runner knows there are two. Every token the target
computes, the draft computes too, into the same slot of its own pool:

    a prompt chunk, a decode    the draft runs the step's plan as well (same ids, positions, slots, tables) in one
                                pass of its own; only its K/V writes are needed, not its logits (follow());
    a verification of k guesses the guesses are drafted in k one-token passes (early_exit.draft, with the draft
                                model and its pool): pass j writes the draft's K/V of position start + j, the newest
                                token's, then each guess's but the last; follow() writes the last guess's
                                (start + k), so that when the target keeps all k the draft holds them all;
    a rejection                 BlockManager.truncate gives back the blocks past the kept tokens, the draft's with
                                the target's (same slots); at the kept positions the draft wrote its guesses,
                                which are the kept tokens, each after the kept ones: its K/V there are right;
    a preemption                the sequence is recomputed by prefill later, which the draft follows too;
    a prefix-cache hit          a cached block was filled by earlier steps, each followed by the draft, and is
                                overwritten (in both pools at once) only after it leaves the cache: the draft's
                                copy of it is as good as the target's.

The cost: the draft runs over every token the target computes (every step's prompt chunks and decodes, not only
the verifications'), and k one-token passes per verifying step. A draft of 1/10 of the target's weights adds about
(k + 1)/10 of a decode step to each verification and 1/10 to every other step: it pays when its guesses are kept
often enough, which a draft trained on the same data as the target (same family, smaller) is for.
"""
from __future__ import annotations

from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch
from tinyvllm.model.step_plan import SeqStep, StepPlan


class DraftModel:
    """The draft model and its KV pool, of the target pool's number of blocks: the scheduler's tables index both."""

    def __init__(self, model: Model, pool: PagedKVPool):
        self.model, self.pool = model, pool

    @property
    def num_layers(self) -> int:
        """The layers a guess runs through: all of the draft's (StepPlan.draft_layers)."""
        return self.model.cfg.num_hidden_layers

    def follow(self, plan: StepPlan) -> None:
        """The draft's K/V of every token the target computes in this step that drafting did not write: the prompt
        chunks, the decodes, and each verification's last guess (call it after with_drafts: the guesses are real
        tokens then). One pass, its logits never computed."""
        last_guesses = [SeqStep([s.token_ids[-1]], s.end - 1, [s.slots[-1]], s.block_table) for s in plan.verifies]
        rows = plan.decodes + last_guesses
        if plan.prefills or rows:
            prefill_batch(self.model, self.pool, plan.prefills, decodes=rows, logits=False)
