"""Shared fixtures: the tiny model directory, free ports, and per-test PostgreSQL/Redis isolation."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

try:
    import pytest_timeout
except ImportError:  # pragma: no cover - a dev dependency
    pytest_timeout = None

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


if pytest_timeout is not None:
    _dump_threads = pytest_timeout.dump_stacks

    def _dump_threads_and_tasks(terminal: Any) -> None:
        """pytest-timeout prints every thread's stack when a test runs out of time; an async test's hang is
        a task awaiting something, which a thread's stack does not show (the loop sits in ``select``), so
        the tasks of the loop it interrupted are printed too."""
        _dump_threads(terminal)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for task in asyncio.all_tasks(loop):
            terminal.sep("~", title=f"Task {task.get_name()}")
            terminal.write(f"{task!r}\n" + "".join(f"{line}\n" for line in _awaiting(task.get_coro())))

    pytest_timeout.dump_stacks = _dump_threads_and_tasks


def _awaiting(coro: Any) -> list[str]:
    """Where a suspended coroutine waits: its frame, then the frame of what it awaits, down the chain."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return lines


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from engine.models import tiny_dir

    return tiny_dir()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()


PG_ADMIN_URL = os.environ.get("AGENTRL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("AGENTRL_TEST_REDIS", "redis://127.0.0.1:6379/0")


async def pg_admin(sql: str, url: str = PG_ADMIN_URL) -> None:
    """One statement on the machine's PostgreSQL (by default as its admin: ``CREATE DATABASE``, ``DROP
    DATABASE``)."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextmanager
def pg_database(prefix: str = "agentrl_t_") -> Iterator[str]:
    """A fresh database on the machine's PostgreSQL (its asyncpg URL), dropped on exit; the test is
    skipped if there is no server."""
    asyncpg = pytest.importorskip("asyncpg")

    name = prefix + uuid.uuid4().hex[:12]
    try:
        asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError) as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc}")
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL database for one test (created and dropped here); skipped if no server."""
    with pg_database() as url:
        yield url


@pytest.fixture
def redis_prefix():
    """A unique key prefix for one test; every key under it is deleted afterwards."""
    redis = pytest.importorskip("redis")
    prefix = f"agentrl-test:{uuid.uuid4().hex[:12]}:"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:  # pragma: no cover
        pytest.skip(f"Redis not reachable at {REDIS_URL}: {exc}")
    yield prefix
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()
