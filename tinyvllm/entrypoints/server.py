"""`python -m tinyvllm serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

Two processes, as vLLM does it (chapter 7 measures why):

  engine core  (engine_core.py) runs steps and nothing else: add, abort, step, report the new tokens.
  API server   (this file) FastAPI + uvicorn on one asyncio loop: checks each request where it enters
               (pydantic models: a wrong field is a 400 that names it), renders the chat template,
               tokenizes, sends the request to the engine, and turns each step's tokens into text and
               server-sent events. A reader thread receives the engine's reports and hands them to the loop.

So the HTTP work (JSON, detokenizing, one event per token per client) runs beside the engine's steps
instead of between them. When one API process is not enough, `--api-server-count N` runs N of them on one
port in front of the same engine core (api_servers.py). A hundred clients are a hundred sequences in one scheduler, decoded together.
At / a live page (live.py) draws the KV pool, the queues and each step's batch as they change.

No request can hurt another: a field that is wrong is refused at the edge; a request that fails inside
the engine fails alone; a client that leaves (streaming or not, before or after its first byte) is
aborted at once and its blocks go back to the pool. If the engine process itself dies, /health says 503.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import replace

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from tinyvllm.engine import sequence
from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.engine_core import Attachment, EngineClient, Report, Update
from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.entrypoints import live
from tinyvllm.entrypoints import openai_protocol as api
from tinyvllm.entrypoints.metrics import Metrics
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer

MAX_BODY_BYTES = 1 << 20   # 1 MiB: a request body past it gets a 413 before it is parsed
RETRY_AFTER_S = 1          # a 429's Retry-After: a queue of requests moves on within a second or two
ENGINE_SILENCE_S = 30      # /health says 503 past this long without a report (a step or a heartbeat):
                           # the engine is stopped or stuck; the longest step the defaults make is ~1 s
SHUTTING_DOWN = "the server is shutting down; send the request again once it is back"
STEP_RECORDS = 512         # the engine's recent steps, kept for plots and live views: a ring, not a log
log = logging.getLogger(__name__)
access_log = logging.getLogger("tinyvllm.access")


class ApiError(Exception):
    """Refuse a request with an HTTP status and OpenAI's error object."""
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, api.error(message, type_, param, code), headers


# ---- the API side of one request ----

class Choice:
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
    """The engine process as the HTTP handlers see it: submit choices, abort them, read the queues."""
    def __init__(self, config: EngineConfig, model_name: str, max_queue: int = 256, in_thread: bool = False,
                 attach: Attachment | None = None):
        from tinyvllm.formats.checkpoints import resolve_model
        config = replace(config, model=str(resolve_model(config.model)))  # the default model is converted once, here
        self.client = EngineClient(config, in_thread=in_thread, attach=attach)
        self.info, self.max_queue, self.alone = self.client.info, max_queue, attach is None
        self.tokenizer = load_tokenizer(config.model)
        self.metrics = Metrics(model_name, engine_counters=attach is None or attach.index == 0)
        self.choices: dict[str, Choice] = {}
        self.steps: deque[dict] = deque(maxlen=STEP_RECORDS)
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
            self.steps.append({**report.step, "time": now})
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
    def submit(self, choices: list[Choice]) -> None:
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

    def abort(self, choices: list[Choice]) -> None:
        """Stop the unfinished ones now: the client is gone (or the request failed)."""
        for choice in choices:
            if self.choices.pop(choice.request_id, None) is not None:
                self.client.abort(choice.request_id)
                self.metrics.finished("abort")

    def close(self) -> None:
        self.client.close()


# ---- the HTTP side ----

