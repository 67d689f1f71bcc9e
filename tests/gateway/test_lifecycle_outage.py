"""The lifecycle loop during an outage of Redis: one warning when it starts, a count while it lasts, one
line when it ends (it logged a full traceback on every 0.5 s tick). Redis is a private ``redis-server``
that the test kills and starts again on the same port."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway import errors
from gateway.lifecycle import ExportSettings, TrajectoryService, outage_of
from gateway.store import Store
from gateway.store import errors as store_errors
from tests.services import PrivateRedis

LOGGER = "agentrl.gateway.lifecycle"


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for ``condition``, checked as the loop runs; the bound is only a hang guard."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.005)
    assert condition(), what


def lifecycle_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


async def test_a_redis_outage_is_logged_once_counted_and_its_end_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    redis = PrivateRedis(tmp_path)
    redis.start()
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/life.db", redis_url=redis.url, redis_prefix="t:")
    service = TrajectoryService(store, ExportSettings(tick_s=0.001))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        await service.tick()  # Redis up: the tick works
        redis.stop()
        service.start()
        await until(lambda: service.stats.tick_errors >= 25, "25 ticks failed")
        lines = lifecycle_lines(caplog)
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert lines[0].levelno == logging.WARNING and lines[0].exc_info is None
        assert "Redis is unavailable" in lines[0].getMessage()
        assert service.stats.tick_outages == service.stats.tick_errors >= 25

        redis.start()
        await until(lambda: any("is back" in r.getMessage() for r in lifecycle_lines(caplog)), "the end is said")
        # the first upkeep after the restart may fail once more (the queue's stream went with Redis's data,
        # and the failing call has it created again: test_the_redis_queue_heals_after_redis_lost_its_data)
        ticks = service.stats.ticks
        await until(lambda: service.stats.ticks >= ticks + 2 * TrajectoryService.UPKEEP_EVERY_TICKS, "two upkeeps")
        failed = service.stats.tick_outages
        ticks = service.stats.ticks
        await until(lambda: service.stats.ticks >= ticks + 2 * TrajectoryService.UPKEEP_EVERY_TICKS, "two more")
        assert service.stats.tick_outages == failed  # nothing failed since
        lines = [r.getMessage() for r in lifecycle_lines(caplog)]
        assert len(lines) in (2, 4), lines  # one line when an outage starts, one when it ends: never a line a tick
        assert all(r.exc_info is None for r in lifecycle_lines(caplog))
        for start, end in zip(lines[::2], lines[1::2]):
            assert start.startswith("lifecycle: Redis is unavailable (") and end.startswith("lifecycle: Redis is back; ")
    finally:
        await service.stop()
        await store.close()
        redis.stop()


async def test_the_redis_queue_heals_after_redis_lost_its_data(tmp_path: Path) -> None:
    """A Redis restarted without its data has no stream and no consumer group: the queue's next call
    fails (a 503) and creates them again, so the call after it works (it failed for the process's life)."""
    redis = PrivateRedis(tmp_path)
    redis.start()
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/q.db", redis_url=redis.url, redis_prefix="q:")
    service = TrajectoryService(store, ExportSettings())
    try:
        await service.queue.counts()
        redis.stop()
        redis.start()
        outcomes: list[str] = []
        for _ in range(3):  # the first call meets the connection Redis closed, the second the lost group
            try:
                await service.queue.maintain(min_version=None, max_held_s=60.0)
                await service.queue.counts()
                outcomes.append("ok")
            except errors.StoreUnavailable as exc:
                outcomes.append(str(exc))
        assert outcomes[-1] == "ok", outcomes
        assert await service.lease_batch(1, 0.0) is None  # a lease reads the group too
    finally:
        await service.stop()
        await store.close()
        redis.stop()


def test_what_counts_as_an_outage() -> None:
    def raised_from(exc: BaseException, cause: BaseException) -> BaseException:
        try:
            raise exc from cause
        except BaseException as got:  # noqa: BLE001 - building a chain
            return got

    assert outage_of(RedisConnectionError("refused")) == "Redis"
    assert outage_of(raised_from(store_errors.StoreUnavailable("Redis failed"), RedisConnectionError("x"))) == "Redis"
    assert outage_of(store_errors.StoreUnavailable("database unavailable")) == "the database"
    assert outage_of(errors.StoreUnavailable("the conversation store is unavailable")) == "the database"
    assert outage_of(ConnectionRefusedError("refused")) == "the database"  # an OSError from the driver
    assert outage_of(ValueError("a bug")) is None
    assert outage_of(KeyError("a bug")) is None
