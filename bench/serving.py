"""Serving: the HTTP path (`python -m tinyvllm serve`) against the engine's offline throughput, in ONE run.

In the spirit of `vllm bench serve`. DESIGN.md's target: the server delivers at least 90% of the output
tokens/s that `LLM.generate` reaches on the same machine, model, prompts and batch limit. In order:

  1. the workload: --num-requests prompts of exactly --input-len random token ids (seeded; drawn
     uniformly from the vocabulary without the special and stop ids), each asking for exactly
     --output-len tokens: greedy, with vLLM's `ignore_eos` so that no request stops early;
  2. the server, started as a subprocess on a free port, ready once GET /health answers 200, then warmed up;
     beside it, an `LLM` in this process (the offline engine, same limits and pool size), warmed up too;
  3. one offline run (prompts of the same lengths through `LLM.generate` while the server idles), then
     --rounds rounds, each: per mode (stream, then no-stream, on the same server) one burst of the requests from
     --client-processes processes, at most --concurrency in flight in all (or arriving as a Poisson process of
     --request-rate per second, as vLLM's), each request timed; then another offline run. The denominator of a
     round is the mean of the offline runs before and after it. Interleaving matters: on a shared machine the
     same engine's throughput drifts by tens of percent over minutes, and a ratio of two runs far apart
     measures the drift; bracketing cancels a drift that is steady over the round;
  4. the server stopped (SIGINT to its process group, then kill);
  5. per mode, the median round's figures in `vllm bench serve`'s terms (completed and failed requests; request,
     goodput and input/output/total token throughput; TTFT, TPOT, ITL and E2EL: mean, median, std, p90, p99),
     the same over all rounds, the ratio per round and its median, and
     bench/results/serving-<model>-<device>-<time>.json (or --out).

The clients: each process is one asyncio loop for the whole run (as a script is) and makes a new client for
every burst: `--client http` (the default) an httpx.AsyncClient, closed after its burst, that posts the JSON and
parses the server-sent events itself; `--client openai` the official package's AsyncOpenAI (max_retries=0),
never closed, so a burst runs beside the idle connections of the earlier ones, as in a user's script.
`--goodput ttft:MS tpot:MS e2el:MS` (any of them) counts, as vLLM's, the completed requests per second that
meet every bound; without streaming no chunk marks the first token, so only an e2el bound is measured there.

Why several client processes: one Python process that parses a few thousand server-sent events a
second runs out of CPU before a fast engine does, and the benchmark would measure the client.
Why a fresh set of prompts for each run (warm-up, each mode, offline): a prefix cache would otherwise
serve the second run's prompts from memory and flatter it.

    python bench/serving.py [--model default] [--device auto] [--num-requests 256] [--input-len 1024]
        [--output-len 128] [--concurrency 128 | --request-rate R] [--endpoint completions|chat]
        [--stream | --no-stream] [--client-processes 8] [--client http|openai] [--goodput NAME:MS ...]
        [--num-blocks B] [--max-model-len L] [--max-num-seqs S] [--rounds 3] [--seed 0] [--api-server-count N]
        [--out PATH]

CPU smoke run: python bench/serving.py --device cpu --num-requests 8 --concurrency 4 --output-len 8 \
                   --input-len 16 --client-processes 2 --rounds 2 --out /tmp/serving.json
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from queue import Empty
from typing import NamedTuple

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from bench.gpu_common import machine as gpu_machine  # noqa: E402
from bench.gpu_common import write_result  # noqa: E402

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MODES = {"stream": True, "no-stream": False}
# request fields that are vLLM's, not OpenAI's: the official client sends them through extra_body
OPENAI_EXTRAS = ("ignore_eos",)
TARGET = 0.9                 # DESIGN.md: HTTP output tokens/s >= 90% of offline
WARMUP_PROMPT_LEN = 16
REQUEST_TIMEOUT_S = 600      # a server that hangs fails its requests instead of hanging the benchmark
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Times are time.monotonic(): on Linux that is CLOCK_MONOTONIC, one clock for every process, so the
# start and end times that different client processes report can be compared.


class Job(NamedTuple):
    """One request as a client process sends it."""
    index: int
    send_at: float           # seconds after the start before which it is not sent (Poisson arrivals)
    max_tokens: int
    body: dict               # the JSON body, complete


class Prompts(NamedTuple):
    sent: list               # what each request sends: token ids (completions) or messages (chat)
    ids: list[list[int]]     # what the engine sees: for chat, the conversation through the chat template
    max_tokens: list[int]


# ---- the workload ----

def random_prompts(tokenizer, allowed: np.ndarray, endpoint: str, lengths: list[int], max_tokens: list[int],
                   rng: np.random.Generator) -> Prompts:
    """Random token ids; for chat, their text as the user's message (after the template and re-encoding
    the prompt is only about that long: the usage in each response says how long)."""
    ids = [rng.choice(allowed, n).tolist() for n in lengths]
    if endpoint == "completions":
        return Prompts(ids, ids, max_tokens)
    messages = [[{"role": "user", "content": tokenizer.decode(i)}] for i in ids]
    return Prompts(messages, [tokenizer.apply_chat_template(m) for m in messages], max_tokens)


def allowed_ids(tokenizer) -> np.ndarray:
    """Every id but the special and stop ones: a prompt of random ids must not hold a control token."""
    banned = set(tokenizer.special_tokens.values()) | set(tokenizer.stop_token_ids)
    return np.array([i for i in range(tokenizer.vocab_size) if i not in banned])


def warmup_prompts(tokenizer, allowed: np.ndarray, args, size: int, max_model_len: int,
                   rng: np.random.Generator) -> Prompts:
    """`size` short prompts asking for 1, 2, ..., size tokens: they finish one per step, so the batch walks
    down through every size and each CUDA graph bucket is captured before the clock starts."""
    n = min(WARMUP_PROMPT_LEN, args.input_len)
    prompts = random_prompts(tokenizer, allowed, args.endpoint, [n] * size, [0] * size, rng)
    # the lengths once the prompts are known (chat: templated), each within the context window
    return prompts._replace(max_tokens=[min(k + 1, max_model_len - len(ids)) for k, ids in enumerate(prompts.ids)])


def arrival_times(n: int, rate: float | None, rng: np.random.Generator) -> list[float]:
    """All at once without a rate; else a Poisson process (exponential gaps of mean 1/rate), as vLLM's."""
    if rate is None:
        return [0.0] * n
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate, n - 1))]).tolist()


