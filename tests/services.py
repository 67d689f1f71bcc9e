"""Private servers for outage tests: a ``redis-server`` and a PostgreSQL cluster of the test's own, on free
ports, that a test may kill and start again without touching the machine's shared servers.

Import the fixtures into a test module to use them (``from tests.services import private_redis  # noqa:
F401 (fixture)``), or build a server directly where a test wants it outside a fixture."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import free_port


class PrivateRedis:
    """A ``redis-server`` without persistence on a free port; ``stop`` kills it (SIGKILL), so a restart
    comes back empty, as after a crash."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


class PrivatePostgres:
    """A PostgreSQL cluster of its own: ``initdb`` into a temporary directory, served on a free port with
    its socket in that directory. PostgreSQL refuses to run as root, so as root every command runs as the
    ``postgres`` OS user (``runuser``), which owns the directory."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="agentrl-pg-")
        self.data = os.path.join(self.dir, "data")
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            import pwd

            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run(pg_bin("initdb") or "initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync",
                  "-E", "UTF8")

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str) -> None:
        done = subprocess.run([*self.as_user, *argv], capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")

    def _pg_ctl(self, *args: str) -> None:
        self._run(pg_bin("pg_ctl") or "pg_ctl", "-D", self.data, "-l", os.path.join(self.dir, "log"), "-w",
                  "-t", "120", *args)

    def start(self) -> None:
        self._pg_ctl("-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self, mode: str = "fast") -> None:
        self._pg_ctl("-m", mode, "stop")

    def remove(self) -> None:
        try:
            self.stop("immediate")
        except RuntimeError:
            pass  # already stopped
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    if pg_bin("initdb") is None or pg_bin("pg_ctl") is None:
        pytest.skip("the PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.remove()
