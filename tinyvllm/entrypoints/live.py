"""Chapter 7, serving: the live page — watch the engine work.

`python -m tinyvllm serve` serves a page at / (static files in ui/: HTML, CSS and one small script, no
build step) that draws the KV pool block by block, coloured by owner; the running and waiting queues;
the batch of each recent step (who prefilled how many tokens, who decoded, who was preempted); and
tokens/s and time to first token over the last minute. Its form sends one prompt, or a burst of N at
once, to /v1/completions or /v1/chat/completions: enough to make preemption and prefix-cache hits happen.

    GET /              the page (and /ui/live.js, /ui/live.css)
    GET /ui/snapshot   one snapshot, JSON
    GET /ui/events     snapshots as server-sent events, at most 1 / SNAPSHOT_EVERY_S a second

Only watching costs anything: the API side asks the engine core for a snapshot (core_messages.Snapshot)
at most every SNAPSHOT_EVERY_S, once for all the pages open, and the engine core builds one only when
asked. Same origin only (no CORS headers); with --api-key the two snapshot routes want the key, as /v1
does (the page asks for it). `serve --no-ui` leaves all of this out.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from tinyvllm.engine.core_messages import Report
from tinyvllm.engine.step_record import StepRecord
from tinyvllm.entrypoints.openai_protocol import ApiError
from tinyvllm.model.step_plan import BLOCK_SIZE

if TYPE_CHECKING:
    from tinyvllm.entrypoints.async_engine import AsyncEngine   # a type only: async_engine.py imports this module

UI_DIR = Path(__file__).resolve().parent / "ui"
SNAPSHOT_EVERY_S = 0.25    # at most 4 snapshots a second, however many pages watch
SNAPSHOT_TIMEOUT_S = 60    # a snapshot comes after the step under way: on a CPU a long prefill takes seconds
WINDOW_S = 60              # tokens/s and time to first token: over the last minute
RECENT_STEPS = 24          # steps a snapshot lists (the API side's ring of step records keeps more)
STEP_IDS = 32              # requests named per step and role; a GPU batch of 256 is counted, not listed
TTFT_KEPT = 1024           # first-token times kept for the last minute: bounded, whatever the traffic
# the page's own files only, and never inside another site's frame (its form sends requests)
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
                "Cache-Control": "no-cache"}
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/ui/live.js": ("live.js", "text/javascript; charset=utf-8"),
         "/ui/live.css": ("live.css", "text/css; charset=utf-8")}


class Recent:
    """The last minute as the API side sees it: output tokens per second (one bucket a second, so O(1)
    per step), each request's time to first token, and the preemptions counted since the start."""
    def __init__(self):
        self.seconds: deque[list[int]] = deque(maxlen=WINDOW_S + 1)   # [whole second, tokens]; +1: the current
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=TTFT_KEPT)   # (when, seconds)
        self.preemptions = 0

    def add(self, report: Report, now: float) -> None:
        tokens = report.tokens
        if report.step is not None:
            self.preemptions += len(report.step.preempted)
        second = int(now)
        if self.seconds and self.seconds[-1][0] == second:
            self.seconds[-1][1] += tokens
        else:
            self.seconds.append([second, tokens])

    def first_token(self, now: float, ttft: float) -> None:
        self.ttfts.append((now, ttft))

    def tokens_per_s(self, now: float) -> list[int]:
        """Tokens in each of the last WINDOW_S whole seconds, oldest first (the current one is not over)."""
        counts, last = dict(self.seconds), int(now) - 1
        return [counts.get(s, 0) for s in range(last - WINDOW_S + 1, last + 1)]

    def ttft_s(self, now: float) -> list[list[float]]:
        """[seconds ago, time to first token] of every request whose first token came in the last minute."""
        return [[round(now - t, 2), round(ttft, 4)] for t, ttft in self.ttfts if now - t <= WINDOW_S]


