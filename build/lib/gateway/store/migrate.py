"""Apply the Alembic migrations in ``migrations/`` (``alembic upgrade head``) to a database URL.

Called by ``Store.open`` at start-up. Alembic's env.py drives an async engine with ``asyncio.run``, so the
upgrade runs in a worker thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
HEAD_REVISION_INITIAL = "0001_initial"
# Alembic keeps its running context in module globals: one upgrade at a time per process. Across
# processes, env.py takes a PostgreSQL advisory lock (SQLite serialises on its file lock).
_ALEMBIC_LOCK = threading.Lock()


def alembic_config(db_url: str) -> Config:
    """An Alembic config for ``migrations/`` targeting ``db_url`` (no alembic.ini needed)."""
    if not (MIGRATIONS_DIR / "env.py").exists():
        raise FileNotFoundError(f"Alembic migrations not found at {MIGRATIONS_DIR}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    cfg.attributes["url"] = db_url
    return cfg


def upgrade_sync(db_url: str, revision: str = "head") -> None:
    with _ALEMBIC_LOCK:
        command.upgrade(alembic_config(db_url), revision)


async def upgrade(db_url: str, revision: str = "head") -> None:
    """``alembic upgrade <revision>`` in a thread (env.py runs its own event loop)."""
    await asyncio.to_thread(upgrade_sync, db_url, revision)
