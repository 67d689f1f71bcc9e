"""Close an implicit group: ``POST /v1/groups/{id}/close`` for sessions created in implicit mode.

An agent that only knows a URL and a key (implicit mode) gets one session per root conversation, grouped
by root prompt and tools (``gateway.binding.group_of_root``) into groups of the default size; no group row
is admitted for them, so such a group waited for the group timeout (900 s) whenever fewer sessions than
the group size came, and ``close`` answered 404. A coding CLI run once is exactly that case.

Closing one seals it as it stands: a group row is written, closed, with the group's live sessions as its
places (all of them already charged, one by one, when they were created: nothing is given back). The
lifecycle then exports the sessions as one group as soon as they are finished. Later sessions of the same
root prompt are grouped by that size, a sealed row each time (as for any group a caller closed).
"""

from __future__ import annotations

import time

import sqlalchemy as sa

from gateway.store import schema
from gateway.store import GroupRecord
from gateway.store.rows import group_from_row

LIVE = ("active", "finished")


async def seal_implicit(store: object, group_id: str) -> GroupRecord | None:
    """Write a closed group row of the implicit group ``group_id``'s live sessions; None if it has none
    (or a row exists by now: the caller reads it)."""
    s, g = schema.sessions, schema.groups
    async with store.write_transaction() as conn:  # type: ignore[attr-defined]
        if (await conn.execute(sa.select(g.c.id).where(g.c.id == group_id))).first() is not None:
            return None
        live = int((await conn.execute(sa.select(sa.func.count()).select_from(s).where(
            s.c.group_id == group_id, s.c.status.in_(LIVE)))).scalar_one())
        if live == 0:
            return None
        row = {"id": group_id, "size": live, "places": live, "created": live, "status": "closed",
               "task_id": None, "meta": {"implicit": True}, "created_at": time.time()}
        await conn.execute(sa.insert(g).values(**row))
    return group_from_row(row)
