"""Export and leasing through the real gateway, engine and `openai` SDK (SQLite, and PostgreSQL + Redis)."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import redis

from agentrl.trajectory import LEASE_HEADER, MEDIA_TYPE, decode_batch
from gateway.store import Store
from agentrl.procs import Processes
from tests.conftest import REDIS_URL, free_port, pg_admin
from tests.gateway.conftest import ADMIN_KEY, AGENT_KEY, GatewayProc

EXPORT_ENV = {
    "AGENTRL_GATEWAY_GROUP_SIZE": "4",
    "AGENTRL_GATEWAY_GAMMA": "0.9",
    "AGENTRL_GATEWAY_TICK_S": "0.1",
    "AGENTRL_GATEWAY_LEASE_TIMEOUT_S": "3",  # the tests ack within it (a call or two); expiry waits past it
    "AGENTRL_GATEWAY_RETRY_AFTER_S": "3",
}


@pytest.fixture(scope="module", params=["sqlite", pytest.param("pg+redis", marks=pytest.mark.services)])
def gw(request, engine_url, tmp_path_factory) -> Iterator[GatewayProc]:
    """One gateway per backend for this module (starting one costs tens of seconds on a busy machine);
    each test below leaves it as it found it (trainer state re-registered, queue drained)."""
    tmp = tmp_path_factory.mktemp("export-gw")
    port = free_port()
    argv = [sys.executable, "-m", "agentrl", "gateway", "--engine-url", engine_url, "--port", str(port),
            "--admin-key", ADMIN_KEY, "--agent-key", AGENT_KEY, "--log-level", "warning"]
    cleanup = []
    if request.param == "sqlite":
        db = f"sqlite+aiosqlite:///{tmp}/gw.db"
    else:
        name = "agentrl_export_" + uuid.uuid4().hex[:12]
        asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
        cleanup.append(lambda: asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')))
        db = f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
        prefix = f"agentrl-test:{uuid.uuid4().hex[:12]}:"
        argv += ["--redis", REDIS_URL, "--redis-prefix", prefix]

        def drop_keys() -> None:
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=prefix + "*"):
                client.delete(key)
            client.close()

        cleanup.append(drop_keys)
    argv += ["--db", db]
    try:
        with Processes(tmp / "logs") as procs:
            child = procs.start(f"gateway-{port}", argv, env=EXPORT_ENV)
            base = f"http://127.0.0.1:{port}"
            procs.wait_healthy(child, base + "/health", timeout_s=180)
            yield GatewayProc(base, ADMIN_KEY, AGENT_KEY, db, [engine_url], child.log_path)
    finally:
        for step in cleanup:
            step()


def agent(session: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def two_turns(client: openai.OpenAI, seed: int):
    """A self-correction episode: ask, then ask again after the (wrong) first answer."""
    messages = [{"role": "user", "content": f"What is {seed} + 3?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=seed,
                                           logprobs=True)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "That is wrong. Try again."}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=seed + 100,
                                            logprobs=True)
    return first, second


def lease(admin: httpx.Client, max_groups: int = 1, wait_s: float = 120.0):
    resp = admin.get("/v1/trajectories", params={"max_groups": max_groups, "wait_s": wait_s}, timeout=wait_s + 30)
    if resp.status_code == 204:
        return None, None, None
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == MEDIA_TYPE
    rows, meta = decode_batch(resp.content)
    assert meta["lease_id"] == resp.headers[LEASE_HEADER]
    return rows, meta, resp.headers[LEASE_HEADER]


async def recorded(db: str, session_ids: list[str]) -> dict[str, list]:
    store = await Store.open(db, migrate=False)
    try:
        return {s: await store.session_interactions(session_id=s) for s in session_ids}
    finally:
        await store.close()


def error_code(resp: httpx.Response) -> str:
    return resp.json()["error"]["code"]


def past(deadline: float) -> None:
    """Sleep until the wall clock is past a lease's ``lease_deadline`` (the gateway's SQL queue reads
    ``time.time()``, its Redis queue Redis's TIME: the same host clock); waiting longer cannot make a lease
    less expired."""
    while time.time() <= deadline + 0.1:
        time.sleep(max(0.01, deadline + 0.1 - time.time()))


def test_group_of_four_two_turn_sessions_leased_as_one_batch(gw):
    with gw.admin() as admin:
        # A trainer with room for everything this test makes (a fresh registration: the budget restarts).
        r = admin.post("/admin/trainer", json={"version": 0, "batch_size": 64, "staleness_bound": 4})
        assert r.status_code == 200, r.text
        sessions = [gw.create_session(group_id="grp-selfcorrect", task_id=f"task-{i}") for i in range(4)]
        replies = {}
        for i, s in enumerate(sessions):
            first, second = two_turns(agent(s), seed=i)
            replies[s["session_id"]] = (first, second)
            for resp, reward in ((first, 0.0), (second, 1.0)):
                r = admin.post("/reward", json={"response_id": resp.id, "reward": reward})
                assert r.status_code == 200, r.text
        # Three finished sessions are not a group of four: nothing to lease yet.
        for s in sessions[:3]:
            assert admin.post(f"/v1/sessions/{s['session_id']}/finish").status_code == 200
        assert lease(admin, wait_s=0.5)[0] is None
        assert admin.post(f"/v1/sessions/{sessions[3]['session_id']}/finish").status_code == 200

        rows, meta, lease_id = lease(admin)
        assert lease(admin, wait_s=0)[0] is None  # leased: nothing else to lease (checked within the lease)
        ids = [s["session_id"] for s in sessions]
        assert sorted(r.session_id for r in rows) == sorted(ids)
        assert [g["group_id"] for g in meta["groups"]] == ["grp-selfcorrect"]
        assert meta["groups"][0]["complete"] and sorted(meta["groups"][0]["session_ids"]) == sorted(ids)

        tree = asyncio.run(recorded(gw.db, ids))
        for row in rows:
            root, child = tree[row.session_id]
            first, second = replies[row.session_id]
            assert (root.id, child.id, child.parent_id) == (first.id, second.id, first.id)
            # The row is the recorded tokens, concatenated root to leaf, exactly.
            expected = root.prompt_ids + root.output_ids + child.prompt_ids + child.output_ids
            assert row.input_ids.tolist() == expected
            gen = np.flatnonzero(row.loss_mask)
            assert row.input_ids[gen].tolist() == root.output_ids + child.output_ids
            np.testing.assert_array_equal(row.logprobs[gen],
                                          np.float32(root.output_logprobs + child.output_logprobs))
            assert row.versions[gen].tolist() == root.output_versions + child.output_versions
            assert row.turn_ids[gen].tolist() == [0] * len(root.output_ids) + [1] * len(child.output_ids)
            assert set(row.turn_ids[row.loss_mask == 0].tolist()) == {-1}
            # ... and what the agent was told: token counts and logprobs of each answer.
            for turn, resp in ((0, first), (1, second)):
                mine = row.logprobs[row.turn_ids == turn]
                assert len(mine) == resp.usage.completion_tokens
                np.testing.assert_allclose(mine, [t.logprob for t in resp.choices[0].logprobs.content], atol=1e-6)
            np.testing.assert_allclose(row.turn_rewards, [0.0, 1.0])
            np.testing.assert_allclose(row.turn_returns, [0.9, 1.0])
            assert row.reward == pytest.approx(0.9) and row.leaf_id == second.id
            assert row.task_id == f"task-{ids.index(row.session_id)}"

        # Exported sessions are consumed: a reward for them is refused.
        r = admin.post("/reward", json={"session_id": ids[0], "reward": 1.0})
        assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error"

        # Not acknowledged within the lease timeout: the group comes back under a new lease.
        past(meta["lease_deadline"])
        r = admin.post("/v1/trajectories/ack", json={"lease_id": lease_id})
        assert r.status_code == 409 and error_code(r) == "lease_expired"
        again, meta2, lease2 = lease(admin)
        assert lease2 != lease_id and meta2["groups"][0]["deliveries"] == 2
        assert sorted(r.row_id for r in again) == sorted(r.row_id for r in rows)  # same ids: dedupable
        r = admin.post("/v1/trajectories/ack", json={"lease_id": lease2})
        assert r.status_code == 200 and r.json()["acked_groups"] == 1
        r = admin.post("/v1/trajectories/ack", json={"lease_id": lease2})
        assert r.status_code == 409 and error_code(r) == "lease_acked"
        r = admin.post("/v1/trajectories/ack", json={"lease_id": "lease-unknown"})
        assert r.status_code == 404
        past(meta2["lease_deadline"])
        assert lease(admin, wait_s=0.3)[0] is None  # acknowledged: never re-delivered

        for params in ({"max_groups": 0}, {"max_groups": 5000}, {"max_groups": "many"}, {"wait_s": -1}):
            r = admin.get("/v1/trajectories", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] in params, r.text
        r = admin.post("/v1/trajectories/ack", json={})
        assert r.status_code == 400
        stats = admin.get("/v1/trajectories/stats").json()
        assert stats["stats"]["groups_acked"] == 1 and stats["stats"]["groups_redelivered"] == 1
    r = httpx.get(gw.base_url + "/v1/trajectories", headers={"Authorization": f"Bearer {gw.agent_key}"})
    assert r.status_code == 403


def test_staleness_budget_429_then_admission_after_version_advances(gw):
    implicit = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.agent_key, max_retries=0)
    hello = [{"role": "user", "content": "hi"}]
    with gw.admin() as admin:
        # v=0, B=1 group of 4 sessions, k=0: (0 + 0 + 1) x 1 x 4 = 4 sessions.
        r = admin.post("/admin/trainer", json={"version": 0, "batch_size": 1, "staleness_bound": 0})
        assert r.status_code == 200 and r.json()["trainer"]["limit"] == 4, r.text
        pairs = [{"group_id": name, "metadata": {"group_size": 2}} for name in ("pair-a", "pair-a", "pair-b", "pair-b")]
        sessions = [gw.create_session(**body) for body in pairs]
        r = admin.post("/v1/sessions", json=pairs[0])
        assert r.status_code == 429 and int(r.headers["retry-after"]) == 3
        assert r.json()["error"]["code"] == "staleness_budget"
        assert admin.post("/v1/sessions", json={"metadata": {"eval": True}}).status_code == 200
        # Implicit-mode episodes obey the same budget.
        with pytest.raises(openai.RateLimitError):
            implicit.chat.completions.create(model="tiny", messages=hello, max_tokens=2)
        # Run pair-a to the queue.
        for s in sessions[:2]:
            reply = agent(s).chat.completions.create(model="tiny", max_tokens=4,
                                                     messages=[{"role": "user", "content": "1+1?"}])
            assert admin.post("/reward", json={"response_id": reply.id, "reward": 1.0}).status_code == 200
            assert admin.post(f"/v1/sessions/{s['session_id']}/finish").status_code == 200
        # The trainer stepped: room for one more batch (4 sessions), explicit and implicit alike.
        r = admin.post("/admin/trainer", json={"version": 1, "batch_size": 1, "staleness_bound": 0})
        assert r.json()["trainer"]["limit"] == 8 and r.json()["trainer"]["admitted"] == 4
        implicit.chat.completions.create(model="tiny", messages=hello, max_tokens=2)
        # pair-b's two places are taken: its next session starts the group's next pair, reserved whole
        # (5 + 2 = 7); the pair's second session takes the reserved place; a third pair would be 9 > 8.
        for _ in range(2):
            assert admin.post("/v1/sessions", json=pairs[2]).status_code == 200
        assert admin.post("/v1/sessions", json=pairs[2]).status_code == 429

        # pair-a's tokens carry version 0 < v - k = 1: the group is held back, not leased. A lease holds it
        # once the lifecycle has queued it (a tick after the finish): every lease until then gets nothing.
        deadline = time.monotonic() + 120  # a hang guard
        while True:
            assert lease(admin, wait_s=0.2)[0] is None
            queue = admin.get("/v1/trajectories/stats").json()["queue"]
            if queue["held"] or time.monotonic() > deadline:
                break
        assert queue["held"] == 1 and queue["held_rows"] == 2
        # A trainer that accepts older data (k = 1) gets it.
        r = admin.post("/admin/trainer", json={"version": 1, "batch_size": 1, "staleness_bound": 1})
        assert r.status_code == 200
        rows, meta, lease_id = lease(admin)
        assert sorted(r.session_id for r in rows) == sorted(s["session_id"] for s in sessions[:2])
        assert admin.post("/v1/trajectories/ack", json={"lease_id": lease_id}).status_code == 200


def test_trainer_tells_the_gateway_its_group_size(gw):
    """One source of truth: the trainer's group size (not --group-size of the gateway) sizes the budget."""
    with gw.admin() as admin:
        r = admin.post("/admin/trainer", json={"version": 0, "batch_size": 3, "staleness_bound": 0, "group_size": 2})
        assert r.status_code == 200, r.text
        assert r.json()["trainer"]["group_size"] == 2 and r.json()["trainer"]["limit"] == 6
        r = admin.post("/admin/trainer", json={"version": 0, "batch_size": 3, "staleness_bound": 0, "group_size": 0})
        assert r.status_code == 400
