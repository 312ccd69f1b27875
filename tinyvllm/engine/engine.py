"""Chapter 7: the engine loop — continuous batching.

    add_request() ... step() ... step() ...

Every step asks the scheduler what to run, then runs it in ONE forward pass: the prompts (or chunks)
admitted now, their tokens side by side, and one row for every running sequence, whatever their
lengths (the paged cache and the block tables make that possible). A step of decodes alone replays
the CUDA graph of its batch size. Each sequence gets its next token;
a finished one frees its blocks at once, and the next step admits a waiting request in its place.
That is the difference with static batching, where a batch runs until its longest member is done.

One sequence's failure (in sampling, penalties, logprobs or bookkeeping) is that sequence's alone: it
finishes with finish_reason "error" and seq.error, its blocks go back, and the others go on.
"""
from __future__ import annotations

import gc
import itertools
import logging
from collections import deque
from typing import NamedTuple

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.sampling import SamplingParams, apply_penalties, logprob_entries, raw_logprobs, sample
from tinyvllm.engine.scheduler import Scheduler, Step
from tinyvllm.engine.sequence import Sequence, Status, check_prompt
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.formats.config import load_config
from tinyvllm.formats.tokenizer import Tokenizer, load_tokenizer
from tinyvllm.model.backend import resolve_device
from tinyvllm.model.decode import decode_batch
from tinyvllm.model.kv_pool import PagedKVPool, pool_blocks
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch

log = logging.getLogger(__name__)
TRACE_STEPS = 1024   # steps the trace remembers: a ring, so a server running for days keeps bounded memory


class LaunchedStep(NamedTuple):
    """A step whose forward pass is launched: the plan, and logits the device may still be computing."""
    step: Step
    prefill_logits: object
    decode_logits: object