def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, ui: bool = True, host_names: set[str] | None = None) -> FastAPI:
    """host_names: the Host header names to answer (None: any, as for a server bound to every interface)."""
    info, tokenizer = engine.info, engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        yield
        engine.attach(None)

    app = FastAPI(title="tinyvllm", summary="an OpenAI-compatible server on tinyvllm's engine", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)   # the last added runs first: AccessLog, host, key, body
    app.add_middleware(ApiKeyCheck, api_key=api_key)
    if host_names is not None:
        app.add_middleware(LocalHostOnly, names=host_names)
    app.add_middleware(AccessLog)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)   # unknown routes, wrong methods (with Allow), unparsable bodies
    async def http_error(request: Request, e: HTTPException):
        message = str(e.detail)
        if e.status_code == 400:   # FastAPI could not parse the body (malformed, or nested past any sense)
            message = "the request body is not valid JSON, or is nested too deeply to parse"
        return JSONResponse(api.error(message, code=e.status_code), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)   # a field that is wrong: 400 naming it
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first["type"] == "json_invalid":   # the location is a character offset, not a field
            return JSONResponse(api.error(f"the request body is not valid JSON (at character {first['loc'][-1]})"),
                                status_code=400)
        loc = [str(part) for part in first["loc"] if part != "body"]
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "tinyvllm does not know this field (it refuses what it would otherwise ignore); leave it out"
        return JSONResponse(api.error(f"{'.'.join(loc) or 'body'}: {message}", param=loc[0] if loc else None),
                            status_code=400)

    @app.exception_handler(ClientGone)   # nobody is listening: nginx's 499 goes to the access log only
    async def client_gone(request: Request, e: ClientGone):
        return Response(status_code=499)

    @app.exception_handler(Exception)    # a bug: logged with its traceback, the client gets an error object
    async def bug(request: Request, e: Exception):
        log.exception("request failed")
        return JSONResponse(api.error(f"internal error: {type(e).__name__}", "server_error", code=500),
                            status_code=500)

    async def json_only(request: Request) -> None:
        """A web page can POST text/plain to localhost without asking; it cannot send JSON unasked."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise ApiError(415, f"the body must be JSON sent with 'Content-Type: application/json', got "
                                f"{kind or 'no Content-Type'}", code="unsupported_media_type")

    def openapi() -> dict:
        """FastAPI documents a 422 for every route with a body; this server answers a wrong field with a 400."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            for route in schema["paths"].values():
                for operation in route.values():
                    operation["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema["components"]["schemas"].pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health")
    async def health():
        reason = engine.unhealthy()
        if reason is not None:
            return JSONResponse({"status": "error", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "tinyvllm",
                "max_model_len": info["max_model_len"]}

    @app.get("/v1/models", responses=api.ERROR_RESPONSES)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=api.ERROR_RESPONSES)
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions", responses=api.ERROR_RESPONSES, dependencies=[Depends(json_only)])
    async def completions(body: api.CompletionRequest, request: Request):
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
        return await generate(request, body, prompts, body.max_tokens, body.logprobs, chat=False)

    @app.post("/v1/chat/completions", responses=api.ERROR_RESPONSES,
              dependencies=[Depends(json_only)])
    async def chat_completions(body: api.ChatRequest, request: Request):
        try:   # the template may refuse the conversation (raise_exception), or fail on it: one line, 400
            prompt = tokenizer.apply_chat_template(body.conversation(), body.add_generation_prompt)
        except TinyVLLMError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await generate(request, body, [prompt], body.reply_tokens, body.engine_logprobs, chat=True)

    async def generate(request: Request, body, prompts: list[list[int]], max_tokens: int | None,
                       logprobs: int | None, chat: bool):
        if body.model not in (None, model_name):
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        for ids in prompts:
            check_prompt(ids, max_tokens, info)
        try:
            params = body.sampling_params(max_tokens, logprobs)
        except TinyVLLMError as e:
            raise ApiError(400, str(e)) from None
        request_id, wake = api.new_id("chatcmpl" if chat else "cmpl"), asyncio.Event()
        choices = [Choice(f"{request_id}-{i}", i, ids, params.child(k), tokenizer, wake, body.stream,
                          after=None if k == 0 else f"{request_id}-{i - k}")   # sample 0 of the same prompt
                   for i, (ids, k) in enumerate((ids, k) for ids in prompts for k in range(params.n))]
        request.state.request_id, request.state.choices, request.state.user = request_id, choices, body.user
        engine.submit(choices)
        reply = Reply(request_id, model_name, chat, body, choices, tokenizer)
        if body.stream:
            return StreamingResponse(stream_events(engine, reply), media_type="text/event-stream",
                                     background=BackgroundTask(engine.abort, choices))
        try:
            await until_finished(request, choices)
        finally:   # finished: a no-op; the client left (or an error): the unfinished stop now
            engine.abort(choices)
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None and failed.error == SHUTTING_DOWN:
            raise ApiError(503, SHUTTING_DOWN, "server_error", code="shutting_down")
        if failed is not None:
            raise ApiError(500, f"the request failed in the engine: {failed.error}", "server_error")
        return JSONResponse(reply.whole())   # already plain JSON: skip FastAPI's slow recursive encoder

    if ui:   # the live page at /, and its snapshots (serve --no-ui: none of it)
        live.add_routes(app, engine)
    return app


