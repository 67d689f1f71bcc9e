"""Staleness control: how far data generation may run ahead of the trainer.

The trainer tells the gateway (``POST /admin/trainer``) its weight version ``v``, its batch size ``B`` (in
groups) and its staleness bound ``k``. With ``G`` sessions per group, the gateway admits a new session only
while

    admitted < (k + (v - v0) + 1) * B * G

where ``admitted`` counts, since the trainer registered at version ``v0``, every non-eval session that was
running or waiting to be trained at registration plus every non-eval session admitted since (explicit
``POST /v1/sessions`` and implicit-mode episodes alike), minus the sessions that will never be trained
(abandoned at a group timeout, exported with no rows, or dropped as stale). Sessions count as *accepted*
once finished (waiting in a group, queued, leased or trained) and as *running* while active; both are in
``admitted``. With ``v0 = 0`` this is exactly ``accepted + running < (k + v + 1) * B`` with ``B`` measured
in sessions (groups x group size). A session over the budget is refused with 429 and ``Retry-After``.

Leasing enforces the other half: a group whose oldest generated token has a version below ``v - k`` is
not leased; it is held back (counted) and dropped after a configured age (see ``gateway.queue``).

Eval sessions (``metadata.eval``) never count. Before any trainer registers there is no limit.

State lives in one SQL row (table ``trainer_state`` of migration ``0002_trajectories``), and admission is
one conditional ``UPDATE``, so several gateway processes sharing a database share one budget exactly.
The statement is the store backend's (``gateway.store.backend.Backend.admit``): on SQLite (one gateway
process) it runs in the store's writer thread, one hop off the event loop (an implicit-mode root turn asks
for it on every request); on PostgreSQL as one autocommit statement that also reads the state for a
refusal, on the store's own asyncpg connection, not through SQLAlchemy's pool. An admission whose caller
is cancelled meanwhile (its client left) runs to its end and gives back what it charged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, NoReturn

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway import errors
from gateway.store import errors as store_errors
from gateway.store.backend import TRAINER_ROW as _ROW
from gateway.store.backend import Backend
from gateway.store.schema import trainer_state as trainer_table

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TrainerState:
    version: int
    batch_size: int  # groups per training step
    staleness_bound: int
    group_size: int  # sessions per group
    base_version: int  # the version at registration
    admitted: int  # sessions counted against the budget

    @property
    def limit(self) -> int:
        """Sessions that may have been admitted at this version."""
        steps = self.staleness_bound + (self.version - self.base_version) + 1
        return steps * self.batch_size * self.group_size

    @property
    def min_version(self) -> int:
        """Oldest weight version a leased row may carry."""
        return self.version - self.staleness_bound

    def as_dict(self) -> dict[str, int]:
        return {
            "version": self.version, "batch_size": self.batch_size, "staleness_bound": self.staleness_bound,
            "group_size": self.group_size, "base_version": self.base_version, "admitted": self.admitted,
            "limit": self.limit, "min_version": self.min_version,
        }


def _state(row: sa.Row[Any] | None) -> TrainerState | None:
    if row is None:
        return None
    return TrainerState(version=row.version, batch_size=row.batch_size, staleness_bound=row.staleness_bound,
                        group_size=row.group_size, base_version=row.base_version, admitted=row.admitted)


def _unavailable(exc: SQLAlchemyError) -> errors.StoreUnavailable:
    return errors.StoreUnavailable(f"staleness state unavailable: {exc}")


class StalenessControl:
    def __init__(self, backend: Backend, *, default_group_size: int, retry_after_s: float) -> None:
        self.backend = backend  # admit/release are its statements; the rest goes through its write engine
        self.engine = backend.write_engine
        self.default_group_size = default_group_size
        self.retry_after_s = retry_after_s

    async def state(self) -> TrainerState | None:
        """The registered trainer's state, or None before any trainer registered."""
        try:
            async with self.engine.connect() as conn:
                row = (await conn.execute(sa.select(trainer_table).where(trainer_table.c.id == _ROW))).first()
        except SQLAlchemyError as exc:
            raise _unavailable(exc) from exc
        return _state(row)

    async def configure(
        self,
        *,
        version: int,
        batch_size: int,
        staleness_bound: int,
        group_size: int | None = None,
        pending_sessions: int = 0,
    ) -> TrainerState:
        """Register the trainer or move its version forward.

        Same batch size, bound and group size with a version not lower than the stored one: only the
        version changes (the normal call after every weight push). Anything else is a new registration:
        the budget restarts at this version, counting ``pending_sessions`` (running or not yet trained)."""
        if version < 0 or batch_size < 1 or staleness_bound < 0:
            raise errors.InvalidRequest(
                "trainer state needs version >= 0, batch_size >= 1 and staleness_bound >= 0 "
                f"(got {version}, {batch_size}, {staleness_bound})")
        size = group_size or self.default_group_size
        if size < 1:
            raise errors.InvalidRequest(f"group_size must be >= 1, got {size}")
        t = trainer_table
        now = time.time()
        try:
            async with self.engine.begin() as conn:
                old = _state((await conn.execute(sa.select(t).where(t.c.id == _ROW))).first())
                same = old is not None and (old.batch_size, old.staleness_bound, old.group_size) == (
                    batch_size, staleness_bound, size) and version >= old.version
                if same:
                    await conn.execute(t.update().where(t.c.id == _ROW).values(version=version, updated_at=now))
                else:
                    values = dict(version=version, batch_size=batch_size, staleness_bound=staleness_bound,
                                  group_size=size, base_version=version, admitted=pending_sessions, updated_at=now)
                    if old is None:
                        await conn.execute(t.insert().values(id=_ROW, **values))
                    else:
                        await conn.execute(t.update().where(t.c.id == _ROW).values(**values))
                state = _state((await conn.execute(sa.select(t).where(t.c.id == _ROW))).first())
        except SQLAlchemyError as exc:
            raise _unavailable(exc) from exc
        assert state is not None
        return state

    async def set_version(self, version: int) -> None:
        """Move the trainer's version (e.g. when a weight push sets a new version); no-op before
        registration and for a version not above the stored one."""
        t = trainer_table
        try:
            async with self.engine.begin() as conn:
                await conn.execute(t.update().where(t.c.id == _ROW, t.c.version < version)
                                   .values(version=version, updated_at=time.time()))
        except SQLAlchemyError as exc:
            raise _unavailable(exc) from exc

    async def admit(self, *, n: int = 1, is_eval: bool = False) -> int:
        """Count ``n`` new sessions against the budget, all or none, and return how many were counted
        (0 for eval sessions and before any trainer registered); raise ``Overloaded`` (429) if they do not
        fit now, or ``InvalidRequest`` (400) if they can never fit (more than ``(k + 1) x B x G``: a group
        bigger than that would wait forever)."""
        if is_eval or n <= 0:
            return 0
        return await self._shielded(self._admit(n))

    async def _admit(self, n: int) -> int:
        try:
            counted, row = await self.backend.admit(n)
        except store_errors.StoreError as exc:
            raise errors.StoreUnavailable(f"staleness state unavailable: {exc}") from exc
        if counted:
            return n
        if row is None:
            return 0  # no trainer registered: nothing to stay within
        self._refuse(TrainerState(*row), n)

    async def _shielded(self, admission: Awaitable[int]) -> int:
        """An admission that runs to its end even if the caller is cancelled meanwhile (its client left);
        then what it charged is given back once it has committed."""
        task = asyncio.ensure_future(admission)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._give_back_late)
            raise

    def _give_back_late(self, task: asyncio.Future[int]) -> None:
        if task.cancelled() or task.exception() is not None or not task.result():
            return
        late = asyncio.ensure_future(self.release(task.result()))
        late.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.warning(
            "staleness budget of a cancelled admission not given back: %s", t.exception()))

    async def admit_in(self, conn: AsyncConnection, *, n: int = 1, is_eval: bool = False) -> int:
        """:meth:`admit` on the caller's open transaction ``conn`` (on this database): the count commits
        or rolls back with it. Database errors are raised as they come (the caller's store translates
        them)."""
        if is_eval or n <= 0:
            return 0
        t = trainer_table
        limit = (t.c.staleness_bound + t.c.version - t.c.base_version + 1) * t.c.batch_size * t.c.group_size
        done = await conn.execute(
            t.update().where(t.c.id == _ROW, t.c.admitted + n <= limit).values(admitted=t.c.admitted + n)
        )
        if done.rowcount:
            return n
        state = _state((await conn.execute(sa.select(t).where(t.c.id == _ROW))).first())
        if state is None:
            return 0  # no trainer registered: nothing to stay within
        self._refuse(state, n)

    def _refuse(self, state: TrainerState, n: int) -> NoReturn:
        """The error for ``n`` sessions that do not fit ``state``'s budget."""
        window = (state.staleness_bound + 1) * state.batch_size * state.group_size
        if n > window:
            raise errors.InvalidRequest(
                f"{n} sessions can never be admitted at once: the staleness budget holds at most {window} = "
                f"(staleness_bound {state.staleness_bound} + 1) x batch {state.batch_size} groups x "
                f"{state.group_size} sessions; use smaller groups or a larger trainer batch / bound",
                code="group_too_large")
        raise errors.Overloaded(
            f"staleness budget reached: {state.admitted} sessions admitted, {n} more asked, limit {state.limit} = "
            f"(staleness_bound {state.staleness_bound} + version {state.version} - {state.base_version} + 1) x "
            f"batch {state.batch_size} groups x {state.group_size} sessions; retry after the trainer's next step",
            retry_after_s=self.retry_after_s,
        )

    async def release(self, n: int) -> None:
        """Give back budget of ``n`` sessions that will never be trained (abandoned, empty, dropped)."""
        if n <= 0:
            return
        try:
            await self.backend.release(n)
        except store_errors.StoreError as exc:
            raise errors.StoreUnavailable(f"staleness state unavailable: {exc}") from exc
