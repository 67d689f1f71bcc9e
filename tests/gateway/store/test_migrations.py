"""Alembic: the migration builds exactly the tables the queries use; errors at open are clear."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.store import InvalidValue, Store, StoreUnavailable
from gateway.store.migrate import alembic_config
from gateway.store.schema import metadata
from tests.conftest import REDIS_URL

REPO = Path(__file__).resolve().parents[3]


async def _diff(url: str) -> list:
    """Differences between ``schema.py`` and the migrated database, for the store's own tables (later
    revisions add tables owned by other modules)."""

    def mine(name: str | None, type_: str, _parents: dict) -> bool:
        return type_ != "table" or name in metadata.tables

    opts = {"include_name": mine}
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c, opts=opts), metadata))
    finally:
        await engine.dispose()


async def test_schema_matches_migration_sqlite(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/m.db"
    store = await Store.open(url)
    await store.close()
    assert await _diff(url) == []


@pytest.mark.services
async def test_schema_matches_migration_postgres(pg_url: str) -> None:
    store = await Store.open(pg_url)
    await store.close()
    assert await _diff(pg_url) == []


def test_downgrade_and_cli(tmp_path: Path) -> None:
    """``alembic upgrade head`` from the repo root (alembic.ini), then a full downgrade and back."""
    db = tmp_path / "cli.db"
    url = f"sqlite+aiosqlite:///{db}"
    env = {**os.environ, "AGENTRL_DB_URL": url}
    alembic_bin = Path(sys.executable).with_name("alembic")
    subprocess.run([str(alembic_bin), "-c", "alembic.ini", "upgrade", "head"], cwd=REPO, env=env, check=True, timeout=120)
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    assert _current(db) == head  # later revisions (0002_trajectories, ...) sit on top of 0001_initial
    command.downgrade(alembic_config(url), "base")
    assert _current(db) is None
    command.upgrade(alembic_config(url), "0001_initial")
    assert _current(db) == "0001_initial"


def _current(path: Path) -> str | None:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    return rows[0][0] if rows else None


async def test_bad_urls(tmp_path: Path) -> None:
    with pytest.raises(InvalidValue):
        await Store.open("mysql://nobody@localhost/db")
    with pytest.raises(InvalidValue):
        await Store.open("sqlite+aiosqlite://")
    with pytest.raises(StoreUnavailable):
        await Store.open("postgresql+asyncpg://postgres@127.0.0.1:1/none")
    with pytest.raises(StoreUnavailable):
        await Store.open(f"sqlite+aiosqlite:///{tmp_path}/r.db", redis_url="redis://127.0.0.1:1/0")


@pytest.mark.services
async def test_plain_postgres_url_is_accepted(pg_url: str) -> None:
    store = await Store.open(pg_url.replace("postgresql+asyncpg://", "postgresql://"), redis_url=REDIS_URL)
    try:
        assert (await store.create_session()).status == "active"
    finally:
        await store.close()


async def test_unmigrated_database_is_reported(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="no such table|tables are missing"):
        await Store.open(f"sqlite+aiosqlite:///{tmp_path}/empty.db", migrate=False)
