"""Chapter 7: the engine core, a process of its own that only runs steps.

A server has two jobs that compete for one Python interpreter: the HTTP side (parse JSON, render chat
templates, detokenize, write a server-sent event per token for every client) and the engine loop (plan
a step, launch the kernels, sample). In one process they share one GIL, so every event written is a
step delayed. vLLM's answer, and ours: the engine core runs in its own process and talks to the API
server over two ZeroMQ sockets —

    API server --- commands: Add(request), Abort(request id), Snapshot(), None (shut down) ---> engine core
    API server <-- one Report per step: new tokens per request, queue sizes ---- engine core

This file is the engine core's side: its loop, and starting its process. The messages are in core_messages.py,
the API side's handle on this process in core_client.py.

With several API-server processes (`serve --api-server-count N`, api_servers.py) each has its own pair of
sockets; every step's Report, pickled once, goes to all of them, and each keeps its own requests' tokens.

A step's Report goes out while the GPU runs the next step: the loop pickles step N's Report as step N left
things, launches step N + 1 (engine.launch_step, which returns as soon as the kernels are queued), sends the
Report, then waits for step N + 1's tokens (engine.finish_step). With async scheduling (engine.py) launch_step has
also queued step N + 2 by then, so a command may arrive while a step is in flight: an Abort frees blocks its kernels
still write, which is harmless, as every later step's kernels are queued after them on the same GPU, and the aborted
request's tokens from those steps are dropped.

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
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import zmq

from tinyvllm.engine.core_messages import Abort, Add, Report, Snapshot, Stats, Update, one_line, report_bytes
from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.sequence import Sequence, Status
from tinyvllm.engine.snapshot import take_snapshot
from tinyvllm.errors import TinyVLLMError

if TYPE_CHECKING:   # the model code is imported by the engine process alone (run_engine_core)
    from tinyvllm.engine.engine import LaunchedStep
    from tinyvllm.engine.step_record import StepRecord

log = logging.getLogger(__name__)
POLL_MS = 500              # how often the API side checks that the engine process is still alive (and the
                           # idle engine, that its API server is)
HEARTBEAT_S = 1.0          # an idle engine still reports this often: silence means stopped or stuck
SEQUENCE_LISTS = ("prefill", "decode", "preempted")   # the StepRecord fields that list sequence ids


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

    def _finish(self, launched: LaunchedStep, updates: list[Update]) -> StepRecord | None:
        try:
            released = self.engine.finish_step(launched)
        except Exception as e:
            return self._engine_failed(e, updates)
        self.steps += 1
        ran = self.engine.trace[-1]
        record = ran._replace(step=self.steps, **{name: [self.names.get(i, i) for i in getattr(ran, name)]
                                                  for name in SEQUENCE_LISTS})   # sequence ids -> request ids
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
        scheduler, cache, spec = self.engine.scheduler, self.engine.scheduler.cache_stats, self.engine.spec_stats
        blocks = scheduler.block_manager
        return Stats(len(scheduler.running), len(scheduler.waiting), blocks.num_free, blocks.num_blocks,
                     self.steps, cache.queries, cache.hits, spec.verifications, spec.proposed, spec.accepted,
                     tuple(spec.accepted_per_position))


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


if __name__ == "__main__":   # python -m tinyvllm.engine.engine_core SETTINGS_JSON (COMMANDS REPORTS)...
    from tinyvllm.engine import engine_core  # the module itself, not __main__'s copy: its log lines name it
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the API server stops us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # the supervisor of several API servers does
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine_core.run_engine_core(EngineConfig(**json.loads(sys.argv[1])), *sys.argv[2:])
