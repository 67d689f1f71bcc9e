"""The store's caches of sessions: in the process, and in Redis after every change made through the store."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from gateway.sizedlru import CacheSize
from gateway.store.base import StoreBase
from gateway.store.records import SessionRecord
from gateway.store.rows import hash_key, session_from_row


class CachesPart(StoreBase):
    """The in-process caches (sessions by id and the chain index without Redis; key -> session id with it)
    and the cache writes that follow a session's change: one concept, shared by the other parts."""

    def cache_sizes(self) -> list[CacheSize]:
        """The store's in-process caches (``/metrics``: ``agentrl_gateway_cache_*``)."""
        out = [CacheSize("turns", len(self._turns), len(self._turns), self._turns.max_items),
               CacheSize("sequences", len(self._seqs), self._seqs.tokens, self._seqs.max_tokens)]
        if self._local:
            out += [CacheSize("sessions", len(self._sessions), len(self._sessions), self._local_entries),
                    CacheSize("chain_index", len(self._chains), len(self._chains), self._local_entries)]
        else:
            out.append(CacheSize("session_keys", len(self._key_sessions), len(self._key_sessions),
                                 self._local_entries))
        return out

    def _remember(self, cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self._local_entries:
            cache.popitem(last=False)

    async def _recache(self, changed: Sequence[tuple[str, SessionRecord]]) -> None:
        """Sessions whose row just changed (``(key hash, record)``): out of the process cache, and into
        Redis's (one round trip for all of them)."""
        for _, record in changed:
            self._sessions.pop(record.id, None)
        if self._redis is not None and changed:
            await self._redis.put_sessions(changed)

    async def _cache_new_sessions(self, made: list[tuple[dict[str, Any], str]]) -> list[SessionRecord]:
        """Put new sessions into the Redis cache; their records (with their plain api keys)."""
        out = []
        for row, api_key in made:
            if self._local:
                self._remember(self._sessions, row["id"], session_from_row(row))
            if self._redis is not None:
                self._remember(self._key_sessions, row["key_hash"], row["id"])
                await self._redis.put_session(row["key_hash"], session_from_row(row))
            out.append(session_from_row(row, api_key=api_key))
        return out

    def known_session_id(self, *, api_key: str) -> str | None:
        """The id of the session whose api key this is, if this process has resolved that key before (a key
        never moves to another session and sessions are never deleted, so the pair stays true); None
        otherwise, and always without Redis (where nothing would read the record in the same round trip)."""
        if self._redis is None:
            return None
        key_hash = hash_key(api_key)
        session_id = self._key_sessions.get(key_hash)
        if session_id is not None:
            self._key_sessions.move_to_end(key_hash)
        return session_id
