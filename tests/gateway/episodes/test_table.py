"""``episode_threads`` as Alembic ``0006`` builds it equals what ``gateway.episodes.table`` queries."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.episodes.table import metadata
from gateway.store import Store


async def _diff(url: str) -> list:
    def mine(name: str | None, type_: str, _parents: dict) -> bool:
        return type_ != "table" or name in metadata.tables

    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda c: compare_metadata(
                MigrationContext.configure(c, opts={"include_name": mine}), metadata))
    finally:
        await engine.dispose()


async def test_table_matches_migration_sqlite(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/m.db"
    await (await Store.open(url)).close()
    assert await _diff(url) == []


async def test_table_matches_migration_postgres(pg_url: str) -> None:
    await (await Store.open(pg_url)).close()
    assert await _diff(pg_url) == []
