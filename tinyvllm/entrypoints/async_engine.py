"""Chapter 7, serving: the engine core as the API server's event loop sees it — AsyncEngine submits requests,
aborts them, and hands each step's Report to the RequestStates it concerns, one per engine request.

The engine core runs in a process of its own (engine/engine_core.py); a reader thread (engine/core_client.py)
receives its Reports and calls into the event loop once per step, however many requests the step served.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import replace

from tinyvllm.engine.core_client import Attachment, EngineClient
from tinyvllm.engine.core_messages import Report, Update
from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.engine.step_record import StepRecord
from tinyvllm.entrypoints import live
from tinyvllm.entrypoints.metrics import Metrics
from tinyvllm.entrypoints.openai_protocol import ApiError
from tinyvllm.formats.tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer

RETRY_AFTER_S = 1          # a 429's Retry-After: a queue of requests moves on within a second or two
ENGINE_SILENCE_S = 30      # /health says 503 past this long without a report (a step or a heartbeat):
                           # the engine is stopped or stuck; the longest step the defaults make is ~1 s
SHUTTING_DOWN = "the server is shutting down; send the request again once it is back"
STEP_RECORDS = 512         # the engine's recent steps, kept for plots and live views: a ring, not a log


class RequestState:
    """One engine request as the API side follows it: one choice (of n, for each prompt) of an HTTP request.
    The reader's updates accumulate here; the response takes them as text when it is ready to write."""
    def __init__(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer, wake: asyncio.Event, stream: bool, after: str | None = None):
        self.request_id, self.index, self.prompt_ids, self.params = request_id, index, prompt_ids, params
        self.after = after                  # n > 1: the request id of sample 0 of the same prompt
        self.tokenizer, self.wake, self.stream = tokenizer, wake, stream
        self.token_ids: list[int] = []
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival, self.first_token_time, self.last_token_time = time.perf_counter(), None, None
        self._taken = 0                     # tokens already turned into text by take()
        self._engine_text = ""              # text the engine made (stop strings need it), not yet taken
        self._decoder = IncrementalDecoder(tokenizer) if stream and not params.stop else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, update: Update, now: float, metrics: Metrics) -> None:
        if update.token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
                metrics.ttft.observe(now - self.arrival)
            else:
                metrics.itl.observe((now - self.last_token_time) / len(update.token_ids))
            self.last_token_time = now
            self.token_ids += update.token_ids
            metrics.generation_tokens.inc(len(update.token_ids))
            if self.logprobs is not None and update.logprobs:
                self.logprobs += update.logprobs
        if update.text:
            self._engine_text += update.text
        if update.finish_reason is not None:
            self.finish_reason, self.error = update.finish_reason, update.error
            metrics.finished(update.finish_reason)
            metrics.e2e.observe(now - self.arrival)
        if self.stream or self.finished:    # a non-streaming response only needs the end
            self.wake.set()

    def take(self) -> tuple[str, list[int], list[dict] | None]:
        """What arrived since the last take: its text, its token ids and their logprobs."""
        start, end = self._taken, len(self.token_ids)
        self._taken = end
        ids = self.token_ids[start:end]
        logprobs = self.logprobs[start:end] if self.logprobs is not None else None
        if self._decoder is None:           # the engine made the text (stop strings), or not streaming
            text, self._engine_text = self._engine_text, ""
            return text, ids, logprobs
        text_ids = ids[:-1] if ids and self.ends_on_stop_token() else ids   # a stop token is not text
        text = "".join(self._decoder.feed(t) for t in text_ids)
        return (text + self._decoder.flush() if self.finished else text), ids, logprobs

    def final_text(self) -> str:
        """The whole text at the end (non-streaming): one decode call, not one per token."""
        if self.params.stop:
            return self._engine_text
        ids = self.token_ids[:-1] if self.ends_on_stop_token() else self.token_ids
        return self.tokenizer.decode(ids)

    def ends_on_stop_token(self) -> bool:
        """A "stop" finish ends on a stop token, except a structured output's, which also stops once complete."""
        if self.finish_reason != "stop" or not self.token_ids:
            return False
        stops = set(self.tokenizer.stop_token_ids) | set(self.params.stop_token_ids)
        return self.params.structured_outputs is None or self.token_ids[-1] in stops


