"""Sessions and groups: one session per agent episode, a group admitted as a whole (``gateway.groups``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Awaitable, Callable

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.store import schema
from gateway.store.caches import CachesPart
from gateway.store.errors import Conflict, InvalidValue, NotFound
from gateway.store.records import SESSION_STATUSES, GroupRecord, SessionRecord, SessionStatus
from gateway.store.rows import group_from_row, hash_key, new_session_row, session_from_row


MOVE_BATCH = 500  # sessions per transaction in Store.move_sessions (and per query of Store.rewarded)


class SessionsPart(CachesPart):
    """Sessions and the groups admitted as a whole: create, read, move between statuses, list."""

    async def create_session(
        self,
        *,
        group_id: str | None = None,
        task_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> SessionRecord:
        """Create an active session with a fresh random api key (returned here only, kept hashed).

        ``group_id`` defaults to the session id (a group of one). ``is_eval`` = ``metadata["eval"] is True``.
        ``session_id`` may be given (implicit episodes); a duplicate raises Conflict.
        """
        row, api_key = new_session_row(group_id=group_id, task_id=task_id, metadata=metadata,
                                        session_id=session_id)
        try:
            async with self._write_tx() as conn:
                await conn.execute(sa.insert(schema.sessions).values(**row))
        except Conflict as exc:
            raise Conflict(f"session {row['id']} already exists") from exc
        return (await self._cache_new_sessions([(row, api_key)]))[0]

    async def create_group(
        self, *, group_id: str | None, size: int, task_id: str | None = None, metadata: dict[str, Any] | None = None
    ) -> tuple[GroupRecord, list[SessionRecord]]:
        """A group and all ``size`` of its sessions, in one transaction. Conflict if the group id is taken
        (by a group or by any session)."""
        if size < 1:
            raise InvalidValue(f"group size must be >= 1, got {size}")
        gid = group_id or f"grp-{uuid.uuid4().hex}"
        meta = dict(metadata or {})
        g, s = schema.groups, schema.sessions
        now = time.time()
        group_row = {"id": gid, "size": size, "places": size, "created": size, "status": "open",
                     "task_id": task_id, "meta": meta, "created_at": now}
        made = [new_session_row(group_id=gid, task_id=task_id, metadata={**meta, "group_size": size})
                for _ in range(size)]
        async with self._write_tx() as conn:
            taken = (await conn.execute(sa.select(s.c.id).where(s.c.group_id == gid).limit(1))).first()
            if taken is not None:
                raise Conflict(f"group {gid} already exists")
            try:
                await conn.execute(sa.insert(g).values(**group_row))
            except Conflict as exc:
                raise Conflict(f"group {gid} already exists") from exc
            await conn.execute(sa.insert(s), [row for row, _ in made])
        return group_from_row(group_row), await self._cache_new_sessions(made)

    async def join_group(
        self, *, group_id: str, size: int, task_id: str | None = None, metadata: dict[str, Any] | None = None,
        charge: Callable[[AsyncConnection, int], Awaitable[int]] | None = None,
    ) -> SessionRecord | None:
        """A new session in a free place of group ``group_id``; ONE transaction decides.

        With a place free, the session takes it (nothing is charged). With none (no group row yet, every
        place taken, or the group closed) and no ``charge``: None, nothing changed. Otherwise the group gets
        a new batch of places (``size`` for a new row, the row's own size after that), paid for by
        ``await charge(conn, places)`` on this transaction's connection (the staleness budget lives in the
        same database), so the charge commits or rolls back with the places: an exception from ``charge``
        (a 429) leaves nothing changed. The group row is locked (PostgreSQL ``FOR UPDATE``; SQLite has one
        writer), so of concurrent first sessions exactly one charges and the others take its places.
        Conflict when two callers insert the same new group row at once (PostgreSQL): the loser's
        transaction is rolled back whole, charge included; retry and it finds the row."""
        g, s = schema.groups, schema.sessions
        row, api_key = new_session_row(group_id=group_id, task_id=task_id, metadata=metadata)
        async with self._write_tx() as conn:
            query = sa.select(g).where(g.c.id == group_id)
            query = self._backend.lock(query)
            found = (await conn.execute(query)).mappings().first()
            current = group_from_row(found) if found is not None else None
            if current is not None and not current.sealed:
                values: dict[str, Any] = {"created": current.created + 1}
            elif charge is None:
                return None
            else:
                if current is None:
                    new = {"id": group_id, "size": size, "places": 0, "created": 0, "status": "open",
                           "task_id": task_id, "meta": dict(metadata or {}), "created_at": time.time()}
                    # inserted before the charge: a concurrent creator of the same id waits on this row
                    # (PostgreSQL) and then fails with Conflict instead of charging too
                    await conn.execute(sa.insert(g).values(**new))
                    current = group_from_row(new)
                await charge(conn, current.size)
                values = {"places": current.created + current.size, "status": "open", "created": current.created + 1}
            await conn.execute(sa.update(g).where(g.c.id == group_id).values(**values))
            await conn.execute(sa.insert(s).values(**row))
        return (await self._cache_new_sessions([(row, api_key)]))[0]

    async def get_groups(self, *, group_ids: Collection[str]) -> dict[str, GroupRecord]:
        """The admitted groups among ``group_ids`` (ids without a group row are left out)."""
        ids = list(set(group_ids))
        if not ids:
            return {}
        g = schema.groups
        async with self._read() as conn:
            rows = (await conn.execute(sa.select(g).where(g.c.id.in_(ids)))).mappings().all()
        return {row["id"]: group_from_row(row) for row in rows}

    async def open_groups(self, *, created_before: float) -> list[GroupRecord]:
        """Open groups with places never taken, created before ``created_before`` (for the lifecycle to
        close when none of their sessions is left)."""
        g = schema.groups
        query = sa.select(g).where(g.c.status == "open", g.c.created < g.c.places, g.c.created_at < created_before)
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [group_from_row(row) for row in rows]

    async def close_group(self, *, group_id: str, status: str) -> int:
        """Move an open group to ``status`` (``closed`` or ``abandoned``) and return its unused places
        (reserved, never created), which the caller gives back to the budget; 0 if it was not open."""
        g = schema.groups
        async with self._write_tx() as conn:
            query = sa.select(g).where(g.c.id == group_id)
            query = self._backend.lock(query)
            found = (await conn.execute(query)).mappings().first()
            if found is None or found["status"] != "open":
                return 0
            await conn.execute(sa.update(g).where(g.c.id == group_id)
                               .values(status=status, places=found["created"]))
        return int(found["places"] - found["created"])

    async def get_session(self, *, session_id: str, cached: bool = False) -> SessionRecord:
        """The session as stored in SQL (authoritative). NotFound if unknown.

        ``cached=True`` (the implicit-mode hot path, which only needs its status and owner): without
        Redis, a record this process read or changed before, kept until a status or reward change made
        through this store (``last_activity_at`` may lag). Other processes' changes are not seen; the
        group-commit writer refuses a turn of a session that is no longer active in its transaction. With
        Redis, the record cached by id (``sid:<id>``, written with every status or reward change, ordered by
        ``version``; ``last_activity_at`` may lag)."""
        if cached and self._local:
            record = self._sessions.get(session_id)
            if record is not None:
                self._sessions.move_to_end(session_id)
                return record
        if cached and self._redis is not None:
            found = await self._redis.get_session_by_id(session_id)
            if found is not None:
                return found
        async with self._read() as conn:
            row = (await conn.execute(sa.select(schema.sessions).where(schema.sessions.c.id == session_id))).mappings().first()
        if row is None:
            raise NotFound(f"unknown session {session_id}")
        record = session_from_row(row)
        if cached and self._local:
            self._remember(self._sessions, session_id, record)
        if cached and self._redis is not None:
            await self._redis.put_session(row["key_hash"], record)
        return record

    async def get_session_by_key(self, *, api_key: str) -> SessionRecord:
        """The session whose api key this is (the gateway's auth path; Redis-cached when Redis is on).

        ``status``, ``reward`` and ids are exact (writes go through to the cache, ordered by
        ``version``); ``last_activity_at`` of a cached record may lag. NotFound if no session has it.
        """
        key_hash = hash_key(api_key)
        if self._redis is not None:
            cached = await self._redis.get_session(key_hash)
            if cached is not None:
                self._remember(self._key_sessions, key_hash, cached.id)
                return cached
        row = await self._backend.session_row_by_key(key_hash)
        if row is None:
            raise NotFound("no session has this api key")
        record = session_from_row(row)
        if self._redis is not None:
            self._remember(self._key_sessions, key_hash, record.id)
            await self._redis.put_session(key_hash, record)
        return record

    async def finish_session(self, *, session_id: str) -> SessionRecord:
        """Mark an active session finished (sets ``finished_at``). Idempotent: a session that is already
        finished, consumed or abandoned is returned unchanged. NotFound if unknown."""
        return await self._change_session(session_id=session_id, status="finished", expected=None, only_from_active=True)

    async def set_session_status(
        self,
        *,
        session_id: str,
        status: SessionStatus,
        expected: Collection[str] | None = None,
    ) -> SessionRecord:
        """Set the status (compare-and-set when ``expected`` is given: Conflict unless the current status
        is in it). Moving to "finished" sets ``finished_at`` if unset. NotFound; InvalidValue for an
        unknown status."""
        if status not in SESSION_STATUSES:
            raise InvalidValue(f"unknown session status {status!r}; valid: {', '.join(SESSION_STATUSES)}")
        return await self._change_session(session_id=session_id, status=status, expected=expected, only_from_active=False)

    async def _change_session(
        self, *, session_id: str, status: str, expected: Collection[str] | None, only_from_active: bool
    ) -> SessionRecord:
        s = schema.sessions
        async with self._write_tx() as conn:
            query = sa.select(s).where(s.c.id == session_id)
            query = self._backend.lock(query)
            row = (await conn.execute(query)).mappings().first()
            if row is None:
                raise NotFound(f"unknown session {session_id}")
            current = session_from_row(row)
            if expected is not None and current.status not in expected:
                raise Conflict(f"session {session_id} is {current.status}, expected one of {sorted(expected)}")
            if current.status == status or (only_from_active and current.status != "active"):
                return current
            values = _status_change(row, status)
            await conn.execute(sa.update(s).where(s.c.id == session_id).values(**values))
        updated = session_from_row({**row, **values})
        await self._recache([(row["key_hash"], updated)])
        return updated

    async def move_sessions(
        self, *, session_ids: Sequence[str], status: SessionStatus, expected: Collection[str],
    ) -> list[SessionRecord]:
        """Move each of ``session_ids`` that is currently in ``expected`` to ``status``, each on its own
        (one in another status, or unknown, is left as it is: unlike :meth:`claim_sessions`, not all or
        none), ``MOVE_BATCH`` sessions per transaction and one ``UPDATE`` each; the records moved. For the
        lifecycle, which abandons or finishes many sessions at a time: one transaction per session cost
        more than the turns that made them (a single-turn agent leaves one session per request)."""
        if status not in SESSION_STATUSES:
            raise InvalidValue(f"unknown session status {status!r}; valid: {', '.join(SESSION_STATUSES)}")
        s = schema.sessions
        ids = list(dict.fromkeys(session_ids))
        moved: list[tuple[str, SessionRecord]] = []
        for start in range(0, len(ids), MOVE_BATCH):
            part = ids[start:start + MOVE_BATCH]
            now = time.time()
            async with self._write_tx() as conn:
                query = sa.select(s).where(s.c.id.in_(part), s.c.status.in_(list(expected))).order_by(s.c.id)
                query = self._backend.lock(query)
                rows = (await conn.execute(query)).mappings().all()
                if not rows:
                    continue
                await conn.execute(sa.update(s).where(s.c.id.in_([row["id"] for row in rows]))
                                   .values(**_status_update(status, now)))
            moved += [(row["key_hash"], session_from_row({**row, **_status_change(row, status, now)})) for row in rows]
        await self._recache(moved)
        return [record for _, record in moved]

    async def claim_sessions(
        self, *, session_ids: Sequence[str], status: SessionStatus, expected: Collection[str],
        versions: Mapping[str, int] | None = None,
        then: Callable[[AsyncConnection], Awaitable[None]] | None = None,
    ) -> list[SessionRecord]:
        """Move several sessions to ``status`` in one transaction, all or none: Conflict (and nothing
        changed) unless every one of them is currently in ``expected`` (and, with ``versions``, still at
        that version: nothing changed since the caller read it); NotFound for an unknown id. ``then(conn)``
        runs inside the same transaction after the claim (export enqueues the group there, so a group is
        claimed and queued together or not at all). This is how a GRPO group is claimed for export, so two
        exporters can never split a group between them."""
        if status not in SESSION_STATUSES:
            raise InvalidValue(f"unknown session status {status!r}; valid: {', '.join(SESSION_STATUSES)}")
        s = schema.sessions
        ids = list(dict.fromkeys(session_ids))
        async with self._write_tx() as conn:
            query = sa.select(s).where(s.c.id.in_(ids)).order_by(s.c.id)
            query = self._backend.lock(query)
            rows = {row["id"]: row for row in (await conn.execute(query)).mappings().all()}
            missing = [i for i in ids if i not in rows]
            if missing:
                raise NotFound(f"unknown session(s) {missing}")
            wrong = {i: rows[i]["status"] for i in ids if rows[i]["status"] not in expected}
            if wrong:
                raise Conflict(f"sessions not in {sorted(expected)}: {wrong}")
            moved = {i: rows[i]["version"] for i in ids if versions is not None and rows[i]["version"] != versions.get(i)}
            if moved:
                raise Conflict(f"sessions changed since they were read: {moved}")
            now = time.time()
            await conn.execute(sa.update(s).where(s.c.id.in_(ids)).values(**_status_update(status, now)))
            updated = [(rows[i]["key_hash"], session_from_row({**rows[i], **_status_change(rows[i], status, now)}))
                       for i in ids]
            if then is not None:
                await then(conn)
        await self._recache(updated)
        return [record for _, record in updated]

    async def list_sessions(
        self,
        *,
        status: str | Collection[str] | None = None,
        group_id: str | None = None,
        limit: int | None = None,
        after: tuple[float, str] | None = None,
    ) -> list[SessionRecord]:
        """Sessions filtered by status (one or several) and group, oldest first (by ``created_at``, then
        id); ``after`` = the ``(created_at, id)`` of the last session of the previous page (keyset)."""
        s = schema.sessions
        query = sa.select(s).order_by(s.c.created_at, s.c.id)
        if status is not None:
            query = query.where(s.c.status.in_([status] if isinstance(status, str) else list(status)))
        if group_id is not None:
            query = query.where(s.c.group_id == group_id)
        if after is not None:
            query = query.where(sa.or_(s.c.created_at > after[0],
                                       sa.and_(s.c.created_at == after[0], s.c.id > after[1])))
        if limit is not None:
            query = query.limit(limit)
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [session_from_row(row) for row in rows]

    async def lifecycle_sessions(self, *, idle_before: float, timeout_before: float,
                                 idle: bool = True) -> list[SessionRecord]:
        """What one lifecycle tick must look at, selected in SQL so that the finished history is never read:
        every active or finished session of each group id that has a finished session, or an active one
        that can move: idle since ``idle_before`` and rewarded (an idle-finish candidate: a session reward
        or any reward event), or idle since ``timeout_before`` (a group-timeout candidate); oldest first.
        A group id is returned whole (all its live sessions), so that it is cut into GRPO groups as the
        full list would be. (Idle sessions that wait for a reward are left out until their group times
        out: they used to be selected, with their whole group, on every tick.) With ``idle=False`` only the
        groups with a finished session: the idle and timeout candidates cost the database a pass over every
        idle active session (50 ms for 66,364 of them on PostgreSQL), which the lifecycle makes less often."""
        s = schema.sessions
        moving = [s.c.status == "finished"]
        if idle:
            moving += [sa.and_(s.c.status == "active", s.c.last_activity_at <= timeout_before),
                       sa.and_(s.c.status == "active", s.c.last_activity_at <= idle_before, is_rewarded())]
        hot = sa.select(s.c.group_id).where(sa.or_(*moving))
        query = (sa.select(s).where(s.c.status.in_(("active", "finished")), s.c.group_id.in_(hot))
                 .order_by(s.c.created_at, s.c.id))
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [session_from_row(row) for row in rows]

    async def live_group_ids(self, *, group_ids: Collection[str]) -> set[str]:
        """The ids among ``group_ids`` that still have an active or finished session."""
        if not group_ids:
            return set()
        s = schema.sessions
        query = sa.select(s.c.group_id).distinct().where(s.c.group_id.in_(list(group_ids)),
                                                         s.c.status.in_(("active", "finished")))
        async with self._read() as conn:
            return {row[0] for row in (await conn.execute(query)).all()}


def is_rewarded() -> sa.ColumnElement[bool]:
    """A session row has a session reward or any reward event."""
    s, r = schema.sessions, schema.reward_events
    return sa.or_(s.c.reward.is_not(None), sa.exists(sa.select(r.c.id).where(r.c.session_id == s.c.id)))


def _status_update(status: str, now: float) -> dict[str, Any]:
    """:func:`_status_change` as SQL expressions, for one UPDATE of many rows (locked by the caller)."""
    s = schema.sessions
    values: dict[str, Any] = {"status": status, "version": s.c.version + 1}
    if status == "finished":
        values["finished_at"] = sa.func.coalesce(s.c.finished_at, now)
    return values


def _status_change(row: Mapping[Any, Any], status: str, now: float | None = None) -> dict[str, Any]:
    """Column values for moving a session row to ``status``: bump its version; stamp finished_at once."""
    values: dict[str, Any] = {"status": status, "version": row["version"] + 1}
    if status == "finished" and row["finished_at"] is None:
        values["finished_at"] = time.time() if now is None else now
    return values
