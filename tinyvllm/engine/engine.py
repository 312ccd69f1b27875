"""Chapter 7: the engine loop — continuous batching.

    add_request() ... step() ... step() ...

Every step asks the scheduler what to run and hands its plan to the model runner (model/runner.py, the
one door to the model), which runs it in ONE forward pass: the prompts (or chunks) admitted now, their
tokens side by side, and one row for every running sequence, whatever their lengths (the paged cache and
the block tables make that possible); a step of decodes alone replays the CUDA graph of its batch size.
The runner hands back each sequence's next token (and logprobs), on the host;
a finished one frees its blocks at once, and the next step admits a waiting request in its place.
With speculative decoding on (chapter 10, engine/spec_decode.py), a sequence may get several tokens from
one step: the proposals the model agreed with, and its own next token.
That is the difference with static batching, where a batch runs until its longest member is done.

Async scheduling (vLLM's --async-scheduling, on by default on a GPU): between two decode steps the host plans the
next one, copies its inputs and records the tokens: at batch 1 that is a sixth of a step the GPU would spend idle.
So the engine plans and launches step N + 1 before it reads step N's tokens. The plan does not need them: every
sequence of step N gets one token (its count, its slot and its blocks are known); only the token's id is missing,
and the step N + 1 takes it on the device from step N's draw (PENDING_TOKEN, runner.Feed). The price: a sequence that
stops at step N (a stop token, a stop string) has computed one token too many at step N + 1, dropped; max_tokens is
known in advance and wastes nothing. It runs ahead only after a step whose every token was drawn on the device
(no penalties, logprobs or structured outputs: they need the tokens on the host) and without speculative decoding
(its proposals are made from the tokens).

One sequence's failure (in sampling, penalties, logprobs or bookkeeping) is that sequence's alone: it
finishes with finish_reason "error" and seq.error, its blocks go back, and the others go on.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import replace
from typing import NamedTuple

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.sampling import SamplingParams, logprob_entries
from tinyvllm.engine.scheduler import Scheduler, Step
from tinyvllm.engine.sequence import Sequence, Status, check_prompt
from tinyvllm.engine.step_record import StepRecord
from tinyvllm.engine.structured.compiler import StructuredOutputCompiler
from tinyvllm.engine.spec_decode import MAX_SPECULATING_BATCH, MIN_ACCEPTANCE, SpecDecodeStats, make_proposer
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.formats.config import load_config
from tinyvllm.formats.tokenizer import Tokenizer, load_tokenizer
from tinyvllm.model.runner import Feed, Launched, ModelRunner
from tinyvllm.model.step_plan import PENDING_TOKEN, SeqStep

log = logging.getLogger(__name__)
TRACE_STEPS = 1024   # steps the trace remembers: a ring, so a server running for days keeps bounded memory


class LaunchedStep(NamedTuple):
    """A step whose forward pass is launched: the scheduler's decisions, and the runner's pass in flight."""
    step: Step
    launched: Launched


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer):
        """config: clamped (EngineConfig.clamped) to the runner's model and pool."""
        self.config, self.runner, self.tokenizer = config, runner, tokenizer
        self.stop_ids = set(tokenizer.stop_token_ids) | set(runner.model.cfg.eos_token_ids)
        self.scheduler = Scheduler(runner.pool.num_blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_prefix_caching, config.long_prefill_token_threshold,
                                   make_proposer(config, 0 if runner.draft is None else runner.draft.num_layers),
                                   config.num_speculative_tokens,
                                   MAX_SPECULATING_BATCH[config.device], MIN_ACCEPTANCE[config.device])
        self.structured = StructuredOutputCompiler(tokenizer.token_bytes, runner.model.cfg.vocab_size)
        self.spec_stats = SpecDecodeStats()   # chapter 10: proposed and accepted tokens, verifications
        self._ids = itertools.count()
        self.steps = 0   # steps run so far
        # async scheduling: where it pays (a GPU: the host plans while the kernels run) and the tokens allow it
        self.runs_ahead = config.async_scheduling and config.device == "cuda" and config.speculative_method is None
        self.ahead: LaunchedStep | None = None   # the step launched before the last one launched has finished
        # the last TRACE_STEPS steps: who prefilled, decoded (with how many proposals), was preempted; free blocks
        self.trace: deque[StepRecord] = deque(maxlen=TRACE_STEPS)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Everything an engine needs, in order: the model's files checked, the tokenizer, the weights and
        step buffers, the KV pool in the memory that is left (chapter 6), CUDA graphs (chapter 7)."""
        device, model_dir = ModelRunner.resolve_device(config.device), resolve_model(config.model)
        cfg = load_config(model_dir)  # a bad config.json is reported before anything else is read
        draft_dir = draft_cfg = None
        if config.speculative_method == "draft_model":   # chapter 10: a second model, its files checked as early
            draft_dir = resolve_model(config.speculative_model, "draft model path",
                                      'give speculative_config\'s "model" as default or a HF-layout directory '
                                      '(config.json + *.safetensors)')
            draft_cfg = load_config(draft_dir)
        config.check_model(cfg, draft_cfg)
        tokenizer = load_tokenizer(model_dir)
        model_len = cfg.context_window(config.max_model_len)
        if draft_cfg is not None and draft_cfg.context_window(model_len) < model_len:   # the draft sees every position
            log.info("max_model_len lowered from %d to %d: the draft model's context window", model_len,
                     draft_cfg.context_window(model_len))
            model_len = draft_cfg.context_window(model_len)
            config = replace(config, max_model_len=model_len)
        runner = ModelRunner.load(model_dir, device, model_len, config.step_tokens(device, cfg), config.num_blocks,
                                  config.gpu_memory_utilization, config.batch_invariant, draft_dir)
        num_blocks = runner.pool.num_blocks
        clamped = config.clamped(device, cfg, num_blocks)
        if clamped.max_model_len < model_len:  # one sequence must fit the pool: never refuse a request later
            log.info("max_model_len lowered from %d to %d: what the KV cache pool of %d blocks holds",
                     model_len, clamped.max_model_len, num_blocks)
        if not config.enforce_eager:  # decode steps replayed from CUDA graphs, on a GPU
            runner.use_cuda_graphs(clamped.max_num_seqs)
        return cls(clamped, runner, tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def model(self):
        """The runner's model (its config, its tokenizer-independent facts: what callers read)."""
        return self.runner.model

    @property
    def pool(self):
        return self.runner.pool

    def close(self) -> None:
        """Drop the model, the pool and the graphs, and hand the memory back."""
        self.runner.close()

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
        constraint = None if params.structured_outputs is None else self.structured.compile(params.structured_outputs)
        seq = Sequence.create(next(self._ids), prompt_ids, params, self.max_model_len, self.stop_ids,
                              self.tokenizer, incremental=stream, detokenize=detokenize, constraint=constraint)
        self.scheduler.add(seq)
        return seq

    def trace_since(self, step: int) -> list[StepRecord]:
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
        return self.scheduler.has_work() or self.ahead is not None

    def step(self) -> list[tuple[Sequence, str]]:
        """One step of the loop; returns (sequence, the text it released) for every sequence that ran."""
        return self.finish_step(self.launch_step())

    def launch_step(self) -> LaunchedStep:
        """The first half of a step: plan it and launch its forward pass. On a GPU this returns while the
        kernels run, so the caller can do host work (the engine core sends the last step's tokens) meanwhile.
        With async scheduling the step was launched by the call before (self.ahead), and this call launches the
        step after it too, when it can: the caller finishes the one returned while the next one is queued."""
        current = self.ahead or self._launch()
        self.ahead = self._launch(after=current) if self.runs_ahead and current.launched.tokens is not None else None
        return current

    def _launch(self, after: LaunchedStep | None = None) -> LaunchedStep | None:
        """Plan a step and launch it; `after`: the step launched before, still running, whose tokens this step's
        decodes take on the device (None when that plan runs nothing)."""
        if after is not None and not self.scheduler.has_work():
            return None
        step = self.scheduler.schedule()   # blocks taken: the runner reads step.plan
        if not (step.sequences or step.preempted):
            if after is not None:          # all running are about to finish, nobody fits yet: plan after the tokens
                return None
            if self.has_work():
                raise TinyVLLMError(f"the scheduler planned a step that runs nothing while "
                                    f"{len(self.scheduler.waiting)} requests wait and "
                                    f"{self.scheduler.block_manager.num_free} blocks are free; admit() must admit the "
                                    "first waiting request when nothing is running")
        launched = self.runner.launch(step.plan, None if after is None else self._feed(after, step))
        self.scheduler.computed(step)   # the blocks this step filled become findable (prefix caching)
        return LaunchedStep(step, launched)

    @staticmethod
    def _feed(after: LaunchedStep, step: Step) -> Feed:
        """Which of `after`'s tokens each of step's entries takes as its input (those planned with PENDING_TOKEN)."""
        entry = {seq.seq_id: i for i, seq in enumerate(after.step.sequences)}
        return Feed(after.launched.tokens, after.launched.copy,
                    [entry[seq.seq_id] if plan.token_ids[-1] == PENDING_TOKEN else -1
                     for seq, plan in zip(step.sequences, step.plan.steps)])

    def finish_step(self, launched: LaunchedStep) -> list[tuple[Sequence, str]]:
        """The second half: the runner's tokens (the first read-back); record them, retire the finished."""
        step = launched.step
        out = self.runner.finish(launched.launched)
        released = []
        for i, (seq, plan) in enumerate(zip(step.sequences, step.plan.steps)):
            if plan.sampling is None:       # a chunk in the middle of its prompt: no token yet
                continue
            seq.pending -= 1
            if seq.status is Status.FINISHED:   # it stopped (or was aborted) while this step ran ahead: token dropped
                continue
            if i in out.errors:             # its sampling or its logprobs failed: it alone ends
                self._fail(seq, out.errors[i])
                released.append((seq, ""))
            else:
                text = self._isolated(seq, self._record, seq, plan, out.tokens[i], out.logprobs[i])
                released.append((seq, text or ""))
        self.trace.append(StepRecord(self.steps, [s.seq_id for s in step.prefills], step.chunks,
                                     [s.seq_id for s in step.verifies + step.decodes],
                                     [s.seq_id for s in step.preempted], self.scheduler.block_manager.num_free,
                                     [len(p) for p in step.proposals] + [0] * len(step.decodes)))
        self.steps += 1
        return released

    def _record(self, seq: Sequence, plan: SeqStep, tokens: list[int], tops: list[tuple] | None) -> str:
        """Append the tokens (and their logprobs) in order, none past the one that finishes the sequence; free a
        finished sequence's blocks. After a verification (chapter 10): count it, and drop the rejected proposals."""
        text = ""
        for j, token in enumerate(tokens):
            entries = None if tops is None else logprob_entries(token, *tops[j], seq.params.logprobs, self._token_text)
            text += seq.append(token, entries)
            if seq.status is Status.FINISHED:
                self.scheduler.finish(seq)   # its slot and blocks go back now: the next step can use them
                break
        if plan.proposed:
            self.spec_stats.add(plan.proposed, len(tokens))
            if seq.status is Status.RUNNING:
                self.scheduler.verified(seq, plan.proposed, len(tokens) - 1)   # kept: all but the bonus token
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
