"""Export is at-least-once: an exporter killed between claiming a group and queueing it loses nothing.

The kill is a fault-injection point (``TrajectoryService.fault_points``): the exception ends the tick
where the process would have died; the "restarted" exporter is a fresh ``TrajectoryService`` over the same
database (and Redis). SQLite with the SQL queue, and PostgreSQL with the Redis queue."""

from __future__ import annotations

import pytest

from agentrl.trajectory import decode_batch
from gateway.lifecycle import ExportSettings, TrajectoryService
from gateway.store import Store
from tests.conftest import REDIS_URL
from tests.gateway.test_trajectories_lifecycle import session_with_turns


class Killed(BaseException):
    """Stands in for the process dying (not an Exception: nothing may catch it on the way out)."""


def settings() -> ExportSettings:
    return ExportSettings(group_size=2, gamma=1.0, idle_timeout_s=60, group_timeout_s=600, lease_timeout_s=30)


async def _kill_and_restart(store: Store, point: str) -> None:
    sessions = []
    for _ in range(2):
        s = await session_with_turns(store, "g-crash")
        await store.finish_session(session_id=s.id)
        sessions.append(s.id)
    first = TrajectoryService(store, settings())
    first.fault_points[point] = Killed()
    with pytest.raises(Killed):
        await first.tick()
    statuses = {(await store.get_session(session_id=s)).status for s in sessions}
    # "staged" dies inside the claim transaction: nothing happened. "committed" dies after it.
    assert statuses == ({"finished"} if point == "staged" else {"consumed"})

    if store.redis is not None:  # the dead exporter's leadership lapses (its key has a 10 s TTL)
        await store.redis.delete(first._leader_key)
    restarted = TrajectoryService(store, settings())
    try:
        await restarted.tick()
        got = await restarted.lease_batch(4, 0.0)
        assert got is not None, "the group was lost"
        rows, meta = decode_batch(got[1])
        assert [g["group_id"] for g in meta["groups"]] == ["g-crash"]
        assert sorted(r.session_id for r in rows) == sorted(sessions)
        await restarted.ack(got[0])
        await restarted.tick()  # a second sweep publishes nothing again
        assert await restarted.lease_batch(4, 0.0) is None
        assert {(await store.get_session(session_id=s)).status for s in sessions} == {"consumed"}
    finally:
        await restarted.stop()
        await first.queue.close()


@pytest.mark.parametrize("point", ["staged", "committed"])
async def test_sql_queue_group_survives_a_kill_between_claim_and_enqueue(tmp_path, point):
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/crash.db")
    try:
        await _kill_and_restart(store, point)
    finally:
        await store.close()


@pytest.mark.services
@pytest.mark.parametrize("point", ["staged", "committed"])
async def test_redis_queue_group_survives_a_kill_between_claim_and_enqueue(pg_url, redis_prefix, point):
    store = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    try:
        await _kill_and_restart(store, point)
    finally:
        await store.close()


async def test_a_reward_posted_while_exporting_is_not_lost(tmp_path):
    """Rows are built before the claim; a reward that lands in between fails the claim (the session's
    version moved), and the next tick exports the new reward."""
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/late.db")
    service = TrajectoryService(store, settings())
    try:
        s = await session_with_turns(store, None, reward=0.0)
        await store.finish_session(session_id=s.id)
        real = store.session_interactions

        async def reward_lands_meanwhile(*, session_id: str):
            got = await real(session_id=session_id)
            await store.set_reward(reward=1.0, source="late", interaction_id=f"{s.id}-b")
            return got

        store.session_interactions = reward_lands_meanwhile  # type: ignore[method-assign]
        await service.tick()
        assert (await store.get_session(session_id=s.id)).status == "finished"  # claim refused
        store.session_interactions = real  # type: ignore[method-assign]
        await service.tick()
        _, batch = await service.lease_batch(1, 0.0)
        (row,), _ = decode_batch(batch)
        assert row.reward == 1.0
    finally:
        await service.stop()
        await store.close()
