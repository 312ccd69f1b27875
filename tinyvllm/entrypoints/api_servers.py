"""Chapter 7: several API-server processes in front of one engine core (`serve --api-server-count N`).

One API server parses, validates and tokenizes every request and writes every event in Python, on one
core. With a hundred clients that finish together (a batch of equal requests does), the hundred new
requests queue behind each other in that one process while the engine idles: chapter 7 measures it. vLLM's
answer, and ours: N API servers, each listening on the same port (SO_REUSEPORT: the kernel spreads new
connections evenly over their sockets; one shared socket would hand most of them to whichever process is
idle first), each talking to the one engine core over its own pair of ZeroMQ sockets; the engine core
sends each request's tokens back to the process that sent it (engine/engine_core.py).

    supervisor (this file): bind the port, start the engine core, start N API servers, wait;
                            when one of them stops, stop the others.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import replace
from queue import Empty

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.core_client import READY_TIMEOUT_S, Attachment, engine_addresses
from tinyvllm.engine.core_messages import one_line
from tinyvllm.engine.engine_core import start_engine_process
from tinyvllm.entrypoints.server import (Server, Terminated, announce, cannot_listen, listen, terminated,
                                         url_of)
from tinyvllm.errors import TinyVLLMError

log = logging.getLogger(__name__)
CHECK_S = 0.5   # how often the supervisor looks whether every process still runs


MAX_DEFAULT_API_SERVERS = 8


def default_api_server_count(device: str) -> int:
    """serve's --api-server-count when none is given. On a GPU, one API process per two cores, up to 8: a fast
    engine's clients need more HTTP, JSON and detokenizing than one core does (bench/serving.py measured 0.71 of
    offline with one, 0.82 with eight on 16 cores), and the engine process keeps cores of its own. On the CPU,
    one: the NumPy engine needs the cores itself."""
    if device != "cuda":
        return 1
    return max(1, min(MAX_DEFAULT_API_SERVERS, (os.cpu_count() or 1) // 2))


def serve_many(config: EngineConfig, count: int, model_name: str = "default", host: str = "127.0.0.1",
               port: int = 8000, max_queue: int = 256, api_key: str | None = None, ui: bool = True,
               log_level: str = "info") -> None:
    """Run the engine core and `count` API servers on one port until Ctrl-C or until one of them stops."""
    from tinyvllm.formats.checkpoints import resolve_model
    signal.signal(signal.SIGTERM, terminated)   # kill, systemd, docker: stop all, not just this one
    sock = reserve_port(host, port)
    host, port = sock.getsockname()[:2]   # port 0: the free port the kernel picked, for every API server
    config = replace(config, model=str(resolve_model(config.model)))   # converted once, not by N processes
    sockets_dir, metrics_dir = tempfile.mkdtemp(prefix="tinyvllm-"), tempfile.mkdtemp(prefix="tinyvllm-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir   # the API servers inherit it: /metrics adds them up
    pairs = engine_addresses(sockets_dir, count)
    engine = start_engine_process(config, [address for pair in pairs for address in pair])
    spawn = multiprocessing.get_context("spawn")   # fresh interpreters: no fork of this one's threads
    ready = spawn.Queue()
    servers = [spawn.Process(target=run_api_server, name=f"tinyvllm-api-{k}", daemon=True,
                             args=(config, Attachment(k, pairs[k], engine.pid), host, port, model_name,
                                   max_queue, api_key, ui, log_level, ready))
               for k in range(count)]
    got_sigterm = False
    try:
        for server in servers:
            server.start()
        announce(model_name, wait_ready(ready, servers, engine), url_of(sock), ui)
        while engine.poll() is None and all(server.is_alive() for server in servers):
            time.sleep(CHECK_S)
        if engine.poll() is not None:
            raise TinyVLLMError(f"the engine process stopped (exit code {engine.returncode}); the server stops")
        failed = [server for server in servers if server.exitcode not in (0, None)]
        if failed:
            raise TinyVLLMError(f"{failed[0].name} stopped (exit code {failed[0].exitcode}); the server stops")
        # else an API server was told to stop (Ctrl-C reaches the whole process group): so do the others
    except Terminated:
        got_sigterm = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # stopping already: a second Ctrl-C must not cut it short
        stop(servers, engine)
        sock.close()
        shutil.rmtree(sockets_dir, ignore_errors=True)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if got_sigterm:   # everything is stopped and cleaned up: now die by the signal, as a supervisor expects
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def reserve_port(host: str, port: int) -> socket.socket:
    """The port, bound but not listening (so the kernel sends it no connection), with SO_REUSEPORT: the API
    servers' listening sockets join it, and nobody else can take it while we run (another process must
    set SO_REUSEPORT too, as the same user, to share it)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise TinyVLLMError("--api-server-count above 1 needs SO_REUSEPORT (Linux, macOS); use 1 here")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # as socket.create_server does: the last run's connections in TIME_WAIT (~60 s) do not hold the port
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise cannot_listen(host, port, e) from None
    return sock


