"""The state the parts of ``Store`` share (backend, Redis, the in-process caches) and its connections."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.store.backend import Backend
from gateway.store.dberrors import db_errors
from gateway.store.records import SessionRecord
from gateway.store.redis_state import RedisState
from gateway.store.seqcache import SequenceCache, TurnCache
from gateway.store.writer import GroupCommitWriter


class StoreBase:
    """The state every part of the store works on (set up by ``Store.__init__``) and its connections."""

    _backend: Backend
    _engine: AsyncEngine
    _write_engine: AsyncEngine
    _redis: RedisState | None
    _redis_prefix: str
    _seqs: SequenceCache
    _turns: TurnCache
    _local: bool  # without Redis: this process is the only writer of turns (see ``Store.__init__``)
    _sessions: OrderedDict[str, SessionRecord]
    _chains: OrderedDict[tuple[str, str], str]
    _key_sessions: OrderedDict[str, str]
    _local_entries: int
    _writer: GroupCommitWriter

    def connection_slot(self) -> AbstractAsyncContextManager[None]:
        """Wait in arrival order for one of the pool's connections (PostgreSQL; see ``gateway.store.gate``)
        and hold it for the block: for modules using :attr:`engine` on a request's path."""
        return self._backend.slot()

    @asynccontextmanager
    async def _write_tx(self) -> AsyncIterator[AsyncConnection]:
        async with self.connection_slot(), db_errors(), self._write_engine.begin() as conn:
            yield conn

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        async with self.connection_slot(), db_errors(), self._engine.connect() as conn:
            yield conn