def check_prompt(ids: list[int], max_tokens: int | None, info: dict) -> None:
    """Refuse what cannot fit in the context window, rather than quietly cutting the answer short."""
    window = info["max_model_len"]
    try:
        sequence.check_prompt(ids, window, info["vocab_size"])
    except sequence.PromptTooLong as e:
        raise ApiError(400, str(e), param="prompt", code="context_length_exceeded") from None
    except TinyVLLMError as e:
        raise ApiError(400, str(e), param="prompt") from None
    if max_tokens and len(ids) + max_tokens > window:
        raise ApiError(400, f"the prompt has {len(ids)} tokens and max_tokens asks for {max_tokens} more, past "
                            f"this server's context window of {window}; lower max_tokens (or leave it out: "
                            "the reply then gets what fits)", param="max_tokens", code="context_length_exceeded")


async def until_finished(request: Request, choices: list[Choice]) -> None:
    """Wait for every choice to finish, or for the client to leave (then raise: nobody will read it)."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while not all(c.finished for c in choices):
            woken = asyncio.ensure_future(choices[0].wake.wait())
            done, _ = await asyncio.wait({woken, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                woken.cancel()
                raise ClientGone()
            choices[0].wake.clear()
    finally:
        gone.cancel()


class ClientGone(Exception):
    """The client closed the connection: there is nobody to answer."""


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is read, so only that message can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Reply:
    """Builds one HTTP request's response from its choices: whole (JSON) or as server-sent events."""
    def __init__(self, request_id: str, model: str, chat: bool, body, choices: list[Choice], tokenizer: Tokenizer):
        self.request_id, self.model, self.chat, self.body, self.choices = request_id, model, chat, body, choices
        self.tokenizer = tokenizer
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"   # OpenAI's names
        self.created = int(time.time())   # one time for every chunk of a response, as OpenAI's
        self.top_k = getattr(body, "top_logprobs", None) or 0
        self.echo = [tokenizer.decode(c.prompt_ids) if getattr(body, "echo", False) else "" for c in choices]
        self.offsets = [len(e) for e in self.echo]   # where each choice's next text starts (completion logprobs)
        self.text_events = [self._text_event(c.index) for c in choices]

    def usage(self) -> dict:
        prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in self.choices}   # n choices share one prompt
        return api.usage(sum(prompts.values()), sum(len(c.token_ids) for c in self.choices))

    def logprobs(self, choice: Choice, text: str, ids: list[int], entries: list[dict] | None) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return api.chat_logprobs(ids, entries, self.top_k, self.tokenizer)
        out = api.completion_logprobs(ids, entries, self.offsets[choice.index], self.tokenizer)
        self.offsets[choice.index] += len(text)
        return out

    def whole(self) -> dict:
        choices = []
        for c in self.choices:
            text = c.final_text()
            logprobs = self.logprobs(c, text, c.token_ids, c.logprobs)
            make = api.chat_choice if self.chat else api.completion_choice
            choices.append(make(c.index, self.echo[c.index] + text, logprobs, c.finish_reason))
        return api.response(self.request_id, self.object, self.model, choices, self.usage(), self.created)

    def _chunk_data(self, index: int, text: str | None, logprobs: dict | None, finish_reason: str | None) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            data = api.chat_delta_choice(index, delta, logprobs, finish_reason)
        else:
            data = api.completion_choice(index, text or "", logprobs, finish_reason)
        out = api.response(self.request_id, self.chunk_object, self.model, [data], created=self.created)
        return {**out, "usage": None} if self.body.include_usage else out

    def _text_event(self, index: int) -> tuple[str, str]:
        """A text chunk's event split around its text: each token's event is then a splice, not a JSON
        dump of nested dicts (at 128 streams x 150 steps a second, that is the API process's hot loop)."""
        head, tail = event(self._chunk_data(index, TEXT, None, None)).split(json.dumps(TEXT), 1)
        return head, tail

    def chunk(self, choice: Choice, text: str | None, ids: list[int], entries, finish_reason) -> str:
        if text is not None and entries is None and finish_reason is None:
            head, tail = self.text_events[choice.index]
            return head + sse_json(text) + tail
        logprobs = self.logprobs(choice, text or "", ids, entries)
        return event(self._chunk_data(choice.index, text, logprobs, finish_reason))

    def first_chunks(self) -> str:
        if self.chat:   # the first chat chunk of each choice names the role
            return "".join(event(api.response(self.request_id, self.chunk_object, self.model,
                                              [api.chat_delta_choice(c.index, {"role": "assistant", "content": ""},
                                                                     None, None)], created=self.created))
                           for c in self.choices)
        return "".join(self.chunk(c, self.echo[c.index], [], None, None) for c in self.choices if self.echo[c.index])

    def usage_chunk(self) -> str:
        return event({**api.response(self.request_id, self.chunk_object, self.model, [], created=self.created),
                      "usage": self.usage()})