def request_body(endpoint: str, prompt, max_tokens: int, stream: bool, ignore_eos: bool, model: str) -> dict:
    body = {"model": model, "temperature": 0, "stream": stream}
    if endpoint == "completions":
        body |= {"prompt": prompt, "max_tokens": max_tokens}   # a list of ids: the exact prompt length
    else:
        body |= {"messages": prompt, "max_completion_tokens": max_tokens}
    if stream:
        body["stream_options"] = {"include_usage": True}      # the token count comes from the usage
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def jobs_for(args, prompts: Prompts, stream: bool, ignore_eos: bool, model: str, send_at: list[float]) -> list[Job]:
    return [Job(i, t, m, request_body(args.endpoint, p, m, stream, ignore_eos, model))
            for i, (p, m, t) in enumerate(zip(prompts.sent, prompts.max_tokens, send_at))]


# ---- the client processes ----

class ClientSpec(NamedTuple):
    """How the client processes talk to the server."""
    kind: str                # "http": httpx, one client a burst, closed after it; "openai": see burst_sender
    url: str
    route: str               # the raw HTTP route; the openai client picks its own from the body
    timeout: float = REQUEST_TIMEOUT_S
    leave_streams: bool = False   # openai: stop reading a stream at its finish chunk and never close it
    api_key: str = "none"    # openai: the client needs one; a server started without --api-key takes any
    drop_clients: bool = False   # openai: let each burst's client go (garbage) instead of keeping it referenced


