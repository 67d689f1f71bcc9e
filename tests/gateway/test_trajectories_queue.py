"""The trajectory queue (SQL and Redis-stream backends) and staleness admission, on real databases."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from agentrl.trajectory import decode_batch, encode_batch, export_concat, merge_batches, Turn
from gateway import errors
from gateway.queue import QueuedGroup, RedisQueue, SqlQueue, lease_meta
from gateway.staleness import StalenessControl
from gateway.store.backend import open_backend
from gateway.store.errors import StoreUnavailable
from tests.conftest import REDIS_URL


def make_group(key: str, *, min_version: int = 0, sessions: int = 2) -> QueuedGroup:
    rows = []
    for s in range(sessions):
        turns = [Turn(id=f"{key}-{s}", parent_id=None, prompt_ids=[1, 2], output_ids=[3, 4],
                      logprobs=[-0.1, -0.2], versions=[min_version, min_version + 1], reward=float(s))]
        rows += export_concat(turns, gamma=1.0, session_id=f"{key}-s{s}", group_id=key)
    return QueuedGroup(group_key=key, group_id=key, session_ids=[r.session_id for r in rows],
                       payload=encode_batch(rows), n_rows=len(rows), n_tokens=sum(r.num_tokens for r in rows),
                       min_version=min_version, complete=True)


SERVICES = pytest.mark.services

# A lease outlives every test that does not wait for it to expire (a slow machine cannot make a lease lapse
# between two calls); the expiry test gives its leases EXPIRY_S and waits past each lease's own deadline.
LONG_LEASE_S = 300.0
EXPIRY_S = 1.5


async def past(deadline: float) -> None:
    """Sleep until the wall clock (the SQL queue's ``time.time()``; Redis's TIME on this host) is past
    ``deadline``: waiting longer can only leave the lease more expired."""
    while time.time() <= deadline + 0.05:
        await asyncio.sleep(max(0.01, deadline + 0.05 - time.time()))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=SERVICES), pytest.param("redis", marks=SERVICES)])
def backend(request):
    return request.param


@pytest.fixture
def db_url(backend, request, tmp_path):
    if backend == "postgresql":
        return request.getfixturevalue("pg_url")
    return f"sqlite+aiosqlite:///{tmp_path}/q.db"


@pytest.fixture
def stream_prefix(backend, request):
    return request.getfixturevalue("redis_prefix") if backend == "redis" else None


@pytest.fixture
async def db(db_url):
    opened = await open_backend(db_url)  # migrated
    yield opened
    await opened.close()


@pytest.fixture
async def queue(db, stream_prefix):
    if stream_prefix is None:
        yield SqlQueue(db, lease_timeout_s=LONG_LEASE_S)
        return
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=False)
    yield RedisQueue(client, prefix=stream_prefix, lease_timeout_s=LONG_LEASE_S)
    await client.aclose()


async def test_lease_ack_round_trip(queue):
    for i in range(3):
        assert await queue.put(make_group(f"g{i}"))
    assert not await queue.put(make_group("g0"))  # idempotent by group key
    lease = await queue.lease(2, 0.0)
    assert [g.group_key for g in lease.groups] == ["g0", "g1"]
    assert all(g.deliveries == 1 for g in lease.groups)
    batch = merge_batches([g.payload for g in lease.groups], lease_meta(lease))
    rows, meta = decode_batch(batch)
    assert meta["lease_id"] == lease.id and len(rows) == 4
    assert [r.session_id for r in rows] == ["g0-s0", "g0-s1", "g1-s0", "g1-s1"]
    assert (await queue.counts()).leased == 2
    assert await queue.ack(lease.id) == 2
    with pytest.raises(errors.Conflict, match="already acknowledged"):
        await queue.ack(lease.id)
    with pytest.raises(errors.NotFound):
        await queue.ack("lease-nope")
    rest = await queue.lease(5, 0.0)
    assert [g.group_key for g in rest.groups] == ["g2"]
    assert await queue.lease(1, 0.0) is None


async def test_expired_lease_is_redelivered_and_cannot_be_acked(queue):
    queue.lease_timeout_s = EXPIRY_S  # the calls between a lease and its ack below are one or two queue calls
    await queue.put(make_group("g0"))
    first = await queue.lease(1, 0.0)
    assert await queue.lease(1, 0.0) is None  # leased: not visible
    await past(first.deadline)
    with pytest.raises(errors.Conflict, match="expired"):
        await queue.ack(first.id)
    second = await queue.lease(1, 0.0)
    assert second.id != first.id
    assert [g.group_key for g in second.groups] == ["g0"] and second.groups[0].deliveries == 2
    with pytest.raises(errors.Conflict):
        await queue.ack(first.id)
    assert await queue.ack(second.id) == 1
    assert await queue.lease(1, 0.0) is None
    await past(second.deadline)
    assert await queue.lease(1, 0.0) is None  # acked groups never come back


async def test_lease_waits_for_enough_groups(queue):
    await queue.put(make_group("g0"))

    async def later():
        await asyncio.sleep(0.3)
        await queue.put(make_group("g1"))

    task = asyncio.create_task(later())
    t0 = time.monotonic()
    lease = await queue.lease(2, 60.0)  # answered once the second group is there, not when the wait ends
    await task
    assert len(lease.groups) == 2 and 0.25 < time.monotonic() - t0 < 60.0
    t0 = time.monotonic()
    assert await queue.lease(1, 0.4) is None  # nothing comes: None after the wait
    assert time.monotonic() - t0 >= 0.35


async def test_stale_groups_are_held_then_requeued_or_dropped(queue):
    await queue.put(make_group("old", min_version=0))
    await queue.put(make_group("new", min_version=3))
    lease = await queue.lease(5, 0.0, min_version=2)
    assert [g.group_key for g in lease.groups] == ["new"]
    counts = await queue.counts()
    assert (counts.held, counts.held_rows) == (1, 2)
    assert (await queue.maintain(min_version=2, max_held_s=60)).requeued == 0
    # The bound was widened: the held group is admissible again.
    assert (await queue.maintain(min_version=0, max_held_s=60)).requeued == 1
    again = await queue.lease(5, 0.0, min_version=2)  # ... and held again at the old bound
    assert again is None and (await queue.counts()).held == 1
    await asyncio.sleep(0.05)
    done = await queue.maintain(min_version=2, max_held_s=0.01)
    assert (done.dropped_groups, done.dropped_rows, done.dropped_sessions) == (1, 2, 2)
    assert (await queue.counts()).held == 0


async def test_counts_name_the_pending_sessions_of_ready_leased_and_held_groups(queue):
    await queue.put(make_group("held", min_version=0))
    await queue.put(make_group("leased", min_version=3))
    lease = await queue.lease(5, 0.0, min_version=2)
    assert [g.group_key for g in lease.groups] == ["leased"]
    await queue.put(make_group("ready", min_version=3))
    counts = await queue.counts()
    assert counts.pending_ids == {f"{g}-s{s}" for g in ("held", "leased", "ready") for s in range(2)}
    assert counts.as_dict() == {"ready": 1, "leased": 1, "held": 1, "held_rows": 2, "pending_sessions": 6}
    assert await queue.ack(lease.id) == 1
    assert (await queue.counts()).as_dict()["pending_sessions"] == 4  # trained sessions are no longer pending


async def test_concurrent_leases_never_share_a_group(queue):
    for i in range(20):
        await queue.put(make_group(f"g{i:02d}"))
    leases = await asyncio.gather(*(queue.lease(3, 0.0) for _ in range(10)))
    keys = [g.group_key for lease in leases if lease for g in lease.groups]
    assert sorted(keys) == [f"g{i:02d}" for i in range(20)]


async def test_staleness_admission(db):
    """Admission is the backend's one statement (SQLite: in the store's writer thread; PostgreSQL: on the
    store's own asyncpg connection): the same rules, and a cancelled caller's charge is given back."""
    control = StalenessControl(db, default_group_size=2, retry_after_s=3)
    await _admission_checks(control)
    await _cancelled_admission_gives_back(control)


@pytest.mark.services
async def test_staleness_admission_recovers_from_a_lost_postgres_connection(pg_url):
    """On PostgreSQL, a lost connection of the store's own is a 503 that the next admission recovers from."""
    db = await open_backend(pg_url)
    statements = db.statements
    try:
        control = StalenessControl(db, default_group_size=2, retry_after_s=3)
        await control.configure(version=0, batch_size=100, staleness_bound=1)
        # the server ends the connection in the middle of a statement (a restart, say): a 503, deterministic
        # (ending it from another connection races with the client noticing, which then reconnects silently)
        with pytest.raises(StoreUnavailable, match="connection"):
            await statements.fetchrow("SELECT pg_terminate_backend(pg_backend_pid())")
        before = (await control.state()).admitted
        good = dict(statements._kwargs)
        statements._kwargs["port"] = 1  # while the database cannot be reached, admission is a 503 ...
        with pytest.raises(errors.StoreUnavailable, match="staleness state unavailable"):
            await control.admit()
        statements._kwargs = good  # ... and the next one, once it can, connects again
        assert await control.admit() == 1 and (await control.state()).admitted == before + 1
    finally:
        await db.close()


