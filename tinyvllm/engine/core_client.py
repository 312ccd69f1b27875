"""Chapter 7: the API side's handle on the engine core — start its process (or attach to one), send it
commands, and read its Reports in a thread of its own (the loop itself is engine_core.py)."""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import zmq

from tinyvllm.engine.core_messages import Abort, Add, Report, Snapshot, Stats, report_from
from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.engine_core import POLL_MS, run_engine_core, start_engine_process
from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.errors import TinyVLLMError

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 600      # loading a model (and compiling kernels) on a cold machine takes minutes at worst


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
        """Seconds since the engine last reported: a step, or a heartbeat while idle (engine_core.HEARTBEAT_S)."""
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

