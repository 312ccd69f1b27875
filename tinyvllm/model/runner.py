"""Chapter 7: the model runner — the one door between the engine and the model.

The engine decides (the scheduler's plan: tokens, positions, slots, block tables, how to sample); the
runner computes. It owns the model's weights, the physical KV pool and the CUDA graphs, and runs a plan in
ONE forward pass of its own choosing:

    prompts (or chunks) in the step   -> prefill_batch, the step's decodes riding along as extra rows
    proposals to verify (chapter 10)  -> with prompts in the step, prefill_batch: a sequence's newest token and its
                                         k proposals are a chunk after its cached tokens, logits at all k + 1;
                                         without, k + 1 decode rows (decode_rows_of), graphed as decodes are
                                         (early exit: the proposals are drafted first, by the model's first
                                         layers, in k one-token passes: early_exit.py; a draft model:
                                         the same passes through the draft, draft_model.py)
    decodes alone, on a GPU           -> the CUDA graph of their batch size (chapter 7)
    decodes alone, on a CPU (or eager)-> decode_batch

With a draft model (chapter 10) the runner holds it and its KV pool too, and the draft follows every step
(draft_model.py): its pool must hold every token the target's does. Then the runner samples (sampler.py) and
hands back a StepOutput on the host: per sequence of the plan, its token and, where asked, its logprobs.
vLLM's GPUModelRunner.execute_model and nano-vllm's ModelRunner.run draw the same line. A step is two halves,
launch and finish: on a GPU launch returns while the kernels run, so the engine core can send the previous
step's tokens meanwhile (engine_core.py).
"""
from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from tinyvllm.model.backend import resolve_device
from tinyvllm.model.decode import decode_batch
from tinyvllm.model.draft_model import DraftModel
from tinyvllm.model.early_exit import with_drafts
from tinyvllm.model.kv_pool import PagedKVPool, pool_blocks
from tinyvllm.model.mask_table import MaskTable
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch
from tinyvllm.model.sampler import sample_on_device, sample_step, samples_on_device
from tinyvllm.model.step_plan import SeqStep, StepOutput, StepPlan


def decode_rows_of(verifies: list[SeqStep]) -> list[SeqStep]:
    """Chapter 10: a verification of k proposals as k + 1 decode rows, row j at position start + j attending to the
    keys up to its own (its end), through the sequence's one block table. A decode layer stores every row's K/V
    before any row attends, so row j reads rows 0 .. j - 1 of this step: the chunk's causal mask, and the step
    replays a CUDA graph (a verification through the prefill path runs eagerly: ~300 launches on a 30-layer model)."""
    return [SeqStep([token], s.start + j, [slot], s.block_table)
            for s in verifies for j, (token, slot) in enumerate(zip(s.token_ids, s.slots))]


class Launched(NamedTuple):
    """A step whose forward pass is queued: its plan, and the logits of its rows the device may still compute
    (every prefill's last token, every verification's last proposed + 1 tokens, then every decode); when every
    entry samples_on_device, the tokens too, drawn on the device (one per entry; else None: drawn in finish), and
    their copy to the host, already queued (ops.HostCopy)."""
    plan: StepPlan
    logits: object
    tokens: object = None
    copy: object = None


class Feed(NamedTuple):
    """Async scheduling (engine.py): a plan launched before the step ahead of it has finished. Its decodes whose input
    is PENDING_TOKEN take the token the step ahead drew on the device: entry j's is tokens[rows[j]] (rows[j] -1: its
    own token_ids hold it)."""
    tokens: object        # the step ahead's Launched.tokens, on the device
    copy: object          # ... and their copy to the host, already queued (its Launched.copy)
    rows: list[int]       # per entry of this plan (plan.steps' order)

    def on_host(self, plan: StepPlan) -> StepPlan:
        """The plan with the fed tokens written in, as the host reads them: for a step that is not a graph replay."""
        tokens, entries = self.copy.result(), iter(self.rows)
        fed = [[s if (row := next(entries)) < 0 else replace(s, token_ids=[int(tokens[row])]) for s in steps]
               for steps in (plan.prefills, plan.verifies, plan.decodes)]
        return StepPlan(*fed, plan.draft_layers)


