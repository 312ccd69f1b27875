"""`serve --api-server-count N`: several API-server processes in front of one engine core.

Run as a user runs it (the CLI in a process group of its own, stopped with Ctrl-C's SIGINT):
- every answer equals the Python API's, whichever process took the connection, and both processes took some;
- /metrics, from whichever process answers, counts every process's requests;
- Ctrl-C stops every process of the group; a dead engine stops the API servers with one line and exit 2;
- a bad model is one line and exit 2, as with one API server.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tinyvllm import LLM, SamplingParams

pytestmark = pytest.mark.slow   # not in make test-fast: each test starts and stops serve with several processes

MAX_MODEL_LEN, NUM_BLOCKS = 256, 128
PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(24)]
GREEDY = dict(temperature=0, max_tokens=8)


def start_serve(model: str, *extra: str, sigint_ignored: bool = False) -> tuple[subprocess.Popen, str]:
    """The CLI in its own process group; returns it and the URL it announced (or fails with its log).
    sigint_ignored: started as a shell script's background job is (`serve ... &`), SIGINT ignored."""
    command = [sys.executable, "-m", "tinyvllm", "serve", "--model", model, "--device", "cpu", "--port", "0",
               "--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", str(NUM_BLOCKS), "--no-ui", *extra]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=ignore)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        found = re.search(r"OpenAI API at (http://\S+)/v1", line)
        if found:
            return proc, found.group(1)
    proc.wait(30)
    pytest.fail("serve stopped before it announced its URL:\n" + "".join(lines))


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return False
    except ProcessLookupError:
        return True


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


async def ask_all(url: str) -> list[str]:
    """Each prompt on a connection of its own (so the kernel may hand it to either process), half streamed."""
    async def one(i: int, prompt: str) -> str:
        body = {"prompt": prompt, **GREEDY, "stream": i % 2 == 1}
        async with httpx.AsyncClient(timeout=120) as http:
            if not body["stream"]:
                r = await http.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
                return r.json()["choices"][0]["text"]
            text = ""
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text
    return await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])


