"""The ``episode_threads`` table: one row per thread segment of an episode, with its typed edge.

Created by Alembic revision ``0006_episode_threads`` (a test compares the two). Kept out of
``gateway.store.schema`` on purpose: the turns stay where they are (each turn's own thread label is recorded
with its request, ``request["episode"]``, in the turn's commit); this table adds what no single turn holds:
which client run an implicit session is (``episode_key``), where each thread segment starts and how it joins
the rest (``edge``: ``spawned_by`` / ``compacted_from``), and whether that link was confirmed, guessed
nothing, or could not be made (``status``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from gateway.store.schema import sessions

metadata = sa.MetaData()

episode_threads = sa.Table(
    "episode_threads",
    metadata,
    sa.Column("session_id", sa.String(64), sa.ForeignKey(sessions.c.id, ondelete="CASCADE"), primary_key=True),
    sa.Column("thread", sa.String(255), primary_key=True),
    sa.Column("segment", sa.String(64), primary_key=True),
    sa.Column("client", sa.String(32), nullable=False),
    sa.Column("episode_key", sa.String(255), nullable=True),
    sa.Column("owner", sa.String(64), nullable=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("first_turn", sa.String(64), nullable=False),
    sa.Column("edge", sa.String(16), nullable=True),
    sa.Column("from_thread", sa.String(255), nullable=True),
    sa.Column("from_segment", sa.String(64), nullable=True),
    sa.Column("from_turn", sa.String(64), nullable=True),
    sa.Column("from_call", sa.String(255), nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("detail", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Index("ix_episode_threads_key", "episode_key", "owner"),
)

# status values
ROOT = "root"  # the episode's first thread: nothing to link
LINKED = "linked"  # linked at its first turn by the client's signals, not confirmed (yet)
CONFIRMED = "confirmed"  # a later request named the same link (tool result's agent id, summary text)
UNLINKED = "unlinked"  # no link could be made: shown and counted, never guessed
CONTRADICTED = "contradicted"  # a later request named another call than the one linked first


@dataclass(slots=True)
class ThreadRow:
    session_id: str
    thread: str
    segment: str
    client: str
    kind: str  # "main" | "subagent"
    first_turn: str
    status: str
    episode_key: str | None = None
    owner: str | None = None
    edge: str | None = None  # "spawned_by" | "compacted_from"
    from_thread: str | None = None
    from_segment: str | None = None
    from_turn: str | None = None
    from_call: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {c.name: getattr(self, c.name) for c in episode_threads.columns}


def row_of(mapping: Any) -> ThreadRow:
    return ThreadRow(**{c.name: mapping[c.name] for c in episode_threads.columns})


async def session_threads(store: Any, session_id: str) -> list[ThreadRow]:
    t = episode_threads
    async with store.read_connection() as conn:
        rows = (await conn.execute(sa.select(t).where(t.c.session_id == session_id)
                                   .order_by(t.c.created_at))).mappings().all()
    return [row_of(r) for r in rows]


async def threads_of(store: Any, session_ids: list[str]) -> dict[str, list[ThreadRow]]:
    """The thread rows of several sessions (export, the UI), by session."""
    out: dict[str, list[ThreadRow]] = {sid: [] for sid in session_ids}
    if not session_ids:
        return out
    t = episode_threads
    async with store.read_connection() as conn:
        rows = (await conn.execute(sa.select(t).where(t.c.session_id.in_(session_ids))
                                   .order_by(t.c.created_at))).mappings().all()
    for r in rows:
        out[r["session_id"]].append(row_of(r))
    return out


async def session_of_episode(store: Any, episode_key: str, owner: str | None) -> str | None:
    """The newest session recorded for a client's run id under this owner (implicit mode)."""
    t = episode_threads
    query = sa.select(t.c.session_id).where(t.c.episode_key == episode_key)
    query = query.where(t.c.owner.is_(None) if owner is None else t.c.owner == owner)
    async with store.read_connection() as conn:
        found = (await conn.execute(query.order_by(t.c.created_at.desc()).limit(1))).first()
    return None if found is None else str(found[0])


async def insert(store: Any, row: ThreadRow) -> bool:
    """Insert a thread row; False if that (session, thread, segment) is there already (another replica)."""
    t = episode_threads
    async with store.write_transaction() as conn:
        exists = (await conn.execute(sa.select(t.c.session_id).where(
            t.c.session_id == row.session_id, t.c.thread == row.thread, t.c.segment == row.segment))).first()
        if exists is not None:
            return False
        await conn.execute(sa.insert(t).values(**row.as_dict()))
    return True


async def update(store: Any, row: ThreadRow, **values: Any) -> None:
    t = episode_threads
    async with store.write_transaction() as conn:
        await conn.execute(sa.update(t).where(t.c.session_id == row.session_id, t.c.thread == row.thread,
                                              t.c.segment == row.segment).values(**values))
    for key, value in values.items():
        setattr(row, key, value)
