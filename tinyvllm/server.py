"""`python -m tinyvllm serve`: an OpenAI-compatible HTTP server on one continuous-batching engine.

Two threads, and one rule: neither ever waits for the other.

  engine thread   owns the LLM. It loops: apply the commands queued since the last step (add a request,
                  abort one), run one engine step (chapter 7), hand each request the text it released.
                  With no work it sleeps until a command arrives.
  HTTP thread     asyncio + uvicorn: parses requests, queues an "add" command, then awaits the request's
                  own asyncio.Queue, which the engine thread fills with loop.call_soon_threadsafe.

So a hundred clients are a hundred sequences in the same scheduler, decoded together in one batch per
step. A streaming client that goes away is cancelled by the server, and its "abort" command frees its
blocks before the next step.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from tinyvllm import openai_protocol as api
from tinyvllm.errors import TinyVLLMError
from tinyvllm.llm import LLM
from tinyvllm.sampling import SamplingParams
from tinyvllm.sequence import Status

MAX_BODY_BYTES = 1 << 20   # 1 MiB: a request body past it gets a 413 before it is parsed
log = logging.getLogger("tinyvllm.server")


class ApiError(Exception):
    """Refuse a request with an HTTP status and OpenAI's error object."""
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, api.error(message, type_, param, code)


class Stream:
    """One request as both threads see it: the engine thread puts events, the HTTP side awaits them."""
    def __init__(self, prompt_ids: list[int], params: SamplingParams, incremental: bool):
        self.prompt_ids, self.params, self.incremental = prompt_ids, params, incremental
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()   # ("accepted"|"text"|"done"|"error", value)
        self.seq = None

    def put(self, kind: str, value=None) -> None:   # engine thread -> HTTP thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:   # the HTTP thread's event loop is closed: the server is shutting down
            pass

    async def texts(self):
        """The text chunks as the engine releases them, until the sequence finishes."""
        while True:
            kind, value = await self.events.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value


class EngineLoop:
    """The engine thread: the only code that touches the LLM once the server runs."""
    def __init__(self, llm: LLM, max_queue: int = 256):
        self.llm, self.engine, self.max_queue = llm, llm.llm_engine, max_queue
        self.streams: dict[int, Stream] = {}           # seq_id -> its client's stream
        self.steps = 0                                 # engine steps so far (tests and plots read it)
        self.step_times: list[float] = []              # time.perf_counter() at the end of each step
        self._commands: list = []
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._post(None)
        self._thread.join()

    # ---- called from the HTTP thread: they only queue commands ----

    async def add(self, prompt_ids: list[int], params: SamplingParams, incremental: bool) -> Stream:
        """Queue a request; returns its Stream once the engine took it (or raises why it did not)."""
        stream = Stream(prompt_ids, params, incremental)
        self._post(lambda: self._add(stream))
        kind, value = await stream.events.get()
        if kind == "error":
            raise value
        return stream

    def abort(self, stream: Stream) -> None:
        self._post(lambda: self._abort(stream))

    def _post(self, command) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    # ---- the engine thread ----

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._commands and not self.engine.has_work():
                    self._wake.wait()
                commands, self._commands = self._commands, []
            for command in commands:
                if command is None:
                    return
                command()
            if self.engine.has_work():
                self._step()

    def _add(self, stream: Stream) -> None:
        waiting = len(self.engine.scheduler.waiting)
        if waiting >= self.max_queue:
            return stream.put("error", ApiError(429, f"{waiting} requests are already waiting (the server's "
                                                     "--max-queue); retry later", "rate_limit_error",
                                                code="queue_full"))
        try:
            stream.seq = self.llm.add_request(stream.prompt_ids, stream.params, stream.incremental)
        except TinyVLLMError as e:   # an empty prompt, a token outside the vocabulary, a pool too small
            return stream.put("error", ApiError(400, str(e)))
        self.streams[stream.seq.seq_id] = stream
        stream.put("accepted")

    def _abort(self, stream: Stream) -> None:
        if stream.seq is not None and self.streams.pop(stream.seq.seq_id, None):
            self.engine.abort(stream.seq)              # its blocks are back in the pool now

    def _step(self) -> None:
        try:
            released = self.engine.step()
        except Exception as e:   # a bug, not a client's mistake: fail the requests in flight, keep serving
            log.exception("engine step failed")
            for stream in self.streams.values():
                self.engine.abort(stream.seq)
                stream.put("error", ApiError(500, f"the engine failed: {e!r}", "server_error"))
            self.streams.clear()
            return
        for seq, text in released:
            stream = self.streams.get(seq.seq_id)
            if stream is None:
                continue
            if text:
                stream.put("text", text)
            if seq.status is Status.FINISHED:
                del self.streams[seq.seq_id]
                stream.put("done")
        self.steps += 1
        self.step_times.append(time.perf_counter())


# ---- the HTTP side ----

