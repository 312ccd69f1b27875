"""Chapter 7, serving: the ASGI middleware every request goes through before a route sees it. Outermost first:

    AccessLog      one line per request, once it is answered
    LocalHostOnly  bound to a loopback address: only this machine's names in the Host header (DNS rebinding)
    ApiKeyCheck    with --api-key: 401 without it, before the body is read
    BodyLimit      413 for a body past max_bytes, before anything parses it
"""
from __future__ import annotations

import logging
import secrets
import time

from fastapi.responses import JSONResponse

from tinyvllm.entrypoints import openai_protocol as api

MAX_BODY_BYTES = 1 << 20   # 1 MiB: a request body past it gets a 413 before it is parsed
access_log = logging.getLogger("tinyvllm.access")


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


LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


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


def host_names(host: str) -> set[str] | None:
    """The Host header names a server bound to `host` answers: this machine's names on a loopback address, any
    name on another (it cannot know what names point at it)."""
    if host.strip("[]") in LOOPBACK_NAMES or host.startswith("127."):
        return LOOPBACK_NAMES | {host.strip("[]")}
    return None


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
