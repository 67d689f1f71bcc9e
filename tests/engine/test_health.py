"""``/health`` behaves as SGLang's: a one-token generation that waits behind a pause; and the gateway's router
still resumes an engine whose health probe failed while it was paused (the disk push that left SGLang
paused for good, issue 11)."""

from __future__ import annotations

import asyncio
import time

import httpx

from gateway.engine_client import EngineClient, EngineRouter, SamplingParams


def test_health_blocks_behind_a_pause_and_the_router_still_resumes(engine_url: str) -> None:
    url = engine_url
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.post(url + "/pause_generation", json={"mode": "abort"}, timeout=10).status_code == 200
    started = time.monotonic()
    assert httpx.get(url + "/health", timeout=10).status_code == 503  # its generation waited for 2 s
    assert time.monotonic() - started >= 2.0
    assert httpx.get(url + "/get_model_info", timeout=10).status_code == 200  # answers while paused
    assert httpx.post(url + "/continue_generation", json={}, timeout=10).status_code == 200
    assert httpx.get(url + "/health", timeout=10).status_code == 200

    async def push_through_the_router() -> list[int]:
        async with httpx.AsyncClient() as http:
            router = EngineRouter([EngineClient(url, http)])
            await router.pause()
            await router.check_health()  # the health loop ticks during a long push
            await router.resume(1)
            await router.check_health()
            assert router.engines[0].healthy
            last = None
            async for gen in router.generate([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0),
                                             affinity_key=None, stream=False):
                last = gen
            assert last is not None
            return last.versions

    try:
        # no weights were pushed: the tokens carry the version the engine reports, not the announced one
        assert asyncio.run(asyncio.wait_for(push_through_the_router(), 60)) == [0, 0, 0]
    finally:  # the engine is shared by the engine tests: never leave it paused
        httpx.post(url + "/continue_generation", json={}, timeout=10)