class ClientPool:
    """`processes` client processes that live as long as the pool, each one event loop for its whole life, as a
    script is: the clients that an earlier burst left open are still open, idle, when the next burst runs."""

    def __init__(self, spec: ClientSpec, processes: int):
        ctx = mp.get_context("spawn")   # fresh interpreters: nothing of this process (a CUDA context) is inherited
        self.barrier, self.outbox = ctx.Barrier(processes), ctx.Queue()   # every burst starts at once
        self.inboxes = [ctx.Queue() for _ in range(processes)]
        # daemons: if this process stops on an error, its clients stop with it rather than keep it waiting
        self.procs = [ctx.Process(target=client_process, args=(spec, inbox, self.outbox, self.barrier), daemon=True)
                      for inbox in self.inboxes]
        for p in self.procs:
            p.start()

    def burst(self, jobs: list[Job], concurrency: int) -> list[dict]:
        """Send the jobs from the processes sharing `concurrency`; one result per job, in job order."""
        n = max(1, min(len(self.procs), concurrency, len(jobs)))
        shares = [concurrency // n + (k < concurrency % n) for k in range(n)]
        # round robin: with Poisson arrivals each process gets every n-th arrival, spread over the whole run;
        # the processes beyond n get nothing to send but still pass the barrier
        for k, inbox in enumerate(self.inboxes):
            inbox.put((jobs[k::n], shares[k]) if k < n else ([], 0))
        results, reports = [], 0
        while reports < len(self.procs):
            try:
                results += self.outbox.get(timeout=1)
                reports += 1
            except Empty:   # a client that died (not a failed request: those are results) hangs nothing
                if any(p.exitcode is not None for p in self.procs):
                    raise RuntimeError("a client process failed; see its traceback above") from None
        return sorted(results, key=lambda r: r["index"])

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():   # stopped mid-burst (an error, Ctrl-C): it would not read the None
                p.terminate()


@contextmanager
def client_pool(spec: ClientSpec, processes: int):
    pool = ClientPool(spec, processes)
    try:
        yield pool
    finally:
        pool.close()


def client_process(spec: ClientSpec, inbox, outbox, barrier) -> None:
    asyncio.run(client_loop(spec, inbox, outbox, barrier))


async def client_loop(spec: ClientSpec, inbox, outbox, barrier) -> None:
    """Bursts until None. The waits run in threads so that the loop, and the connections that earlier bursts'
    clients hold, stay serviced between bursts, as in a script that awaits something else meanwhile."""
    loop = asyncio.get_running_loop()
    while (burst := await loop.run_in_executor(None, inbox.get)) is not None:
        jobs, concurrency = burst
        await loop.run_in_executor(None, barrier.wait)
        outbox.put(await send_all(spec, jobs, concurrency))


async def send_all(spec: ClientSpec, jobs: list[Job], concurrency: int) -> list[dict]:
    """One burst through one new client: at most `concurrency` in flight, each job not before its send_at."""
    gate = asyncio.Semaphore(max(concurrency, 1))
    async with burst_sender(spec, concurrency) as send:
        start = time.monotonic()

        async def one(job: Job) -> dict:
            await asyncio.sleep(job.send_at - (time.monotonic() - start))   # a negative wait returns at once
            async with gate:
                return await timed(job, send)

        return await asyncio.gather(*map(one, jobs))


KEPT_CLIENTS: list = []   # every burst's openai client, referenced for the life of the process


@asynccontextmanager
async def burst_sender(spec: ClientSpec, concurrency: int):
    """A burst's client, as a function of (body, record) -> usage."""
    if spec.kind == "openai":
        import openai
        # a user's script: the defaults but no retries (a retry would hide a lost request), and never closed
        client = openai.AsyncOpenAI(base_url=f"{spec.url}/v1", api_key=spec.api_key, max_retries=0,
                                    timeout=spec.timeout)
        if not spec.drop_clients:   # dropped, the package's __del__ closes it in a task of this loop, and
            KEPT_CLIENTS.append(client)   # requests of the live client then wait for answers that never come
        yield lambda body, r: openai_request(client, body, r, spec.leave_streams)
        return
    # httpx keeps at most 100 connections by default: a larger share would queue inside the client
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=spec.url, limits=limits, timeout=spec.timeout) as client:
        yield lambda body, r: (read_stream(client, spec.route, body, r) if body["stream"]
                               else read_whole(client, spec.route, body))


class RequestFailed(Exception):
    """The server answered, but not with a completion."""


async def timed(job: Job, send) -> dict:
    """One request, timed. A failure is recorded in the result, not raised: the others go on."""
    r = {"index": job.index, "max_tokens": job.max_tokens, "start": time.monotonic(), "ttft": None, "last": None,
         "itl": [], "prompt_tokens": 0, "completion_tokens": 0, "error": None}
    try:
        usage = await send(job.body, r)
        if not usage:
            raise RequestFailed("the response carries no usage")
        r["prompt_tokens"], r["completion_tokens"] = usage["prompt_tokens"], usage["completion_tokens"]
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
    r["end"] = time.monotonic()
    return r


def mark_text(r: dict) -> None:
    """A chunk that carries text arrived: TTFT at the first, ITL between them (a chunk can carry several tokens:
    the server releases text once it is complete UTF-8)."""
    now = time.monotonic()
    if r["last"] is None:
        r["ttft"] = now - r["start"]
    else:
        r["itl"].append(now - r["last"])
    r["last"] = now


async def read_whole(client: httpx.AsyncClient, route: str, body: dict) -> dict | None:
    response = await client.post(route, json=body)
    if response.status_code != 200:
        raise RequestFailed(f"HTTP {response.status_code}: {error_message(response.text)}")
    return response.json().get("usage")