TEXT = "\x00text\x00"   # a placeholder no JSON dump leaves unescaped


def event(data) -> str:
    return f"data: {sse_json(data)}\n\n"


# JSON leaves U+0085, U+2028 and U+2029 as they are, and SSE allows them, but Python's str.splitlines() ends a
# line at each: httpx's line reader (so the openai client) cut an event in two, and its JSON did not parse
LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(data) -> str:
    """One event's JSON: UTF-8 as it is (no \\uXXXX for every accent), except the characters that end a line."""
    return json.dumps(data, ensure_ascii=False).translate(LINE_BREAKS_JSON_KEEPS)


async def stream_events(engine: AsyncEngine, reply: Reply):
    """Server-sent events: the text of each choice as it arrives (whatever came since the last event, in one
    chunk: a slow client gets bigger chunks, not a growing queue), then each choice's finish reason, the
    usage if asked, and `data: [DONE]`. One write per wake-up. Cancelled when the client goes away: its
    choices are aborted."""
    choices, wake = reply.choices, reply.choices[0].wake
    try:
        first = reply.first_chunks()
        if first:
            yield first
        open_ = list(choices)
        while open_:
            await wake.wait()
            wake.clear()
            events = []
            for choice in list(open_):
                text, ids, entries = choice.take()
                if choice.finish_reason == "error":
                    message = choice.error if choice.error == SHUTTING_DOWN else \
                        f"the request failed in the engine: {choice.error}"
                    error = api.error(message, "server_error")
                    yield "".join(events) + event(error) + "data: [DONE]\n\n"
                    return
                if text or entries:   # a stop token alone is no text: nothing to send but the finish
                    events.append(reply.chunk(choice, text, ids, entries, None))
                if choice.finished:
                    events.append(reply.chunk(choice, None, [], None, choice.finish_reason))
                    open_.remove(choice)
            if not open_:
                events += [reply.usage_chunk()] if reply.body.include_usage else []
                events.append("data: [DONE]\n\n")
            if events:
                yield "".join(events)
    finally:   # finished: a no-op; the client left (cancelled here): its choices stop now
        engine.abort(choices)


# ---- middleware: two small jobs every request goes through ----