async def _cancelled_admission_gives_back(control: StalenessControl) -> None:
    """A caller cancelled while its admission runs gives the charge back once it has committed."""
    before = (await control.state()).admitted
    existing = asyncio.all_tasks()
    task = asyncio.ensure_future(control.admit())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The admission runs on to its commit, and the give-back after it, in tasks of their own: wait for every
    # task started since (polling the count could read it before the commit, equal to ``before`` too).
    async with asyncio.timeout(120):  # a hang guard
        while left := asyncio.all_tasks() - existing - {asyncio.current_task()}:
            await asyncio.wait(left)
    assert (await control.state()).admitted == before


async def _admission_checks(control: StalenessControl) -> None:
    for _ in range(10):
        await control.admit()  # no trainer registered: no limit
    state = await control.configure(version=0, batch_size=1, staleness_bound=1, pending_sessions=1)
    assert (state.limit, state.admitted) == (4, 1)  # (1 + 0 + 1) x 1 x 2
    for _ in range(3):
        await control.admit()
    with pytest.raises(errors.Overloaded) as exc:
        await control.admit()
    assert exc.value.retry_after_s == 3 and "limit 4" in exc.value.message
    await control.admit(is_eval=True)  # eval sessions never count
    state = await control.configure(version=1, batch_size=1, staleness_bound=1)  # the trainer stepped
    assert (state.limit, state.admitted, state.base_version) == (6, 4, 0)
    await control.admit(n=2)
    with pytest.raises(errors.Overloaded):
        await control.admit()
    await control.release(1)  # an abandoned session gives its place back
    await control.admit()
    assert (await control.state()).min_version == 0
    state = await control.configure(version=5, batch_size=2, staleness_bound=0, pending_sessions=0)
    assert (state.base_version, state.admitted, state.limit, state.min_version) == (5, 0, 4, 5)
    with pytest.raises(errors.InvalidRequest):
        await control.configure(version=0, batch_size=0, staleness_bound=1)