class ModelRunner:
    resolve_device = staticmethod(resolve_device)   # "auto" -> "cuda" or "cpu": the engine asks before loading

    def __init__(self, model: Model, pool: PagedKVPool, draft: DraftModel | None = None):
        """A model and the pool its K/V live in, and a draft model with its own pool (chapter 10) or None; decode steps
        run eagerly until use_cuda_graphs()."""
        self.model, self.pool, self.draft = model, pool, draft
        self.mask_table = MaskTable()   # chapter 11: structured outputs' masks, each sent to the device once
        self.decode = lambda steps: decode_batch(model, pool, steps)
        self.graphs = None   # the GraphedDecode that self.decode is, once use_cuda_graphs()

    @classmethod
    def load(cls, model_dir: str | Path, device: str, max_model_len: int, max_num_batched_tokens: int,
             num_blocks: int | None, gpu_memory_utilization: float, batch_invariant: bool,
             draft_dir: str | Path | None = None) -> ModelRunner:
        """Weights and step buffers first (the draft model's too, from draft_dir, chapter 10), then the KV pool in the
        memory that is left (chapter 6), unless num_blocks says how many blocks; a draft's pool has as many blocks
        (draft_model.py). The settings come from EngineConfig: no defaults here."""
        model = Model(model_dir, device, max_num_batched_tokens, max_model_len, batch_invariant)
        drafter = None if draft_dir is None else Model(draft_dir, device, max_num_batched_tokens, max_model_len,
                                                       batch_invariant)
        num_blocks = num_blocks or pool_blocks(model.cfg, model.ops, gpu_memory_utilization,
                                               draft_cfg=None if drafter is None else drafter.cfg)
        draft = None if drafter is None else DraftModel(drafter, PagedKVPool(drafter.cfg, drafter.ops, num_blocks))
        return cls(model, PagedKVPool(model.cfg, model.ops, num_blocks), draft)

    def use_cuda_graphs(self, max_num_seqs: int) -> None:
        """On a GPU, decode steps of up to max_num_seqs sequences replay a captured graph (chapter 7)."""
        if self.model.device == "cuda":
            from tinyvllm.model.cuda_graphs import GraphedDecode
            self.decode = self.graphs = GraphedDecode(self.model, self.pool, max_num_seqs)

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run the plan: every sequence's new tokens through the model, its K/V into the pool, and a token
        sampled for each SeqStep whose sampling is set (the kept proposals and a bonus token, for a verification)."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan, feed: Feed | None = None) -> Launched:
        """The first half: queue the forward pass (on a GPU this returns before the kernels finish), and where every
        entry allows, the sampling too (sample_on_device). feed: the inputs the step ahead still holds on the
        device (async scheduling): a graph replay takes them there, any other pass reads them back first."""
        if feed is not None and not self._replays(plan):
            plan, feed = feed.on_host(plan), None
        if plan.draft_layers and plan.verifies:   # the guesses are drafted now, then verified below
            drafter = (self.model, self.pool) if self.draft is None else (self.draft.model, self.draft.pool)
            plan = with_drafts(*drafter, plan)
        if self.draft is not None:   # a draft model computes every token the target does: its pool stays complete
            self.draft.follow(plan)
        if plan.prefills:   # one pass for the whole step: verifications and decodes ride along (no CUDA graph then)
            logits = prefill_batch(self.model, self.pool, plan.prefills + plan.verifies, decodes=plan.decodes)
        elif feed is not None:   # decodes alone, their inputs fed on the device: a graph replay
            logits = self.decode(plan.decodes, feed)
        elif plan.verifies or plan.decodes:  # decode rows only: the CUDA graph of their number, on a GPU
            logits = self.decode(decode_rows_of(plan.verifies) + plan.decodes)
        else:
            return Launched(plan, None)
        samplings = [s.sampling for s in plan.steps]
        if plan.verifies or not all(map(samples_on_device, samplings)):
            return Launched(plan, logits)    # drawn in finish (sample_step), where the host's lists are read
        states = [s.rng.bit_generator.state for s in samplings if s is not None]
        try:
            tokens = sample_on_device(logits, samplings, batched=not self.model.batch_invariant)
            return Launched(plan, logits, tokens, self.model.ops.HostCopy(tokens))
        except Exception:   # drawn again in finish, each group then each entry alone: a failure is its entry's alone
            for s, state in zip([s for s in samplings if s is not None], states):
                s.rng.bit_generator.state = state
            return Launched(plan, logits)

    def _replays(self, plan: StepPlan) -> bool:
        """Whether the plan's pass is a graph replay: decodes alone, as many as a graph has rows, on a GPU."""
        return (self.graphs is not None and not (plan.prefills or plan.verifies)
                and self.graphs.takes(len(plan.decodes)))

    def finish(self, launched: Launched) -> StepOutput:
        """The second half: sample where the plan says (unless launch did), and bring the ids (and logprobs) to the
        host."""
        plan, logits, drawn, copy = launched
        samplings = [s.sampling for s in plan.steps]
        if drawn is not None:
            tokens = copy.result().tolist()
            return StepOutput([[tokens[i]] if s else [] for i, s in enumerate(samplings)], [None] * len(samplings))
        if logits is None or not any(samplings):
            return StepOutput([[] for _ in samplings], [None] * len(samplings))
        return sample_step(logits, samplings, [s.proposals for s in plan.steps],
                           batched=not self.model.batch_invariant, mask_table=self.mask_table)

    def close(self) -> None:
        """Drop the model, the pool and the graphs, and hand the memory back (on a GPU, CuPy keeps freed
        memory for this process's next arrays until told otherwise)."""
        ops = self.model.ops
        self.model = self.pool = self.draft = self.decode = self.graphs = self.mask_table = None
        gc.collect()  # an array caught in a reference cycle goes only when the collector runs: run it now
        ops.free_cached_memory()
