"""Shared fixtures: the tiny model directory, free ports, and per-test PostgreSQL/Redis isolation."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


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


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL database for one test (created and dropped here); skipped if no server."""
    asyncpg = pytest.importorskip("asyncpg")
    import asyncio

    name = "agentrl_t_" + uuid.uuid4().hex[:12]

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    try:
        asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError) as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc}")
    yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


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
