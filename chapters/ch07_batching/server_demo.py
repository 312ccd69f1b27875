"""Chapter 7, serving: clients arrive one after another at the OpenAI-compatible server and stream their
answers; the engine process batches whoever is there. The notebook and `make figures` call these.

The clients speak plain HTTP (the standard library's http.client), to show what is on the wire: a POST
of JSON, then server-sent events, one `data: {...}` line per piece of text, and `data: [DONE]`.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from functools import lru_cache
from urllib.parse import urlsplit

from matplotlib.figure import Figure

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.entrypoints.server import Server

QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
             "Write a haiku about rain.", "What does a CPU do?", "Give me a synonym for happy.",
             "How many legs does a spider have?", "What is Python?", "Tell me a fun fact about cats.",
             "Suggest a name for a dog.", "What is the boiling point of water?", "List three prime numbers.",
             "Translate 'good morning' to French.", "Why is the sea salty?", "What is 7 times 8?",
             "Name an ocean.")
EVERY = 3                          # a new client every EVERY engine steps (the same picture on any CPU)
MAX_TOKENS = (16, 24, 32, 40)      # client i asks for MAX_TOKENS[i % 4] tokens at most


def stream_chat(url: str, question: str, max_tokens: int) -> dict:
    """One streaming chat request over plain HTTP: the answer and when its pieces arrived."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=300)
    body = {"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    pieces, times = [], []
    for line in conn.getresponse():   # server-sent events: one "data: {...}" line per chunk
        if line.startswith(b"data: {"):
            text = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if text:
                pieces.append(text)
                times.append(time.perf_counter())
    conn.close()
    return {"question": question, "text": "".join(pieces), "start": start, "piece_times": times}


def run_clients(settings: EngineConfig, questions=QUESTIONS, every: int = EVERY, max_tokens=MAX_TOKENS) -> dict:
    """Start a server (port 0: any free one; its engine in a process of its own), send a new client every
    `every` engine steps, wait. Returns each client's answer and timings, and the engine's steps."""
    server = Server(settings, "default", port=0, log_level="warning").start()
    stats = server.engine.client.stats
    first_step = stats.steps
    results: list[dict | None] = [None] * len(questions)

    def client(i: int) -> None:
        results[i] = stream_chat(server.url, questions[i], max_tokens[i % len(max_tokens)])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(questions))]
    for i, thread in enumerate(threads):
        deadline = time.perf_counter() + 10   # in case everyone before has finished and the engine is idle
        while server.engine.client.stats.steps - first_step < i * every and time.perf_counter() < deadline:
            time.sleep(0.001)
        thread.start()
    for thread in threads:
        thread.join()
    time.sleep(0.2)                           # the last step's report reaches the API side
    steps = [s for s in server.engine.steps if s.step > first_step]
    stats = server.engine.client.stats
    server.stop()
    return {"clients": results, "trace": steps, "step_times": [s.time for s in steps],
            "free_blocks_after": stats.free_blocks, "num_blocks": stats.num_blocks}


@lru_cache(maxsize=1)
def measure() -> dict:
    return run_clients(EngineConfig("default", "cpu", num_blocks=256))   # the pool of the notebook's other LLMs


def draw_server_batch(run: dict | None = None) -> Figure:
    """Top: per engine step, how many requests decoded and how many were prefilled (just admitted), and
    when each client sent its request. Bottom: each client's request, step by step."""
    run = run or measure()
    trace, ends, clients = run["trace"], run["step_times"], run["clients"]
    steps = range(len(trace))
    decode = [len(s.decode) for s in trace]
    prefill = [len(s.prefill) for s in trace]
    arrivals = [sum(e < c["start"] for e in ends) for c in clients]   # steps finished before it was sent
    fig = Figure(figsize=(12, 7.5))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1.2, 1]})
    top.bar(steps, decode, width=1.0, color="#4C72B0", label="decoded in the step (one token each)")
    top.bar(steps, prefill, width=1.0, bottom=decode, color="#C44E52", label="prefilled in the step (just admitted)")
    top.scatter(arrivals, [max(decode) + 1.5] * len(arrivals), marker="v", color="black", s=30,
                label="a client sends its request")
    top.set(ylabel="requests in the step", xlim=(-1, len(trace)))
    top.legend(fontsize=8, loc="upper right")
    top.set_title(f"{len(clients)} streaming clients, one every {EVERY} engine steps, max_tokens "
                  f"{'/'.join(map(str, MAX_TOKENS))} in turn, through one server (SmolLM2-135M, CPU):\n"
                  f"{len(trace)} engine steps, at most {max(decode)} requests decoded together", fontsize=10)
    seq_ids = list(dict.fromkeys(seq for s in trace for seq in s.prefill))  # in arrival order (FIFO)
    for row, (seq, sent) in enumerate(zip(seq_ids, arrivals)):
        ran = [t for t, s in enumerate(trace) if seq in s.prefill or seq in s.decode]
        bottom.barh(row, ran[0] - sent, left=sent - 0.5, height=0.6, color="#E3E3E3")
        bottom.barh(row, 1, left=ran[0] - 0.5, height=0.6, color="#C44E52")
        bottom.barh(row, ran[-1] - ran[0], left=ran[0] + 0.5, height=0.6, color="#4C72B0")
        bottom.text(ran[-1] + 1, row, clients[row]["question"], va="center", fontsize=7)
    bottom.invert_yaxis()
    bottom.set(xlabel="engine step", ylabel="client")
    bottom.set_title("each client's request: sent, waiting (grey), prefilled (red), decoding (blue) until it "
                     "stops or reaches max_tokens", fontsize=10)
    fig.tight_layout()
    return fig
