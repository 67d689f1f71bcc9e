"""kill -9 of a gateway process under load (PostgreSQL + Redis, real tiny engine): every acknowledged turn is
in the database, and no session stays marked in flight (the markers lapse with their replica)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from gateway.lifecycle import InFlight
from gateway.store import Store
from tests.conftest import REDIS_URL
from tests.gateway.conftest import GatewayProc


@pytest.mark.slow
def test_kill_9_under_load_loses_no_acknowledged_turn_and_leaves_no_session_in_flight(
        gateway_factory: Callable[..., GatewayProc], pg_url: str, redis_prefix: str) -> None:
    gw = gateway_factory(db=pg_url, redis=REDIS_URL, redis_prefix=redis_prefix)
    sessions = [gw.create_session(group_id=f"g{i}") for i in range(6)]
    acked: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def agent(sess: dict[str, str]) -> None:
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=sess["api_key"], max_retries=0, timeout=60)
        i = 0
        while not stop.is_set():
            try:
                r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"q{i}"}],
                                                   max_tokens=24)
            except openai.APIError:
                return  # the gateway is gone
            with lock:
                acked.append(r.id)
            i += 1

    threads = [threading.Thread(target=agent, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acked) < 12 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(gw.pid, signal.SIGKILL)  # turns are in flight right now
    stop.set()
    for t in threads:
        t.join(60)
    assert len(acked) >= 12

    async def check() -> tuple[int, set[str]]:
        store = await Store.open(pg_url, migrate=False)
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            found = 0
            for rid in acked:
                await store.get_interaction(interaction_id=rid)  # raises if an acknowledged turn is missing
                found += 1
            inflight = InFlight(client, prefix=redis_prefix)
            ids = [s["session_id"] for s in sessions]
            busy = await inflight.busy(ids)
            limit = time.monotonic() + 45  # markers lapse within their 30 s TTL
            while busy and time.monotonic() < limit:
                await asyncio.sleep(1)
                busy = await inflight.busy(ids)
            return found, busy
        finally:
            await client.aclose()
            await store.close()

    found, busy = asyncio.run(check())
    assert found == len(acked)
    assert busy == set(), f"sessions still marked in flight after the replica died: {busy}"


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
            deadline = time.monotonic() + 10
            while not admin_b.get("/admin/engines").json()["paused"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert admin_b.get("/admin/engines").json()["paused"], "B did not pause with A"
            pushed = httpx.post(engine + "/update_weights_from_disk",
                                json={"model_path": model, "weight_version": "4"}, timeout=120)
            assert pushed.status_code == 200 and pushed.json()["success"], pushed.text
            assert admin_a.post("/admin/resume", json={"weight_version": 4}).status_code == 200
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                health = httpx.get(b.base_url + "/health", timeout=10).json()
                if health["weight_version"] == 4 and not health["paused"]:
                    break
                time.sleep(0.05)
            assert health["weight_version"] == 4 and not health["paused"], health
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
