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
