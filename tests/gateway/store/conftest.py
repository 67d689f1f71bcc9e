"""Store fixtures: every store test runs on SQLite (tmp_path) and on the machine's PostgreSQL + Redis.

Creating and dropping a PostgreSQL database costs seconds on this machine, so the parametrised ``store``
tests share one migrated database for the whole run and empty its tables before each test; tests that
need a fresh database (migrations, two processes) take the shared ``pg_url`` fixture instead.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.store import Store
from gateway.store.migrate import upgrade_sync
from tests.conftest import REDIS_URL, pg_admin, pg_database


@dataclass(frozen=True)
class Backend:
    name: str
    db_url: str
    redis_url: str | None
    redis_prefix: str

    async def open(self, **kwargs: object) -> Store:
        return await Store.open(self.db_url, redis_url=self.redis_url, redis_prefix=self.redis_prefix, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def shared_pg_url() -> Iterator[str]:
    """One migrated PostgreSQL database for all store tests of the run (dropped at the end)."""
    with pg_database("agentrl_store_") as url:
        upgrade_sync(url)
        yield url


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, copied for each test (cheaper than migrating every time)."""
    path = tmp_path_factory.mktemp("store-template") / "template.db"
    upgrade_sync(f"sqlite+aiosqlite:///{path}")
    return path


@pytest.fixture(params=["sqlite", pytest.param("pg_redis", marks=pytest.mark.services)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        shutil.copy(request.getfixturevalue("sqlite_template"), tmp_path / "store.db")
        return Backend("sqlite", f"sqlite+aiosqlite:///{tmp_path}/store.db", None, "agentrl:")
    url: str = request.getfixturevalue("shared_pg_url")
    asyncio.run(pg_admin("TRUNCATE reward_events, interactions, sessions CASCADE", url.replace("+asyncpg", "")))
    prefix = request.getfixturevalue("redis_prefix")
    return Backend("pg_redis", url, REDIS_URL, prefix)


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[Store]:
    st = await backend.open()
    yield st
    await st.close()


@pytest.fixture
async def pg_store(shared_pg_url: str) -> AsyncIterator[Store]:
    """A store on the shared PostgreSQL database, without Redis (tests that reach into its writer)."""
    st = await Store.open(shared_pg_url, migrate=False)
    yield st
    await st.close()
