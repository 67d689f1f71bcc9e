"""Hot state shared by gateway replicas through Redis; all of it can be rebuilt from SQL.

Keys (under the store's prefix, default ``agentrl:``):

- ``skey:<sha256(api key)>``: hash ``{v: version, d: session JSON}``, the session-by-key cache, and
  ``sid:<session id>``, the same record by id (the implicit-mode hot path). Writes are guarded by the
  session's ``version`` (a Lua script keeps the newer copy of each), so a slow reader that fills the cache
  from an old SQL row cannot overwrite a newer status written by another replica.
- ``chain:<session id>``: hash ``chain_hash -> interaction id``, the parent index. Written after each
  commit, before the caller's response goes out (its reply is awaited after); a later turn with the same
  hash overwrites (most recent wins). A miss falls back to SQL, which also refills the hash.
- ``seq:<interaction id>``: the turn's full token sequence, packed int32 (immutable, so never stale).

An implicit-mode turn that continues an episode reads the gateway's episode index, the session record, the
parent index and sets its in-flight marker in one script call (:meth:`RedisState.find_continued`); the
script composes the session's keys from its id, so these keys must live on one Redis (no Cluster).

Reads that fail (Redis down) fall back to SQL and are counted; writes that fail after a commit try to
drop the affected key so that nothing stale is served, and are counted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, NoScriptError, RedisError, ResponseError

from gateway.store.errors import StoreUnavailable
from gateway.store.records import SessionRecord
from gateway.store.resp import LeanRedis

log = logging.getLogger(__name__)

REDIS_MAX_CONNECTIONS = 128  # per gateway process
REDIS_POOL_TIMEOUT_S = 30.0  # waiting longer for a free connection is an outage (503)
SESSION_TTL_S = 24 * 3600
CHAIN_TTL_S = 24 * 3600
SEQ_TTL_S = 3600

# KEYS = skey, sid (the same record by key hash and by id); ARGV = version, json, ttl. Each key keeps the
# copy with the highest version.
_PUT_IF_NEWER = """
local wrote = 0
for _, key in ipairs(KEYS) do
  local cur = redis.call('HGET', key, 'v')
  if not (cur and tonumber(cur) >= tonumber(ARGV[1])) then
    redis.call('HSET', key, 'v', ARGV[1], 'd', ARGV[2])
    redis.call('EXPIRE', key, ARGV[3])
    wrote = 1
  end
end
return wrote
"""


# KEYS = the implicit-episode index keys of a turn's candidate parents, longest first. ARGV = the store's
# prefix, the longest candidate's chain hash, then the in-flight marker: key prefix ('' for none), member,
# expiry score, key ttl. The first indexed candidate's session: its cached record, the parent index's entry
# for the longest candidate, and (when the record is cached) the marker, added before anything is returned.
_FIND_CONTINUED = """
local sid = false
for _, key in ipairs(KEYS) do
  sid = redis.call('GET', key)
  if sid then break end
end
if not sid then return false end
local record = redis.call('HGET', ARGV[1] .. 'sid:' .. sid, 'd')
local parent = redis.call('HGET', ARGV[1] .. 'chain:' .. sid, ARGV[2])
local marked = 0
if record and ARGV[3] ~= '' then
  local key = ARGV[3] .. sid
  redis.call('ZADD', key, ARGV[5], ARGV[4])
  redis.call('EXPIRE', key, ARGV[6])
  marked = 1
end
return {sid, record, parent, marked}
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Marker:
    """An in-flight marker for :meth:`RedisState.find_continued` to add: ``member`` scored ``expiry`` in the
    sorted set ``<key_prefix><session id>``, which expires after ``key_ttl_s`` (``gateway.lifecycle.InFlight``
    owns these keys)."""

    key_prefix: str
    member: str
    expiry: float
    key_ttl_s: int


@dataclasses.dataclass(frozen=True, slots=True)
class Continued:
    """What :meth:`RedisState.find_continued` found: the episode's session id, its cached record (None: not
    cached, read SQL), the parent index's entry for the longest candidate (None: not indexed, read SQL) and
    whether the in-flight marker was added (only with a cached record)."""

    session_id: str
    record: SessionRecord | None
    parent_id: str | None
    marked: bool


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _session_json(record: SessionRecord) -> str:
    data = dataclasses.asdict(record)
    data["api_key"] = None
    return json.dumps(data, separators=(",", ":"))


