"""A first-come, first-served wait for the SQLAlchemy pool's connections.

SQLAlchemy's pool lets a caller wait ``pool_timeout`` (30 s) for a connection and then raises; its wait is
not fair either: a connection given back goes to whoever asks next, before the callers already waiting
(who then wait again at the end). Under a saturated event loop (the 1,000-agent soak: every implicit root
turn's staleness admission, every turn-cache miss of ``find_parent``) connections are held for seconds
each, and requests failed with 503 "QueuePool limit ... reached, connection timed out" although the
database was fine.

:class:`ConnectionGate` sits in front of the pool: at most ``slots`` (the pool's size plus overflow, less a
few for the ungated background users) callers hold a connection, the rest wait in arrival order for as
long as a client waits for an answer. The wait is bounded: a caller that finds ``max_waiting`` callers
already waiting, or waits longer than ``wait_s``, gets StoreUnavailable at once (503 with Retry-After).
A task that already holds a slot (a store call inside another one) passes through without waiting, so
nesting cannot deadlock on the gate."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.store.errors import StoreUnavailable

_holding: contextvars.ContextVar[ConnectionGate | None] = contextvars.ContextVar("agentrl_store_gate", default=None)


class ConnectionGate:
    def __init__(self, slots: int, *, max_waiting: int = 10_000, wait_s: float = 300.0) -> None:
        self.slots = max(1, slots)
        self.max_waiting = max_waiting
        self.wait_s = wait_s
        self._free = asyncio.Semaphore(self.slots)  # FIFO: a free slot goes to the longest waiter
        self.waiting = 0
        self.max_waited = 0  # the most callers ever seen waiting (stats)
        self.refused = 0

    @property
    def holding(self) -> int:
        return self.slots - self._free._value  # noqa: SLF001 - a count for stats

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the pool's connections' slots for the block (wait for one in arrival order)."""
        if _holding.get() is self:
            yield
            return
        if self.waiting >= self.max_waiting and self._free.locked():
            self.refused += 1
            raise StoreUnavailable(f"database overloaded: {self.waiting} calls already wait for one of "
                                   f"{self.slots} connections")
        self.waiting += 1
        self.max_waited = max(self.max_waited, self.waiting)
        try:
            async with asyncio.timeout(self.wait_s):
                await self._free.acquire()
        except TimeoutError:
            self.refused += 1
            raise StoreUnavailable(f"database overloaded: no connection free within {self.wait_s:g} s "
                                   f"({self.slots} in use)") from None
        finally:
            self.waiting -= 1
        token = _holding.set(self)
        try:
            yield
        finally:
            _holding.reset(token)
            self._free.release()