async def read_stream(client: httpx.AsyncClient, route: str, body: dict, r: dict) -> dict | None:
    """Server-sent events, the usage from the last."""
    usage = None
    async with client.stream("POST", route, json=body) as response:
        if response.status_code != 200:
            raise RequestFailed(f"HTTP {response.status_code}: {error_message((await response.aread()).decode())}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:   # after the 200 has gone out, a failure arrives as an event
                raise RequestFailed(chunk["error"].get("message"))
            usage = chunk.get("usage") or usage
            if chunk_text(chunk):
                mark_text(r)
    return usage


def chunk_text(chunk: dict) -> str:
    """The text of a completion or chat chunk; the usage chunk has no choices, chat's first only a role."""
    if not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def openai_request(client, body: dict, r: dict, leave_streams: bool) -> dict | None:
    """The same request through the official client: its own fields as arguments, vLLM's extras in extra_body.
    The client raises on an HTTP error and on an error event."""
    fields = {k: v for k, v in body.items() if k not in OPENAI_EXTRAS}
    extra = {k: v for k, v in body.items() if k in OPENAI_EXTRAS}
    api = client.chat.completions if "messages" in body else client.completions
    response = await api.create(**fields, extra_body=extra or None)
    if not body["stream"]:
        return response.usage and response.usage.model_dump()
    usage = None
    async for chunk in response:
        usage = chunk.usage.model_dump() if chunk.usage else usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if getattr(choice, "text", None) or getattr(getattr(choice, "delta", None), "content", None):
            mark_text(r)
        if leave_streams and choice.finish_reason:
            # the usage chunk stays unread: the text chunks stand for the tokens, the prompt is not counted
            return {"prompt_tokens": 0, "completion_tokens": len(r["itl"]) + (r["ttft"] is not None)}
    return usage


def error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]


# ---- the server ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], url: str, log) -> subprocess.Popen:
    """Start the server in a process group of its own (it may run its engine in a child process) and wait
    until GET /health answers 200. Its output goes to `log`: a pipe nobody reads would fill and stall it."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900   # loading and converting the model, compiling the kernels
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop_server(proc)   # its engine process may outlive it
            raise RuntimeError(f"the server exited with code {proc.returncode}:\n{tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:   # not listening yet
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health within 900 s:\n{tail(log)}")


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C as a terminal sends it, to the server's whole process group; kill the group if it lingers.
    Returns once every process of the group is gone: the offline run needs the memory they held."""
    for sig, seconds in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:   # the group is gone already
            return
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            proc.poll()   # reap the server itself; its children are reaped by init
            try:
                os.killpg(proc.pid, 0)   # signal 0: does any process of the group remain?
            except ProcessLookupError:
                return
            time.sleep(0.1)
    print(f"warning: the server's process group {proc.pid} did not exit; the offline run may find less memory")


def tail(log, lines: int = 20) -> str:
    log.flush()
    return "\n".join(Path(log.name).read_text(errors="replace").splitlines()[-lines:])


def served_model(url: str) -> str:
    """The name the server answers to, for the requests' `model` field."""
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def warm_up_server(pool: ClientPool, args, prompts: Prompts, model: str) -> bool:
    """Warm the server up; returns whether it takes `ignore_eos` (the warm-up doubles as the probe)."""
    size = len(prompts.ids)
    ignore_eos = True
    results = pool.burst(jobs_for(args, prompts, False, ignore_eos, model, [0.0] * size), size)
    if any(r["error"] and "ignore_eos" in r["error"] for r in results):
        print("the server refuses ignore_eos; sending requests without it (a response may stop at EOS)")
        ignore_eos = False
        results = pool.burst(jobs_for(args, prompts, False, ignore_eos, model, [0.0] * size), size)
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        print(f"warm-up: {len(errors)} of {size} requests failed, e.g. {errors[0]}")
    return ignore_eos


