"""The store's first-come, first-served wait for pool connections (``gateway.store.gate``)."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from gateway.store import Store, StoreUnavailable
from gateway.store.gate import ConnectionGate


async def test_waiters_get_the_slots_in_arrival_order_and_nesting_passes_through() -> None:
    gate = ConnectionGate(2)
    order: list[int] = []
    release = asyncio.Event()

    async def caller(i: int) -> None:
        async with gate.slot():
            order.append(i)
            async with gate.slot():  # a store call inside another: no second slot, no deadlock
                pass
            if i < 2:
                await release.wait()

    tasks = []
    for i in range(12):
        tasks.append(asyncio.ensure_future(caller(i)))
        await asyncio.sleep(0)  # arrival order = i
    await asyncio.sleep(0.01)
    assert order == [0, 1] and gate.waiting == 10 and gate.holding == 2
    release.set()
    await asyncio.gather(*tasks)
    assert order == list(range(12)) and gate.waiting == 0 and gate.holding == 0 and gate.max_waited == 10


async def test_the_wait_is_bounded_in_length_and_in_time() -> None:
    gate = ConnectionGate(1, max_waiting=2, wait_s=0.2)
    held = asyncio.Event()
    done = asyncio.Event()

    async def holder() -> None:
        async with gate.slot():
            held.set()
            await done.wait()

    first = asyncio.ensure_future(holder())
    await held.wait()
    waiters = [asyncio.ensure_future(gate.slot().__aenter__()) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(StoreUnavailable, match="2 calls already wait"):
        async with gate.slot():
            pass
    for w in waiters:  # nobody gave the slot back within wait_s
        with pytest.raises(StoreUnavailable, match="no connection free within 0.2 s"):
            await w
    done.set()
    await first
    async with gate.slot():  # free again
        assert gate.holding == 1
    assert gate.refused == 3 and gate.holding == 0


@pytest.mark.services
async def test_more_concurrent_reads_than_pool_connections_wait_instead_of_failing(shared_pg_url: str) -> None:
    """150 reads at once, each holding its connection 50 ms, on the store's 30-connection PostgreSQL pool
    whose own wait is cut to 0.2 s here: without the gate most of them fail with the pool's timeout
    (StoreUnavailable, 503); through the gate none reaches the pool's wait, so all succeed."""
    store = await Store.open(shared_pg_url, migrate=False)
    try:
        store.engine.pool._timeout = 0.2  # noqa: SLF001 - what 30 s is under the soak's saturated loop

        async def read() -> int:
            async with store.read_connection() as conn:
                return (await conn.execute(sa.text("SELECT 1 FROM pg_sleep(0.05)"))).scalar_one()

        assert await asyncio.gather(*(read() for _ in range(150))) == [1] * 150
        gate = store.backend.gate
        assert gate is not None and gate.max_waited > 100 and gate.refused == 0

        store.backend.gate = None  # the same without the gate
        results = await asyncio.gather(*(read() for _ in range(150)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, StoreUnavailable) and "QueuePool limit" in str(r) for r in failed)
        store.backend.gate = gate
    finally:
        await store.close()
