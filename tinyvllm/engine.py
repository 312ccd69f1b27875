"""Chapter 7: the engine loop — continuous batching.

    add_request() ... step() ... step() ...

Every step asks the scheduler what to run, then runs it: ONE batched prefill for the prompts admitted
now (their tokens side by side) and ONE batched decode for every running sequence, whatever their
lengths (the paged cache and the block tables make that possible). Each sequence gets its next token;
a finished one frees its blocks at once, and the next step admits a waiting request in its place.
That is the difference with static batching, where a batch runs until its longest member is done.

One sequence's failure (in sampling, penalties, logprobs or bookkeeping) is that sequence's alone: it
finishes with finish_reason "error" and seq.error, its blocks go back, and the others go on.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque

from tinyvllm.block_manager import BLOCK_SIZE
from tinyvllm.decode import decode_step
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model import Model
from tinyvllm.paged_cache import PagedKVCache
from tinyvllm.prefill import prefill_batch
from tinyvllm.sampling import SamplingParams, apply_penalties, logprob_entries, raw_logprobs, sample
from tinyvllm.scheduler import Scheduler
from tinyvllm.sequence import Sequence, Status
from tinyvllm.tokenizer import Tokenizer

log = logging.getLogger("tinyvllm.engine")
TRACE_STEPS = 1024   # steps the trace remembers: a ring, so a server running for days keeps bounded memory


class Engine:
    def __init__(self, model: Model, tokenizer: Tokenizer, cache: PagedKVCache, stop_ids: set[int],
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None, decode=None,
                 max_model_len: int | None = None):
        self.model, self.tokenizer, self.cache, self.stop_ids = model, tokenizer, cache, stop_ids
        self.max_model_len = max_model_len or model.max_model_len  # LLM lowers it to what the pool holds
        max_num_seqs = min(max_num_seqs, model.max_tokens)  # a decode step's rows live in the buffers
        self.scheduler = Scheduler(cache.blocks, max_num_seqs, min(max_num_batched_tokens or model.max_tokens,
                                                                    model.max_tokens))
        self.decode = decode or (lambda tokens, seqs: decode_step(model, tokens, cache, seqs))  # chapter 7: graphs
        self._ids = itertools.count()
        self.steps = 0   # steps run so far
        # the last TRACE_STEPS steps: who prefilled, who decoded, who was preempted, free blocks (for plots)
        self.trace: deque[dict] = deque(maxlen=TRACE_STEPS)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, stream: bool = True,
                    detokenize: bool = True) -> Sequence:
        """Queue one sample of a request; stream=False decodes its text once at the end (cheaper with many
        requests), detokenize=False not at all (stop strings still need the text). A request of n samples
        is n calls, with params.child(0) ... params.child(n - 1)."""
        if params.n != 1:
            raise TinyVLLMError(f"a sequence is one sample but params.n is {params.n}; add params.child(i) "
                                "for each sample i, or use LLM.generate")
        seq = Sequence.create(next(self._ids), prompt_ids, params, self.max_model_len, self.stop_ids,
                              self.tokenizer, incremental=stream, detokenize=detokenize)
        self.scheduler.add(seq)
        return seq

    def trace_since(self, step: int) -> list[dict]:
        """The trace of steps `step`, step + 1, ... (read engine.steps before a run to get its steps)."""
        records, oldest = list(self.trace), self.steps - len(self.trace)
        if step < oldest:
            raise TinyVLLMError(f"the trace keeps the last {TRACE_STEPS} steps; step {step} is gone "
                                f"(the oldest kept is {oldest})")
        return records[step - oldest:]

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
        self.trace.append({"step": self.steps, "prefill": [s.seq_id for s in plan.prefills],
                           "decode": [s.seq_id for s in plan.decodes], "preempted": [s.seq_id for s in plan.preempted],
                           "free_blocks": self.cache.blocks.num_free})
        self.steps += 1
        return released

    def _append_tokens(self, seqs: list[Sequence], logits, prefilled: bool) -> list[tuple[Sequence, str]]:
        """Sample each row, record the tokens, retire the finished. A failure is caught per sequence."""
        tokens = self._greedy_tokens(seqs, logits)
        for i, seq in enumerate(seqs):
            if i not in tokens:
                tokens[i] = self._isolated(seq, self._sample_row, seq, logits[i])
        top = self._top_logprobs(seqs, logits, tokens)
        out = []
        for i, seq in enumerate(seqs):
            if seq.status is Status.FINISHED:   # its sampling or its logprobs failed just now
                out.append((seq, ""))
            else:
                out.append((seq, self._isolated(seq, self._record, seq, tokens[i], top.get(i), prefilled) or ""))
        return out

    def _greedy_tokens(self, seqs: list[Sequence], logits) -> dict[int, int]:
        """The greedy rows without penalties, all with ONE argmax (only their ids reach the host)."""
        plain = [i for i, s in enumerate(seqs) if s.params.temperature == 0 and not s.params.has_penalties]
        if not plain:
            return {}
        rows = logits if len(plain) == len(seqs) else logits[plain]   # no gather when all are plain greedy
        return dict(zip(plain, self.model.ops.to_host(rows.argmax(axis=1)).tolist()))

    def _sample_row(self, seq: Sequence, row) -> int:
        if seq.params.has_penalties:
            row = apply_penalties(row, seq.params, seq.prompt_ids, seq.output_ids)
        return sample(row, seq.params, seq.rng)

    def _top_logprobs(self, seqs: list[Sequence], logits, tokens: dict[int, int]) -> dict[int, tuple]:
        """For the rows that asked for logprobs, from ONE log-softmax over those rows of the raw logits:
        row -> (the sampled token's logprob, its rank, the top ids, their logprobs), on the host."""
        asked = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and s.status is not Status.FINISHED]
        if not asked:
            return {}
        try:
            k = max(seqs[i].params.logprobs for i in asked)
            top, values, chosen, ranks = (self.model.ops.to_host(a) for a in
                                          raw_logprobs(logits[asked], [tokens[i] for i in asked], k))
        except Exception as e:   # a batch operation: every row in it fails, the other rows go on
            for i in asked:
                self._fail(seqs[i], e)
            return {}
        return {i: (chosen[r], ranks[r], top[r], values[r]) for r, i in enumerate(asked)}

    def _record(self, seq: Sequence, token: int, top: tuple | None, prefilled: bool) -> str:
        """Append the token (and its logprobs); cache newly full blocks; free a finished sequence's blocks."""
        entries = None if top is None else logprob_entries(token, *top, seq.params.logprobs, self._token_text)
        text = seq.append(token, entries)
        if hasattr(self.cache.blocks, "cache_full_blocks") and (
                prefilled or self.cache.lengths[seq.seq_id] % BLOCK_SIZE == 0):   # blocks just filled
            self.cache.blocks.cache_full_blocks(seq.seq_id, seq.token_ids)
        if seq.status is Status.FINISHED:
            self.scheduler.finish(seq)
        return text

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _isolated(self, seq: Sequence, work, *args):
        """work(*args), but an exception fails `seq` alone (returns None then)."""
        try:
            return work(*args)
        except Exception as e:
            self._fail(seq, e)
            return None

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """Log the failure with its traceback, finish the sequence with "error", give its blocks back."""
        log.error("sequence %d failed; the other sequences go on", seq.seq_id, exc_info=error)
        seq.fail(f"{type(error).__name__}: {error}".strip().splitlines()[0])
        self.scheduler.finish(seq)