def create_app(engine_loop: EngineLoop, model_name: str, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="tinyvllm", summary="an OpenAI-compatible server on tinyvllm's engine")
    llm = engine_loop.llm

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(HTTPException)   # unknown routes, wrong methods: the same error object
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(api.error(str(e.detail), code=str(e.status_code)), status_code=e.status_code)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tinyvllm", "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_request(request, api.CompletionRequest, max_body_bytes)
        return await generate(body, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_request(request, api.ChatRequest, max_body_bytes)
        return await generate(body, body.reply_tokens, chat=True)

    async def generate(body, max_tokens: int | None, chat: bool):
        if body.model not in (None, model_name):
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        try:
            prompt_ids = body.prompt_ids(llm.tokenizer)
            params = body.sampling_params(max_tokens)
        except TinyVLLMError as e:
            raise ApiError(400, str(e)) from None
        check_context(len(prompt_ids), max_tokens, llm.max_model_len)
        stream = await engine_loop.add(prompt_ids, params, incremental=body.stream)
        request_id, make = api.new_id("chatcmpl" if chat else "cmpl"), api.chat_completion if chat else api.completion
        if body.stream:
            return StreamingResponse(sse(engine_loop, stream, request_id, model_name, chat, body.include_usage),
                                     media_type="text/event-stream")
        text = "".join([t async for t in stream.texts()])
        use = api.usage(len(prompt_ids), len(stream.seq.output_ids))
        return make(request_id, model_name, text, stream.seq.finish_reason, use)

    return app


async def read_request(request: Request, model, max_body_bytes: int):
    """The body, size-checked while it arrives, parsed as JSON, validated into `model`; else a 4xx."""
    if int(request.headers.get("content-length") or 0) > max_body_bytes:
        raise ApiError(413, f"the request body is over {max_body_bytes} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise ApiError(413, f"the request body is over {max_body_bytes} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(map(str, first["loc"])) or None
        raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param) from None


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Refuse what cannot fit in the context window, rather than quietly cutting the answer short."""
    if prompt_tokens >= max_model_len:
        raise ApiError(400, f"the prompt has {prompt_tokens} tokens but this model's context window is "
                            f"{max_model_len}; shorten the prompt", param="prompt", code="context_length_exceeded")
    if max_tokens and prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"the prompt has {prompt_tokens} tokens and max_tokens asks for {max_tokens} more, "
                            f"past this model's context window of {max_model_len}; lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")


async def sse(engine_loop: EngineLoop, stream: Stream, request_id: str, model: str, chat: bool,
              include_usage: bool):
    """Server-sent events: one `data: {chunk}` per text piece as the engine releases it, then the finish
    reason, the usage (if asked), and `data: [DONE]`. Cancelled when the client goes away: abort."""
    def event(data) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def chunk(text: str | None, finish_reason: str | None = None) -> dict:
        if chat:
            delta = {} if text is None else {"role": "assistant", "content": text} if text == "" else {"content": text}
            out = api.chat_chunk(request_id, model, delta, finish_reason)
        else:
            out = api.completion_chunk(request_id, model, text or "", finish_reason)
        return {**out, "usage": None} if include_usage else out

    try:
        if chat:
            yield event(chunk(""))   # the first chat chunk names the role
        try:
            async for text in stream.texts():
                yield event(chunk(text))
        except ApiError as e:
            yield event(e.body)
            return
        yield event(chunk(None, stream.seq.finish_reason))
        if include_usage:
            use = api.usage(len(stream.prompt_ids), len(stream.seq.output_ids))
            yield event({**chunk(None), "choices": [], "usage": use})
        yield "data: [DONE]\n\n"
    finally:   # finished: a no-op; the client left (cancelled here): its sequence stops now
        engine_loop.abort(stream)


# ---- running it ----

def listen(host: str, port: int) -> socket.socket:
    """Bind the port first, so a port in use is one clear error (port 0: any free port)."""
    try:
        return socket.create_server((host, port))
    except OSError as e:
        raise TinyVLLMError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port or --host") from None


class Server:
    """The engine thread + uvicorn. serve() blocks (the CLI); start() runs uvicorn in a thread (tests, notebook)."""
    def __init__(self, llm: LLM, model_name: str = "default", host: str = "127.0.0.1", port: int = 8000,
                 max_queue: int = 256, max_body_bytes: int = MAX_BODY_BYTES, log_level: str = "info"):
        self.engine_loop = EngineLoop(llm, max_queue)
        self.sock = listen(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        app = create_app(self.engine_loop, model_name, max_body_bytes)
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=1))
        self._thread = None

    def serve(self) -> None:
        self.engine_loop.start()
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.engine_loop.stop()

    def start(self) -> Server:
        self._thread = threading.Thread(target=self.serve, name="tinyvllm-http", daemon=True)
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped while starting; see the log above")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self._thread.join()
