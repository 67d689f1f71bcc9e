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


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup --no-loadscope-reorder`, see the
# Makefile). A module's tests stay on one worker (its module fixtures are built once); the tests over the shared
# vLLM server (tests/vllm/conftest.py's session fixture) form one group, so one worker starts it; the groups that
# start a vLLM server go out first, then the modules with slow tests, so that no long group starts last.
SHARED_VLLM_SERVER = ("tests/vllm/test_live_vllm.py", "tests/gateway/test_vllm_client.py")


def xdist_group(item: pytest.Item) -> str:
    path = Path(str(item.fspath)).resolve().relative_to(REPO).as_posix()
    return "vllm-server" if path in SHARED_VLLM_SERVER else path


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a plain run keeps the collection's order
    groups = {id(item): xdist_group(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    slow = {groups[id(item)] for item in items if item.get_closest_marker("slow")}

    def rank(group: str) -> int:
        return 0 if group == "vllm-server" or group.startswith("tests/vllm/") else 1 if group in slow else 2

    items.sort(key=lambda item: rank(groups[id(item)]))  # stable: each group keeps its order


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
