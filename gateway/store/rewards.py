"""Rewards: a turn's or a session's value (the latest one counts) and every value posted, audited."""

from __future__ import annotations

import math
import time
from collections.abc import Collection

import sqlalchemy as sa

from gateway.store import schema, sessions
from gateway.store.caches import CachesPart
from gateway.store.errors import Conflict, InvalidValue, NotFound
from gateway.store.records import RewardRecord, SessionRecord
from gateway.store.rows import reward_from_row, session_from_row
from gateway.store.sessions import is_rewarded


class RewardsPart(CachesPart):
    """Rewards of turns and sessions, with their audit trail."""

    async def set_reward(
        self,
        *,
        reward: float,
        source: str,
        interaction_id: str | None = None,
        session_id: str | None = None,
    ) -> RewardRecord:
        """Set the reward of one turn (``interaction_id``) or of a session (``session_id``); exactly one.

        The value replaces any earlier one on that target; every call adds an audit row. InvalidValue for
        a non-finite value or both/neither target; NotFound for unknown ids; Conflict when the session is
        consumed."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise InvalidValue(f"reward must be a finite number, got {reward!r}")
        if (interaction_id is None) == (session_id is None):
            raise InvalidValue("give exactly one of interaction_id and session_id")
        s, i = schema.sessions, schema.interactions
        now = time.time()
        updated: SessionRecord | None = None
        key_hash = ""
        async with self._write_tx() as conn:
            if interaction_id is not None:
                found = (await conn.execute(sa.select(i.c.session_id).where(i.c.id == interaction_id))).first()
                if found is None:
                    raise NotFound(f"unknown interaction {interaction_id}")
                target_session: str = found.session_id
            else:
                assert session_id is not None
                target_session = session_id
            query = sa.select(s).where(s.c.id == target_session)
            query = self._backend.lock(query)
            row = (await conn.execute(query)).mappings().first()
            if row is None:
                raise NotFound(f"unknown session {target_session}")
            if row["status"] == "consumed":
                raise Conflict(f"session {target_session} was already consumed by training; its rewards are final")
            if interaction_id is not None:
                await conn.execute(sa.update(i).where(i.c.id == interaction_id).values(reward=float(reward)))
                # the session's version moves too: an exporter that read the turns before this reward
                # sees the change when it claims the session (claim_sessions(versions=...)) and re-reads
                await conn.execute(sa.update(s).where(s.c.id == target_session).values(version=row["version"] + 1))
                updated = session_from_row({**row, "version": row["version"] + 1})
                key_hash = row["key_hash"]
            else:
                values = {"reward": float(reward), "version": row["version"] + 1}
                await conn.execute(sa.update(s).where(s.c.id == target_session).values(**values))
                updated = session_from_row({**row, **values})
                key_hash = row["key_hash"]
            result = await conn.execute(
                sa.insert(schema.reward_events).values(
                    session_id=target_session,
                    interaction_id=interaction_id,
                    reward=float(reward),
                    source=source,
                    created_at=now,
                )
            )
            assert result.inserted_primary_key is not None
            event_id = int(result.inserted_primary_key[0])
        if interaction_id is not None:
            self._turns.set_reward(interaction_id, float(reward))
        self._sessions.pop(target_session, None)
        if updated is not None and self._redis is not None:
            await self._redis.put_session(key_hash, updated)
        return RewardRecord(
            id=event_id,
            session_id=target_session,
            interaction_id=interaction_id,
            reward=float(reward),
            source=source,
            created_at=now,
        )

    async def rewarded(self, *, session_ids: Collection[str]) -> set[str]:
        """The ids among ``session_ids`` with a session reward or any reward event (a query per
        ``sessions.MOVE_BATCH`` ids)."""
        ids = list(set(session_ids))
        s = schema.sessions
        found: set[str] = set()
        for start in range(0, len(ids), sessions.MOVE_BATCH):
            query = sa.select(s.c.id).where(s.c.id.in_(ids[start:start + sessions.MOVE_BATCH]), is_rewarded())
            async with self._read() as conn:
                found.update(row[0] for row in (await conn.execute(query)).all())
        return found

    async def reward_history(
        self, *, session_id: str | None = None, interaction_id: str | None = None
    ) -> list[RewardRecord]:
        """The audit rows for a session (all its targets) or one turn, oldest first."""
        r = schema.reward_events
        query = sa.select(r).order_by(r.c.id)
        if session_id is not None:
            query = query.where(r.c.session_id == session_id)
        if interaction_id is not None:
            query = query.where(r.c.interaction_id == interaction_id)
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [reward_from_row(row) for row in rows]
