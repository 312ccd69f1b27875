"""Chapter 10: self-speculation by early exit — the model's own first layers are the draft.

The draft model is the target cut short: its first L layers, then the target's final norm and LM head (vLLM
has no such method; the name "early_exit" is LayerSkip's, Elhoushi et al. 2024, which Hugging Face's generate()
runs as assistant_early_exit=L). No second model is loaded, and the draft needs no KV cache of its own:

    for a layer i < L, the draft's K/V at a position are the target's (same weights, same inputs: the draft
    and the target run the same tokens through the same first L layers).

So the draft writes layers 0 .. L - 1 of the very pool slots that the verification then overwrites, all layers,
at positions p .. p + k - 1: the scheduler allocated them for the verification's 1 + k tokens already. A draft
pass at position p + j reads layers < L at positions up to p + j: the sequence's own K/V (the pool) and the draft's
earlier guesses (written by the passes before it), exactly what the cut-short model would read.

Drafting k guesses is k one-token passes through L layers (and the full LM head each time: with a large vocabulary
a big share of a small model's weights), all verifying sequences together as one batch per pass, each guess the
argmax of the draft's logits: a point-mass proposal, which the sampler's verify() already handles (as n-gram's).
L trades the two costs: more layers, better guesses (more kept per verification) but dearer ones.

The same loop drafts for a draft model (draft_model.py): with_drafts and draft take the model and the pool to draft
with, so there they get the draft model, all its layers, and its own pool, whose slots are the verification's too.
"""
from __future__ import annotations

from dataclasses import replace

from tinyvllm.model.decode import decode_batch
from tinyvllm.model.model import Model
from tinyvllm.model.sampler import argmax_rows
from tinyvllm.model.step_plan import SeqStep, StepPlan


def with_drafts(model: Model, pool, plan: StepPlan) -> StepPlan:
    """The plan with its verifications' placeholder proposals replaced by the guesses of the first plan.draft_layers
    layers of `model`, whose K/V are in `pool`: the target and its pool (early exit), or the draft model and its own
    (draft_model.py). A new plan: the scheduler's stays as it planned it. On a GPU each pass's guesses come to the
    host (the next pass's token ids are built there): launch waits for the draft, not the verification."""
    drafts = draft(model, pool, plan.verifies, plan.draft_layers)
    verifies = [replace(s, token_ids=[s.token_ids[0], *guesses]) for s, guesses in zip(plan.verifies, drafts)]
    return replace(plan, verifies=verifies, draft_layers=0)


def draft(model: Model, pool, verifies: list[SeqStep], num_layers: int) -> list[list[int]]:
    """Per verification, its `proposed` greedy guesses from the model's first num_layers layers (None: all): pass j
    feeds every sequence still drafting its token at position start + j (its newest token, then its previous guess)."""
    guesses: list[list[int]] = [[] for _ in verifies]
    for j in range(max(s.proposed for s in verifies)):
        drafting = [i for i, s in enumerate(verifies) if s.proposed > j]   # fewer guesses for some: budget, blocks
        steps = [draft_step(verifies[i], guesses[i], j) for i in drafting]
        logits = decode_batch(model, pool, steps, num_layers)
        for i, token in zip(drafting, model.ops.to_host(argmax_rows(logits)).tolist()):
            guesses[i].append(token)
    return guesses


def draft_step(verify: SeqStep, guesses: list[int], j: int) -> SeqStep:
    """Draft pass j of one verification: one token at position start + j, its K/V into the verification's slot there
    (early exit: layers < L of the target's pool, which the verification then overwrites; a draft model: its own
    pool), attending to everything before it through the sequence's block table."""
    token = verify.token_ids[0] if j == 0 else guesses[j - 1]
    return SeqStep([token], verify.start + j, [verify.slots[j]], verify.block_table)