@contextmanager
def running_server(args, device: str, max_model_len: int, max_num_seqs: int, num_blocks: int):
    """The server on a free port for the `with` block; yields its URL and command line."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tinyvllm", "serve", "--model", args.model, "--device", device,
               "--port", str(port), "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
               "--num-blocks", str(num_blocks)]
    if args.api_server_count is not None:   # else the server's own default (serve --help says how it chooses)
        command += ["--api-server-count", str(args.api_server_count)]
    with tempfile.NamedTemporaryFile("w+", prefix="tinyvllm-serve-", suffix=".log", delete=False) as log:
        print(f"server: {shlex.join(command)} (log: {log.name})")
        proc = start_server(command, url, log)
        try:
            yield url, shlex.join(command), proc.pid
        finally:
            stop_server(proc)


def run_mode(args, pool: ClientPool, model: str, mode: str, prompts: Prompts, ignore_eos: bool,
             rng: np.random.Generator, group: int) -> tuple[dict, list[dict]]:
    """One burst of the workload in one mode: its figures, and the requests' results."""
    jobs = jobs_for(args, prompts, MODES[mode], ignore_eos, model,
                    arrival_times(len(prompts.ids), args.request_rate, rng))
    before = cpu_seconds(group)
    results = pool.burst(jobs, args.concurrency)
    after = cpu_seconds(group)
    row = summarize(results, MODES[mode], args.goodput)
    row["server_cpu_s"] = {side: after[side] - before[side] for side in after}   # where the server's time went
    cpu = ", ".join(f"{side} {seconds:.2f} s" for side, seconds in row["server_cpu_s"].items())
    print(f"  {mode}: {row['output_throughput']:,.1f} output tok/s in {row['duration_s']:.2f} s, "
          f"{row['completed']} completed, {row['failed']} failed; CPU time: {cpu or 'not measured (no /proc)'}")
    return row, results


def cpu_seconds(group: int) -> dict[str, float]:
    """CPU seconds so far of the server's processes (Linux /proc): the engine core, and the API side (the API
    servers, and a supervisor when there are several). An API side near 1 s per second is one core, full."""
    if not os.path.isdir("/proc"):
        return {}
    totals = {"api": 0.0, "engine": 0.0}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(int(pid)) != group:
                continue
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            side = "engine" if b"engine_core" in Path(f"/proc/{pid}/cmdline").read_bytes() else "api"
        except (OSError, ProcessLookupError):   # gone meanwhile
            continue
        totals[side] += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime
    return totals


# ---- the offline denominator ----

def offline_engine(args, device: str, max_model_len: int, max_num_seqs: int, num_blocks: int):
    from tinyvllm import LLM
    return LLM(args.model, device=device, max_model_len=max_model_len, num_blocks=num_blocks,
               max_num_seqs=max_num_seqs)


def run_offline(llm, prompts: Prompts) -> dict:
    """The same kind of prompts through LLM.generate, all at once, same limits: wall time from the call to
    the last output."""
    start = time.monotonic()
    outputs = generate(llm, prompts)
    seconds = time.monotonic() - start
    n_in, n_out = sum(len(ids) for ids in prompts.ids), sum(len(o.token_ids) for o in outputs)
    print(f"  offline: {n_out / seconds:,.1f} output tok/s")
    return {"requests": len(outputs), "completed": len(outputs), "duration_s": seconds,
            "total_input_tokens": n_in, "total_output_tokens": n_out, "request_throughput": len(outputs) / seconds,
            "input_throughput": n_in / seconds, "output_throughput": n_out / seconds,
            "total_token_throughput": (n_in + n_out) / seconds}


def generate(llm, prompts: Prompts) -> list:
    from tinyvllm import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in prompts.max_tokens]
    return llm.generate(prompts.ids, params)


# ---- the figures ----

SLO_NAMES = ("ttft", "tpot", "e2el")   # what --goodput may bound, as vLLM's
PERCENTILES = (90, 99)
# the figures that are rates over a run; the rounds give each a median and a spread
RATES = ("request_throughput", "request_goodput", "input_throughput", "output_throughput", "total_token_throughput")


def stats_ms(seconds: list[float]) -> dict | None:
    """Mean, median, standard deviation (of the population, as numpy's and vLLM's) and percentiles, in ms."""
    if not seconds:
        return None
    ms = 1e3 * np.asarray(seconds)
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())} | {
        f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}


def request_times(r: dict) -> dict[str, float | None]:
    """A completed request's TTFT, TPOT and E2EL in seconds, as vLLM's: TPOT is the time after the first token
    over the tokens after it, and 0 for a single token. Without streaming no chunk marks the first token: TTFT
    and TPOT are None, as for a stream whose chunks carried no text."""
    e2el = r["end"] - r["start"]
    if r["ttft"] is None:
        return {"ttft": None, "tpot": None, "e2el": e2el}
    after_first = r["completion_tokens"] - 1
    return {"ttft": r["ttft"], "tpot": (e2el - r["ttft"]) / after_first if after_first > 0 else 0.0, "e2el": e2el}


