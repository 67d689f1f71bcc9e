"""Browsing sessions for people (the trace viewer): filtered pages, newest first, and counts per status.

Pages use keyset pagination on ``(created_at, id)``: a cursor names the last session of the previous
page and the next page is ``WHERE (created_at, id) < (cursor) ORDER BY created_at DESC, id DESC LIMIT n``,
one index range scan whatever the page number (``ix_sessions_created_id``; with a status filter
``ix_sessions_status_created``; with a group filter ``ix_sessions_group_id``). OFFSET would read and
throw away every earlier row. ``tests/gateway/store/test_browse.py`` checks the plans with EXPLAIN on
PostgreSQL over 100k sessions.

    page = await sessions_page(store, filters=SessionFilter(status=("finished",)), limit=50)
    more = await sessions_page(store, filters=..., limit=50, cursor=page.next_cursor)

Cursors are opaque strings (``created_at`` as its exact float repr and the id, base64url); a malformed
one raises ``InvalidValue``. Written for any read-only list of sessions (the viewer's, and a public
``GET /v1/sessions`` if one is added).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.store import schema
from gateway.store.api import Store
from gateway.store.errors import InvalidValue
from gateway.store.records import SESSION_STATUSES, SessionRecord
from gateway.store.rows import session_from_row

MAX_PAGE = 500


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionFilter:
    """Which sessions to list. Every field is optional; all given ones must hold."""

    status: tuple[str, ...] = ()  # any of these statuses
    group_id: str | None = None
    created_from: float | None = None  # created_at >= this (unix seconds)
    created_to: float | None = None  # created_at < this
    min_reward: float | None = None  # the session-level reward, >= (sessions without one are left out)
    max_reward: float | None = None  # <=

    def __post_init__(self) -> None:
        bad = [s for s in self.status if s not in SESSION_STATUSES]
        if bad:
            raise InvalidValue(f"unknown session status {bad[0]!r}; valid: {', '.join(SESSION_STATUSES)}")
        for name in ("created_from", "created_to", "min_reward", "max_reward"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidValue(f"{name} must be a finite number, got {value!r}")

    def where(self, *, with_status: bool = True) -> list[sa.ColumnElement[bool]]:
        s = schema.sessions
        out: list[sa.ColumnElement[bool]] = []
        if with_status and self.status:
            out.append(s.c.status == self.status[0] if len(self.status) == 1 else s.c.status.in_(self.status))
        if self.group_id is not None:
            out.append(s.c.group_id == self.group_id)
        if self.created_from is not None:
            out.append(s.c.created_at >= self.created_from)
        if self.created_to is not None:
            out.append(s.c.created_at < self.created_to)
        if self.min_reward is not None:
            out.append(s.c.reward >= self.min_reward)
        if self.max_reward is not None:
            out.append(s.c.reward <= self.max_reward)
        return out


@dataclass(slots=True)
class SessionPage:
    sessions: list[SessionRecord]
    next_cursor: str | None  # None on the last page
    turns: dict[str, int] = field(default_factory=dict)  # recorded turns per listed session


def encode_cursor(created_at: float, session_id: str) -> str:
    raw = json.dumps([repr(created_at), session_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """``(created_at, id)`` of a cursor from :func:`encode_cursor`; InvalidValue if it is not one."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, sid = json.loads(raw)
        value = float(created)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise InvalidValue("malformed cursor: pass back the next_cursor of a previous page") from None
    if not isinstance(sid, str) or not math.isfinite(value):
        raise InvalidValue("malformed cursor: pass back the next_cursor of a previous page")
    return value, sid


def page_query(filters: SessionFilter, *, limit: int, cursor: str | None = None) -> sa.Select[tuple[object, ...]]:
    """The SQL of one page (``limit + 1`` rows: the extra one tells whether a next page exists)."""
    s = schema.sessions
    query = sa.select(s).where(*filters.where()).order_by(s.c.created_at.desc(), s.c.id.desc()).limit(limit + 1)
    if cursor is not None:
        created, sid = decode_cursor(cursor)
        query = query.where(sa.tuple_(s.c.created_at, s.c.id) < sa.tuple_(sa.literal(created), sa.literal(sid)))
    return query


async def sessions_page(
    store: Store, *, filters: SessionFilter, limit: int = 50, cursor: str | None = None
) -> SessionPage:
    """One page of sessions, newest first, with the number of recorded turns of each."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidValue(f"limit must be between 1 and {MAX_PAGE}, got {limit}")
    query = page_query(filters, limit=limit, cursor=cursor)
    async with store.read_connection() as conn:
        rows = (await conn.execute(query)).mappings().all()
        sessions = [session_from_row(row) for row in rows[:limit]]
        turns = await _turn_counts(conn, [x.id for x in sessions])
    last = sessions[-1] if len(rows) > limit else None
    return SessionPage(sessions=sessions, next_cursor=encode_cursor(last.created_at, last.id) if last else None,
                       turns=turns)


async def _turn_counts(conn: AsyncConnection, session_ids: Sequence[str]) -> dict[str, int]:
    if not session_ids:
        return {}
    i = schema.interactions
    query = sa.select(i.c.session_id, sa.func.count()).where(i.c.session_id.in_(list(session_ids))).group_by(i.c.session_id)
    rows = (await conn.execute(query)).all()
    return {sid: int(n) for sid, n in rows}


async def status_counts(store: Store, *, filters: SessionFilter) -> dict[str, int]:
    """How many sessions match ``filters`` (its status filter ignored), by status; every status listed."""
    s = schema.sessions
    query = sa.select(s.c.status, sa.func.count()).where(*filters.where(with_status=False)).group_by(s.c.status)
    async with store.read_connection() as conn:
        rows = (await conn.execute(query)).all()
    counts = dict.fromkeys(SESSION_STATUSES, 0)
    counts.update({status: int(n) for status, n in rows})
    return counts
