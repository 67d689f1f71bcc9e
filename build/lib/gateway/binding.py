"""Who is calling and which session a request belongs to.

A bearer key is, in this order: the admin key, one of the runner keys, one of the agent keys, or a
session's own key (looked up in the store by its hash). What each may reach:

- admin: everything (engines, pause/resume, trajectory leasing, the trainer's version, every session);
- runner (``--runner-key``, what an agent runner needs): create and list sessions and groups, post rewards,
  finish, abandon and read any session; no engine control, no leasing, no trainer version;
- agent (``--agent-key``): generation, and only the implicit sessions created under that same key;
- session key: generation, rewards, finish and read of its own session.

A chat request is bound to a session by

- the session key (``Authorization: Bearer <session key>``), or
- the URL ``/sessions/{session_id}/v1/...`` (with that session's key, an agent key or the admin key; a
  session key used on another session's URL is 403), or
- nothing (implicit mode, agent or admin key): the request continues the implicit episode that holds its
  parent turn, or starts a new episode (its own session, ``group_id`` = hash of the root prompt + tools).

Implicit mode needs to find the session from the messages alone. :class:`ImplicitIndex` maps the chain
hash of every implicit turn to its session id (Redis when configured, so that replicas share it; else a
bounded in-process map). When two episodes hold identical conversations (same prompt, same answers), a
follow-up joins the most recent one.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request

from redis.exceptions import RedisError

from gateway.errors import (
    AuthenticationFailed,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
    from_store_error,
)
from gateway.settings import GatewaySettings
from gateway.sizedlru import CacheSize
from gateway.store import Continued, Marker, SessionRecord, Store
from gateway.store import errors as store_errors

Role = Literal["admin", "runner", "agent", "session"]


@dataclass(frozen=True, slots=True)
class KeyedSession:
    """A session known by its key and id only: its record is read with the turn's first Redis round trip
    (``GenerationService``), not before (see :func:`authenticate`'s ``defer``)."""

    id: str
    api_key: str


@dataclass(slots=True)
class Caller:
    role: Role
    session: SessionRecord | KeyedSession | None = None  # the session whose key was used (role "session")
    owner: str | None = None  # agent keys: a fingerprint recorded in the implicit sessions they create


@functools.lru_cache(maxsize=64)  # the configured agent keys: hashed once, not on every request
def key_owner(key: str) -> str:
    """The fingerprint of an agent key stored in its implicit sessions (never the key itself)."""
    return "agent-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def bearer(request: Request) -> str:
    """The caller's key: ``Authorization: Bearer <key>``, or ``x-api-key: <key>`` (how Anthropic's SDKs send
    it); the same keys either way."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = request.headers.get("x-api-key", "").strip()
    if key:
        return key
    raise AuthenticationFailed(
        "missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>' (a session key, an "
        "agent key or the admin key)")


def _matches(key: str, candidates: Sequence[str]) -> bool:
    found = False
    for candidate in candidates:
        found |= hmac.compare_digest(key.encode(), candidate.encode())
    return found


async def authenticate(request: Request, settings: GatewaySettings, store: Store, *,
                       defer: bool = False) -> Caller:
    """The caller of ``request``; 401 for a missing or unknown key.

    ``defer`` (the generation routes): a session key this process has resolved before is answered from
    memory as a :class:`KeyedSession`, and the session's record comes with the turn's in-flight marker in
    one Redis round trip instead of one before it (a key stays its session's for good, so the key is as
    valid as it was; the record, its status above all, is read fresh with the marker)."""
    key = bearer(request)
    if _matches(key, [settings.admin_key]):
        return Caller("admin", owner="admin")
    if settings.runner_key and _matches(key, settings.runner_key):
        return Caller("runner", owner="runner")
    if settings.agent_key and _matches(key, settings.agent_key):
        return Caller("agent", owner=key_owner(key))
    if defer:
        session_id = store.known_session_id(api_key=key)
        if session_id is not None:
            return Caller("session", KeyedSession(session_id, key))
    return Caller("session", await session_of_key(store, key))


async def session_of_key(store: Store, key: str) -> SessionRecord:
    """The session whose api key ``key`` is: 401 if there is none."""
    try:
        return await store.get_session_by_key(api_key=key)
    except store_errors.NotFound:
        raise AuthenticationFailed("invalid API key") from None
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc


def require_admin(caller: Caller) -> None:
    if caller.role != "admin":
        raise PermissionDenied("this endpoint needs the admin key")


def require_runner(caller: Caller) -> None:
    """Session and group management and rewards: a runner key or the admin key."""
    if caller.role not in ("admin", "runner"):
        raise PermissionDenied("this endpoint needs a runner key (--runner-key) or the admin key")


async def load_session(store: Store, session_id: str) -> SessionRecord:
    try:
        return await store.get_session(session_id=session_id)
    except store_errors.NotFound:
        raise NotFound(f"no session {session_id!r}", param="session_id") from None
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc


async def session_for(caller: Caller, url_session_id: str | None, store: Store
                      ) -> SessionRecord | KeyedSession | None:
    """The session a generation request is bound to; None means implicit mode (a :class:`KeyedSession`
    from a deferred session key)."""
    if caller.role == "session":
        assert caller.session is not None
        if url_session_id is not None and url_session_id != caller.session.id:
            raise PermissionDenied(
                f"this API key belongs to another session, not {url_session_id!r}", code="foreign_session")
        return caller.session
    if url_session_id is not None:
        record = await load_session(store, url_session_id)
        may_access_session(caller, record)
        return record
    return None


def owns(caller: Caller, record: SessionRecord) -> bool:
    """Whether ``caller`` may act on ``record`` (see the module docstring)."""
    if caller.role in ("admin", "runner"):
        return True
    if caller.role == "session":
        return caller.session is not None and caller.session.id == record.id
    metadata = record.metadata or {}
    return bool(metadata.get("implicit")) and metadata.get("owner") == caller.owner


def may_access_session(caller: Caller, record: SessionRecord) -> None:
    if not owns(caller, record):
        if caller.role == "session":
            raise PermissionDenied("this API key belongs to another session", code="foreign_session")
        raise PermissionDenied("an agent key reaches only the implicit sessions created under it",
                               code="foreign_session")


def group_of_root(request_hash: str, tools: Any) -> str:
    """The GRPO group of an implicit episode: same root prompt (and tools) -> same group."""
    digest = hashlib.sha256(request_hash.encode())
    if tools:
        digest.update(json.dumps(tools, sort_keys=True, separators=(",", ":")).encode())
    return "grp-" + digest.hexdigest()[:32]


class ImplicitIndex:
    """chain hash of an implicit-mode turn -> its session id (Redis-backed when the store has Redis)."""

    def __init__(self, store: Store, *, max_entries: int = 1_000_000, ttl_s: int = 7 * 24 * 3600) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._local: OrderedDict[str, str] = OrderedDict()

    def _key(self, chain_hash: str) -> str:
        return f"{self.store.redis_prefix}gw:implicit:{chain_hash}"

    def cache_sizes(self) -> list[CacheSize]:
        """The episode index held here (without Redis only)."""
        if self.store.redis_hot is not None:
            return []
        return [CacheSize("implicit_episodes", len(self._local), len(self._local), self.max_entries)]

    async def lookup(self, hashes: Sequence[str], marker: Marker | None = None) -> Continued | None:
        """The episode of the first hash (longest prefix first) that an implicit turn was stored under.

        With Redis this is one round trip that also brings the session's cached record, the parent index's
        entry for the longest hash and adds ``marker`` (``Store.find_continued``); without Redis only
        ``session_id`` is known (from this process's map). A hash in neither is looked up in SQL (the
        stored turns' chain hashes), which then brings the session's record."""
        if not hashes:
            return None
        if self.store.redis is not None:
            hit = await self.store.find_continued(index_keys=[self._key(h) for h in hashes],
                                                  longest_hash=hashes[0], marker=marker)
            if hit is not None:
                return hit
        else:
            for h in hashes:
                if h in self._local:
                    return Continued(self._local[h], None, None, False)
        # Not in the index: this process restarted (without Redis the index lived in it), Redis lost it (a
        # restart without persistence), the entry expired or was evicted, or the conversation never went
        # through this gateway (few-shot assistant messages). The turns themselves are in SQL: one indexed
        # query finds the episode, so a conversation that outlived its index entry is not cut in two.
        record = await self.store.find_session_by_chain(chain_hashes=hashes, implicit_only=True)
        return Continued(record.id, record, None, False) if record is not None else None

    def redis_entries(self, entries: Sequence[tuple[str, str]]) -> list[tuple[str, str, int]]:
        """``(chain_hash, session_id)`` entries as the Redis ``(key, value, ttl)`` sets that :meth:`add`
        makes, for the store to publish with the turns' own index after their commit
        (``Store.record_interactions(publish=)``, one round trip); empty without Redis."""
        if self.store.redis is None:
            return []
        return [(self._key(h), sid, self.ttl_s) for h, sid in entries]

    async def add(self, entries: Sequence[tuple[str, str]]) -> None:
        """Remember ``(chain_hash, session_id)`` of recorded implicit turns."""
        redis = self.store.redis_hot
        if redis is not None:
            try:
                async with redis.pipeline(transaction=False) as pipe:
                    for h, sid in entries:
                        pipe.set(self._key(h), sid, ex=self.ttl_s)
                    await pipe.execute()
            except RedisError as exc:
                raise StoreUnavailable(f"Redis failed: {exc}") from exc
            return
        for h, sid in entries:
            self._local[h] = sid
            self._local.move_to_end(h)
        while len(self._local) > self.max_entries:
            self._local.popitem(last=False)