def latency_stats(ok: list[dict]) -> dict:
    """TTFT, TPOT (requests of more than one token, as vLLM's), ITL and E2EL over the completed requests."""
    times = [request_times(r) for r in ok]
    return {"ttft_ms": stats_ms([t["ttft"] for t in times if t["ttft"] is not None]),
            "tpot_ms": stats_ms([t["tpot"] for t, r in zip(times, ok)
                                 if t["tpot"] is not None and r["completion_tokens"] > 1]),
            "itl_ms": stats_ms([gap for r in ok for gap in r["itl"]]),
            "e2el_ms": stats_ms([t["e2el"] for t in times])}


def good_requests(ok: list[dict], stream: bool, slo: dict[str, float]) -> int | None:
    """vLLM's goodput count: completed requests within every SLO (ms). None where an SLO bounds a figure that
    this mode does not measure (TTFT and TPOT need streaming); a stream without text meets no TTFT bound."""
    if not stream and slo.keys() - {"e2el"}:
        return None
    return sum(all(t[name] is not None and 1e3 * t[name] <= ms for name, ms in slo.items())
               for t in map(request_times, ok))


def summarize(results: list[dict], stream: bool, slo: dict[str, float]) -> dict:
    """vLLM's figures: the duration runs from the first request sent to the last response read; the
    throughputs count completed requests and their tokens (the server's usage) over it; goodput counts the
    completed requests that meet every --goodput SLO."""
    ok = [r for r in results if r["error"] is None]
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    n_in, n_out = sum(r["prompt_tokens"] for r in ok), sum(r["completion_tokens"] for r in ok)
    good = good_requests(ok, stream, slo) if slo else None
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "error_examples": sorted({r["error"] for r in results if r["error"]})[:3],
        "duration_s": seconds, "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / seconds, "request_goodput": None if good is None else good / seconds,
        "input_throughput": n_in / seconds, "output_throughput": n_out / seconds,
        "total_token_throughput": (n_in + n_out) / seconds,
        "prompt_tokens_mean": n_in / len(ok) if ok else None,
        # a response shorter than max_tokens: the server stopped at EOS, ignore_eos was not honoured
        "short_outputs": sum(r["completion_tokens"] < r["max_tokens"] for r in ok),
    } | latency_stats(ok)


def spread(values: list[float | None]) -> dict | None:
    if None in values:
        return None
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}


def over_rounds(rows: list[dict], results: list[dict]) -> dict:
    """One mode over every round: each rate's median, min and max over the rounds, the counts summed, and the
    latency figures of all the rounds' requests together (the rounds run the same workload)."""
    return {"rounds": len(rows), "completed": sum(row["completed"] for row in rows),
            "failed": sum(row["failed"] for row in rows)} | {
        rate: spread([row[rate] for row in rows]) for rate in RATES} | latency_stats(
        [r for r in results if r["error"] is None])


def print_table(title: str, rows: dict[str, dict], before: dict, after: dict) -> None:
    """The HTTP rows and the offline runs before and after them; '/ offline' divides by those two's mean."""
    offline = (before["output_throughput"] + after["output_throughput"]) / 2
    print(f"\n{title}\n{'':14} {'done':>6} {'failed':>6} {'seconds':>8} {'req/s':>8} {'good/s':>8} {'in tok/s':>10} "
          f"{'out tok/s':>10} {'tot tok/s':>10} {'/ offline':>9}")
    for name, row in {**rows, "offline before": before, "offline after": after}.items():
        good = row.get("request_goodput")
        print(f"{name:14} {row['completed']:>6} {row.get('failed', '-'):>6} {row['duration_s']:>8.2f} "
              f"{row['request_throughput']:>8.2f} {'-' if good is None else f'{good:.2f}':>8} "
              f"{row['input_throughput']:>10,.1f} {row['output_throughput']:>10,.1f} "
              f"{row['total_token_throughput']:>10,.1f} {row['output_throughput'] / offline:>9.3f}")
    for mode, row in rows.items():
        print_latencies(mode, row)


def print_latencies(mode: str, row: dict) -> None:
    print(f"{'ms':16} {'mean':>9} {'median':>9} {'std':>9}" + "".join(f" {f'p{p}':>9}" for p in PERCENTILES))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        if row[f"{metric}_ms"]:
            s = row[f"{metric}_ms"]
            print(f"{mode + ' ' + metric.upper():16}" + "".join(f" {s[k]:>9.1f}" for k in ("mean", "median", "std")) +
                  "".join(f" {s[f'p{p}']:>9.1f}" for p in PERCENTILES))


def print_over_rounds(mode: str, summary: dict) -> None:
    print(f"\n{mode}, over {summary['rounds']} rounds: {summary['completed']} completed, {summary['failed']} failed; "
          "median [min, max] of the rounds")
    for rate in RATES:
        if summary[rate]:
            s = summary[rate]
            print(f"  {rate:24} {s['median']:>10,.2f} [{s['min']:,.2f}, {s['max']:,.2f}]")
    print_latencies(mode, summary)


