"""Concurrent first sessions of a group make ONE admission decision (real gateway process; SQLite, and
PostgreSQL + Redis).

Sixteen ``POST /v1/sessions`` for two new groups of eight arrive at once against a staleness budget of
exactly sixteen sessions. Each group must be charged once (8 + 8 = 16): every request is answered 200, the
budget is then full (a third group is refused), and after the groups are trained (or abandoned) the
budget in use returns exactly to where it was.

To make the race certain rather than likely, the test holds the database lock the admission decision
needs while the sixteen requests arrive: on SQLite the write lock (``BEGIN IMMEDIATE``; the gateway's one
writer connection then queues the requests in arrival order), on PostgreSQL the staleness row
(``SELECT ... FOR UPDATE`` on ``trainer_state``) until all sixteen requests wait on a lock. Before the fix
every request probed the group, found no place, and then each charged a whole group: 429s for sessions of
an admitted group, and places charged that no session would ever use (until the group timeout).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

import httpx
import pytest

from agentrl.trajectory import decode_batch
from tests.conftest import REDIS_URL
from tests.gateway.conftest import GatewayProc

SIZE = 8
GROUPS = 2
HOLD_SQLITE_S = 3.0  # < the gateway's SQLite busy_timeout (10 s)

pytestmark = pytest.mark.slow


class Lock:
    """Hold what the admission decision needs while requests pile up behind it."""

    def __init__(self, gw: GatewayProc) -> None:
        self.gw = gw
        self.pg: Any = None
        self.sqlite: sqlite3.Connection | None = None

    async def hold(self) -> None:
        if self.gw.db.startswith("sqlite"):
            self.sqlite = sqlite3.connect(self.gw.db.split("///", 1)[1], isolation_level=None, timeout=30)
            self.sqlite.execute("BEGIN IMMEDIATE")
        else:
            import asyncpg

            self.pg = await asyncpg.connect(self.gw.db.replace("postgresql+asyncpg", "postgresql"))
            await self.pg.execute("BEGIN")
            assert await self.pg.fetchval("SELECT admitted FROM trainer_state WHERE id = 1 FOR UPDATE") is not None

    async def until_queued(self, n: int) -> None:
        """Return once ``n`` requests wait behind the lock (PostgreSQL: counted; SQLite: a fixed wait, as
        the gateway's writer queue cannot be seen from outside)."""
        if self.sqlite is not None:
            await asyncio.sleep(HOLD_SQLITE_S)
            return
        deadline = time.monotonic() + 120
        waiting = 0
        while time.monotonic() < deadline:
            # (pg_stat_activity is a snapshot per transaction: clear it, as this connection is in one)
            await self.pg.execute("SELECT pg_stat_clear_snapshot()")
            waiting = await self.pg.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
            if waiting >= n:
                return
            await asyncio.sleep(0.05)
        rows = await self.pg.fetch("SELECT state, wait_event_type, wait_event, left(query, 120) AS q FROM pg_stat_activity "
                                   "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        raise AssertionError(f"only {waiting} of {n} requests reached the database lock: {[dict(r) for r in rows]}")

    async def release(self) -> None:
        if self.sqlite is not None:
            self.sqlite.execute("ROLLBACK")
            self.sqlite.close()
            self.sqlite = None
        if self.pg is not None:
            await self.pg.execute("ROLLBACK")
            await self.pg.close()
            self.pg = None


async def trainer_state(http: httpx.AsyncClient) -> dict[str, Any]:
    resp = await http.get("/v1/trajectories/stats")
    assert resp.status_code == 200, resp.text
    return resp.json()["trainer"]  # type: ignore[no-any-return]


async def register(http: httpx.AsyncClient, version: int) -> None:
    resp = await http.post("/admin/trainer", json={"version": version, "batch_size": GROUPS, "staleness_bound": 0,
                                                   "group_size": SIZE})
    assert resp.status_code == 200, resp.text
    await asyncio.sleep(0)


async def first_sessions_at_once(gw: GatewayProc, http: httpx.AsyncClient, prefix: str) -> list[dict[str, Any]]:
    """SIZE x GROUPS ``POST /v1/sessions`` for GROUPS new group ids, all arriving at once behind the lock."""
    lock = Lock(gw)
    await lock.hold()
    try:
        calls = [asyncio.create_task(http.post("/v1/sessions", json={
            "group_id": f"{prefix}-{g}", "task_id": "t", "metadata": {"group_size": SIZE}}))
            for g in range(GROUPS) for _ in range(SIZE)]
        await lock.until_queued(len(calls))
    finally:
        await lock.release()
    answers = await asyncio.gather(*calls)
    codes = [r.status_code for r in answers]
    assert codes == [200] * len(calls), [(r.status_code, r.text[:200]) for r in answers if r.status_code != 200]
    return [r.json() for r in answers]


async def one_turn(gw: GatewayProc, http: httpx.AsyncClient, s: dict[str, Any], reward: float) -> None:
    async with httpx.AsyncClient(base_url=s["base_url"], timeout=120,
                                 headers={"Authorization": f"Bearer {s['api_key']}"}) as agent:
        resp = await agent.post("/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert resp.status_code == 200, resp.text
    assert (await http.post("/reward", json={"session_id": s["session_id"], "reward": reward})).status_code == 200
    assert (await http.post(f"/v1/sessions/{s['session_id']}/finish")).status_code == 200


async def run(gw: GatewayProc) -> None:
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {gw.admin_key}"}) as http:
        await register(http, 0)  # limit (0 + 0 + 1) x 2 groups x 8 sessions = 16
        assert (await trainer_state(http))["limit"] == SIZE * GROUPS

        # Round 1: the groups are admitted once each, trained, and the trainer steps.
        before = await trainer_state(http)
        made = await first_sessions_at_once(gw, http, "r1")
        state = await trainer_state(http)
        assert state["admitted"] - before["admitted"] == SIZE * GROUPS, state
        for g in range(GROUPS):
            group = (await http.get(f"/v1/groups/r1-{g}")).json()
            # every place taken and no more reserved: not "open"
            assert group["size"] == SIZE and len(group["sessions"]) == SIZE and group["status"] == "active", group
        over = await http.post("/v1/sessions", json={"group_id": "r1-extra", "metadata": {"group_size": SIZE}})
        assert over.status_code == 429 and "retry-after" in over.headers, over.text  # the budget is exact
        await asyncio.gather(*(one_turn(gw, http, s, float(i % 2)) for i, s in enumerate(made)))
        trained: list[str] = []
        deadline = time.monotonic() + 120
        while len(trained) < GROUPS and time.monotonic() < deadline:
            resp = await http.get("/v1/trajectories", params={"max_groups": GROUPS, "wait_s": 5})
            if resp.status_code == 204:
                continue
            assert resp.status_code == 200, resp.text
            rows, meta = decode_batch(resp.content)
            assert all(g["complete"] for g in meta["groups"]), meta["groups"]
            trained += [g["group_id"] for g in meta["groups"]]
            assert (await http.post("/v1/trajectories/ack", json={"lease_id": meta["lease_id"]})).status_code == 200
        assert sorted(trained) == [f"r1-{g}" for g in range(GROUPS)]
        # trained sessions stay counted until the trainer's version moves on; the budget in use is back
        # where it was once it does
        assert (await trainer_state(http))["admitted"] == state["admitted"]
        await register(http, 1)
        after = await trainer_state(http)
        assert after["limit"] - after["admitted"] == before["limit"] - before["admitted"], (before, after)

        # Round 2: admitted once each again, then abandoned as groups: exactly the charge comes back.
        before = after
        await first_sessions_at_once(gw, http, "r2")
        assert (await trainer_state(http))["admitted"] == before["admitted"] + SIZE * GROUPS
        for g in range(GROUPS):
            assert (await http.post(f"/v1/groups/r2-{g}/abandon")).status_code == 200
        assert (await trainer_state(http))["admitted"] == before["admitted"]


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("pg+redis", marks=pytest.mark.services)])
def test_concurrent_first_sessions_charge_each_group_once(backend: str, gateway_factory: Any, request: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_GATEWAY_TICK_S", "0.1")
    if backend == "sqlite":
        gw = gateway_factory()
    else:
        gw = gateway_factory(db=request.getfixturevalue("pg_url"), redis=REDIS_URL,
                             redis_prefix=request.getfixturevalue("redis_prefix"))
    asyncio.run(run(gw))
