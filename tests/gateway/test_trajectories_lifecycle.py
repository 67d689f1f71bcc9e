"""The lifecycle loop over a real store (SQLite): idle finish, readiness, timeouts, eval, in-flight turns."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from agentrl.trajectory import decode_batch
from gateway import errors
from gateway.lifecycle import ExportSettings, StalenessAdmission, TrajectoryService
from gateway.store import Interaction, Store
from gateway.store import sessions as store_sessions
from gateway.store import errors as store_errors


def turn(tid: str, sid: str, parent: str | None, *, prompt: list[int], output: list[int],
         rh: str | None = None, version: int = 0) -> Interaction:
    return Interaction(
        id=tid, session_id=sid, parent_id=parent, request={"messages": []},
        response_message={"role": "assistant", "content": tid}, prompt_ids=prompt, output_ids=output,
        output_logprobs=[-0.25] * len(output), output_versions=[version] * len(output), finish_reason="stop",
        chain_hash=f"chain-{tid}", request_hash=rh or f"req-{tid}")


@pytest.fixture
async def service(tmp_path):
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/life.db")
    svc = TrajectoryService(store, ExportSettings(group_size=2, gamma=0.5, idle_timeout_s=60, group_timeout_s=600,
                                                  lease_timeout_s=30))
    yield svc
    await svc.stop()
    await store.close()


async def session_with_turns(store: Store, group_id: str | None, *, reward: float | None = 1.0, **kw):
    s = await store.create_session(group_id=group_id, **kw)
    await store.record_interactions([turn(f"{s.id}-a", s.id, None, prompt=[1, 2], output=[3])])
    await store.record_interactions([turn(f"{s.id}-b", s.id, f"{s.id}-a", prompt=[4], output=[5, 6])])
    if reward is not None:
        await store.set_reward(reward=reward, source="test", interaction_id=f"{s.id}-b")
    return s


async def test_ready_group_is_exported_once_and_consumed(service):
    store = service.store
    a = await session_with_turns(store, "g")
    b = await session_with_turns(store, "g", reward=None)
    await store.finish_session(session_id=a.id)
    await service.tick()
    assert (await service.queue.counts()).ready == 0  # b is still active: the group waits
    await store.finish_session(session_id=b.id)
    await service.tick()
    await service.tick()  # nothing is exported twice
    assert (await service.queue.counts()).ready == 1
    lease_id, batch = await service.lease_batch(4, 0.0)
    rows, meta = decode_batch(batch)
    assert {r.session_id for r in rows} == {a.id, b.id}
    by_session = {r.session_id: r for r in rows}
    assert by_session[a.id].turn_returns.tolist() == [0.5, 1.0]
    assert by_session[b.id].turn_returns.tolist() == [0.0, 0.0]
    assert by_session[a.id].input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert meta["groups"][0]["complete"] is True and meta["export_mode"] == "concat"
    for s in (a, b):
        assert (await store.get_session(session_id=s.id)).status == "consumed"
    with pytest.raises(store_errors.Conflict):
        await store.set_reward(reward=0.0, source="late", session_id=a.id)
    assert await service.ack(lease_id) == 1


async def test_idle_finish_needs_a_reward_and_no_turn_in_flight(service):
    store = service.store
    rewarded = await session_with_turns(store, None)  # no group id: a group of one
    silent = await session_with_turns(store, None, reward=None)
    busy = await session_with_turns(store, None)
    later = time.time() + 120
    async with service.inflight.track(busy.id):
        await service.tick(now=later)
        assert (await store.get_session(session_id=busy.id)).status == "active"
    assert (await store.get_session(session_id=rewarded.id)).status == "consumed"
    assert (await store.get_session(session_id=silent.id)).status == "active"
    await service.tick(now=later)
    assert (await store.get_session(session_id=busy.id)).status == "consumed"
    assert service.stats.idle_finished == 2 and (await service.queue.counts()).ready == 2


async def test_group_timeout_sends_a_smaller_group_and_abandons_the_rest(service):
    store = service.store
    done = await session_with_turns(store, "slow")
    stuck = await session_with_turns(store, "slow", reward=None)
    await store.finish_session(session_id=done.id)
    await service.tick()
    assert (await service.queue.counts()).ready == 0
    await service.tick(now=time.time() + 601)
    assert (await store.get_session(session_id=stuck.id)).status == "abandoned"
    _, batch = await service.lease_batch(1, 0.0)
    rows, meta = decode_batch(batch)
    assert [r.session_id for r in rows] == [done.id]
    assert meta["groups"][0]["complete"] is False
    assert service.stats.sessions_abandoned == 1 and service.stats.groups_partial == 1


async def test_eval_sessions_are_never_exported_and_never_counted(service):
    store = service.store
    await service.configure_trainer(version=0, batch_size=1, staleness_bound=0)  # limit 2 sessions
    admission = StalenessAdmission(service)
    for _ in range(3):
        assert await admission.reserve(1, metadata={"eval": True}) == 0
    ev = await session_with_turns(store, None, metadata={"eval": True})
    await store.finish_session(session_id=ev.id)
    await service.tick()
    assert (await store.get_session(session_id=ev.id)).status == "finished"
    assert (await service.queue.counts()).ready == 0
    assert await admission.reserve(1) == 1
    assert await admission.reserve(1, metadata={}) == 1
    with pytest.raises(errors.Overloaded):
        await admission.reserve(1, metadata={})


async def test_group_size_from_metadata_and_retry_dropped(service):
    store = service.store
    sessions = [await store.create_session(group_id="big", metadata={"group_size": 3}) for _ in range(3)]
    for s in sessions:
        # The agent retried its first request; only the continued answer is kept.
        await store.record_interactions([turn(f"{s.id}-r1", s.id, None, prompt=[1], output=[7], rh="same")])
        await store.record_interactions([turn(f"{s.id}-r2", s.id, None, prompt=[1], output=[8], rh="same")])
        await store.record_interactions([turn(f"{s.id}-c", s.id, f"{s.id}-r2", prompt=[2], output=[9])])
        await store.finish_session(session_id=s.id)
    await service.tick()
    _, batch = await service.lease_batch(1, 0.0)
    rows, meta = decode_batch(batch)
    assert len(meta["groups"][0]["session_ids"]) == 3
    assert [r.input_ids.tolist() for r in rows] == [[1, 8, 2, 9]] * 3


async def test_staleness_releases_budget_of_abandoned_sessions(service):
    store = service.store
    await service.configure_trainer(version=0, batch_size=1, staleness_bound=0)
    admission = StalenessAdmission(service)
    await admission.reserve(1)
    await store.create_session(group_id="x")
    await admission.reserve(1)
    await store.create_session(group_id="x")
    with pytest.raises(errors.Overloaded):
        await admission.reserve(1)
    await service.tick(now=time.time() + 601)  # both abandoned at the group timeout
    assert (await service.staleness.state()).admitted == 0
    await admission.reserve(1)


async def _until(check: Any) -> None:
    async with asyncio.timeout(120):  # a hang guard
        while not check():
            await asyncio.sleep(0.005)


async def test_lease_waits_without_blocking_the_loop(service):
    store = service.store
    service.settings.tick_s = 0.05
    service.start()
    waiting = asyncio.create_task(service.lease_batch(1, 120.0))  # the wait is a hang guard
    ticks = service.stats.ticks
    await _until(lambda: service.stats.ticks >= ticks + 2)  # the loop ticks while the lease waits
    assert not waiting.done()
    s = await session_with_turns(store, None)
    await store.finish_session(session_id=s.id)
    lease_id, batch = await asyncio.wait_for(waiting, 150)
    assert decode_batch(batch)[0][0].session_id == s.id
    with pytest.raises(errors.InvalidRequest):
        await service.lease_batch(0, 0.0)
    with pytest.raises(errors.InvalidRequest):
        await service.lease_batch(1, 1e6)


@pytest.mark.services
async def test_two_replicas_export_each_group_once(pg_url, redis_prefix):
    from tests.conftest import REDIS_URL

    stores = [await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix) for _ in range(2)]
    services = [TrajectoryService(s, ExportSettings(group_size=2)) for s in stores]
    try:
        for g in range(3):
            for _ in range(2):
                s = await session_with_turns(stores[0], f"g{g}")
                await stores[0].finish_session(session_id=s.id)
        await asyncio.gather(*(svc.tick() for svc in services for _ in range(3)))
        assert sum(svc.stats.groups_exported for svc in services) == 3
        assert max(svc.stats.groups_exported for svc in services) == 3  # one leader did all of it
        # Either replica leases from the shared Redis stream; the other acknowledges.
        lease_id, batch = await services[1].lease_batch(3, 0.0)
        assert len(decode_batch(batch)[0]) == 6
        assert await services[0].ack(lease_id) == 3
    finally:
        for svc, store in zip(services, stores):
            await svc.stop()
            await store.close()


async def test_stop_ends_the_loop_when_cancelled_right_after_a_wake_up(service):
    """Shutdown right after a notify() (e.g. POST /admin/trainer just before the app exits). The cancel can
    land in any loop iteration after the wake-up; with asyncio.wait_for (Python 3.11) one of them swallowed
    it and stop() waited forever."""
    service.settings.tick_s = 30.0  # the loop sits in its wait between ticks, not in a tick
    finished = asyncio.Event()
    real_tick = service.tick

    async def tick(*args: Any, **kwargs: Any) -> None:
        await real_tick(*args, **kwargs)
        finished.set()  # the loop goes on to its wait without yielding: it is there when the test wakes

    service.tick = tick  # type: ignore[method-assign]
    for yields in range(6):
        finished.clear()
        service.start()
        await asyncio.wait_for(finished.wait(), 120)  # the first tick has finished (a hang guard)
        service.notify()
        for _ in range(yields):
            await asyncio.sleep(0)
        stopping = asyncio.create_task(service.stop())
        done, _ = await asyncio.wait({stopping}, timeout=60)  # a hang check, not a timing figure
        if not done:
            stopping.cancel()  # a second cancel does reach the loop; leave nothing running
            await asyncio.gather(stopping, return_exceptions=True)
        assert done, f"stop() hung after a wake-up followed by {yields} loop iterations"
        service.stats.ticks = 0



async def test_the_loop_does_its_upkeep_every_tenth_tick_and_when_woken(service):
    """The loop's upkeep (outbox sweep, staleness maintenance, deserted groups) runs on its first tick, on
    every UPKEEP_EVERY_TICKS-th one after it, and on a tick woken by notify(); every tick still finishes
    and exports. A direct tick() does everything."""
    upkeeps: list[int] = []
    real = service._upkeep

    async def counted() -> None:
        upkeeps.append(service.stats.ticks)
        await real()

    service._upkeep = counted  # type: ignore[method-assign]
    every = service.UPKEEP_EVERY_TICKS
    finished: list[bool] = []  # the loop's finished ticks (their upkeep flag)
    real_tick = service.tick

    async def tick(now: float | None = None, *, upkeep: bool = True) -> None:
        await real_tick(now, upkeep=upkeep)
        finished.append(upkeep)
        if len(finished) == 2 * every + 1:
            # the loop now waits between ticks until woken: set before its next wait begins, so that no
            # tick of the short period can follow however slowly the test runs
            service.settings.tick_s = 30.0

    service.tick = tick  # type: ignore[method-assign]
    service.settings.tick_s = 0.01
    service.start()
    await _until(lambda: len(finished) >= 2 * every + 1)
    seen = list(upkeeps)
    assert seen[:3] == [1, every + 1, 2 * every + 1], seen  # ticks counted from 1
    ticks = service.stats.ticks
    service.notify()
    await _until(lambda: len(finished) == 2 * every + 2)  # the woken tick has finished
    assert upkeeps[-1] == ticks + 1 and len(upkeeps) == len(seen) + 1  # the woken tick did its upkeep
    await service.stop()
    await real_tick()
    assert len(upkeeps) == len(seen) + 2


async def test_stop_ends_the_loop_when_a_tick_swallows_the_cancellation(service):
    """A library below the tick that swallows the cancellation (seen in the queue's upkeep at shutdown) used
    to leave the loop waiting a whole tick_s, its wake-up from stop() cleared: the CI hang of stop 26."""
    entered = asyncio.Event()

    async def swallowing() -> None:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # what the library did

    service._upkeep = swallowing  # type: ignore[method-assign]
    service.settings.tick_s = 3600.0
    service.start()
    await entered.wait()
    stopping = asyncio.create_task(service.stop())
    done, _ = await asyncio.wait({stopping}, timeout=60)  # a hang check, not a timing figure
    if not done:
        stopping.cancel()
        await asyncio.gather(stopping, return_exceptions=True)
    assert done, "stop() hung after a tick swallowed its cancellation"


async def test_overlapping_exporters_never_split_a_group(service):
    """Ticks that overlap (two exporters whose leadership overlapped, or concurrent ticks) claim a group all
    or nothing: every group goes out once, whole."""
    store = service.store
    groups = {}
    for g in range(4):
        members = [await session_with_turns(store, f"g{g}") for _ in range(2)]
        for s in members:
            await store.finish_session(session_id=s.id)
        groups[f"g{g}"] = {s.id for s in members}
    await asyncio.gather(*(service.tick() for _ in range(6)))
    assert service.stats.groups_exported == 4
    lease_id, batch = await service.lease_batch(8, 0.0)
    rows, meta = decode_batch(batch)
    exported: dict[str, set[str]] = {}
    for r in rows:
        exported.setdefault(r.group_id, set()).add(r.session_id)
    assert exported == groups


async def test_two_exports_of_one_group_in_opposite_orders_give_one_whole_group(service):
    """The race behind a split group, made deterministic: two exporters claim the same group's sessions in
    opposite orders. Claimed one by one, each would take one session and ship half a group."""
    store = service.store
    members = [await session_with_turns(store, "g") for _ in range(2)]
    for s in members:
        await store.finish_session(session_id=s.id)
    members = [await store.get_session(session_id=s.id) for s in members]
    await asyncio.gather(service._export(members, complete=True), service._export(members[::-1], complete=True))
    assert service.stats.groups_exported == 1
    lease_id, batch = await service.lease_batch(8, 0.0)
    rows, meta = decode_batch(batch)
    assert {r.session_id for r in rows} == {s.id for s in members}


async def test_rows_carry_their_exported_groups_key(service):
    """One group id cut into two GRPO groups (group_size 2): each row names its own group's key, so the
    trainer normalises over each chunk, not over both merged under the shared group id."""
    store = service.store
    for _ in range(4):
        s = await session_with_turns(store, "same-root", metadata={"group_size": 2})
        await store.finish_session(session_id=s.id)
    await service.tick()
    _, batch = await service.lease_batch(2, 0.0)
    rows, meta = decode_batch(batch)
    keys = {g["group_key"]: set(g["session_ids"]) for g in meta["groups"]}
    assert len(keys) == 2 and {r.group_id for r in rows} == {"same-root"}
    for r in rows:
        assert r.session_id in keys[r.group_key] and r.grpo_group == r.group_key


async def test_a_tick_moves_many_sessions_in_batches_and_releases_their_budget_once(service, monkeypatch):
    """Sessions that time out or go idle together are moved ``MOVE_BATCH`` at a time (a transaction each
    cost more than the turns that made them), the budget comes back in one release, and a session that
    moved on its own between the tick's read and its move is left to the next tick."""
    monkeypatch.setattr(store_sessions, "MOVE_BATCH", 4)
    store = service.store
    stuck = [await store.create_session() for _ in range(9)]  # groups of one, no reward
    done = await session_with_turns(store, "mixed")
    late = await session_with_turns(store, "mixed", reward=None)
    await store.finish_session(session_id=done.id)
    idle = [await session_with_turns(store, None) for _ in range(6)]  # rewarded
    released: list[int] = []
    release = service.staleness.release

    async def record_release(n: int) -> None:
        released.append(n)
        await release(n)

    read = store.lifecycle_sessions

    async def read_then_finish_one(**kw):
        live = await read(**kw)
        if not released:  # first tick only: stuck[0] finishes after the tick read it as active
            await store.finish_session(session_id=stuck[0].id)
        return live

    monkeypatch.setattr(service.staleness, "release", record_release)
    monkeypatch.setattr(store, "lifecycle_sessions", read_then_finish_one)
    await service.tick(now=time.time() + 601)
    status = {s.id: (await store.get_session(session_id=s.id)).status for s in [*stuck, done, late, *idle]}
    assert [status[s.id] for s in stuck] == ["finished"] + ["abandoned"] * 8
    assert status[late.id] == "abandoned" and status[done.id] == "consumed"
    assert [status[s.id] for s in idle] == ["consumed"] * 6
    assert service.stats.sessions_abandoned == 9 and released == [9]
    assert service.stats.idle_finished == 6 and (await service.queue.counts()).ready == 7
    await service.tick(now=time.time() + 601)  # the one that finished meanwhile goes now (no turns: empty)
    assert (await store.get_session(session_id=stuck[0].id)).status == "consumed"
    assert service.stats.sessions_empty == 1 and released == [9, 1]


async def test_the_loop_looks_for_idle_sessions_every_hundredth_of_the_timeout_and_for_finished_ones_every_tick(service):
    """The loop's ticks (``upkeep=False``) skip the idle/timeout selection until 1 % of the shorter timeout
    (0.6 s here) has passed since the last one; a finished session's group goes out on any tick."""
    store = service.store
    idle = await session_with_turns(store, None)  # rewarded, a group of one
    t0 = (await store.get_session(session_id=idle.id)).last_activity_at
    await service.tick(now=t0 + 59.8)  # a full tick: looks, the session is not idle yet
    assert (await store.get_session(session_id=idle.id)).status == "active"
    done = await session_with_turns(store, None)
    await store.finish_session(session_id=done.id)
    await service.tick(now=t0 + 60.1, upkeep=False)  # idle now, but 0.3 s since the last look
    assert (await store.get_session(session_id=idle.id)).status == "active"
    assert (await store.get_session(session_id=done.id)).status == "consumed"
    await service.tick(now=t0 + 60.5, upkeep=False)  # 0.7 s since: it looks
    assert (await store.get_session(session_id=idle.id)).status == "consumed"
    assert service.stats.idle_finished == 1
