"""Chapter 7: the engine core, a process of its own that only runs steps.

A server has two jobs that compete for one Python interpreter: the HTTP side (parse JSON, render chat
templates, detokenize, write a server-sent event per token for every client) and the engine loop (plan
a step, launch the kernels, sample). In one process they share one GIL, so every event written is a
step delayed. vLLM's answer, and ours: the engine core runs in its own process and talks to the API
server over two ZeroMQ sockets —

    API server --- commands: Add(request), Abort(request id), Snapshot(), None (shut down) ---> engine core
    API server <-- one Report per step: new tokens per request, queue sizes ---- engine core

With several API-server processes (`serve --api-server-count N`, api_servers.py) each has its own pair of
sockets; every step's Report, pickled once, goes to all of them, and each keeps its own requests' tokens.

A step's Report goes out while the GPU runs the next step: the loop pickles step N's Report as step N left
things, launches step N + 1 (engine.launch_step, which returns as soon as the kernels are queued), sends the
Report, then waits for step N + 1's tokens (engine.finish_step). Commands are still applied before a launch,
never while a step is in flight, so an Abort never frees blocks that running kernels write.

The engine core does not detokenize token by token (the API side does, while the next step runs), except
when stop strings need the text to decide where the output ends; its Update carries token ids. Nothing a request carries can
stop this loop: a request that fails, fails alone (its Update carries the error), and the loop goes on.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

import zmq

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.engine.sequence import Sequence, Status
from tinyvllm.engine.snapshot import take_snapshot
from tinyvllm.errors import TinyVLLMError

if TYPE_CHECKING:   # the model code is imported by the engine process alone (run_engine_core)
    from tinyvllm.engine.engine import LaunchedStep

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 600      # loading a model (and compiling kernels) on a cold machine takes minutes at worst
POLL_MS = 500              # how often the API side checks that the engine process is still alive
HEARTBEAT_S = 1.0          # an idle engine still reports this often: silence means stopped or stuck
SEQUENCE_LISTS = ("prefill", "decode", "preempted")   # the lists of sequence ids in a step's trace record


# ---- the messages: named tuples, and on the socket a Report's Updates go as plain tuples (report_bytes) ----

class Add(NamedTuple):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    after: str | None = None          # sample 0 of the same prompt (n > 1): with prefix caching, start once
                                      # it is prefilled, so this sample finds the prompt's blocks cached


class Abort(NamedTuple):
    request_id: str


class Snapshot(NamedTuple):
    """Ask for the pool and the queues as they are after the next step (the live page; at most 4 a second)."""


class Update(NamedTuple):
    """What one request got in one step."""
    request_id: str
    token_ids: list[int]              # new tokens since the last Update
    logprobs: list | None             # one {token id: Logprob} per new token, if the request asked
    text: str | None                  # new text, only when the engine detokenizes (stop strings)
    finish_reason: str | None         # "stop", "length", "abort" or "error" once it is finished
    error: str | None = None          # why it failed ("error" finish), one line


@dataclass
class Stats:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    num_blocks: int = 0
    steps: int = 0
    prefix_cache_queries: int = 0     # prompt tokens admitted so far (recomputed ones included)
    prefix_cache_hits: int = 0        # of which found in the prefix cache, not computed
    spec_decode_num_drafts: int = 0           # speculative decoding (chapter 10): verifications so far
    spec_decode_num_draft_tokens: int = 0     # tokens proposed
    spec_decode_num_accepted_tokens: int = 0  # of which kept


class Report(NamedTuple):
    updates: list[Update]
    stats: Stats
    step: dict | None                 # who prefilled, decoded, was preempted (request ids), for the chapter's plots
    snapshot: dict | None = None      # the pool and the queues, only when a Snapshot was asked for
    tokens: int = 0                   # new tokens this step, every API-server process's requests together


# ---- the engine process ----

class EngineCore:
    """The loop in the engine process: apply commands, run one step, report. Blocks only when idle."""
    def __init__(self, engine, commands: zmq.Socket, reports: list[zmq.Socket]):
        self.engine, self.commands, self.reports = engine, commands, reports   # one reports socket per API server
        self.requests: dict[str, Sequence] = {}      # request id -> its sequence, while it waits or runs
        self.deferred: list[Add] = []                # samples waiting for their sample 0's prefill
        self.names: dict[int, str] = {}              # sequence id -> request id
        self.sent: dict[str, int] = {}               # request id -> tokens already reported
        self.steps, self.started, self.parent = 0, time.perf_counter(), os.getppid()
        self.busy = self.idle = 0.0                  # seconds in steps, and waiting for work
        self.queries = self.hits = 0                 # prefix cache: tokens admitted, tokens found cached
        self.snapshot_asked = False                  # a live page watches: the next Report carries a snapshot
        self.last_sent = time.monotonic()            # when the last Report went out (heartbeats while idle)

    def run(self) -> None:
        """Until told to stop (None; SIGTERM from api_servers.py's supervisor) or orphaned; then one log line
        of where the time went: in steps, in between (commands in, reports out), idle."""
        try:
            self._loop()
        finally:
            log.info("%d steps: %.2f s in steps, %.2f s in between, %.2f s idle", self.steps, self.busy,
                     time.perf_counter() - self.started - self.busy - self.idle, self.idle)

    def _loop(self) -> None:
        outbox: bytes | None = None   # the last step's Report, pickled, sent while the GPU runs the next step
        while True:
            updates: list[Update] = []
            # idle: nothing to run or to send (a sample 0 done at once frees its siblings: deferred counts)
            was_idle = not self.engine.has_work() and not self.deferred and outbox is None
            while was_idle:                                         # idle: sleep until a command arrives
                start = time.perf_counter()
                arrived = self.commands.poll(POLL_MS)
                self.idle += time.perf_counter() - start
                if arrived:
                    break
                if time.monotonic() - self.last_sent >= HEARTBEAT_S:   # an empty report: "still here"
                    self._send(self._report([], None, None))
                if os.getppid() != self.parent:                     # the API server is gone: so are we
                    return log.warning("the API server process is gone; the engine stops")
            while self.commands.poll(0):
                command = pickle.loads(self.commands.recv())
                if command is None:
                    return self._send(outbox) if outbox is not None else None   # the last tokens still go out
                self._apply(command, updates)
            for command in self._ready_samples():
                self._apply(command, updates)
            stepping = time.perf_counter()
            launched = self._launch(updates) if self.engine.has_work() else None
            self.busy += time.perf_counter() - stepping
            if outbox is not None:   # sending overlaps the kernels just launched
                self._send(outbox)
            stepping = time.perf_counter()
            step = self._finish(launched, updates) if launched is not None else None
            self.busy += time.perf_counter() - stepping
            snapshot = self._snapshot() if self.snapshot_asked else None   # nobody watching: this `if` is all
            # pickled now, as the step left things: the next launch changes the scheduler the snapshot reads
            outbox = self._report(updates, step, snapshot)
            if launched is None:     # nothing in flight to hide the sending behind: send now
                self._send(outbox)
                outbox = None

    def _report(self, updates: list[Update], step: dict | None, snapshot: dict | None) -> bytes:
        """The step's Report, pickled once for every API server: each keeps the updates of its own requests (their
        ids are unique) and drops the rest, in its own process, instead of this loop sorting and pickling per server."""
        tokens = sum(len(update.token_ids) for update in updates)
        return report_bytes(Report(updates, self.stats(), step, snapshot, tokens))

    def _send(self, data: bytes) -> None:
        for socket in self.reports:
            socket.send(data)
        self.last_sent = time.monotonic()

    def _apply(self, command: Add | Abort | Snapshot, updates: list[Update]) -> None:
        if isinstance(command, Snapshot):
            self.snapshot_asked = True
            return
        if isinstance(command, Abort):
            self.deferred = [add for add in self.deferred if add.request_id != command.request_id]
            if command.request_id in self.requests:
                self.engine.abort(self._forget(command.request_id))   # its blocks are back in the pool now
            return
        if command.after is not None and self.engine.config.enable_prefix_caching and self._prefilling(command.after):
            return self.deferred.append(command)
        try:   # the API side checked the request; anything raised here still fails this request only
            seq = self.engine.add_request(command.prompt_ids, command.params, stream=False, detokenize=False)
        except Exception as e:
            if not isinstance(e, TinyVLLMError):
                log.exception("adding request %s failed", command.request_id)
            updates.append(Update(command.request_id, [], None, None, "error", one_line(e)))
            return
        self.requests[command.request_id], self.sent[command.request_id] = seq, 0
        self.names[seq.seq_id] = command.request_id

    def _prefilling(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        return seq is not None and not seq.output_ids

    def _ready_samples(self) -> list[Add]:
        ready = [add for add in self.deferred if not self._prefilling(add.after)]
        self.deferred = [add for add in self.deferred if add not in ready]
        return ready

    def _forget(self, request_id: str) -> Sequence:
        seq = self.requests.pop(request_id)
        del self.sent[request_id], self.names[seq.seq_id]
        return seq

    def _launch(self, updates: list[Update]) -> LaunchedStep | None:
        try:
            return self.engine.launch_step()
        except Exception as e:
            return self._engine_failed(e, updates)

    def _engine_failed(self, e: Exception, updates: list[Update]) -> None:
        """Not one request's fault (the model failed): fail those in flight, go on."""
        log.exception("engine step failed")
        for request_id in list(self.requests):
            self.engine.abort(self._forget(request_id))
            updates.append(Update(request_id, [], None, None, "error", f"the engine failed: {one_line(e)}"))

    def _finish(self, launched: LaunchedStep, updates: list[Update]) -> dict | None:
        try:
            released = self.engine.finish_step(launched)
        except Exception as e:
            return self._engine_failed(e, updates)
        self.steps += 1
        trace = self.engine.trace[-1]
        for seq_id, count in zip(trace["prefill"], trace["chunks"]):
            seq = self.requests.get(self.names.get(seq_id))
            if seq is not None and seq.num_computed - count == seq.num_cached:   # its first chunk: looked up now
                sampled = seq.num_computed == len(seq) - 1   # its whole prompt fit this step: a token came out
                self.queries += len(seq) - sampled           # the tokens the prefix cache was asked about
                self.hits += seq.num_cached
        record = {key: [self.names.get(i, i) for i in value] if key in SEQUENCE_LISTS else value
                  for key, value in self.engine.trace[-1].items()}   # sequence ids -> request ids (not the chunks)
        record["step"] = self.steps
        for seq, text in released:
            request_id = self.names.get(seq.seq_id)
            if request_id is not None:
                updates.append(self._update(request_id, seq, text))
                if seq.status is Status.FINISHED:
                    self._forget(request_id)
        return record

    def _snapshot(self) -> dict:
        self.snapshot_asked, start = False, time.perf_counter()
        snapshot = take_snapshot(self.engine.scheduler, self.names)
        snapshot["took_ms"] = 1e3 * (time.perf_counter() - start)   # what watching costs the loop: the page shows it
        return snapshot

    def _update(self, request_id: str, seq: Sequence, text: str) -> Update:
        start, self.sent[request_id] = self.sent[request_id], len(seq.output_ids)
        logprobs = seq.logprobs[start:] if seq.logprobs is not None else None
        finish_reason = seq.finish_reason if seq.status is Status.FINISHED else None
        return Update(request_id, seq.output_ids[start:], logprobs, text if seq.incremental else None,
                      finish_reason, seq.error)

    def stats(self) -> Stats:
        scheduler, spec = self.engine.scheduler, self.engine.spec_stats
        blocks = scheduler.block_manager
        return Stats(len(scheduler.running), len(scheduler.waiting), blocks.num_free, blocks.num_blocks,
                     self.steps, self.queries, self.hits, spec.verifications, spec.proposed, spec.accepted)