class SnapshotBoard:
    """The latest snapshot (as JSON text) and the one wait for the next: however many pages read, the
    engine is asked at most every SNAPSHOT_EVERY_S."""
    def __init__(self, ask: Callable[[], None], compose: Callable[[dict], str]):
        self.ask, self.compose = ask, compose   # ask: send a Snapshot command; compose: engine part -> JSON
        self.latest: str | None = None
        self.latest_at = float("-inf")
        self.next: asyncio.Future | None = None

    async def fresh(self) -> str:
        """A snapshot at most SNAPSHOT_EVERY_S old: the latest, or the next one (asked for once)."""
        if time.monotonic() - self.latest_at < SNAPSHOT_EVERY_S:
            return self.latest
        if self.next is None:
            self.next = asyncio.get_running_loop().create_future()
            self.ask()
        try:   # shield: a page that leaves cancels its own wait, not the others'
            return await asyncio.wait_for(asyncio.shield(self.next), SNAPSHOT_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.next = None   # ask again next time (the engine may have died meanwhile)
            raise

    def arrived(self, part: dict) -> None:
        """In the event loop: the engine's snapshot came with a Report."""
        self.latest, self.latest_at = self.compose(part), time.monotonic()
        if self.next is not None and not self.next.done():
            self.next.set_result(self.latest)
        self.next = None


def page_json(part: dict, engine: AsyncEngine) -> str:
    """The engine core's snapshot plus what only the API side knows (recent steps, rates), as the page reads it."""
    now, info, stats = time.perf_counter(), engine.info, engine.client.stats
    running = part["running"]
    pool = {"num_blocks": part["num_blocks"], "free": part["free"], "shown": len(part["refs"]),
            "refs": part["refs"], "cached": part["cached"], "owner": block_owners(running, len(part["refs"]))}
    return json.dumps({
        "model": engine.metrics.model_name, "device": info["device"], "block_size": BLOCK_SIZE,
        "max_num_seqs": info["max_num_seqs"], "max_model_len": info["max_model_len"], "step": stats.steps,
        "snapshot_ms": round(part["took_ms"], 3),   # the engine core's time to take this snapshot
        "prefix_cache": {"queries": stats.prefix_cache_queries, "hits": stats.prefix_cache_hits},
        "pool": pool,
        "running": [{**seq, "blocks": len(seq["blocks"])} for seq in running],
        "waiting": [{**seq, "blocks": len(seq["blocks"])} for seq in part["waiting"]],
        "steps": [step_view(record) for record in list(engine.steps)[-RECENT_STEPS:]],
        "preemptions": engine.recent.preemptions,
        "tokens_per_s": engine.recent.tokens_per_s(now), "ttft_s": engine.recent.ttft_s(now)})


def block_owners(running: list[dict], shown: int) -> list[int]:
    """For each drawn block, the index in `running` of the sequence holding it (-1: none). A shared
    block is drawn as shared (its reference count says by how many); here it names its oldest holder."""
    owners = [-1] * shown
    for i, seq in enumerate(running):
        for block in seq["blocks"]:
            if block < shown and owners[block] < 0:
                owners[block] = i
    return owners


def step_view(record: StepRecord) -> dict:
    """One step's batch: [request, tokens] per prefill, the decodes, the preempted (each list cut at STEP_IDS)."""
    return {"step": record.step, "free_blocks": record.free_blocks,
            "prefill": [list(pair) for pair in zip(record.prefill[:STEP_IDS], record.chunks)],
            "prefills": len(record.prefill), "decode": record.decode[:STEP_IDS],
            "decodes": len(record.decode), "preempted": record.preempted[:STEP_IDS]}


async def snapshot_events(engine: AsyncEngine) -> AsyncIterator[str]:
    """Server-sent events, one snapshot each, until the client leaves (Starlette cancels us) or the engine dies."""
    while not engine.dead:
        try:
            yield f"data: {await engine.board.fresh()}\n\n"
        except asyncio.TimeoutError:   # a step longer than the timeout: keep the stream, try again
            continue
        await asyncio.sleep(SNAPSHOT_EVERY_S)


def add_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """The page and its two snapshot routes (the snapshots behind --api-key, as the /v1 routes: middleware.py's
    ApiKeyCheck). None of them is in /openapi.json: they are not OpenAI's API."""
    for path, (name, media_type) in FILES.items():
        app.add_api_route(path, static_file((UI_DIR / name).read_bytes(), media_type), methods=["GET"],
                          include_in_schema=False)

    async def fresh() -> str:
        if engine.dead:
            raise ApiError(503, f"{engine.dead}; the server must be restarted", "server_error", code="engine_dead")
        try:
            return await engine.board.fresh()
        except asyncio.TimeoutError:
            raise ApiError(503, f"the engine sent no snapshot in {SNAPSHOT_TIMEOUT_S} s", "server_error") from None

    @app.get("/ui/snapshot", include_in_schema=False)
    async def snapshot():
        return Response(await fresh(), media_type="application/json")

    @app.get("/ui/events", include_in_schema=False)
    async def events():
        await fresh()   # a dead engine is a 503 before the stream starts, not a stream that ends at once
        return StreamingResponse(snapshot_events(engine), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def static_file(content: bytes, media_type: str) -> Callable:
    """A GET handler for one of the page's files, read once at start-up."""
    async def serve_file():
        return Response(content, media_type=media_type, headers=PAGE_HEADERS)
    return serve_file
