"""Pause and weight version: a pause lapses after its deadline, resume always resumes, and every replica
sharing Redis pauses, resumes and tags alike (``gateway.control``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from gateway import control as control_module
from gateway.control import ControlPlane
from gateway.engine_client import EngineClient, EngineRouter
from gateway.metrics import Metrics
from tests.conftest import REDIS_URL
from tests.gateway.test_openai_inprocess import ADMIN, Gw, make_gw, tokenizer  # noqa: F401 (fixtures)

HI = [{"role": "user", "content": "hi"}]


async def _chat(gw: Gw, **kw: Any) -> Any:
    return await gw.sdk().chat.completions.create(model="m", messages=HI, max_tokens=4, **kw)


async def _until(check: Any, timeout_s: float = 120.0) -> None:  # the bound is a hang guard
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)


class _Clock:
    """The control plane's wall clock, moved by the test: the pause's deadline passes when the test says so,
    not when a slow machine happens to get there (with a real 0.6 s deadline the turn could be resumed
    before the test saw it held)."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


async def test_a_pause_whose_trainer_died_lapses_after_its_deadline(make_gw: Any, monkeypatch: Any) -> None:
    clock = _Clock()
    monkeypatch.setattr(control_module, "time", clock)
    async with make_gw(["held"], pause_timeout_s=0.6) as gw:
        assert (await gw.post("/admin/pause", {}, key=ADMIN)).status_code == 200
        turn = asyncio.ensure_future(_chat(gw))  # held: the trainer that paused never resumes
        await _until(lambda: gw.svc.router.held == 1)
        clock.now += 0.5  # before the deadline: the watchdog (every 0.15 s) leaves the pause alone
        await asyncio.sleep(0.3)  # (a negative check: on the test's clock no wait can make it lapse)
        assert not turn.done() and not gw.svc.control.expired
        clock.now += 0.2  # past the 0.6 s deadline
        result = await asyncio.wait_for(turn, 120)  # the deadline resumed generation (a hang guard)
        assert result.choices[0].message.content == "held"
        assert not gw.svc.router.paused and gw.svc.control.expired == 1
        metrics = (await gw.http.get("/metrics")).text
        assert "agentrl_gateway_pause_expired_total 1.0" in metrics
        # a late resume from a trainer that came back is harmless (idempotent) and sets the version
        again = await gw.post("/admin/resume", {"weight_version": 0}, key=ADMIN)
        assert again.status_code == 200 and not gw.svc.router.paused


async def test_resume_sets_running_even_when_continue_is_cancelled() -> None:
    """``continue_generation`` hangs and the resume is cancelled: held generations must still go on."""
    hang, reached = asyncio.Event(), asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/continue_generation":
            reached.set()
            await hang.wait()
        return httpx.Response(200, json={"status": "ok"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        router = EngineRouter([EngineClient("http://e", http)])
        await router.pause()
        assert router.paused
        resume = asyncio.ensure_future(router.resume(2))
        await asyncio.wait_for(reached.wait(), 120)  # the resume hangs in continue_generation now
        resume.cancel()
        await asyncio.gather(resume, return_exceptions=True)
        assert not router.paused and router.weight_version == 2


async def test_two_replicas_pause_resume_and_tag_alike(make_gw: Any, redis_prefix: str) -> None:
    shared = {"redis": REDIS_URL, "redis_prefix": redis_prefix}
    async with make_gw(["one"], **shared) as a, make_gw(["two"], **shared) as b:
        assert (await a.post("/admin/pause", {}, key=ADMIN)).status_code == 200
        await _until(lambda: b.svc.router.paused)  # B paused through Redis, not by the trainer
        assert b.engine.inner.app  # each replica has its own engine here: B paused it too
        held = asyncio.ensure_future(_chat(b))
        await _until(lambda: b.svc.router.held == 1)
        for gw in (a, b):  # the trainer pushes version 5 to every engine ...
            async with httpx.AsyncClient(transport=gw.engine, base_url="http://engine") as engine:
                assert (await engine.post("/update_weights_from_disk",
                                          json={"model_path": "x", "weight_version": "5"})).status_code == 200
        assert (await a.post("/admin/resume", {"weight_version": 5}, key=ADMIN)).status_code == 200  # ... via A
        result = await asyncio.wait_for(held, 120)  # a hang guard
        await _until(lambda: not b.svc.router.paused and b.svc.router.weight_version == 5)
        health = (await b.http.get("/health")).json()
        assert health["weight_version"] == 5 and health["paused"] is False
        for gw, res in ((b, result), (a, await _chat(a))):
            turn = await gw.store.get_interaction(interaction_id=res.id)
            assert set(turn.output_versions) == {5}
        # a replica that starts later adopts the shared version (whatever its engine said at start-up)
        late = ControlPlane(EngineRouter([EngineClient("http://engine", a.http)]), Metrics(),
                            redis=a.store.redis, prefix=redis_prefix)
        await late.start()
        try:
            assert late.router.weight_version == 5 and not late.router.paused
        finally:
            await late.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_replica_whose_engine_aborts_before_the_pause_message_holds_the_turn(
        make_gw: Any, redis_prefix: str, stream: bool) -> None:
    """Another replica paused the shared state but this one has not heard yet: an abort from the engine
    is checked against Redis and held, not answered as an engine error."""
    shared = {"redis": REDIS_URL, "redis_prefix": redis_prefix}
    async with make_gw(["one"], **shared) as a, make_gw(["two"], **shared) as b:
        await b.svc.control.close()  # B stops following: it will only learn of the pause by asking
        assert (await a.post("/admin/pause", {}, key=ADMIN)).status_code == 200
        assert not b.svc.router.paused
        assert await b.svc.control._paused_elsewhere()
        assert b.svc.router.paused
        held = asyncio.ensure_future(_chat(b, stream=stream) if not stream else _drain(b))
        await _until(lambda: b.svc.router.held == 1)
        assert (await a.post("/admin/resume", {"weight_version": 0}, key=ADMIN)).status_code == 200
        await b.svc.control._catch_up()
        await asyncio.wait_for(held, 120)  # a hang guard


async def _drain(gw: Gw) -> str:
    stream = await _chat(gw, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
