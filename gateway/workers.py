"""`agentrl gateway --workers N`: N worker processes of the gateway serving one port.

Python runs one request at a time per process, so a replica uses more cores through more processes. The
parent process here is a small supervisor that serves nothing itself:

- It checks the port is free (``check_port_free``, before it starts), then gives each worker its own listening socket bound to the same address
  with ``SO_REUSEPORT``, so the kernel spreads new connections over the workers by their address hash
  (one shared socket would let whichever worker wakes first accept a whole burst of connections). A
  worker's socket starts listening only once the worker's app has started (uvicorn calls ``listen()``
  after the lifespan), so no connection waits on a worker that is still loading its tokenizer.
- Each worker is ``python -m gateway.workers`` with the parent's validated settings (JSON in an
  environment variable) and its socket's file descriptor; it runs the same app as ``--workers 1``.
  Workers get a parent-death signal (``agentrl.procs.die_with``): if the supervisor is killed, even with
  SIGKILL, the kernel sends every worker SIGTERM, so no orphan keeps serving the port.
- A worker that dies after it was serving is started again (a new socket; the connections queued on the
  dead one are reset and clients reconnect to the others). A worker that dies before it ever served is a
  start-up failure (bad database URL, no engine): the supervisor stops the others and exits with its code.
- SIGTERM / SIGINT to the supervisor stop every worker gracefully (uvicorn drains, the lifecycle leader
  lets its lock go) and it exits 0.

What the workers share goes through PostgreSQL and Redis, as between replicas on different machines
(``GatewaySettings.validate`` refuses ``--workers > 1`` with SQLite or without Redis); the exceptions are
documented in ``docs/gateway.md`` ("Several workers"). Responses carry ``x-agentrl-worker: <index>`` when
there are several workers, so that a client (or a test) can see which one answered.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from agentrl.command import configure_logging
from agentrl.procs import die_with
from gateway.cli import LOG_FORMAT, QUIET
from gateway.settings import GatewaySettings

log = logging.getLogger("agentrl.gateway.workers")

CHILD_ENV = "AGENTRL_GATEWAY_WORKER_SPEC"  # JSON {index, fd, settings}; not a settings field
WORKER_HEADER = b"x-agentrl-worker"
RESTART_BACKOFF_S = 1.0
STOP_GRACE_S = 15.0  # uvicorn's graceful shutdown (5 s) plus the store's last flush
MALLOC_ARENAS = 2  # glibc malloc arenas of a serving process (gateway.memory)
TRIM_MEMORY_S = 20.0  # how often a serving process gives free heap pages back (gateway.memory)


def check_port_free(host: str, port: int) -> None:
    """Raise OSError if something already listens on ``host:port``. Binding without SO_REUSEPORT fails
    then, even against a listener that set SO_REUSEPORT itself (another gateway's workers), whose
    connections we would otherwise silently share."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, not yet listening (the worker listens when ready)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def is_listening(sock: socket.socket) -> bool:
    """Whether ``listen()`` was called on this socket (by the worker that shares it)."""
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    ready: bool = False


class Supervisor:
    """Starts ``settings.workers`` workers, restarts the ones that die, stops them all on SIGTERM/SIGINT."""

    def __init__(self, settings: GatewaySettings, *, poll_s: float = 0.2) -> None:
        self.settings = settings
        self.poll_s = poll_s
        self.workers: dict[int, Worker] = {}
        self.restarts = 0
        self._stopping = False

    def _start(self, index: int) -> Worker:
        sock = reuseport_socket(self.settings.host, self.settings.port)
        spec = {"index": index, "fd": sock.fileno(), "settings": dataclasses.asdict(self.settings)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.workers"], env={**os.environ, CHILD_ENV: json.dumps(spec)},
            pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL, preexec_fn=die_with(os.getpid()))
        worker = Worker(index, proc, sock)
        self.workers[index] = worker
        return worker

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stopping = True

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit code 0) or a worker's start-up failure (its exit code)."""
        s = self.settings
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        for index in range(s.workers):
            self._start(index)
        announced = False
        code = 0
        try:
            while not self._stopping:
                for worker in list(self.workers.values()):
                    rc = worker.proc.poll()
                    if rc is None:
                        if not worker.ready and is_listening(worker.sock):
                            worker.ready = True
                        continue
                    worker.sock.close()
                    if not worker.ready:
                        log.error("gateway worker %d exited with %s before it served; stopping", worker.index, rc)
                        code = rc or 1
                        self._stopping = True
                        break
                    log.warning("gateway worker %d (pid %d) exited with %s; starting it again",
                                worker.index, worker.proc.pid, rc)
                    self.restarts += 1
                    time.sleep(RESTART_BACKOFF_S)
                    self._start(worker.index)
                if not announced and all(w.ready for w in self.workers.values()):
                    announced = True
                    log.info("gateway: %d workers serving http://%s:%d (pids %s)", s.workers, s.host, s.port,
                             ", ".join(str(w.proc.pid) for w in self.workers.values()))
                time.sleep(self.poll_s)
        finally:
            self.stop()
        return code

    def stop(self) -> None:
        """SIGTERM every worker, SIGKILL those still running after STOP_GRACE_S."""
        for worker in self.workers.values():
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in self.workers.values():
            try:
                worker.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
            worker.sock.close()
        self.workers.clear()


class WorkerHeader:
    """ASGI middleware adding ``x-agentrl-worker: <index>`` to every response of a worker."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self.header = (WORKER_HEADER, str(index).encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def serve(settings: GatewaySettings, *, sock: socket.socket | None = None, index: int | None = None) -> None:
    """Run the gateway app in this process: on ``settings.host:port``, or on ``sock`` (a worker)."""
    import uvicorn

    from gateway.app import create_app
    from gateway.http_server import protocol
    from gateway.memory import limit_arenas

    limit_arenas(MALLOC_ARENAS)  # before the tokenizer's and the writers' threads start
    app: Any = create_app(settings, freeze_gc=True, trim_memory_s=TRIM_MEMORY_S)
    if index is not None:
        app = WorkerHeader(app, index)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=5, http=protocol(settings.header_timeout_s))
    server = uvicorn.Server(config)
    server.run(sockets=[sock] if sock is not None else None)
    if not server.started:
        sys.exit(3)  # uvicorn returns normally when the lifespan failed at start-up


def worker_main() -> None:
    """Entry point of one worker (``python -m gateway.workers``, started by :class:`Supervisor`)."""
    spec = json.loads(os.environ.pop(CHILD_ENV))
    settings = GatewaySettings(**spec["settings"])
    configure_logging(settings.log_level, LOG_FORMAT, QUIET)  # as `agentrl gateway` (gateway.cli) does
    sock = socket.socket(fileno=int(spec["fd"]))
    serve(settings, sock=sock, index=int(spec["index"]))


if __name__ == "__main__":
    worker_main()