READY_GRACE_S = 5   # after the engine exits, how long its last word may take to arrive


def wait_ready(ready, servers: list, engine) -> dict:
    """Every API server's word that it reached the engine (the engine's info), or the first one's failure."""
    deadline, info = time.monotonic() + READY_TIMEOUT_S, None
    for _ in servers:
        while True:
            try:
                index, info, error, user_mistake = ready.get(timeout=CHECK_S)
                break
            except Empty:
                server_gone = not all(server.is_alive() for server in servers)
                if engine.poll() is not None or server_gone or time.monotonic() > deadline:
                    try:   # why it stopped comes through the API servers, perhaps a moment after a process exits
                        index, info, error, user_mistake = ready.get(timeout=READY_GRACE_S)
                        break
                    except Empty:
                        raise TinyVLLMError("an API-server process stopped while starting" if server_gone else
                                            "the engine process stopped while loading the model; run with "
                                            "--debug to see why") from None
        if error is not None:
            raise TinyVLLMError(error) if user_mistake else RuntimeError(f"the engine failed to start: {error}")
    return info


def stop_when_orphaned(server: Server, parent: int) -> None:
    """An API server whose supervisor was killed (kill -9, an OOM kill) stops too, instead of holding the port
    for a new server and answering with an engine that is gone."""
    while os.getppid() == parent:
        time.sleep(CHECK_S)
    log.warning("the supervisor process is gone; this API server stops")
    server.uvicorn.should_exit = True


def stop(servers: list, engine) -> None:
    """API servers first (SIGTERM: uvicorn finishes politely), then the engine they talk to."""
    for server in servers:
        if server.is_alive():
            server.terminate()
    for server in servers:
        server.join(timeout=5)
        if server.is_alive():
            server.kill()
    if engine.poll() is None:
        engine.terminate()
        try:
            engine.wait(timeout=10)
        except Exception:
            engine.kill()


def run_api_server(config: EngineConfig, attach: Attachment, host: str, port: int, model_name: str,
                   max_queue: int, api_key: str | None, ui: bool, log_level: str, ready) -> None:
    """One API server's process: reach the engine, say so, serve on the shared socket until told to stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s[{attach.index}]: %(message)s")
    try:
        server = Server(config, model_name, host, max_queue=max_queue, api_key=api_key, log_level=log_level, ui=ui,
                        sock=listen(host, port, reuse_port=True), attach=attach)
    except Exception as e:
        ready.put((attach.index, None, one_line(e), isinstance(e, TinyVLLMError)))
        return
    ready.put((attach.index, server.engine.info, None, True))
    threading.Thread(target=stop_when_orphaned, args=(server, os.getppid()), daemon=True).start()
    try:
        server.serve()
    finally:
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(os.getpid())