def host(client: str) -> dict:
    """The machine the clients run on (and the engine too, on the CPU), and the client library's version."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "?")
    library = {"httpx": httpx.__version__}
    if client == "openai":
        import openai
        library = {"openai": openai.__version__}
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            **library, "thread_env": {v: os.environ.get(v) for v in THREAD_VARS}}


# ---- the run ----

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a model directory")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (chat: of the user's text)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, help="requests in flight at most (default 128; none with --request-rate)")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--endpoint", choices=list(ROUTES), default="completions")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, help="one mode only (default: both)")
    p.add_argument("--client-processes", type=int, default=8)
    p.add_argument("--client", choices=["http", "openai"], default="http",
                   help="http: raw requests through httpx; openai: the official client as a user's script uses it "
                        "(AsyncOpenAI, max_retries=0, a new one per burst and process, never closed)")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", type=slo_pair,
                   help=f"SLOs for goodput, as vLLM's: completed requests/s within every bound, NAME in "
                        f"{', '.join(SLO_NAMES)} (e.g. ttft:500 tpot:50)")
    p.add_argument("--num-blocks", type=int,
                   help="KV cache blocks, server and offline (default: a full batch of the longest sequences)")
    p.add_argument("--rounds", type=int, default=3, help="server and offline runs interleaved; the median ratio")
    p.add_argument("--max-model-len", type=int, help="default: the longest prompt + --output-len")
    p.add_argument("--max-num-seqs", type=int, help="server and offline (default: --concurrency, at most 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-server-count", type=int, default=None,
                   help="the server's API-server processes (default: the server's own default)")
    p.add_argument("--out", help="the result file (default: bench/results/serving-<model>-<device>-<time>.json)")
    args = p.parse_args()
    args.goodput = dict(args.goodput or [])
    if args.client == "openai" and importlib.util.find_spec("openai") is None:
        p.error("--client openai needs the openai package: pip install openai")
    if args.concurrency is None:
        args.concurrency = args.num_requests if args.request_rate else 128   # a rate alone: no cap, as vLLM
    return args


def slo_pair(text: str) -> tuple[str, float]:
    """NAME:MS, as vLLM's --goodput takes it."""
    name, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if name not in SLO_NAMES or not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:MS with NAME in {', '.join(SLO_NAMES)} and MS a "
                                         f"number >= 0, e.g. ttft:500")
    return name, value


def pool_blocks_for(max_model_len: int, max_num_seqs: int) -> int:
    """Both engines get the same pool: every sequence of a full batch at its longest, no preemption. (A
    pool sized from free memory would leave the offline engine, loaded beside the server, nothing.)"""
    from tinyvllm.model.step_plan import blocks_for
    return max_num_seqs * blocks_for(max_model_len)