def test_two_api_servers_answer_as_one_and_stop_together(default_model_dir):
    llm = LLM(default_model_dir, device="cpu", max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS)
    outputs = llm.generate(PROMPTS, SamplingParams(**GREEDY))
    want, want_tokens = [out.outputs[0].text for out in outputs], sum(len(out.outputs[0].token_ids) for out in outputs)
    proc, url = start_serve("default", "--api-server-count", "2")
    try:
        got = asyncio.run(ask_all(url))
        assert got == want, "every answer must equal LLM.generate's, whichever API server took it"
        metrics = httpx.get(f"{url}/metrics").text
        done = re.findall(r'vllm:request_success_total\{finished_reason="\w+",model_name="default"\} (\S+)', metrics)
        tokens = re.search(r'vllm:generation_tokens_total\{model_name="default"\} (\S+)', metrics)
        assert sum(map(float, done)) == len(PROMPTS), "/metrics adds up every API server's requests"
        assert tokens and float(tokens.group(1)) == want_tokens
        os.killpg(proc.pid, signal.SIGINT)                                   # Ctrl-C in the terminal
        log = proc.stderr.read()
        proc.wait(30)
        assert wait_for(lambda: group_gone(proc.pid), 15), "every process of the group must stop"
        served = {k: len(re.findall(rf"tinyvllm\.access\[{k}\]: POST /v1/completions 200", log)) for k in (0, 1)}
        assert served[0] > 0 and served[1] > 0 and sum(served.values()) == len(PROMPTS), served
    finally:
        if not group_gone(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_dead_engine_stops_every_api_server():
    proc, url = start_serve("default", "--api-server-count", "2")
    try:
        engines = [pid for pid in os.listdir("/proc") if pid.isdigit() and os.getpgid(int(pid)) == proc.pid
                   and b"tinyvllm.engine.engine_core" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engines) == 1, "one engine core for both API servers"
        os.kill(int(engines[0]), signal.SIGKILL)
        assert proc.wait(30) == 2
        last = proc.stderr.read().strip().splitlines()[-1]
        assert last.startswith("error: the engine process stopped"), last
        assert wait_for(lambda: group_gone(proc.pid), 15)
    finally:
        if not group_gone(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_bad_model_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    result = subprocess.run([sys.executable, "-m", "tinyvllm", "serve", "--model", str(tmp_path), "--device", "cpu",
                             "--port", "0", "--api-server-count", "2"], capture_output=True, text=True, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "config.json" in errors[0], result.stderr


def test_api_servers_stop_when_their_supervisor_is_killed():
    """kill -9 of serve's supervisor (an OOM kill, a container's hard stop): its API servers and the engine stop
    too, rather than hold the port with an engine that is gone, and the port can be served again."""
    proc, url = start_serve("default", "--api-server-count", "2")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_for(lambda: group_gone(proc.pid), 20), "API servers or the engine outlived their supervisor"
        port = int(url.rsplit(":", 1)[1])
        again, url_again = start_serve("default", "--port", str(port))
        try:
            assert url_again == url and httpx.get(f"{url}/health").status_code == 200
        finally:
            os.killpg(again.pid, signal.SIGKILL)
    finally:
        if not group_gone(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def sockets_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("tinyvllm-")}


async def cut_short(url: str, started: asyncio.Event) -> dict:
    """A request streamed and one not, both far from done when the server is told to stop: what each got."""
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        async def streamed() -> list[str]:
            async with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                lines = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        started.set()
                return lines
        whole = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body))
        lines = await streamed()
        response = await whole
        return {"stream": lines, "status": response.status_code, "body": response.json()}


@pytest.mark.parametrize("count", ["1", "2"], ids=["one API server", "two API servers"])
def test_sigterm_stops_serve_as_ctrl_c_does_and_the_port_serves_again(tiny_model_dir, count):
    """kill, systemd and docker stop a server with SIGTERM: the requests in flight are answered (a 503 error
    object; the stream closes with an error event and [DONE]), every process stops, the sockets folder is
    removed, the process dies by the signal, and a server can listen on the same port at once (the
    connections in TIME_WAIT do not hold it)."""
    before = sockets_dirs()
    proc, url = start_serve(str(tiny_model_dir), "--max-model-len", "2048", "--api-server-count", count)
    idle = httpx.Client()   # a client's pooled keep-alive connection: the server closes it, so TIME_WAIT is its
    try:
        idle.get(f"{url}/health")
        async def scenario() -> dict:
            started = asyncio.Event()
            answers = asyncio.ensure_future(cut_short(url, started))
            await asyncio.wait_for(started.wait(), 60)
            os.kill(proc.pid, signal.SIGTERM)
            return await asyncio.wait_for(answers, 30)
        got = asyncio.run(scenario())
        assert got["status"] == 503 and got["body"]["error"]["code"] == "shutting_down", got["body"]
        assert got["stream"][-1] == "[DONE]" and "shutting down" in json.loads(got["stream"][-2])["error"]["message"]
        assert proc.wait(30) == -signal.SIGTERM, "serve must die by the signal, after cleaning up"
        assert wait_for(lambda: group_gone(proc.pid), 15), "every process of the group must stop"
        assert wait_for(lambda: sockets_dirs() <= before, 5), "the engine's sockets folder must be removed"
        other = "2" if count == "1" else "1"   # restarted with the other count: either may follow either
        again, url_again = start_serve(str(tiny_model_dir), "--port", url.rsplit(":", 1)[1], "--api-server-count", other)
        try:
            assert url_again == url and httpx.get(f"{url}/health").status_code == 200
        finally:
            os.killpg(again.pid, signal.SIGKILL)
    finally:
        idle.close()
        if not group_gone(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def test_health_notices_an_engine_that_stops_reporting(tiny_model_dir):
    """An engine process that is stopped (SIGSTOP) or stuck sends no step report and no heartbeat: /health turns
    503 once it has been silent past the limit (2 s here), and 200 again when it resumes."""
    from tinyvllm.engine.engine_config import EngineConfig
    from tinyvllm.entrypoints.server import Server
    server = Server(EngineConfig(str(tiny_model_dir), "cpu", max_model_len=256, num_blocks=64), port=0,
                    log_level="warning", ui=False).start()
    try:
        server.engine.silence_limit_s = 2
        engine_pid = server.engine.client.process.pid
        assert httpx.get(f"{server.url}/health").status_code == 200
        time.sleep(3)
        assert httpx.get(f"{server.url}/health").status_code == 200, "an idle engine's heartbeats keep it healthy"
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, 10)
            assert "not reported" in httpx.get(f"{server.url}/health").json()["reason"]
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, 10)
    finally:
        server.stop()


@pytest.mark.parametrize("count", ["1", "2"], ids=["one API server", "two API servers"])
def test_kill_int_stops_serve_started_as_a_background_job(tiny_model_dir, count):
    """`serve ... &` in a script starts with SIGINT ignored; the script's `kill -INT` (to the server's pid, not
    its group) must still stop every process, as Ctrl-C does."""
    proc, url = start_serve(str(tiny_model_dir), "--api-server-count", count, sigint_ignored=True)
    try:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(30)
        assert wait_for(lambda: group_gone(proc.pid), 15), "every process of the group must stop"
    finally:
        if not group_gone(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
