"""The public API of the conversation store: records, and the ``Store`` that the gateway and export call.

The store keeps sessions, their turn trees (one ``Interaction`` per turn), rewards with an audit trail,
and the hot state that gateway replicas must share. SQL (SQLite by default, PostgreSQL by URL) is the
truth; Redis, when given, is a cache of things rebuildable from SQL (session-by-key, the chain-hash index
that finds a turn's parent, full token sequences). Every method is async and keyword-only.

    store = await Store.open("sqlite+aiosqlite:///var/agentrl.db")          # runs `alembic upgrade head`
    session = await store.create_session(group_id="g1", task_id="t1", metadata={})
    match = await store.find_parent(session_id=session.id, candidates=[(4, h4), (2, h2)])
    prompt = (await store.full_sequence(interaction_id=match.interaction.id)) + delta if match else delta
    await store.record_interactions([Interaction(...)])                    # returns once committed
    await store.close()

Times are unix seconds (float). Token arrays are plain Python lists here and packed int32/float32
little-endian bytes in SQL. Errors: see ``gateway.store.errors``.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

SessionStatus = Literal["active", "finished", "consumed", "abandoned"]
SESSION_STATUSES: tuple[str, ...] = ("active", "finished", "consumed", "abandoned")
FinishReason = Literal["stop", "length", "tool_calls", "abort"]


@dataclass(slots=True, kw_only=True)
class SessionRecord:
    """One session (episode). ``api_key`` is the plain key only on the record returned by
    ``create_session``; the store keeps a SHA-256 of it, so every other read returns ``api_key=None``."""

    id: str
    api_key: str | None
    group_id: str
    task_id: str | None
    metadata: dict[str, Any]
    status: SessionStatus
    is_eval: bool
    created_at: float
    finished_at: float | None
    last_activity_at: float
    reward: float | None = None  # the session-level reward, if one was posted (export decides its use)
    version: int = 0  # bumped on every status/reward change; keeps Redis copies from going backwards


@dataclass(slots=True, kw_only=True)
class Interaction:
    """One turn. ``id`` is the response id (``chatcmpl-<hex>``); with ``n>1`` each choice is its own turn.

    ``prompt_ids`` holds ONLY the delta beyond the parent's full sequence (for a root: the whole prompt),
    so storage stays linear in conversation length. The full sequence of a turn is
    ``full_sequence(parent) + prompt_ids + output_ids``. ``bridge_len`` leading prompt tokens are an
    end-of-turn token added because the parent was cut (always loss-masked). ``output_logprobs`` and
    ``output_versions`` have one entry per output token.
    """

    id: str
    session_id: str
    parent_id: str | None
    request: dict[str, Any]  # only the messages new beyond the parent's path, plus tools and params
    response_message: dict[str, Any]  # the assistant message exactly as returned
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    chain_hash: str  # hash chain over normalised messages + returned assistant message
    request_hash: str  # hash chain over the request's normalised messages (equal for retries)
    bridge_len: int = 0
    reward: float | None = None
    root_reason: str | None = None  # for roots: "first_turn", "no_prefix_match", ...
    created_at: float = field(default_factory=time.time)
    timings: dict[str, float] = field(default_factory=dict)  # milliseconds, by stage


@dataclass(slots=True, frozen=True)
class ParentMatch:
    """The turn found as parent, and the length of the message prefix (the candidate) that matched."""

    prefix_len: int
    interaction: Interaction


@dataclass(slots=True, kw_only=True, frozen=True)
class RewardRecord:
    """One row of the reward audit: who set which value on which target, when."""

    id: int
    session_id: str
    interaction_id: str | None  # None for a session-level reward
    reward: float
    source: str
    created_at: float


@dataclass(slots=True, kw_only=True)
class CommitStats:
    """Counters of the group-commit writer (monotonic since ``open``)."""

    transactions: int = 0  # committed batch transactions (successful or not)
    rows: int = 0  # interactions committed
    calls: int = 0  # record_interactions calls completed successfully
    failed_calls: int = 0
    retried_batches: int = 0  # batches that failed and were retried caller by caller
    max_batch_calls: int = 0  # the most callers served by one transaction


class Store:
    """The durable conversation store. Create with ``await Store.open(...)``; one per process."""

    @classmethod
    async def open(
        cls,
        db_url: str,
        *,
        redis_url: str | None = None,
        redis_prefix: str = "agentrl:",
        migrate: bool = True,
        max_batch_rows: int = 256,
        commit_delay_s: float = 0.0,
        seq_cache_tokens: int = 8_000_000,
    ) -> Store:
        """Connect, run ``alembic upgrade head`` (unless ``migrate=False``) and start the group-commit writer.

        ``db_url``: ``sqlite+aiosqlite:///path/to.db`` (WAL and foreign keys are switched on) or
        ``postgresql+asyncpg://user@host/db``. ``redis_url``: share hot state with other gateway
        processes on the same database; every key lives under ``redis_prefix``. The writer commits
        everything pending as one transaction as soon as the previous commit ends (so batches grow with
        load), waiting ``commit_delay_s`` first if set, and at most ``max_batch_rows`` rows per
        transaction. ``seq_cache_tokens`` bounds the in-process cache of full token sequences.
        Raises StoreUnavailable when the database or Redis cannot be reached.
        """
        raise NotImplementedError

    async def close(self) -> None:
        """Flush pending writes, stop the writer, dispose of connections. Idempotent."""
        raise NotImplementedError

    # ---- for other store modules (export/leasing, issue 4) ----
    @property
    def engine(self) -> Any:
        """The SQLAlchemy ``AsyncEngine`` (for modules that add their own tables via Alembic 0002+)."""
        raise NotImplementedError

    @property
    def redis(self) -> Any | None:
        """The ``redis.asyncio.Redis`` client, or None without Redis."""
        raise NotImplementedError

    @property
    def redis_prefix(self) -> str:
        raise NotImplementedError

    @property
    def commit_stats(self) -> CommitStats:
        """A copy of the group-commit counters."""
        raise NotImplementedError

    # ---- sessions ----
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
        raise NotImplementedError

    async def get_session(self, *, session_id: str) -> SessionRecord:
        """The session as stored in SQL (authoritative). NotFound if unknown."""
        raise NotImplementedError

    async def get_session_by_key(self, *, api_key: str) -> SessionRecord:
        """The session whose api key this is (the gateway's auth path; Redis-cached when Redis is on).

        ``status``, ``reward`` and ids are exact (writes go through to the cache, ordered by
        ``version``); ``last_activity_at`` of a cached record may lag. NotFound if no session has it.
        """
        raise NotImplementedError

    async def touch_session(self, *, session_id: str, at: float | None = None) -> None:
        """Set ``last_activity_at`` (default now). ``record_interactions`` already does this. NotFound."""
        raise NotImplementedError

    async def finish_session(self, *, session_id: str) -> SessionRecord:
        """Mark an active session finished (sets ``finished_at``). Idempotent: a session that is already
        finished, consumed or abandoned is returned unchanged. NotFound if unknown."""
        raise NotImplementedError

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
        raise NotImplementedError

    async def list_sessions(
        self,
        *,
        status: str | Collection[str] | None = None,
        group_id: str | None = None,
        limit: int | None = None,
    ) -> list[SessionRecord]:
        """Sessions filtered by status (one or several) and group, oldest first."""
        raise NotImplementedError

    # ---- turns ----
    async def find_parent(
        self, *, session_id: str, candidates: Sequence[tuple[int, str]]
    ) -> ParentMatch | None:
        """The parent of a new turn: the first candidate, in the order given (longest message prefix
        first), whose chain hash is the ``chain_hash`` of a turn of this session. If several turns share
        that hash (retries), the most recent wins. One index probe per candidate (Redis hash, else one
        indexed SQL query for all candidates); None when nothing matches."""
        raise NotImplementedError

    async def full_sequence(self, *, interaction_id: str) -> list[int]:
        """All tokens of a turn: parent's full sequence + its prompt delta + its output. Cached (memory,
        then Redis); a miss walks the ancestors in one SQL query. NotFound if unknown."""
        raise NotImplementedError

    async def record_interactions(self, interactions: Sequence[Interaction]) -> None:
        """Durably record turns; returns only after they are committed.

        Group commit: rows of concurrent callers are written in one transaction by a background writer;
        each caller awaits its own outcome. All rows of one call commit together or not at all; a
        failure fails exactly the callers whose rows failed (the batch is retried caller by caller) and
        leaves no partial rows. Raises NotFound (unknown session or parent), Conflict (session not
        active, parent from another session, duplicate id), InvalidValue (array lengths disagree),
        StoreUnavailable. Also sets the sessions' ``last_activity_at`` and updates the Redis index.
        """
        raise NotImplementedError

    async def get_interaction(self, *, interaction_id: str) -> Interaction:
        """One turn. NotFound if unknown."""
        raise NotImplementedError

    async def session_interactions(self, *, session_id: str) -> list[Interaction]:
        """Every turn of a session (the whole tree), parents before children, oldest first. NotFound if
        the session is unknown."""
        raise NotImplementedError

    async def session_tree_json(
        self, *, session_id: str, decode: Callable[[list[int]], str] | None = None
    ) -> dict[str, Any]:
        """The session and its turn tree as JSON for people and the UI (``GET /v1/sessions/{id}``).

        Shape: ``{"session": {...}, "roots": [node...], "num_interactions": int}`` where a node is
        ``{"id", "parent_id", "created_at", "request", "response_message", "finish_reason", "reward",
        "root_reason", "bridge_len", "prompt_tokens", "output_tokens", "versions": [min, max] | None,
        "timings", "children": [node...]}``; with ``decode``, nodes also carry ``prompt_text`` and
        ``output_text``. Token arrays themselves are summarised by length."""
        raise NotImplementedError

    # ---- rewards ----
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
        raise NotImplementedError

    async def reward_history(
        self, *, session_id: str | None = None, interaction_id: str | None = None
    ) -> list[RewardRecord]:
        """The audit rows for a session (all its targets) or one turn, oldest first."""
        raise NotImplementedError

    # ---- counters ----
    async def root_counts(self, *, since: float | None = None) -> dict[str, int]:
        """How many root turns were recorded, by ``root_reason`` (optionally since a unix time)."""
        raise NotImplementedError