def median_round(rounds: list[dict], ratios: list[float]) -> dict:
    """The round whose ratio is the median one (the lower of the two middle ones for an even count)."""
    return rounds[sorted(range(len(ratios)), key=ratios.__getitem__)[(len(ratios) - 1) // 2]]


def report(args, rounds: list[dict], per_round: dict[str, list[float]], ratios: dict[str, float],
           summary: dict[str, dict], ignore_eos: bool) -> None:
    """The median round's tables per mode, the figures over the rounds, the ratio per round and its median."""
    modes = list(per_round)
    for mode in modes:
        middle = median_round(rounds, per_round[mode])
        print_table(f"{mode}, median round", {mode: middle[mode]}, middle["offline_before"], middle["offline"])
    if args.rounds > 1:
        for mode in modes:
            print_over_rounds(mode, summary[mode])
    print(f"\nHTTP / offline output tok/s, per round: "
          f"{'; '.join(f'{m} ' + ' '.join(f'{x:.3f}' for x in r) for m, r in per_round.items())}")
    print(f"median of {args.rounds}: {', '.join(f'{m} {r:.3f}' for m, r in ratios.items())} (target >= {TARGET})")
    if args.goodput and any(summary[m]["request_goodput"] is None for m in modes):
        print("note: goodput is not measured without streaming for a TTFT or TPOT bound (no chunk marks the first "
              "token)")
    if not ignore_eos or any(row[m]["short_outputs"] for row in rounds for m in modes):
        print("note: the server did not honour ignore_eos; output tok/s counts the tokens it did generate")


def main() -> None:
    args = parse_args()
    # `kill` or `timeout` sends SIGTERM: exit through the `finally` that stops the server, which runs in
    # a session of its own and would otherwise outlive this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # the engine stays out of the client processes, which re-import this file
    from tinyvllm.formats.checkpoints import resolve_model
    from tinyvllm.formats.tokenizer import load_tokenizer
    from tinyvllm.model.backend import resolve_device

    load_at_start = os.getloadavg()
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(resolve_model(args.model))   # converts the default model once
    allowed = allowed_ids(tokenizer)
    rng = np.random.default_rng(args.seed)
    lengths, outputs = [args.input_len] * args.num_requests, [args.output_len] * args.num_requests
    modes = [m for m, on in MODES.items() if args.stream in (None, on)]

    def fresh() -> Prompts:   # a new set for every run: no prefix-cache hit flatters a later one
        return random_prompts(tokenizer, allowed, args.endpoint, lengths, outputs, rng)

    workloads = [{name: fresh() for name in [*modes, "offline"]} for _ in range(args.rounds)]
    opening = fresh()   # an offline run before the first round: every HTTP run then has one before and after it
    max_model_len = args.max_model_len or max(
        len(i) for w in workloads for p in [*w.values(), opening] for i in p.ids) + args.output_len
    max_num_seqs = args.max_num_seqs or min(args.concurrency, 256)   # both sides batch the same at most
    num_blocks = args.num_blocks or pool_blocks_for(max_model_len, max_num_seqs)
    warmup = warmup_prompts(tokenizer, allowed, args, min(max_num_seqs, args.concurrency, args.num_requests),
                            max_model_len, rng)

    rounds, samples = [], {mode: [] for mode in modes}
    with running_server(args, device, max_model_len, max_num_seqs, num_blocks) as (url, server_command, group), \
            client_pool(ClientSpec(args.client, url, ROUTES[args.endpoint]), args.client_processes) as pool:
        model = served_model(url)
        ignore_eos = warm_up_server(pool, args, warmup, model)
        llm = offline_engine(args, device, max_model_len, max_num_seqs, num_blocks)   # beside the idle server
        generate(llm, warmup)
        arrivals = np.random.default_rng([args.seed, 1])   # seeded, apart from the prompts
        before = run_offline(llm, opening)
        for r, workload in enumerate(workloads):   # interleaved: a drift of the machine hits both sides alike
            print(f"round {r + 1} of {args.rounds}")
            rows = {}
            for mode in modes:
                rows[mode], results = run_mode(args, pool, model, mode, workload[mode], ignore_eos, arrivals, group)
                samples[mode] += results
            rounds.append(rows | {"offline_before": before, "offline": run_offline(llm, workload["offline"])})
            before = rounds[-1]["offline"]
    # each round's HTTP runs against the mean of the offline runs just before and after them: a steady drift cancels
    per_round = {mode: [2 * row[mode]["output_throughput"] /
                        (row["offline_before"]["output_throughput"] + row["offline"]["output_throughput"])
                        for row in rounds] for mode in modes}
    ratios = {mode: float(np.median(r)) for mode, r in per_round.items()}
    summary = {mode: over_rounds([row[mode] for row in rounds], samples[mode]) for mode in modes}
    report(args, rounds, per_round, ratios, summary, ignore_eos)

    machine = {"host": host(args.client) | {"load_average_at_start": load_at_start,
                                            "load_average_at_end": os.getloadavg()}}
    if device == "cuda":
        machine |= gpu_machine()
    result = {"benchmark": "serving", "machine": machine, "model": args.model, "device": device,
              "command": shlex.join(["python", "bench/serving.py", *sys.argv[1:]]), "server_command": server_command,
              "workload": {"num_requests": args.num_requests, "input_len": args.input_len,
                           "output_len": args.output_len, "endpoint": args.endpoint,
                           "concurrency": args.concurrency, "request_rate": args.request_rate,
                           "client_processes": args.client_processes, "max_num_seqs": max_num_seqs,
                           "max_model_len": max_model_len, "num_blocks": num_blocks, "seed": args.seed,
                           "temperature": 0, "ignore_eos_sent": ignore_eos, "warmup_requests": len(warmup.ids),
                           "rounds": args.rounds, "api_server_count": args.api_server_count or "server default",
                           "client": args.client, "goodput_slo_ms": args.goodput},
              "rounds": rounds, "over_rounds": summary, "http_over_offline_per_round": per_round,
              "http_over_offline": ratios, "target_http_over_offline": TARGET}
    name = args.model if args.model == "default" else Path(args.model).name
    write_result(f"serving-{name}-{device}", result, args.out)


if __name__ == "__main__":
    main()