class AsyncEngine:
    """The engine process as the HTTP handlers see it: submit a request's RequestStates (its choices), abort
    them, read the queues."""
    def __init__(self, config: EngineConfig, model_name: str, max_queue: int = 256, in_thread: bool = False,
                 attach: Attachment | None = None):
        from tinyvllm.formats.checkpoints import resolve_model
        config = replace(config, model=str(resolve_model(config.model)))  # the default model is converted once, here
        self.client = EngineClient(config, in_thread=in_thread, attach=attach)
        self.info, self.max_queue, self.alone = self.client.info, max_queue, attach is None
        self.tokenizer = load_tokenizer(config.model)
        self.metrics = Metrics(model_name, engine_counters=attach is None or attach.index == 0)
        self.choices: dict[str, RequestState] = {}
        self.steps: deque[StepRecord] = deque(maxlen=STEP_RECORDS)
        self.recent = live.Recent()         # the last minute's tokens/s and times to first token (the live page)
        self.board = live.SnapshotBoard(self.client.ask_snapshot, lambda part: live.page_json(part, self))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client.on_report, self.client.on_death = self._on_report, self._on_death
        self.silence_limit_s, self.stopping = ENGINE_SILENCE_S, False

    def attach(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop

    @property
    def dead(self) -> str | None:
        return self.client.dead

    def unhealthy(self) -> str | None:
        """Why /health should say 503: the engine is gone, or silent (SIGSTOP, a hang), or we are stopping."""
        silent = self.client.silent_for()
        if self.dead or self.stopping:
            return self.dead or SHUTTING_DOWN
        if silent > self.silence_limit_s:
            return f"the engine has not reported for {silent:.0f} s: it is stopped or stuck"
        return None

    def stop_requests(self) -> None:
        """The server is told to stop: every request in flight ends now (a 503, or an error event that closes
        its stream), so that the graceful shutdown has nothing to wait for and nothing is cut off."""
        self.stopping = True
        self._call_in_loop(self._fail_all, SHUTTING_DOWN)

    # reader thread -> event loop: one call per step, however many requests it served
    def _on_report(self, report: Report) -> None:
        self._call_in_loop(self._dispatch, report, time.perf_counter())

    def _call_in_loop(self, function, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except (AttributeError, RuntimeError):   # no loop yet, or it closed: the server is stopping
            pass

    def _on_death(self, reason: str) -> None:
        self._call_in_loop(self._fail_all, f"{reason}; the server must be restarted")

    def _fail_all(self, error: str) -> None:
        for request_id in list(self.choices):
            self._dispatch_one(Update(request_id, [], None, None, "error", error), time.perf_counter())

    def _dispatch(self, report: Report, now: float) -> None:
        self.metrics.engine_stats(report.stats)
        if report.step is not None:
            self.steps.append(report.step._replace(time=now))
        self.recent.add(report, now)
        if report.snapshot is not None:     # a live page asked for one
            self.board.arrived(report.snapshot)
        for update in report.updates:
            self._dispatch_one(update, now)

    def _dispatch_one(self, update: Update, now: float) -> None:
        choice = self.choices.get(update.request_id)
        if choice is None:   # another API server's request, or aborted a moment ago: its tokens are not ours
            return
        waited = choice.first_token_time is None
        choice.apply(update, now, self.metrics)
        if waited and choice.first_token_time is not None:
            self.recent.first_token(now, now - choice.arrival)
        if choice.finished:
            del self.choices[update.request_id]

    # event loop -> engine process
    def submit(self, choices: list[RequestState]) -> None:
        if self.dead:
            raise ApiError(503, f"{self.dead}; the server must be restarted", "server_error", code="engine_dead")
        if self.stopping:
            raise ApiError(503, SHUTTING_DOWN, "server_error", code="shutting_down")
        most = self.info["max_num_seqs"] + self.max_queue
        if len(choices) > most:   # never fits, however long the client waits: not a 429
            raise ApiError(400, f"this request asks for {len(choices)} sequences (prompts x n); this server takes "
                                f"at most {most} at once (--max-num-seqs plus --max-queue); split it", param="n")
        if len(choices) > most - self.outstanding():
            raise ApiError(429, f"{len(self.choices)} sequences are running or waiting (the server's --max-num-seqs "
                                "plus --max-queue); retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        for choice in choices:
            self.choices[choice.request_id] = choice
            self.metrics.prompt_tokens.inc(len(choice.prompt_ids))
            self.client.add(choice.request_id, choice.prompt_ids, choice.params, choice.after)

    def outstanding(self) -> int:
        """Sequences running or waiting. Beside other API servers: the engine's count as of the last step
        (a step behind for their newest requests: the limit guards memory, it is not a quota)."""
        if self.alone:
            return len(self.choices)
        return max(len(self.choices), self.client.stats.running + self.client.stats.waiting)

    def abort(self, choices: list[RequestState]) -> None:
        """Stop the unfinished ones now: the client is gone (or the request failed)."""
        for choice in choices:
            if self.choices.pop(choice.request_id, None) is not None:
                self.client.abort(choice.request_id)
                self.metrics.finished("abort")

    def close(self) -> None:
        self.client.close()

