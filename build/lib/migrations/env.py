"""Alembic environment for the conversation store (async drivers: aiosqlite, asyncpg).

The URL comes from, in order: ``config.attributes["url"]`` (set by ``gateway.store.migrate``), the
``AGENTRL_DB_URL`` environment variable, or ``sqlalchemy.url`` in alembic.ini. On PostgreSQL the
upgrade holds an advisory lock, so gateway replicas starting together migrate one at a time.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

config = context.config
_MIGRATION_LOCK = 0x61676E74  # arbitrary constant shared by every agentrl gateway


def _url() -> str:
    url = config.attributes.get("url") or os.environ.get("AGENTRL_DB_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: set AGENTRL_DB_URL or pass the URL to gateway.store.migrate")
    return url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=None, literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    is_pg = connection.dialect.name == "postgresql"
    if is_pg:
        connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _MIGRATION_LOCK})
        connection.commit()
    try:
        context.configure(connection=connection, target_metadata=None, render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()
    finally:
        if is_pg:
            connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _MIGRATION_LOCK})
            connection.commit()


async def run_migrations_online() -> None:
    engine = create_async_engine(_url(), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