class RedisState:
    """Redis-backed caches of the store. ``errors`` counts failed Redis calls (served from SQL).

    ``client`` is ``redis-py``'s (everything off the turn's path); ``hot`` is the lean pipelined client
    (:mod:`gateway.store.resp`) for the reads and writes every turn makes."""

    def __init__(self, client: aioredis.Redis, prefix: str, hot: LeanRedis | None = None) -> None:
        self.client = client
        self.hot: LeanRedis | aioredis.Redis = hot if hot is not None else client
        self.prefix = prefix
        self.errors = 0
        self.publish_resent = 0  # after-commit publishes sent again on a new connection
        self._put_if_newer = client.register_script(_PUT_IF_NEWER)
        self._find_continued_sha = hashlib.sha1(_FIND_CONTINUED.encode()).hexdigest()

    @classmethod
    async def connect(cls, url: str, prefix: str) -> RedisState:
        # A blocking pool: a burst of requests beyond the pool's size waits for a connection (Redis
        # commands take microseconds). The default pool raised "Too many connections" at once past 100
        # concurrent commands, which made 1,000 concurrent agents (bench/soak.py) see 503s.
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=REDIS_MAX_CONNECTIONS,
                                                        timeout=REDIS_POOL_TIMEOUT_S, decode_responses=False)
        client = aioredis.Redis.from_pool(pool)
        hot = LeanRedis.from_url(url)
        try:
            await client.ping()
            await hot.ping()
            await client.script_load(_PUT_IF_NEWER)  # publish_turns calls it by its sha in a pipeline
            await client.script_load(_FIND_CONTINUED)  # so that the first turns need not send it whole
        except RedisError as exc:
            await client.aclose()
            await hot.aclose()
            raise StoreUnavailable(f"cannot reach Redis at {url}: {exc}") from exc
        return cls(client, prefix, hot)

    async def close(self) -> None:
        await self.client.aclose()
        if self.hot is not self.client:
            await self.hot.aclose()

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        log.warning("redis %s failed (falling back to SQL): %s", what, exc)

    # ---- sessions ----
    async def _cached_session(self, key: str) -> SessionRecord | None:
        try:
            raw = await self.hot.hget(f"{self.prefix}{key}", "d")
        except RedisError as exc:
            self._failed("session read", exc)
            return None
        if raw is None:
            return None
        return SessionRecord(**json.loads(raw))

    async def get_session(self, key_hash: str) -> SessionRecord | None:
        return await self._cached_session(f"skey:{key_hash}")

    async def get_session_by_id(self, session_id: str) -> SessionRecord | None:
        """The cached record of a session by id (the implicit-mode hot path); None on a miss."""
        return await self._cached_session(f"sid:{session_id}")

    def _session_keys(self, key_hash: str, record: SessionRecord) -> list[str]:
        return [f"{self.prefix}skey:{key_hash}", f"{self.prefix}sid:{record.id}"]

    async def put_session(self, key_hash: str, record: SessionRecord) -> None:
        keys = self._session_keys(key_hash, record)
        try:
            await self._put_if_newer(keys=keys, args=[record.version, _session_json(record), SESSION_TTL_S])
        except RedisError as exc:
            self._failed("session write", exc)
            for key in keys:
                await self._drop(key)

    async def put_sessions(self, items: Sequence[tuple[str, SessionRecord]]) -> None:
        """Several sessions' records (``(key hash, record)``) in one round trip, as the turn publish caches
        the sessions created with its turns."""
        if items:
            await self.publish_turns((), (), sessions=items)

    async def find_continued(self, index_keys: Sequence[str], longest_hash: str,
                             marker: Marker | None = None) -> Continued | None:
        """One round trip for an implicit-mode turn (see ``_FIND_CONTINUED``): None when no candidate is
        in the episode index. Raises ``RedisError`` (the index lives only in Redis: nothing to fall back to)."""
        if not index_keys:
            return None
        args: list[str | float | int] = [self.prefix, longest_hash]
        args += [marker.key_prefix, marker.member, marker.expiry, marker.key_ttl_s] if marker else ["", "", 0, 0]
        try:
            reply = await self.hot.evalsha(self._find_continued_sha, len(index_keys), *index_keys, *args)
        except ResponseError as exc:  # NOSCRIPT: Redis restarted since (redis-py names it NoScriptError)
            if not (isinstance(exc, NoScriptError) or str(exc).startswith("NOSCRIPT")):
                raise
            reply = await self.hot.eval(_FIND_CONTINUED, len(index_keys), *index_keys, *args)  # loads it
        if not reply:
            return None
        sid, raw, parent, marked = reply
        record = SessionRecord(**json.loads(raw)) if raw is not None else None
        return Continued(str(_text(sid)), record, _text(parent), bool(marked))

    async def mark_session(self, session_id: str, longest_hash: str | None, marker: Marker, *,
                           read_record: bool) -> tuple[SessionRecord | None, str | None]:
        """A named session's turn, in one round trip: add its in-flight ``marker``, read the parent index's
        entry for the longest candidate (``longest_hash``; None: a first turn, nothing to read) and, with
        ``read_record``, the session's cached record. Returns (record or None: not cached or not read,
        parent or None: not indexed). Raises ``RedisError``."""
        key = marker.key_prefix + session_id
        pipe = self.hot.pipeline(transaction=False)
        if read_record:
            pipe.hget(f"{self.prefix}sid:{session_id}", "d")
        pipe.zadd(key, {marker.member: marker.expiry})
        pipe.expire(key, marker.key_ttl_s)
        if longest_hash is not None:
            pipe.hget(f"{self.prefix}chain:{session_id}", longest_hash)
        replies = await pipe.execute()
        raw = replies[0] if read_record else None
        record = SessionRecord(**json.loads(raw)) if raw is not None else None
        return record, (_text(replies[-1]) if longest_hash is not None else None)

    # ---- chain-hash index ----
    async def chain_lookup(self, session_id: str, hashes: Sequence[str]) -> list[str | None]:
        if not hashes:
            return []
        try:
            values = await self.hot.hmget(f"{self.prefix}chain:{session_id}", list(hashes))
        except RedisError as exc:
            self._failed("chain read", exc)
            return [None] * len(hashes)
        return [_text(v) for v in values]

    async def chain_add(self, entries: Iterable[tuple[str, str, str]], *, only_missing: bool = False) -> None:
        """Index ``(session_id, chain_hash, interaction_id)`` entries. ``only_missing`` (used when
        refilling from SQL) never overwrites an entry a concurrent commit may just have written."""
        by_session: dict[str, dict[str, str]] = {}
        for session_id, chain_hash, interaction_id in entries:
            by_session.setdefault(session_id, {})[chain_hash] = interaction_id
        if not by_session:
            return
        try:
            pipe = self.hot.pipeline(transaction=False)
            for session_id, mapping in by_session.items():
                key = f"{self.prefix}chain:{session_id}"
                if only_missing:
                    for field, value in mapping.items():
                        pipe.hsetnx(key, field, value)
                else:
                    pipe.hset(key, mapping=cast("dict[Any, Any]", mapping))  # redis-py types str keys narrowly
                pipe.expire(key, CHAIN_TTL_S)
            await pipe.execute()
        except RedisError as exc:
            self._failed("chain write", exc)
            for session_id in by_session:
                await self._drop(f"{self.prefix}chain:{session_id}")

    async def publish_turns(
        self, chain_entries: Sequence[tuple[str, str, str]], sequences: Sequence[tuple[str, bytes]], *,
        sessions: Sequence[tuple[str, SessionRecord]] = (), extra: Sequence[tuple[str, str, int]] = (),
        release: Sequence[tuple[str, str]] = (),
    ) -> None:
        """After a commit, in one round trip: index the new turns' chain hashes (overwriting: the most
        recent turn wins), cache their full sequences, cache the sessions created with them (``(key hash,
        record)``, through the version-guarded script), set ``extra`` ``(key, value, ttl)`` entries and
        remove the ``release`` ``(sorted-set key, member)`` entries (the turns' in-flight markers)."""
        by_session: dict[str, dict[str, str]] = {}
        for session_id, chain_hash, interaction_id in chain_entries:
            by_session.setdefault(session_id, {})[chain_hash] = interaction_id
        first_session = 0  # the index of the first session script's reply

        async def send() -> list[Any]:
            nonlocal first_session
            pipe = self.hot.pipeline(transaction=False)
            for session_id, mapping in by_session.items():
                key = f"{self.prefix}chain:{session_id}"
                pipe.hset(key, mapping=cast("dict[Any, Any]", mapping))  # redis-py types str keys narrowly
                pipe.expire(key, CHAIN_TTL_S)
            for interaction_id, packed in sequences:
                pipe.set(f"{self.prefix}seq:{interaction_id}", packed, ex=SEQ_TTL_S)
            first_session = len(pipe)
            for key_hash, record in sessions:  # EVALSHA: the script is loaded at connect (else NOSCRIPT below)
                pipe.evalsha(self._put_if_newer.sha, 2, *self._session_keys(key_hash, record), record.version,
                             _session_json(record), SESSION_TTL_S)
            for key, value, ttl in extra:
                pipe.set(key, value, ex=ttl)
            for key, member in release:
                pipe.zrem(key, member)
            return cast("list[Any]", await pipe.execute(raise_on_error=False))

        try:
            try:
                results = await send()
            except ConnectionError:
                # The connection was lost (closed by Redis, a proxy or the network), not a slow server: send
                # it again once on a new one. Every command here is idempotent (HSET/SET of the same values,
                # ZREM, the version-guarded session script). A lost entry of the episode index in ``extra``
                # costs its follow-up a SQL lookup (``ImplicitIndex.lookup``), not its link.
                self.publish_resent += 1
                results = await send()
        except RedisError as exc:
            self._failed("turn publish", exc)
            for session_id in by_session:
                await self._drop(f"{self.prefix}chain:{session_id}")
            for key_hash, record in sessions:
                for key in self._session_keys(key_hash, record):
                    await self._drop(key)
            return
        failed = [r for r in results if isinstance(r, Exception)]
        if not failed:
            return
        for (key_hash, record), result in zip(sessions, results[first_session:]):
            if isinstance(result, Exception):  # NOSCRIPT (Redis restarted): the script call loads it
                await self.put_session(key_hash, record)
        others = [r for i, r in enumerate(results) if isinstance(r, Exception)
                  and not first_session <= i < first_session + len(sessions)]
        if others:
            self._failed("turn publish", others[0])
            for session_id in by_session:
                await self._drop(f"{self.prefix}chain:{session_id}")

    # ---- full sequences ----
    async def seq_get(self, interaction_id: str) -> bytes | None:
        try:
            value = await self.hot.get(f"{self.prefix}seq:{interaction_id}")
        except RedisError as exc:
            self._failed("sequence read", exc)
            return None
        return value if isinstance(value, bytes) else None

    async def seq_get_many(self, interaction_ids: Sequence[str]) -> dict[str, bytes]:
        """The cached sequences among ``interaction_ids`` (one MGET; a failure is only a cache miss)."""
        try:
            values = await self.hot.mget([f"{self.prefix}seq:{i}" for i in interaction_ids])
        except RedisError as exc:
            self._failed("sequence read", exc)
            return {}
        return {i: v for i, v in zip(interaction_ids, values) if isinstance(v, bytes)}

    async def seq_put(self, items: Iterable[tuple[str, bytes]]) -> None:
        try:
            pipe = self.hot.pipeline(transaction=False)
            for interaction_id, packed in items:
                pipe.set(f"{self.prefix}seq:{interaction_id}", packed, ex=SEQ_TTL_S)
            await pipe.execute()
        except RedisError as exc:  # sequences are immutable: a missing copy is only a cache miss
            self._failed("sequence write", exc)

    async def _drop(self, key: str) -> None:
        try:
            await self.hot.delete(key)
        except RedisError as exc:
            log.error("redis: could not drop %s after a failed write; it may be stale until it expires: %s", key, exc)
