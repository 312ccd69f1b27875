"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP on 127.0.0.1.

- completions and chat, plain and streaming: greedy text equal to LLM.generate / LLM.chat run before the
  server started, with OpenAI's shapes, usage counts and finish reasons; a stream ends with [DONE];
- 64 concurrent streaming clients: all finish, each equal to its request run alone, decoded together in
  one batch, and the pool is whole afterwards;
- bad requests get a 4xx with OpenAI's error object and the server keeps serving; a full queue gets 429;
- a client that disconnects mid-stream has its blocks back in the pool within one engine step.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.cli import main
from tinyvllm.server import Server

NUM_BLOCKS, MAX_MODEL_LEN = 256, 512
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
QUESTIONS = ["What is 2+2?", "Name a color.", "Say hello.", "Capital of France?", "Why is the sea salty?",
             "Write a haiku about autumn.", "List three prime numbers.", "What is Python?",
             "How many legs does a spider have?", "Give me a synonym for happy.", "What does a CPU do?",
             "Tell me a fun fact about cats.", "Spell 'necessary' backwards.", "Suggest a name for a dog.",
             "What is the boiling point of water?", "Translate 'good morning' to French."]
STYLES = ["", "Answer briefly. ", "Please be precise. ", "In one sentence: "]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, device="cpu", max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def expected(llm):
    """Made with the Python API before the server owns the engine."""
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:2]]
    return {"completions": llm.generate(PROMPTS, GREEDY), "chats": (chats, llm.chat(chats, GREEDY))}


@pytest.fixture(scope="module")
def server(llm, expected):
    srv = Server(llm, "default", port=0, log_level="warning").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == ["default"] and models[0].max_model_len == MAX_MODEL_LEN


def test_completions_equal_generate(client, expected):
    for prompt, want in zip(PROMPTS, expected["completions"]):
        got = client.completions.create(model="default", prompt=prompt, max_tokens=16, temperature=0)
        assert got.object == "text_completion" and got.id.startswith("cmpl-")
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.outputs[0].finish_reason
        counts = (got.usage.prompt_tokens, got.usage.completion_tokens)
        assert counts == (len(want.prompt_token_ids), len(want.token_ids))
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_chat_equal_llm_chat(client, expected):
    chats, wants = expected["chats"]
    for messages, want in zip(chats, wants):
        got = client.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0)
        assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
        assert got.choices[0].message.content == want.text
        assert got.choices[0].finish_reason == want.outputs[0].finish_reason
        counts = (got.usage.prompt_tokens, got.usage.completion_tokens)
        assert counts == (len(want.prompt_token_ids), len(want.token_ids))