class BodyLimit:
    """Read the body before anything parses it, and answer 413 past max_bytes (a client cannot make the
    server buffer gigabytes). The body is then replayed to the app, followed by the client's own messages."""
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        body, more = bytearray(), True
        if not declared.isdigit() or int(declared) <= self.max_bytes:
            while more and len(body) <= self.max_bytes:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
        if more or len(body) > self.max_bytes:
            response = JSONResponse(api.error(f"the request body is over {self.max_bytes} bytes",
                                              code="request_too_large"), status_code=413)
            return await response(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


KEYED_PATHS = ("/v1/", "/ui/snapshot", "/ui/events")   # what --api-key guards (the page itself loads, to ask for it)
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def error_response(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(api.error(message, code=code), status_code=status, headers=headers)


class ApiKeyCheck:
    """With --api-key: a request to a guarded path without `Authorization: Bearer <key>` gets a 401 before its
    body is read or parsed (a client without the key cannot make the server parse a megabyte of JSON)."""
    def __init__(self, app, api_key: str | None):
        self.app, self.expected = app, None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or not scope["path"].startswith(KEYED_PATHS):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")   # RFC 6750: "Bearer" (any case), one space, the token
        if scheme.lower() == b"bearer" and secrets.compare_digest(token, self.expected):
            return await self.app(scope, receive, send)
        response = error_response(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                                  "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class LocalHostOnly:
    """Bound to a loopback address, answer only requests whose Host header names this machine: a web page on
    another site could otherwise point its own name at 127.0.0.1 (DNS rebinding) and read a keyless server."""
    def __init__(self, app, names: set[str]):
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host   # drop the port; keep [::1] whole
        if name.strip("[]").lower() in self.names:
            return await self.app(scope, receive, send)
        response = error_response(400, f"the Host header {printable(host)!r} does not name this server; it answers "
                                       f"only to {sorted(self.names)} (serve --host 0.0.0.0 to answer any name)",
                                  "invalid_host")
        await response(scope, receive, send)


def printable(text: str) -> str:
    """Text safe for a log line: control characters (CR, LF, the escape of ANSI colours) as \\xNN escapes."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


class AccessLog:
    """One line per request: method, path, status, request id, the client's `user` if sent, tokens in and
    out, seconds. The path and the user are the client's text: escaped, so that they cannot forge a line."""
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            state = scope.get("state", {})
            choices = state.get("choices", [])
            user = f" user={state['user']!r}" if state.get("user") else ""
            access_log.info("%s %s %d %s%s prompt_tokens=%d output_tokens=%d %.3fs", scope["method"],
                            printable(scope["path"]),
                            status[0], state.get("request_id", "-"), user, sum(len(c.prompt_ids) for c in choices),
                            sum(len(c.token_ids) for c in choices), time.perf_counter() - start)


# ---- running it ----

def host_names(host: str) -> set[str] | None:
    """The Host header names a server bound to `host` answers: this machine's names on a loopback address, any
    name on another (it cannot know what names point at it)."""
    if host.strip("[]") in LOOPBACK_NAMES or host.startswith("127."):
        return LOOPBACK_NAMES | {host.strip("[]")}
    return None


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


def announce(model_name: str, info: dict, url: str, ui: bool) -> None:
    page = f", live page at {url}/" if ui else ""
    print(f"serving {model_name!r} on {info['device']} (context window {info['max_model_len']} tokens): "
          f"OpenAI API at {url}/v1{page} (Ctrl-C stops)", file=sys.stderr)


def listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Bind the port first, so a port in use is one clear error (port 0: any free port). reuse_port: one of
    several API servers' sockets on the same port (the kernel spreads new connections over them)."""
    try:
        return socket.create_server((host, port), reuse_port=reuse_port)
    except OSError as e:
        raise cannot_listen(host, port, e) from None


def cannot_listen(host: str, port: int, e: OSError) -> TinyVLLMError:
    return TinyVLLMError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port or --host")


class Server:
    """The engine process + uvicorn. serve() blocks (the CLI); start() runs uvicorn in a thread (tests, notebook).
    With `sock` and `attach`: one of several API servers (api_servers.py) on a shared socket and engine."""
    def __init__(self, config: EngineConfig, model_name: str = "default", host: str = "127.0.0.1",
                 port: int = 8000, max_queue: int = 256, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, log_level: str = "info", engine_in_thread: bool = False,
                 ui: bool = True, sock: socket.socket | None = None, attach: Attachment | None = None):
        self.sock = listen(host, port) if sock is None else sock
        self.url = url_of(self.sock)
        api_key = api_key or os.environ.get("TINYVLLM_API_KEY") or None
        try:
            self.engine = AsyncEngine(config, model_name, max_queue, in_thread=engine_in_thread, attach=attach)
        except BaseException:
            self.sock.close()
            raise
        app = create_app(self.engine, model_name, api_key, max_body_bytes, ui, host_names(host))
        logging.getLogger("tinyvllm").setLevel(getattr(logging, log_level.upper()))
        self.uvicorn = StoppingServer(uvicorn.Config(app, log_level=log_level, access_log=False,
                                                     timeout_graceful_shutdown=1), self.engine.stop_requests)
        self._thread = None

    def serve(self) -> None:
        """Until Ctrl-C or SIGTERM (kill, systemd, docker), which stop it alike: requests in flight are
        answered 503, uvicorn closes the connections, the engine stops. uvicorn then raises the signal it
        caught again: SIGTERM is turned into an exception here, so that the engine is closed before this
        process dies by that signal, as its supervisor expects."""
        in_main = threading.current_thread() is threading.main_thread()   # signals go to the main thread only
        previous, got_sigterm = signal.signal(signal.SIGTERM, terminated) if in_main else None, False
        try:
            self.uvicorn.run(sockets=[self.sock])
        except Terminated:
            got_sigterm = True
        finally:
            self.engine.close()
            if in_main:
                signal.signal(signal.SIGTERM, previous)
        if got_sigterm:
            signal.raise_signal(signal.SIGTERM)

    def start(self) -> Server:
        self._thread = threading.Thread(target=self.serve, name="tinyvllm-http", daemon=True)
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped while starting; see the log above")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.engine.stop_requests()
        self.uvicorn.should_exit = True
        self._thread.join()


class StoppingServer(uvicorn.Server):
    """uvicorn, ending the requests in flight the moment it is told to stop (on_stop), instead of cutting
    them off with a plain-text 500 once its grace period is over."""
    def __init__(self, config: uvicorn.Config, on_stop) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    def handle_exit(self, sig: int, frame) -> None:
        self.on_stop()
        super().handle_exit(sig, frame)


class Terminated(Exception):
    """SIGTERM arrived: leave uvicorn.run through the cleanup, as KeyboardInterrupt does for Ctrl-C."""


def terminated(signum: int, frame) -> None:
    raise Terminated()
