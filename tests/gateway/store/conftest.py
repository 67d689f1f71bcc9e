"""Store fixtures: every store test runs on SQLite (tmp_path) and on the machine's PostgreSQL + Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from gateway.store import Store
from tests.conftest import REDIS_URL


@dataclass(frozen=True)
class Backend:
    name: str
    db_url: str
    redis_url: str | None
    redis_prefix: str

    async def open(self, **kwargs: object) -> Store:
        return await Store.open(self.db_url, redis_url=self.redis_url, redis_prefix=self.redis_prefix, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(params=["sqlite", pytest.param("pg_redis", marks=pytest.mark.services)])
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    if request.param == "sqlite":
        return Backend("sqlite", f"sqlite+aiosqlite:///{tmp_path}/store.db", None, "agentrl:")
    pg_url = request.getfixturevalue("pg_url")
    prefix = request.getfixturevalue("redis_prefix")
    return Backend("pg_redis", pg_url, REDIS_URL, prefix)


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[Store]:
    st = await backend.open()
    yield st
    await st.close()
