"""kill -9 of a gateway process under load (PostgreSQL + Redis, and SQLite; real tiny engine): every
acknowledged turn is in the database under its parent, and no session is stuck afterwards (with Redis the
in-flight markers lapse with their replica); an implicit conversation goes on after a restart; two replicas
across a push."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import openai
import pytest
import redis.asyncio as aioredis

from gateway.lifecycle import InFlight
from gateway.store import Store
from tests.conftest import REDIS_URL
from tests.engine_hooks import wait_for
from tests.gateway.conftest import GatewayProc, read_turns
from tests.gateway.under_load import Agents, check_recorded


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgres+redis", "sqlite"])
def test_kill_9_under_load_loses_no_acknowledged_turn_and_leaves_no_session_stuck(
        gateway_factory: Callable[..., GatewayProc], backend: str, request: pytest.FixtureRequest) -> None:
    """Six agents in multi-turn conversations; the gateway is killed with -9 while turns are in flight.
    Afterwards every acknowledged turn is in the database under its parent, and no session is stuck: with
    Redis its in-flight markers lapse with the dead replica; a gateway restarted on the database serves
    every session again."""
    if backend == "sqlite":
        db, redis, prefix = None, None, None
    else:
        db, redis, prefix = request.getfixturevalue("pg_url"), REDIS_URL, request.getfixturevalue("redis_prefix")
    gw = gateway_factory(db=db, redis=redis, redis_prefix=prefix)
    sessions = [gw.create_session(group_id=f"g{i}") for i in range(6)]
    agents = Agents(gw.base_url, sessions).start()
    agents.wait_acked(30)
    os.kill(gw.pid, signal.SIGKILL)  # turns are in flight right now
    agents.stop()
    assert len(agents.acked) >= 30 and agents.statuses[500] == 0, agents.statuses
    check_recorded(gw.db, agents.acked)
    print(f"kill -9 on {backend}: {len(agents.acked)} turns acknowledged, all recorded under their parents")

    if redis is not None:
        async def still_busy() -> set[str]:
            client = aioredis.Redis.from_url(redis)
            try:
                inflight = InFlight(client, prefix=prefix or "")
                ids = [s["session_id"] for s in sessions]
                busy = await inflight.busy(ids)
                limit = time.monotonic() + 45  # markers lapse within their 30 s TTL
                while busy and time.monotonic() < limit:
                    await asyncio.sleep(1)
                    busy = await inflight.busy(ids)
                return busy
            finally:
                await client.aclose()

        busy = asyncio.run(still_busy())
        assert busy == set(), f"sessions still marked in flight after the replica died: {busy}"
    again = gateway_factory(db=gw.db, redis=redis, redis_prefix=prefix)
    for sess in sessions:
        client = openai.OpenAI(base_url=again.base_url + "/v1", api_key=sess["api_key"], max_retries=0, timeout=60)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "after"}], max_tokens=2)


def test_an_implicit_conversation_continues_on_a_gateway_restarted_after_kill_9(
        gateway_factory: Callable[..., GatewayProc]) -> None:
    """SQLite, no Redis: the implicit-episode index lived in the killed process. A gateway restarted on the
    database links the conversation's next turn to its parent in the same episode (found in SQL)."""
    gw = gateway_factory()
    messages: list[dict[str, str]] = [{"role": "user", "content": "count to three"}]
    ids = []
    for follow_up in ("go on", None):
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.agent_key, max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        ids.append(r.id)
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": follow_up or "and after the restart?"}]
    os.kill(gw.pid, signal.SIGKILL)
    again = gateway_factory(db=gw.db)
    client = openai.OpenAI(base_url=again.base_url + "/v1", api_key=again.agent_key, max_retries=0, timeout=60)
    ids.append(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4).id)
    t1, t2, t3 = read_turns(gw.db, ids)
    assert (t2.parent_id, t3.parent_id) == (t1.id, t2.id)
    assert t1.session_id == t2.session_id == t3.session_id


@pytest.mark.slow
def test_two_gateway_processes_pause_resume_and_tag_alike_across_a_push(
        gateway_factory: Callable[..., GatewayProc], pg_url: str, redis_prefix: str) -> None:
    """Two replicas on one PostgreSQL + Redis and the same engine; the trainer talks to A only."""
    import httpx

    a = gateway_factory(db=pg_url, redis=REDIS_URL, redis_prefix=redis_prefix)
    b = gateway_factory(db=pg_url, redis=REDIS_URL, redis_prefix=redis_prefix)
    engine = a.engine_urls[0]
    model = httpx.get(engine + "/get_model_info", timeout=30).json()["model_path"]
    with a.admin() as admin_a, b.admin() as admin_b:
        try:
            assert admin_a.post("/admin/pause", json={}).status_code == 200
            wait_for(lambda: admin_b.get("/admin/engines").json()["paused"], "B to pause with A")
            pushed = httpx.post(engine + "/update_weights_from_disk",
                                json={"model_path": model, "weight_version": "4"}, timeout=120)
            assert pushed.status_code == 200 and pushed.json()["success"], pushed.text
            assert admin_a.post("/admin/resume", json={"weight_version": 4}).status_code == 200
            wait_for(lambda: (lambda h: h["weight_version"] == 4 and not h["paused"])(
                httpx.get(b.base_url + "/health", timeout=30).json()), "B to resume at version 4 with A")
            ids = []
            for gw in (a, b):
                client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.agent_key, max_retries=0, timeout=60)
                ids.append(client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4).id)

            async def versions() -> list[set[int]]:
                store = await Store.open(pg_url, migrate=False)
                try:
                    return [set((await store.get_interaction(interaction_id=i)).output_versions) for i in ids]
                finally:
                    await store.close()

            assert asyncio.run(versions()) == [{4}, {4}]
        finally:
            admin_a.post("/admin/resume", json={"weight_version": 0})
            httpx.post(engine + "/update_weights_from_disk", json={"model_path": model, "weight_version": "0"},
                       timeout=120)  # the engine is shared by later tests
