"""Chapter 7: the engine loop — continuous batching.

    add_request() ... step() ... step() ...

Every step asks the scheduler what to run, then runs it: ONE batched prefill for the prompts admitted
now (their tokens side by side) and ONE batched decode for every running sequence, whatever their
lengths (the paged cache and the block tables make that possible). Each sequence gets its next token;
a finished one frees its blocks at once, and the next step admits a waiting request in its place.
That is the difference with static batching, where a batch runs until its longest member is done.
"""
from __future__ import annotations

import itertools

import numpy as np

from tinyvllm.block_manager import BLOCK_SIZE
from tinyvllm.decode import decode_step
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model import Model
from tinyvllm.paged_cache import PagedKVCache
from tinyvllm.prefill import prefill_batch
from tinyvllm.sampling import SamplingParams, sample
from tinyvllm.scheduler import Scheduler
from tinyvllm.sequence import Sequence, Status
from tinyvllm.tokenizer import Tokenizer


class Engine:
    def __init__(self, model: Model, tokenizer: Tokenizer, cache: PagedKVCache, stop_ids: set[int],
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None, decode=None):
        self.model, self.tokenizer, self.cache, self.stop_ids = model, tokenizer, cache, stop_ids
        max_num_seqs = min(max_num_seqs, model.max_tokens)  # a decode step's rows live in the buffers
        self.scheduler = Scheduler(cache.blocks, max_num_seqs, min(max_num_batched_tokens or model.max_tokens,
                                                                    model.max_tokens))
        self.decode = decode or (lambda tokens, seqs: decode_step(model, tokens, cache, seqs))  # chapter 7: graphs
        self._ids = itertools.count()
        self.trace: list[dict] = []   # per step: who prefilled, who decoded, who was preempted (for plots)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, stream: bool = True) -> Sequence:
        """Queue a request; stream=False decodes its text once at the end (cheaper with many requests)."""
        seq = Sequence.create(next(self._ids), prompt_ids, params, self.model.max_model_len, self.stop_ids,
                              self.tokenizer, incremental=stream)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request now (a client went away): its blocks go back to the pool."""
        self.scheduler.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[tuple[Sequence, str]]:
        """One step of the loop; returns (sequence, the text it released) for every sequence that ran."""
        plan = self.scheduler.schedule()
        if not (plan.prefills or plan.decodes or plan.preempted) and self.has_work():
            raise TinyVLLMError(f"the scheduler planned a step that runs nothing while {len(self.scheduler.waiting)} "
                                f"requests wait and {self.cache.blocks.num_free} blocks are free; admit() must "
                                "admit the first waiting request when nothing is running")  # else: loop forever
        released = []
        if plan.prefills:
            prompts = [s.token_ids[s.num_cached:] for s in plan.prefills]  # a cached prefix is not recomputed
            logits = prefill_batch(self.model, prompts, self.cache, [s.seq_id for s in plan.prefills])
            released += self._append_tokens(plan.prefills, logits, prefilled=True)
        if plan.decodes:
            logits = self.decode([s.last_token for s in plan.decodes], [s.seq_id for s in plan.decodes])
            released += self._append_tokens(plan.decodes, logits, prefilled=False)
        self.trace.append({"prefill": [s.seq_id for s in plan.prefills], "decode": [s.seq_id for s in plan.decodes],
                           "preempted": [s.seq_id for s in plan.preempted], "free_blocks": self.cache.blocks.num_free})
        return released

    def _append_tokens(self, seqs: list[Sequence], logits, prefilled: bool) -> list[tuple[Sequence, str]]:
        """Sample each row (greedy rows with one argmax over the batch), record, retire the finished."""
        greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0]
        rows = logits if len(greedy) == len(seqs) else logits[greedy]   # no gather when all are greedy
        tokens = dict(zip(greedy, self.model.ops.to_host(rows.argmax(axis=1)).tolist())) if greedy else {}
        caching = hasattr(self.cache.blocks, "cache_full_blocks")
        out = []
        for i, seq in enumerate(seqs):
            token = tokens[i] if i in tokens else sample(logits[i], seq.params, seq.rng)
            out.append((seq, seq.append(token)))
            if caching and (prefilled or self.cache.lengths[seq.seq_id] % BLOCK_SIZE == 0):  # blocks just filled
                self.cache.blocks.cache_full_blocks(seq.seq_id, seq.token_ids)
            if seq.status is Status.FINISHED:
                self.scheduler.finish(seq)
        return out
