"""Turns: the parent of a new turn, full token sequences, recording (group commit) and reading turn trees."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Awaitable, Callable

import sqlalchemy as sa
from redis.exceptions import RedisError

from gateway.store import schema
from gateway.store.caches import CachesPart
from gateway.store.errors import NotFound, StoreUnavailable
from gateway.store.packing import unpack_i32
from gateway.store.records import Interaction, NewSession, ParentMatch, SessionRecord
from gateway.store.redis_state import Continued, Marker
from gateway.store.rows import check_interaction, interaction_from_row, interaction_to_row, new_session_row, session_from_row
from gateway.store.tree import parents_first, tree_json

log = logging.getLogger(__name__)


FIND_BY_CHAIN_ROWS = 64  # find_session_by_chain reads at most this many of the newest matching turns


class TurnsPart(CachesPart):
    """Turns: find a new turn's parent and its full token sequence, record turns (group commit), read trees."""

    async def find_continued(self, *, index_keys: Sequence[str], longest_hash: str,
                             marker: Marker | None = None) -> Continued | None:
        """With Redis, one round trip for an implicit-mode turn: the session of the first of ``index_keys``
        (the gateway's episode index, longest candidate first) that is set, its cached record, the parent
        index's entry for ``longest_hash`` (give it to :meth:`find_parent` as ``indexed``) and, with a
        cached record, the in-flight ``marker`` added (``gateway.store.redis_state``). None without Redis
        or when no key is set. Raises StoreUnavailable when Redis fails."""
        if self._redis is None:
            return None
        try:
            return await self._redis.find_continued(index_keys, longest_hash, marker)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed: {exc}") from exc

    async def mark_session(self, *, session_id: str, longest_hash: str | None, marker: Marker,
                           record: SessionRecord | None = None) -> Continued | None:
        """With Redis, one round trip for a turn of a named session: add its in-flight ``marker``, read the
        parent index's entry for ``longest_hash`` (None: a first turn; give the result to :meth:`find_parent`
        as ``indexed``) and, unless its ``record`` is given, the session's cached record (``Continued.record``
        is None when it is not cached: read it with :meth:`get_session_by_key`). None without Redis. Raises
        StoreUnavailable when Redis fails."""
        if self._redis is None:
            return None
        try:
            cached, parent = await self._redis.mark_session(session_id, longest_hash, marker,
                                                            read_record=record is None)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed (in-flight marker): {exc}") from exc
        return Continued(session_id, record or cached, parent, True)

    async def find_parent(
        self, *, session_id: str, candidates: Sequence[tuple[int, str]], indexed: Continued | None = None
    ) -> ParentMatch | None:
        """The parent of a new turn: the first candidate, in the order given (longest message prefix
        first), whose chain hash is the ``chain_hash`` of a turn of this session. If several turns share
        that hash (retries), the most recent wins. One index probe per candidate (Redis hash, else one
        indexed SQL query for all candidates); None when nothing matches.

        The turn itself comes from an in-process cache of recent turns when it is there, so with Redis
        the longest candidate's hit needs no SQL at all. ``interaction.reward`` may then lag a reward
        set via another replica (``get_interaction`` reads SQL). ``indexed``: what :meth:`find_continued`
        read of this session's index for the longest candidate (then it is not read again).
        """
        if not candidates:
            return None
        hashes = [h for _, h in candidates]
        if self._local:
            known = self._chains.get((session_id, hashes[0]))
            if known is not None:  # the longest candidate, committed here: nothing can beat it
                try:
                    return ParentMatch(candidates[0][0], await self._turn(known))
                except NotFound:
                    self._chains.pop((session_id, hashes[0]), None)
        if self._redis is not None:
            found = [indexed.parent_id] if indexed is not None and indexed.session_id == session_id \
                else await self._redis.chain_lookup(session_id, hashes[:1])
            if found[0] is not None:  # the longest candidate: nothing can beat it
                try:
                    return ParentMatch(candidates[0][0], await self._turn(found[0]))
                except NotFound:
                    log.warning("redis chain index points at unknown interaction %s; using SQL", found[0])
        i = schema.interactions
        query = (  # ids only: a long conversation matches many candidates, and only one row is needed
            sa.select(i.c.id, i.c.chain_hash)
            .where(i.c.session_id == session_id, i.c.chain_hash.in_(set(hashes)))
            .order_by(i.c.created_at.desc(), i.c.id.desc())
        )
        async with self._read() as conn:
            rows = (await conn.execute(query)).all()
        newest: dict[str, str] = {}
        for row in rows:
            newest.setdefault(row.chain_hash, row.id)
        if self._redis is not None and newest:
            await self._redis.chain_add([(session_id, h, iid) for h, iid in newest.items()], only_missing=True)
        for prefix_len, chain_hash in candidates:
            if chain_hash in newest:
                return ParentMatch(prefix_len, await self._turn(newest[chain_hash]))
        return None

    async def _turn(self, interaction_id: str) -> Interaction:
        """A turn from the recent-turn cache, else SQL (then cached)."""
        turn = self._turns.get(interaction_id)
        if turn is None:
            turn = await self.get_interaction(interaction_id=interaction_id)
            self._turns.put(turn)
        return turn

    async def find_session_by_chain(
        self, *, chain_hashes: Sequence[str], implicit_only: bool = True
    ) -> SessionRecord | None:
        """The session holding a turn with one of ``chain_hashes`` (tried in order, longest prefix first;
        the most recent turn wins), across all sessions: how an implicit-mode request, which names no
        session, finds its episode. ``implicit_only`` considers only sessions created with
        ``metadata={"implicit": True}``. One indexed SQL query; the gateway may keep a faster index in
        front of it (this is the rebuild-from-SQL path)."""
        if not chain_hashes:
            return None
        i, s = schema.interactions, schema.sessions
        query = (
            sa.select(i.c.chain_hash, s)
            .join(s, s.c.id == i.c.session_id)
            .where(i.c.chain_hash.in_(set(chain_hashes)))
            .order_by(i.c.created_at.desc(), i.c.id.desc())
            # the newest turns only: a prefix repeated by many episodes (identical greedy answers) must not
            # read them all; a conversation's longest prefix is its newest turn, so it is among these
            .limit(FIND_BY_CHAIN_ROWS)
        )
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        newest: dict[str, Any] = {}
        for row in rows:
            if implicit_only and not (isinstance(row["meta"], dict) and row["meta"].get("implicit") is True):
                continue
            newest.setdefault(row["chain_hash"], row)
        for chain_hash in chain_hashes:
            if chain_hash in newest:
                return session_from_row(newest[chain_hash])
        return None

    async def full_sequence(self, *, interaction_id: str) -> list[int]:
        """All tokens of a turn: parent's full sequence + its prompt delta + its output. Cached (memory,
        then Redis); a miss walks the ancestors in one SQL query. NotFound if unknown."""
        return unpack_i32(await self._full_packed(interaction_id))

    async def _full_packed(self, interaction_id: str) -> bytes:
        packed = self._seqs.get(interaction_id)
        if packed is not None:
            return packed
        if self._redis is not None:
            packed = await self._redis.seq_get(interaction_id)
            if packed is not None:
                self._seqs.put(interaction_id, packed)
                return packed
        async with self._read() as conn:
            rows = (await conn.execute(_ancestors_sql(), {"id": interaction_id})).all()
        if not rows:
            raise NotFound(f"unknown interaction {interaction_id}")
        packed = b"".join(bytes(part) for row in rows for part in (row.prompt_ids, row.output_ids))
        self._seqs.put(interaction_id, packed)
        if self._redis is not None:
            await self._redis.seq_put([(interaction_id, packed)])
        return packed

    def new_session(self, *, group_id: str | None = None, task_id: str | None = None,
                    metadata: dict[str, Any] | None = None) -> NewSession:
        """A session to create together with its first turns (``record_interactions(create=[...])``): its
        id is known at once and it exists only if those turns commit. No I/O."""
        row, api_key = new_session_row(group_id=group_id, task_id=task_id, metadata=metadata)
        return NewSession(row=row, api_key=api_key)

    async def record_interactions(self, interactions: Sequence[Interaction], *,
                                  create: Sequence[NewSession] = (),
                                  publish: Sequence[tuple[str, str, int]] = (),
                                  release: Sequence[tuple[str, str]] = ()) -> None:
        """Durably record turns; returns only after they are committed.

        ``create``: sessions (from :meth:`new_session`) inserted in the same transaction as the turns,
        before them (a new implicit episode and its first turn: one commit, all or nothing); they are
        cached (Redis included) with the turns. ``publish``: Redis ``(key, value, ttl)`` entries set in the
        same round trip as the turns' index after the commit (the gateway's implicit-episode index;
        ignored without Redis). ``release``: Redis sorted-set ``(key, member)`` entries removed in that
        round trip (the turn's in-flight markers, ``InFlight.releases``; ignored without Redis). That round
        trip is sent before this returns and answered after (:meth:`published` waits for it).

        Group commit: rows of concurrent callers are written in one transaction by a background writer;
        each caller awaits its own outcome. All rows of one call commit together or not at all; a
        failure fails exactly the callers whose rows failed (the batch is retried caller by caller) and
        leaves no partial rows. Raises NotFound (unknown session or parent), Conflict (session not
        active, parent from another session, duplicate id), InvalidValue (array lengths disagree),
        StoreUnavailable. Also sets the sessions' ``last_activity_at`` and updates the Redis index.
        """
        if not interactions:
            return
        for it in interactions:
            check_interaction(it)
        rows = [interaction_to_row(it) for it in interactions]
        await self._writer.submit(list(interactions), rows, [new.row for new in create], publish, release)

    async def published(self) -> None:
        """Return once Redis has answered the after-commit publish of every turn recorded so far (what
        :meth:`record_interactions` sends to Redis without waiting for its reply)."""
        await self._writer.published()

    def _after_commit(self, jobs: list[Any]) -> Awaitable[None] | None:
        """Cache the new turns and the sessions created with them in the process, and return what is left
        to do with Redis (None without it): publishing all that (and the jobs' ``publish`` entries, and
        the removal of their ``release`` entries) in one round trip. The writer answers the jobs' callers
        and then awaits it: its command is on Redis's socket before any caller is answered (so a follow-up,
        which can only come after the answer, finds the turn in Redis from any replica), and the caller
        does not wait for Redis's reply (a lost publish costs a follow-up a SQL lookup, not its link)."""
        committed = [pair for job in jobs for pair in zip(job.interactions, job.rows)]
        created = [row for job in jobs for row in job.sessions]
        if self._local:
            for row in created:
                self._remember(self._sessions, row["id"], session_from_row(row))
        sequences: list[tuple[str, bytes]] = []
        unknown: list[tuple[Interaction, dict[str, Any]]] = []  # turns whose parent's sequence is not here
        for it, row in committed:
            self._turns.put(it)
            if self._local:
                self._remember(self._chains, (it.session_id, it.chain_hash), it.id)
            parent = b"" if it.parent_id is None else self._seqs.get(it.parent_id)
            if parent is None:
                unknown.append((it, row))
            else:
                sequences.append(self._extend(parent, it, row))
        if self._redis is None:
            return None  # the unknown ones are computed from SQL on first use
        # A conversation's next turn extends this one, not its parent, so with Redis (which holds every
        # sequence cached here, SEQ_TTL_S) the parents' copies leave this process: the cache then holds
        # about one sequence per live conversation instead of every turn of each (its bound filled in
        # about a minute of the 1,000-agent soak, ~36 MB). A retry or branch from a parent reads Redis.
        for it, _ in committed:
            if it.parent_id is not None:
                self._seqs.discard(it.parent_id)
        return self._publish_committed(jobs, committed, created, sequences, unknown)

    def _extend(self, parent: bytes, it: Interaction, row: dict[str, Any]) -> tuple[str, bytes]:
        """Cache the full sequence of a committed turn from its parent's; returns ``(turn id, sequence)``."""
        packed = parent + row["prompt_ids"] + row["output_ids"]
        self._seqs.put(it.id, packed)
        return it.id, packed

    async def _publish_committed(self, jobs: list[Any], committed: list[tuple[Interaction, dict[str, Any]]],
                                 created: list[dict[str, Any]], sequences: list[tuple[str, bytes]],
                                 unknown: list[tuple[Interaction, dict[str, Any]]]) -> None:
        redis = self._redis
        assert redis is not None
        chain = [(it.session_id, it.chain_hash, it.id) for it, _ in committed]
        # Nothing is awaited before this write: the callers are answered after it is on Redis's socket, so
        # their next command on this connection (a follow-up's lookup) comes after it.
        await redis.publish_turns(chain, sequences,
                                  sessions=[(row["key_hash"], session_from_row(row)) for row in created],
                                  extra=[entry for job in jobs for entry in job.publish],
                                  release=[entry for job in jobs for entry in job.release])
        # A branch from a turn whose copy already left this process: its parent's sequence is in Redis, and
        # the branch's own is cached after (until then, a follow-up of the branch reads SQL for it).
        missing = list(dict.fromkeys(it.parent_id for it, _ in unknown if it.parent_id is not None))
        if not missing:
            return
        fetched = await redis.seq_get_many(missing)
        later = [self._extend(fetched[it.parent_id], it, row) for it, row in unknown
                 if it.parent_id is not None and it.parent_id in fetched]
        if later:
            await redis.seq_put(later)

    async def get_interaction(self, *, interaction_id: str) -> Interaction:
        """One turn. NotFound if unknown."""
        i = schema.interactions
        async with self._read() as conn:
            row = (await conn.execute(sa.select(i).where(i.c.id == interaction_id))).mappings().first()
        if row is None:
            raise NotFound(f"unknown interaction {interaction_id}")
        return interaction_from_row(row)

    async def path(self, *, interaction_id: str) -> list[Interaction]:
        """The turns from the root down to ``interaction_id`` (root first): two queries whatever the depth
        (how ``previous_response_id`` recovers a conversation). NotFound if unknown."""
        i = schema.interactions
        async with self._read() as conn:
            ids = [row.id for row in (await conn.execute(_path_ids_sql(), {"id": interaction_id})).all()]
            if not ids:
                raise NotFound(f"unknown interaction {interaction_id}")
            rows = (await conn.execute(sa.select(i).where(i.c.id.in_(ids)))).mappings().all()
        by_id = {row["id"]: interaction_from_row(row) for row in rows}
        return [by_id[turn_id] for turn_id in ids]

    async def session_interactions(self, *, session_id: str) -> list[Interaction]:
        """Every turn of a session (the whole tree), parents before children, oldest first. NotFound if
        the session is unknown."""
        i = schema.interactions
        async with self._read() as conn:
            rows = (await conn.execute(sa.select(i).where(i.c.session_id == session_id))).mappings().all()
            if not rows:
                exists = (await conn.execute(sa.select(schema.sessions.c.id).where(schema.sessions.c.id == session_id))).first()
                if exists is None:
                    raise NotFound(f"unknown session {session_id}")
        return parents_first([interaction_from_row(row) for row in rows])

    async def session_tree_json(
        self, *, session_id: str, decode: Callable[[list[int]], str] | None = None
    ) -> dict[str, Any]:
        """The session and its turn tree as JSON for people and the UI (``GET /v1/sessions/{id}``).

        Shape: ``{"session": {...}, "roots": [node...], "num_interactions": int}`` where a node is
        ``{"id", "parent_id", "created_at", "request", "response_message", "finish_reason", "reward",
        "root_reason", "bridge_len", "prompt_tokens", "output_tokens", "versions": [min, max] | None,
        "timings", "children": [node...]}``; with ``decode``, nodes also carry ``prompt_text`` and
        ``output_text``. Token arrays themselves are summarised by length."""
        session = await self.get_session(session_id=session_id)
        return tree_json(session, await self.session_interactions(session_id=session_id), decode)


def _ancestors_sql() -> sa.TextClause:
    return sa.text(
        """
        WITH RECURSIVE anc(id, parent_id, prompt_ids, output_ids, depth) AS (
            SELECT id, parent_id, prompt_ids, output_ids, 0 FROM interactions WHERE id = :id
            UNION ALL
            SELECT i.id, i.parent_id, i.prompt_ids, i.output_ids, anc.depth + 1
            FROM interactions i JOIN anc ON i.id = anc.parent_id
        )
        SELECT id, prompt_ids, output_ids FROM anc ORDER BY depth DESC
        """
    )


def _path_ids_sql() -> sa.TextClause:
    return sa.text(
        """
        WITH RECURSIVE anc(id, parent_id, depth) AS (
            SELECT id, parent_id, 0 FROM interactions WHERE id = :id
            UNION ALL
            SELECT i.id, i.parent_id, anc.depth + 1 FROM interactions i JOIN anc ON i.id = anc.parent_id
        )
        SELECT id FROM anc ORDER BY depth DESC
        """
    )
