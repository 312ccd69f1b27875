"""The server under the official openai client, used the way scripts use it (bounded: about a minute on 2 cores).

Each burst makes a NEW AsyncOpenAI client and never closes it (a script's client per task), and mixes what
clients do: streaming and not, n > 1, logprobs, stop strings, a stream the client leaves after two chunks, a
request the client gives up on before its first byte, and a stream the client stops reading without closing.
Bursts follow each other at once, so each finds the last one's connections still open and idle.

Asserted: every request that its client waits for completes (none lost, none timed out) with what it asked
for; every abandoned one is aborted; at the end /metrics says 0 running and 0 waiting, and the pool has every
block back (free, or cached for the prefix cache).
"""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.entrypoints.server import Server

from tests.test_server import pool_is_whole, read_metric, wait_until

pytestmark = pytest.mark.slow   # not in make test-fast: the official client's bursts (about a minute)

BURSTS, REQUESTS, IN_FLIGHT = 4, 40, 16
TIMEOUT_S = 90          # a request its client waits for must finish well inside this on a loaded 2-core machine


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(EngineConfig(str(tiny_model_dir), "cpu", num_blocks=256, max_num_seqs=16), port=0,
                 log_level="warning", max_queue=512).start()
    yield srv
    srv.stop()


async def one(client: openai.AsyncOpenAI, model: str, i: int, word: str) -> str:
    """Request i of a burst, of the kind i % 8 picks. Returns 'ok', 'left' (the client walked away) or an error."""
    kind = i % 8
    chat = dict(model=model, messages=[{"role": "user", "content": f"Tell {word} a story, R{i}."}],
                max_tokens=24, temperature=0)
    if kind == 0:
        reply = await client.chat.completions.create(**chat)
        return "ok" if reply.choices[0].finish_reason in ("length", "stop") else f"finish {reply.choices[0]}"
    if kind == 1:
        stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat)
        chunks = [chunk async for chunk in stream]
        return "ok" if chunks[-1].usage is not None else "no usage chunk"
    if kind == 2:
        reply = await client.completions.create(model=model, prompt=f"Once {i}", max_tokens=16, n=2,
                                                temperature=0.8, seed=i)
        return "ok" if len(reply.choices) == 2 else f"{len(reply.choices)} choices"
    if kind == 3:
        reply = await client.chat.completions.create(**chat, logprobs=True, top_logprobs=2)
        return "ok" if len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens else "logprobs"
    if kind == 4:
        reply = await client.completions.create(model=model, prompt=f"Count {i}", max_tokens=24,
                                                stop=["e", "a"])
        return "ok" if reply.choices[0].finish_reason in ("stop", "length") else "stop"
    if kind == 5:   # leaves mid-stream: two chunks, then closes the response (the rest would take many seconds)
        stream = await client.chat.completions.create(stream=True, **{**chat, "max_tokens": 4000})
        async for n, _ in aenumerate(stream):
            if n == 1:
                break
        await stream.close()
        return "left"
    if kind == 6:   # gives up before the first byte
        try:
            await client.with_options(timeout=0.01).chat.completions.create(**{**chat, "max_tokens": 200})
        except openai.APITimeoutError:
            pass
        return "left"
    stream = await client.chat.completions.create(stream=True, **{**chat, "max_tokens": 200})
    async for _ in stream:   # reads one chunk and stops reading, without closing: the response stays open
        break
    unread.append(stream)
    return "left"


unread: list = []   # the streams nobody reads any more, kept alive until the end of the module


async def aenumerate(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1


KEPT: list[openai.AsyncOpenAI] = []   # never closed, but referenced: see the test of dropped clients below


async def burst(url: str, model: str, number: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    KEPT.append(client)
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def limited(i):
        async with gate:
            try:
                return await one(client, model, i, f"burst {number}")
            except Exception as e:   # noqa: BLE001 - every failure is reported, not raised mid-burst
                return f"{type(e).__name__}: {e}"[:200]
    return await asyncio.gather(*(limited(i) for i in range(REQUESTS)))


def test_bursts_of_the_official_client_lose_nothing(server):
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]

    async def main():
        return [await burst(server.url, model, b) for b in range(BURSTS)]
    results = asyncio.run(main())
    for number, outcomes in enumerate(results):
        failed = {i: o for i, o in enumerate(outcomes) if o not in ("ok", "left")}
        assert not failed, f"burst {number}: {len(failed)} of {REQUESTS} requests failed: {failed}"
        assert outcomes.count("ok") == REQUESTS * 5 // 8
    assert wait_until(lambda: read_metric(server, "vllm:num_requests_running") == 0
                      and read_metric(server, "vllm:num_requests_waiting") == 0, 60), "requests left running"
    assert wait_until(lambda: pool_is_whole(server), 60), f"the pool is not whole: {server.engine.client.stats}"
    aborted = sum(float(line.split()[-1]) for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                  if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line)
    assert aborted >= BURSTS * REQUESTS // 8, f"{aborted} aborts: the streams left after two chunks were not aborted"


def test_requests_that_a_dropped_client_loses_were_all_answered(server):
    """A client made per task and dropped unclosed is garbage once its burst ends; the openai package's __del__
    then closes it in a task of the running loop, and some requests of the next, live client wait for answers
    that never reach them (measured: 68 of 1,536 on 2 CPU cores; 0 of 1,536 with the clients kept). The server
    is not where they are lost: it answers every request of such bursts, each within seconds, which its
    /metrics shows; a client that keeps its client (or closes it) gets every answer."""
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    before = read_metric(server, "vllm:request_success_total")
    requests, bursts = 64, 3

    async def dropped_client_burst(number: int) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=20)
        gate = asyncio.Semaphore(32)

        async def ask(i: int) -> str:
            async with gate:
                try:
                    reply = await client.chat.completions.create(model=model, max_tokens=8, stream=number % 2 == 0,
                                                                 messages=[{"role": "user", "content": f"R{i}"}])
                    if number % 2 == 0:
                        async for _ in reply:   # read to the end, as a script printing the stream does
                            pass
                    return "ok"
                except Exception as e:   # noqa: BLE001 - a lost request is counted, not raised
                    return type(e).__name__
        return await asyncio.gather(*(ask(i) for i in range(requests)))

    async def main():
        return [await dropped_client_burst(b) for b in range(bursts)]   # each client dropped after its burst
    outcomes = [o for burst_outcomes in asyncio.run(main()) for o in burst_outcomes]
    wait_until(lambda: read_metric(server, "vllm:request_success_total") - before >= requests * bursts, 30)
    answered = read_metric(server, "vllm:request_success_total") - before
    assert answered == requests * bursts, (f"the server finished {answered} of {requests * bursts} requests "
                                           f"(the clients saw {outcomes.count('ok')} answers)")