def report_bytes(report: Report) -> bytes:
    """A Report for the socket, its Updates as plain tuples: pickle spends ~5x longer on a named tuple than on
    a plain one (128 Updates: 128 us against 23 us on a 2-core CPU), and the engine core pickles a Report every
    step, in the loop's own time."""
    return pickle.dumps(report._replace(updates=[tuple(u) for u in report.updates]), pickle.HIGHEST_PROTOCOL)


def report_from(data: bytes):
    """report_bytes undone, on the API side; any other message (("closed",)) as it was sent."""
    message = pickle.loads(data)
    if isinstance(message, Report):
        return message._replace(updates=[Update(*u) for u in message.updates])
    return message


def one_line(e: BaseException) -> str:
    return (str(e) or type(e).__name__).splitlines()[0]


FAILED_LINGER_MS = 30_000   # how long a failed engine waits for its API servers to take the reason why


def run_engine_core(config: EngineConfig, *addresses: str) -> None:
    """The engine process's main: build the LLM, say ready (or why not), loop until shut down.
    addresses: a (commands, reports) pair per API-server process; one PULL socket reads every commands one."""
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 1000)   # exiting (SIGTERM too) waits at most 1 s for reports nobody reads
    commands, reports = context.socket(zmq.PULL), [context.socket(zmq.PUSH) for _ in addresses[1::2]]
    for address in addresses[0::2]:
        commands.connect(address)
    for socket, address in zip(reports, addresses[1::2]):
        socket.connect(address)

    def tell_all(message: tuple) -> None:
        for socket in reports:
            socket.send(pickle.dumps(message))
    try:
        from tinyvllm.engine.engine import Engine  # the model code: only the engine process needs it
        engine = Engine.from_config(config)
    except Exception as e:   # a bad model path or file: the API side reports it as the user's mistake
        if not isinstance(e, TinyVLLMError):
            log.exception("the engine failed to start")
        tell_all(("failed", one_line(e), isinstance(e, TinyVLLMError)))
        for socket in reports:   # API servers still starting (slow imports on a busy machine) bind later: wait
            socket.close(linger=FAILED_LINGER_MS)
        return context.term()
    tell_all(("ready", engine_info(engine)))
    EngineCore(engine, commands, reports).run()
    tell_all(("closed",))                     # the API side's reader stops on it
    commands.close(linger=0)
    for socket in reports:
        socket.close(linger=1000)             # a second to deliver "closed", if anyone still listens
    context.term()