def test_streaming_chat_and_completion(client, expected):
    chats, wants = expected["chats"]
    chunks = list(client.chat.completions.create(model="default", messages=chats[0], max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3, "the text should arrive in pieces, as it is generated"
    assert "".join(pieces) == wants[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == wants[0].outputs[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(wants[0].token_ids)

    want = expected["completions"][1]
    chunks = list(client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason


def test_a_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_sixty_four_concurrent_streaming_clients(server, llm):
    prompts = [f"{style}{q}\nAnswer:" for style in STYLES for q in QUESTIONS]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    start = len(llm.llm_engine.trace)
    alone = [client.completions.create(model="default", prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]                                               # one at a time
    first_step = len(llm.llm_engine.trace)

    async def one(aclient, prompt: str) -> str:
        stream = await aclient.completions.create(model="default", prompt=prompt, max_tokens=6, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    together = asyncio.run(asyncio.wait_for(all_at_once(), timeout=300))
    assert together == alone
    one_by_one, concurrent = first_step - start, len(llm.llm_engine.trace) - first_step
    batch = max(len(step["decode"]) for step in llm.llm_engine.trace[first_step:])
    assert concurrent < one_by_one / 2 and batch > 1, \
        f"{concurrent} steps together vs {one_by_one} one by one, at most {batch} in a step: not batched"
    assert llm.cache.blocks.num_free == NUM_BLOCKS and not llm.llm_engine.has_work()


@pytest.mark.parametrize("body, status, param", [
    (b'{"model": "default", "prompt": "hi", ', 400, None),                                  # malformed JSON
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": "default", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "default", "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"model": "default", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "default", "prompt": "hi", "n": 2}, 400, "n"),
    ({"model": "default"}, 400, "prompt"),
    ({"model": "default", "prompt": "hello " * 600}, 400, "prompt"),                         # past the window
    ({"model": "default", "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"model": "default", "prompt": [[1, 2], [3]]}, 400, None),                              # one prompt a request
    ({"model": "default", "prompt": [10 ** 9]}, 400, None),                                  # outside the vocabulary
    (b'{"model": "default", "prompt": "' + b"x" * (2 << 20) + b'"}', 413, None),             # 2 MiB body
    ({"model": "default", "messages": []}, 400, "messages"),                                 # chat: no messages
])
def test_bad_requests_get_an_error_object_and_the_server_goes_on(server, client, body, status, param):
    chat = isinstance(body, dict) and "messages" in body
    url = f"{server.url}/v1/{'chat/completions' if chat else 'completions'}"
    r = httpx.post(url, **({"json": body} if isinstance(body, dict) else {"content": body}), timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert client.completions.create(model="default", prompt="Hi", max_tokens=1).usage.completion_tokens == 1


def test_a_full_queue_gets_429(server, llm):
    scheduler, engine_loop = llm.llm_engine.scheduler, server.engine_loop
    scheduler.max_num_seqs, engine_loop.max_queue = 1, 1     # one slot, one place in the queue
    body = {"model": "default", "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "stream": True}
    short = {"prompt": "Hi", "max_tokens": 2}
    queued = []
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=body) as running:   # holds the only slot
                lines = running.iter_lines()   # kept: a dropped iterator would close the response
                next(line for line in lines if line)
                waiting = threading.Thread(target=lambda: queued.append(
                    httpx.post(f"{server.url}/v1/completions", json=short, timeout=120)))
                waiting.start()
                deadline = time.time() + 60
                while not scheduler.waiting and time.time() < deadline:
                    time.sleep(0.001)
                assert len(scheduler.waiting) == 1, "the second request should be waiting for the slot"
                r = http.post("/v1/completions", json=short)                     # one too many
            waiting.join()                     # the stream closed: the waiting request got the slot
    finally:
        scheduler.max_num_seqs, engine_loop.max_queue = 256, 256
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert queued[0].status_code == 200 and queued[0].json()["usage"]["completion_tokens"] == 2
    assert llm.cache.blocks.num_free == NUM_BLOCKS


def test_a_client_that_leaves_mid_stream_frees_its_blocks_within_one_step(server, llm, monkeypatch):
    engine_loop, noticed = server.engine_loop, []   # when the HTTP side posted the abort: (time, steps then)
    abort = engine_loop.abort
    monkeypatch.setattr(engine_loop, "abort", lambda s: (noticed.append((time.time(), engine_loop.steps)), abort(s)))
    body = {"model": "default", "prompt": PROMPTS[2], "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            events = r.iter_lines()
            for _ in range(3):
                next(line for line in events if line)
            assert llm.cache.blocks.num_free < NUM_BLOCKS
    left = time.time()                                  # the response is closed: the client has gone
    deadline = left + 10
    while llm.cache.blocks.num_free < NUM_BLOCKS and time.time() < deadline:
        time.sleep(0.001)
    assert llm.cache.blocks.num_free == NUM_BLOCKS and not engine_loop.streams and not llm.llm_engine.has_work()
    assert len(noticed) == 1 and noticed[0][0] - left < 2, "the server should notice the disconnect at once"
    assert engine_loop.steps - noticed[0][1] <= 1, "only the step already running may finish before the abort"


def test_serve_on_a_port_in_use_is_one_line_and_exit_2(capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        code = main(["serve", "--port", str(busy.getsockname()[1]), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cannot listen on 127.0.0.1:") and err.count("\n") == 1
