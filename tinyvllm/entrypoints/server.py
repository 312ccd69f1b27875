"""`python -m tinyvllm serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

Two processes, as vLLM does it (chapter 7 measures why):

  engine core  (engine/engine_core.py) runs steps and nothing else: add, abort, step, report the new tokens.
  API server   FastAPI + uvicorn on one asyncio loop: checks each request where it enters (pydantic models,
               openai_protocol.py: a wrong field is a 400 that names it), renders the chat template,
               tokenizes, sends the request to the engine (async_engine.py), and turns each step's tokens
               into text and server-sent events (responses.py). A reader thread receives the engine's
               reports and hands them to the loop.

So the HTTP work (JSON, detokenizing, one event per token per client) runs beside the engine's steps
instead of between them. When one API process is not enough, `--api-server-count N` runs N of them on one
port in front of the same engine core (api_servers.py). A hundred clients are a hundred sequences in one scheduler, decoded together.
At / a live page (live.py) draws the KV pool, the queues and each step's batch as they change.

No request can hurt another: a field that is wrong is refused at the edge; a request that fails inside
the engine fails alone; a client that leaves (streaming or not, before or after its first byte) is
aborted at once and its blocks go back to the pool. If the engine process itself dies, /health says 503.

This file builds the API server's app (its routes, behind middleware.py's checks) and runs it (Server).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from tinyvllm.engine import sequence
from tinyvllm.engine.core_client import Attachment
from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.entrypoints import live, tools
from tinyvllm.entrypoints import openai_protocol as api
from tinyvllm.entrypoints.async_engine import SHUTTING_DOWN, AsyncEngine, RequestState
from tinyvllm.entrypoints.middleware import (MAX_BODY_BYTES, AccessLog, ApiKeyCheck, BodyLimit, LocalHostOnly,
                                             host_names)
from tinyvllm.entrypoints.openai_protocol import ApiError
from tinyvllm.entrypoints.responses import ClientGone, Reply, stream_events, until_finished
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.tokenizer import Tokenizer

log = logging.getLogger(__name__)


# ---- the app ----

def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, ui: bool = True, host_names: set[str] | None = None) -> FastAPI:
    """host_names: the Host header names to answer (None: any, as for a server bound to every interface)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        yield
        engine.attach(None)

    app = FastAPI(title="tinyvllm", summary="an OpenAI-compatible server on tinyvllm's engine", lifespan=lifespan)
    add_middleware(app, api_key, max_body_bytes, host_names)
    add_error_handlers(app)
    app.openapi = lambda: openapi_schema(app)
    add_info_routes(app, engine, model_name)
    add_generate_routes(app, engine, model_name)
    if ui:   # the live page at /, and its snapshots (serve --no-ui: none of it)
        live.add_routes(app, engine)
    return app


def add_middleware(app: FastAPI, api_key: str | None, max_body_bytes: int, host_names: set[str] | None) -> None:
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)   # the last added runs first: AccessLog, host, key, body
    app.add_middleware(ApiKeyCheck, api_key=api_key)
    if host_names is not None:
        app.add_middleware(LocalHostOnly, names=host_names)
    app.add_middleware(AccessLog)


def add_error_handlers(app: FastAPI) -> None:
    """Every error the client gets is OpenAI's error object, whoever raised it: us, FastAPI or a bug."""
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


def openapi_schema(app: FastAPI) -> dict:
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


async def json_only(request: Request) -> None:
    """A web page can POST text/plain to localhost without asking; it cannot send JSON unasked."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"the body must be JSON sent with 'Content-Type: application/json', got "
                            f"{kind or 'no Content-Type'}", code="unsupported_media_type")


def model_not_found(model: str, model_name: str) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                    param="model", code="model_not_found")


def add_info_routes(app: FastAPI, engine: AsyncEngine, model_name: str) -> None:
    """GET /health, /metrics and /v1/models: what the server is and how it is doing."""
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
                "max_model_len": engine.info["max_model_len"]}

    @app.get("/v1/models", responses=api.ERROR_RESPONSES)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=api.ERROR_RESPONSES)
    async def model(model_id: str):
        if model_id != model_name:
            raise model_not_found(model_id, model_name)
        return model_card()


def add_generate_routes(app: FastAPI, engine: AsyncEngine, model_name: str) -> None:
    """POST /v1/completions and /v1/chat/completions: prompts in, token ids to the engine, text back."""
    tokenizer = engine.tokenizer

    @app.post("/v1/completions", responses=api.ERROR_RESPONSES, dependencies=[Depends(json_only)])
    async def completions(body: api.CompletionRequest, request: Request):
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
        return await generate(engine, model_name, request, body, prompts, body.max_tokens, body.logprobs, chat=False)

    @app.post("/v1/chat/completions", responses=api.ERROR_RESPONSES,
              dependencies=[Depends(json_only)])
    async def chat_completions(body: api.ChatRequest, request: Request):
        try:   # the template may refuse the conversation (raise_exception), or fail on it: one line, 400
            prompt = tools.render_prompt(tokenizer, body.conversation(), body.tool_dicts, body.tool_choice_value,
                                         body.add_generation_prompt)
        except TinyVLLMError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await generate(engine, model_name, request, body, [prompt], body.reply_tokens, body.engine_logprobs,
                              chat=True)


async def generate(engine: AsyncEngine, model_name: str, request: Request, body, prompts: list[list[int]],
                   max_tokens: int | None, logprobs: int | None, chat: bool) -> Response:
    """Check the request, hand its choices to the engine, answer: as events while they run, or whole at the end."""
    if body.model not in (None, model_name):
        raise model_not_found(body.model, model_name)
    for ids in prompts:
        check_prompt(ids, max_tokens, engine.info)
    try:
        params = body.sampling_params(max_tokens, logprobs)
    except TinyVLLMError as e:
        raise ApiError(400, str(e)) from None
    request_id = api.new_id("chatcmpl" if chat else "cmpl")
    choices = request_states(request_id, prompts, params, engine.tokenizer, body.stream)
    request.state.request_id, request.state.choices, request.state.user = request_id, choices, body.user
    engine.submit(choices)
    reply = Reply(request_id, model_name, chat, body, choices, engine.tokenizer)
    if body.stream:
        return StreamingResponse(stream_events(engine, reply), media_type="text/event-stream",
                                 background=BackgroundTask(engine.abort, choices))
    return await whole_reply(engine, request, reply)


def request_states(request_id: str, prompts: list[list[int]], params: SamplingParams, tokenizer: Tokenizer,
                   stream: bool) -> list[RequestState]:
    """One engine request per prompt and sample (n of each), all woken by one event: choice i is `{request_id}-i`."""
    wake = asyncio.Event()
    return [RequestState(f"{request_id}-{i}", i, ids, params.child(k), tokenizer, wake, stream,
                         after=None if k == 0 else f"{request_id}-{i - k}")   # sample 0 of the same prompt
            for i, (ids, k) in enumerate((ids, k) for ids in prompts for k in range(params.n))]


async def whole_reply(engine: AsyncEngine, request: Request, reply: Reply) -> JSONResponse:
    """Not streaming: wait for every choice to finish, then answer with all of them, or with why one failed."""
    choices = reply.choices
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


# ---- running it ----

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