def start_engine_process(config: EngineConfig, addresses: list[str]) -> subprocess.Popen:
    """The engine core in a fresh interpreter: no fork of this one's threads, no re-import of the caller's script."""
    return subprocess.Popen([sys.executable, "-m", "tinyvllm.engine.engine_core", json.dumps(asdict(config)),
                             *addresses])


def engine_info(engine) -> dict:
    """What the API side needs to check requests before they reach the engine."""
    config = engine.config
    return {"max_model_len": config.max_model_len, "max_num_batched_tokens": config.max_num_batched_tokens,
            "vocab_size": engine.model.cfg.vocab_size, "num_blocks": config.num_blocks, "device": config.device,
            "max_num_seqs": config.max_num_seqs, "model_dir": str(engine.model.model_dir)}


# ---- the API side's handle on the engine process ----

@dataclass
class EngineClient:
    """Starts the engine process and talks to it. `on_report` runs (in a reader thread) for every Report.
    With `attach`, talks to an engine process that api_servers.py started for several API servers."""
    config: EngineConfig
    in_thread: bool = False                 # tests: the engine in a thread of this process, to inject faults
    attach: Attachment | None = None        # this API server's place among several, and the engine's pid
    info: dict = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)
    dead: str | None = None                 # why the engine is gone, once it is
    on_report: Callable[[Report], None] | None = None
    on_death: Callable[[str], None] | None = None

    def __post_init__(self):
        self._dir = tempfile.mkdtemp(prefix="tinyvllm-") if self.attach is None else None
        self._context = zmq.Context()
        self._context.setsockopt(zmq.LINGER, 0)   # never block this process's exit on an undelivered message
        self._commands, self._reports = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        addresses = engine_addresses(self._dir, 1)[0] if self.attach is None else self.attach.addresses
        self._commands.bind(addresses[0])
        self._reports.bind(addresses[1])
        self._addresses = addresses
        self._lock = threading.Lock()       # sends come from the event loop and from shutdown
        self._closing = False
        if self.attach is not None:
            self.process = None             # api_servers.py's supervisor owns it
        elif self.in_thread:
            self.process = threading.Thread(target=run_engine_core, args=(self.config, *addresses),
                                            name="tinyvllm-engine", daemon=True)
            self.process.start()
        else:
            self.process = start_engine_process(self.config, list(addresses))
        self._wait_ready()
        self.last_heard = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="tinyvllm-reports", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._reports.poll(POLL_MS):
            if not self.alive() or time.monotonic() > deadline:
                self.close()
                raise TinyVLLMError("the engine process stopped while loading the model; run with --debug "
                                    "to see why")
        message = pickle.loads(self._reports.recv())
        if message[0] == "failed":
            self.close()
            if message[2]:
                raise TinyVLLMError(message[1])
            raise RuntimeError(f"the engine failed to start: {message[1]}")
        self.info = message[1]

    def _read(self) -> None:
        while not self._closing:
            if not self._reports.poll(POLL_MS):
                if not self.alive():
                    return self._died("the engine process stopped")
                continue
            report = report_from(self._reports.recv())
            if not isinstance(report, Report):   # ("closed",): the engine has shut down
                return
            self.last_heard = time.monotonic()
            self.stats = report.stats
            if self.on_report is not None:
                self.on_report(report)

    def silent_for(self) -> float:
        """Seconds since the engine last reported: a step, or a heartbeat while idle (HEARTBEAT_S)."""
        return time.monotonic() - self.last_heard

    def alive(self) -> bool:
        if self.attach is not None:
            return pid_alive(self.attach.engine_pid)
        return self.process.is_alive() if self.in_thread else self.process.poll() is None

    def _died(self, reason: str) -> None:
        self.dead = reason
        log.error("%s; requests in flight fail and /health reports 503", reason)
        if self.on_death is not None:
            self.on_death(reason)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, after: str | None = None) -> None:
        self._send(Add(request_id, prompt_ids, params, after))

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def ask_snapshot(self) -> None:
        """The next Report will carry a snapshot (the API side asks at most every 250 ms, only while watched)."""
        self._send(Snapshot())

    def _send(self, command) -> None:
        with self._lock:
            self._commands.send(pickle.dumps(command, pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        """Ask the engine to stop, wait a moment, then make sure it has (attached: only let go of it)."""
        if self.attach is None and self.alive():
            try:   # never wait to deliver it: an engine that is exiting on its own has no socket to take it
                with self._lock:
                    self._commands.send(pickle.dumps(None), zmq.NOBLOCK)
            except zmq.Again:
                pass
            if self.in_thread:
                self.process.join(timeout=10)
            else:
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
        self._closing = True                # an attached engine runs on: the reader stops at its next poll
        if getattr(self, "_reader", None) is not None:
            self._reader.join(timeout=2 * POLL_MS / 1000)
        self._commands.close(linger=0)
        self._reports.close(linger=0)
        self._context.term()
        for address in self._addresses:
            try:
                os.unlink(address.removeprefix("ipc://"))
            except FileNotFoundError:
                pass
        if self._dir is not None:
            os.rmdir(self._dir)


class Attachment(NamedTuple):
    """One API server's place among several (api_servers.py): its index, its socket pair, the engine's pid."""
    index: int
    addresses: tuple[str, str]
    engine_pid: int


def engine_addresses(directory: str, count: int) -> list[tuple[str, str]]:
    """A (commands, reports) pair of IPC addresses per API-server process, in `directory`."""
    return [(f"ipc://{directory}/commands-{k}", f"ipc://{directory}/reports-{k}") for k in range(count)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)   # signal 0: no signal, only the check (the supervisor reaps the engine at once)
        return True
    except ProcessLookupError:
        return False


if __name__ == "__main__":   # python -m tinyvllm.engine.engine_core SETTINGS_JSON (COMMANDS REPORTS)...
    from tinyvllm.engine import engine_core  # the module's own classes, not __main__'s copies: pickles must match
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the API server stops us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # the supervisor of several API servers does
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine_core.run_engine_core(engine_core.EngineConfig(**json.loads(sys.argv[1])), *sys.argv[2:])