class Engine:
    def __init__(self, config: EngineConfig, model: Model, pool: PagedKVPool, tokenizer: Tokenizer, decode=None):
        """config: clamped (EngineConfig.clamped); decode(steps) -> logits: CUDA graphs, or the eager step."""
        self.config, self.model, self.pool, self.tokenizer = config, model, pool, tokenizer
        self.stop_ids = set(tokenizer.stop_token_ids) | set(model.cfg.eos_token_ids)
        self.scheduler = Scheduler(pool.num_blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_prefix_caching, config.long_prefill_token_threshold)
        self.decode = decode or (lambda steps: decode_batch(model, pool, steps))
        self._ids = itertools.count()
        self.steps = 0   # steps run so far
        # the last TRACE_STEPS steps: who prefilled, who decoded, who was preempted, free blocks (for plots)
        self.trace: deque[dict] = deque(maxlen=TRACE_STEPS)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Everything an engine needs, in order: the model's files checked, the tokenizer, the weights and
        step buffers, the KV pool in the memory that is left (chapter 6), CUDA graphs (chapter 7)."""
        device, model_dir = resolve_device(config.device), resolve_model(config.model)
        cfg = load_config(model_dir)  # a bad config.json is reported before anything else is read
        tokenizer = load_tokenizer(model_dir)
        model_len = config.model_len(cfg)
        model = Model(model_dir, device, max_model_len=model_len, max_step_tokens=config.step_tokens(device, cfg),
                      batch_invariant=config.batch_invariant)
        num_blocks = config.num_blocks or pool_blocks(cfg, model.ops, config.gpu_memory_utilization)
        pool = PagedKVPool(cfg, model.ops, num_blocks)
        clamped = config.clamped(device, cfg, num_blocks)
        if clamped.max_model_len < model_len:  # one sequence must fit the pool: never refuse a request later
            log.info("max_model_len lowered from %d to %d: what the KV cache pool of %d blocks holds",
                     model_len, clamped.max_model_len, num_blocks)
        decode = None
        if device == "cuda" and not config.enforce_eager:  # decode steps replayed from CUDA graphs
            from tinyvllm.model.cuda_graphs import GraphedDecode
            decode = GraphedDecode(model, pool, clamped.max_num_seqs)
        return cls(clamped, model, pool, tokenizer, decode)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def close(self) -> None:
        """Drop the model, the pool and the graphs, and hand the memory back (on a GPU, CuPy keeps freed
        memory for this process's next arrays until told otherwise)."""
        ops = self.model.ops
        self.model = self.pool = self.decode = None
        gc.collect()  # an array caught in a reference cycle goes only when the collector runs: run it now
        ops.free_cached_memory()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Refuse a prompt this engine cannot run, before it is queued: one line saying why."""
        check_prompt(prompt_ids, self.max_model_len, self.model.cfg.vocab_size)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, stream: bool = True,
                    detokenize: bool = True) -> Sequence:
        """Queue one sample of a request; stream=False decodes its text once at the end (cheaper with many
        requests), detokenize=False not at all (stop strings still need the text). A request of n samples
        is n calls, with params.child(0) ... params.child(n - 1)."""
        if params.n != 1:
            raise TinyVLLMError(f"a sequence is one sample but params.n is {params.n}; add params.child(i) "
                                "for each sample i, or use LLM.generate")
        self.check_prompt(prompt_ids)
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
        return self.finish_step(self.launch_step())

    def launch_step(self) -> LaunchedStep:
        """The first half of a step: plan it and launch its forward pass. On a GPU this returns while the
        kernels run, so the caller can do host work (the engine core sends the last step's tokens) meanwhile."""
        step = self.scheduler.schedule()   # blocks taken: the model reads step.plan
        if not (step.prefills or step.decodes or step.preempted) and self.has_work():
            raise TinyVLLMError(f"the scheduler planned a step that runs nothing while {len(self.scheduler.waiting)} "
                                f"requests wait and {self.scheduler.blocks.num_free} blocks are free; admit() must "
                                "admit the first waiting request when nothing is running")  # else: loop forever
        prefill_logits = decode_logits = None
        if step.prefills:   # prompts, or chunks of them; a cached prefix or an earlier chunk is not recomputed
            # the decodes ride in the same pass: one read of the weights for the step (no CUDA graph then)
            logits = prefill_batch(self.model, self.pool, step.plan.prefills, decodes=step.plan.decodes)
            prefill_logits, decode_logits = logits[:len(step.prefills)], logits[len(step.prefills):]
        elif step.decodes:  # decodes alone: the CUDA graph of their batch size, on a GPU
            decode_logits = self.decode(step.plan.decodes)
        self.scheduler.computed(step)   # the blocks this step filled become findable (prefix caching)
        return LaunchedStep(step, prefill_logits, decode_logits)

    def finish_step(self, launched: LaunchedStep) -> list[tuple[Sequence, str]]:
        """The second half: wait for the logits (the first read-back), sample, record, retire the finished."""
        step, prefill_logits, decode_logits = launched
        released = []
        done = [i for i, s in enumerate(step.prefills) if s.num_computed == len(s)]  # whole prompt in the pool
        if done:
            rows = prefill_logits if len(done) == len(step.prefills) else prefill_logits[done]
            released += self._append_tokens([step.prefills[i] for i in done], rows)
        if step.decodes:
            released += self._append_tokens(step.decodes, decode_logits)
        self.trace.append({"step": self.steps, "prefill": [s.seq_id for s in step.prefills], "chunks": step.chunks,
                           "decode": [s.seq_id for s in step.decodes], "preempted": [s.seq_id for s in step.preempted],
                           "free_blocks": self.scheduler.blocks.num_free})
        self.steps += 1
        return released

    def _append_tokens(self, seqs: list[Sequence], logits) -> list[tuple[Sequence, str]]:
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
                out.append((seq, self._isolated(seq, self._record, seq, tokens[i], top.get(i)) or ""))
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

    def _record(self, seq: Sequence, token: int, top: tuple | None) -> str:
        """Append the token (and its logprobs); cache newly full blocks; free a finished sequence's blocks."""
        entries = None if top is None else logprob_entries(token, *top, seq.params.logprobs, self._token_text)
        text = seq.append(token, entries)
        if seq.status is Status.FINISHED:
            self.scheduler.finish(seq)   # its slot and blocks go back now: the next step can use them
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
