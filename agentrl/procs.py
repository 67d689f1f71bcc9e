"""Child processes for `agentrl up` and the tests: start, wait until healthy, always stop.

Every child runs in its own process session so that stopping it also stops whatever it started (torchrun's
workers, uvicorn's). `Processes` is a context manager: leaving it — normally, on an error, or on Ctrl-C —
terminates every child (SIGTERM, then SIGKILL after a grace period).

A supervisor killed hard (SIGKILL from a CI timeout or the OOM killer) runs no ``__exit__``, so on Linux
every child also gets a parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, set between fork and
exec): the kernel sends it SIGTERM when the supervisor dies, whatever ended it, and the child stops its
own children as on a normal stop. The signal fires when the *thread* that started the child ends, so it
is set only for children started from the main thread (elsewhere, and on other systems, children are
stopped only by ``stop_all``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child SIGTERM when ``parent_pid`` dies (Linux, main thread only; also
    used by ``agentrl gateway --workers``)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl: nobody would send the signal
            os._exit(1)

    return preexec


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it), for a child to bind."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def flags(**options: object) -> list[str]:
    """Command-line flags for a child, each as one ``--name=value`` word (``admin_key`` -> ``--admin-key=...``).

    One word per flag, because argparse reads a separate value that starts with ``-`` as the next option
    (``--admin-key -x..`` fails with "expected one argument"); ``--name=value`` is never read that way.
    None is left out, a bool is ``--name`` / ``--no-name``, a list repeats the flag once per item.
    """
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            out += [f"{flag}={item}" for item in value]
        else:
            out.append(f"{flag}={value}")
    return out


class ChildFailed(RuntimeError):
    """A child process exited or never became healthy; the message names its log file."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Processes:
    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], *, env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
            preexec_fn=die_with(os.getpid()),
        )
        log.close()
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def start_agentrl(self, name: str, args: list[str], **kw) -> Child:
        return self.start(name, [sys.executable, "-m", "agentrl", *args], **kw)

    def wait_healthy(self, child: Child, url: str, *, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise ChildFailed(f"{child.name} exited with {child.proc.returncode}; log {child.log_path}:\n{child.tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise ChildFailed(f"{child.name} not healthy at {url} after {timeout_s:.0f}s; log {child.log_path}:\n{child.tail()}")

    def check_alive(self) -> None:
        for child in self.children:
            if child.proc.poll() is not None:
                raise ChildFailed(f"{child.name} exited with {child.proc.returncode}; log {child.log_path}:\n{child.tail()}")

    def stop_all(self, grace_s: float = 10.0) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                try:
                    os.killpg(child.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.proc.wait()
        self.children.clear()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
