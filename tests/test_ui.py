"""The live page's data, without a browser (tests/test_ui_browser.py drives the page itself):

- the engine's snapshot names every block: reference counts, prefix-cache blocks, each sequence's table;
- GET /ui/snapshot: every field the page reads, consistent with the engine's own counts, a running
  request's blocks marked as its own; /ui/events: server-sent events, at most four a second;
- nobody watching: the engine is never asked for a snapshot;
- --api-key: both snapshot routes want the key (the page itself loads without it, to ask for it); no
  CORS header, whatever the Origin; a dead engine is a 503;
- --no-ui: 404 at / and at the snapshot routes; the UI routes are not in /openapi.json.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.engine import Engine
from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.snapshot import take_snapshot
from tinyvllm.entrypoints.cli import build_parser
from tinyvllm.entrypoints.live import SNAPSHOT_EVERY_S
from tinyvllm.entrypoints.server import Server

NUM_BLOCKS = 16
KEY = {"Authorization": "Bearer sesame"}
FIELDS = {"model", "device", "block_size", "max_num_seqs", "max_model_len", "step", "snapshot_ms", "prefix_cache",
          "pool", "running", "waiting", "steps", "preemptions", "tokens_per_s", "ttft_s"}
POOL_FIELDS = {"num_blocks", "free", "shown", "refs", "cached", "owner"}
SEQUENCE_FIELDS = {"id", "prompt", "output", "computed", "cached", "preemptions", "blocks"}
STEP_FIELDS = {"step", "free_blocks", "prefill", "prefills", "decode", "decodes", "preempted"}


def start(model_dir, **server_args) -> Server:
    return Server(EngineConfig(str(model_dir), "cpu", num_blocks=NUM_BLOCKS), port=0, log_level="warning",
                  **server_args).start()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = start(tiny_model_dir, api_key="sesame", engine_in_thread=True)   # in this process: a test can slow it
    yield srv
    srv.stop()


def wait_for_snapshot(server: Server, condition, seconds: float = 30) -> dict:
    deadline = time.time() + seconds
    while not condition(snap := httpx.get(f"{server.url}/ui/snapshot", headers=KEY).json()) and time.time() < deadline:
        time.sleep(0.05)
    return snap


def test_the_snapshot_names_every_block(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", num_blocks=NUM_BLOCKS)   # prefix caching: on by default
    prompt = list(range(100, 140))                                         # 40 tokens: 2 full blocks, then 8
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.add_request(prompt, params)
    llm.engine.step()                                # first: prefilled, its 2 full blocks named in the cache
    second = llm.add_request(prompt, params)
    llm.engine.step()                                # second: admitted on the 2 cached blocks
    blocks = llm.engine.scheduler.block_manager
    snap = take_snapshot(llm.engine.scheduler, {first.seq_id: "a", second.seq_id: "b"})
    assert set(snap) == {"num_blocks", "free", "refs", "cached", "running", "waiting"}
    assert snap["num_blocks"] == NUM_BLOCKS and snap["free"] == blocks.num_free
    assert snap["refs"] == blocks.ref_counts and snap["cached"] == sorted(blocks.hash_of)
    running = {seq["id"]: seq for seq in snap["running"]}
    assert running["a"]["blocks"][:2] == running["b"]["blocks"][:2], "the second shares the first's prefix"
    assert all(snap["refs"][b] == 2 for b in running["a"]["blocks"][:2])
    assert running["b"]["cached"] == 32 and running["b"]["prompt"] == 40 and running["a"]["output"] == 2
    held = {b for seq in snap["running"] for b in seq["blocks"]}
    assert held == {b for b, refs in enumerate(snap["refs"]) if refs > 0}, "every held block belongs to a sequence"
    assert snap["waiting"] == []


def test_snapshot_fields_and_a_running_request(server, monkeypatch):
    first = httpx.get(f"{server.url}/ui/snapshot", headers=KEY)
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    snap = first.json()
    assert set(snap) == FIELDS and set(snap["pool"]) == POOL_FIELDS and snap["block_size"] == 16
    assert snap["pool"]["num_blocks"] == snap["pool"]["shown"] == len(snap["pool"]["refs"]) == NUM_BLOCKS
    assert len(snap["tokens_per_s"]) == 60 and snap["device"] == "cpu"

    launch = Engine.launch_step   # 20 ms a step: the request outlives a snapshot's 250 ms on any machine
    monkeypatch.setattr(Engine, "launch_step", lambda engine: (time.sleep(0.02), launch(engine))[1])
    body = {"prompt": list(range(100, 140)), "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=KEY, timeout=60) as reply:
        lines = reply.iter_lines()   # kept: a dropped iterator would close the response
        next(line for line in lines if line.startswith("data: "))   # it is running now
        snap = wait_for_snapshot(server, lambda snap: snap["running"])   # one up to 250 ms old may predate it
    (seq,) = snap["running"]
    assert set(seq) == SEQUENCE_FIELDS and seq["id"].startswith("cmpl-") and seq["prompt"] == 40
    assert seq["blocks"] == snap["pool"]["owner"].count(0) == sum(r > 0 for r in snap["pool"]["refs"]) >= 3
    assert snap["pool"]["free"] == NUM_BLOCKS - seq["blocks"]
    assert snap["steps"] and all(set(step) == STEP_FIELDS for step in snap["steps"])
    assert any(seq["id"] in step["decode"] or [seq["id"], 40] in step["prefill"] for step in snap["steps"])


def test_events_come_at_most_four_a_second(server):
    times = []
    with httpx.stream("GET", f"{server.url}/ui/events", headers=KEY, timeout=30) as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        for line in events.iter_lines():
            if line.startswith("data: "):
                assert set(json.loads(line[6:])) == FIELDS
                times.append(time.monotonic())
            if len(times) == 6:
                break
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.9 * SNAPSHOT_EVERY_S, f"snapshots {gaps} s apart: more than 4 a second"


def test_nobody_watching_costs_no_snapshot(tiny_model_dir):
    srv = start(tiny_model_dir)
    try:
        reports, dispatch = [], srv.engine.client.on_report
        srv.engine.client.on_report = lambda report: (reports.append(report), dispatch(report))
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and len(reports) >= 8
        assert all(report.snapshot is None for report in reports), "nobody watched, yet the engine took a snapshot"
        assert srv.engine.board.latest is None
    finally:
        srv.stop()


def test_the_snapshot_routes_want_the_api_key_and_send_no_cors_header(server):
    for path in ("/ui/snapshot", "/ui/events"):
        assert httpx.get(f"{server.url}{path}").status_code == 401
        wrong = httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    origin = {"Origin": "http://elsewhere.example"}
    page = httpx.get(f"{server.url}/", headers=origin)   # the page loads without the key: it asks for it
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for path in ("/ui/live.js", "/ui/live.css"):
        assert httpx.get(f"{server.url}{path}").status_code == 200
    snap = httpx.get(f"{server.url}/ui/snapshot", headers={**KEY, **origin})
    preflight = httpx.options(f"{server.url}/ui/snapshot", headers={**origin, "Access-Control-Request-Method": "GET"})
    for r in (page, snap, preflight):
        assert not any(h.lower().startswith("access-control-") for h in r.headers), "same origin only"


def test_a_dead_engine_is_a_503(tiny_model_dir):
    srv = start(tiny_model_dir)
    try:
        srv.engine.client.process.kill()
        deadline = time.time() + 10
        while srv.engine.dead is None and time.time() < deadline:
            time.sleep(0.05)
        r = httpx.get(f"{srv.url}/ui/snapshot")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        srv.stop()


def test_no_ui_is_404_and_the_ui_is_not_in_the_openapi_schema(tiny_model_dir, server):
    assert build_parser().parse_args(["serve", "--no-ui"]).ui is False
    assert build_parser().parse_args(["serve"]).ui is True
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert not [p for p in paths if p == "/" or p.startswith("/ui")], "the page is not part of the OpenAI API"
    srv = start(tiny_model_dir, ui=False)
    try:
        for path in ("/", "/ui/live.js", "/ui/snapshot", "/ui/events"):
            assert httpx.get(f"{srv.url}{path}").status_code == 404, path
        assert httpx.get(f"{srv.url}/health").status_code == 200
    finally:
        srv.stop()


def test_a_page_that_leaves_stops_nothing_else(server):
    """Two readers share the snapshots; one leaving mid-stream leaves the other's stream going."""
    got = []

    def read(count: int) -> None:
        with httpx.stream("GET", f"{server.url}/ui/events", headers=KEY, timeout=30) as events:
            for line in events.iter_lines():
                if line.startswith("data: "):
                    got.append(count)
                    if got.count(count) == count:
                        return

    readers = [threading.Thread(target=read, args=(n,)) for n in (1, 5)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(30)
    assert got.count(1) == 1 and got.count(5) == 5
