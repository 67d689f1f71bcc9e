"""Admission control: whether new sessions may start now, and giving back what was charged.

The gateway reserves budget before it creates sessions (``POST /v1/groups`` reserves a whole group in one
decision, ``POST /v1/sessions`` one session or the first session's whole group, an implicit-mode request
one session per choice) and gives it back on every path where the sessions are not created after all
(engine down, context too long, client gone, store error). :class:`AlwaysAdmit` is the default; the
staleness budget of DESIGN.md section 5 replaces it (``app.state.admission = ...``), raising
:class:`gateway.errors.Overloaded` (429 with ``Retry-After``) when admitting would exceed the budget.
``POST /admin/trainer`` hands the trainer's status to ``update_trainer``.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncConnection


class Admission(Protocol):
    async def reserve(self, n: int, *, metadata: dict[str, Any] | None = None) -> int:
        """Charge ``n`` new sessions (all or none) and return how many were charged: 0 for eval sessions
        (``metadata.eval``) and when nothing is counted. Raise ``Overloaded`` if they do not fit."""

    async def settle(self) -> None:
        """Let trainer updates posted just before land; call before opening the transaction of
        :meth:`reserve_in` (``reserve`` does it itself)."""

    async def reserve_in(self, conn: AsyncConnection, n: int, *, metadata: dict[str, Any] | None = None) -> int:
        """As ``reserve``, inside the caller's open transaction on the store's database: the charge commits
        or rolls back with that transaction, so nothing needs to be given back on failure."""

    async def release(self, n: int) -> None:
        """Give back ``n`` charged sessions that were not created or will never be trained."""

    def update_trainer(self, status: dict[str, Any]) -> Any:
        """The trainer's ``{"version", "batch_size", "staleness_bound"}``, as posted to /admin/trainer."""

    def status(self) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """For ``GET /admin/trainer`` (read it with :func:`admission_status`)."""


async def admission_status(admission: Admission) -> dict[str, Any]:
    """``admission.status()``, awaited when the policy reads shared state: the staleness budget lives in
    SQL, so every worker process and replica shows the same trainer, whichever one it registered with."""
    got = admission.status()
    return await got if inspect.isawaitable(got) else got


class AlwaysAdmit:
    def __init__(self) -> None:
        self.trainer: dict[str, Any] | None = None

    async def reserve(self, n: int, *, metadata: dict[str, Any] | None = None) -> int:
        return 0

    async def settle(self) -> None:
        return None

    async def reserve_in(self, conn: AsyncConnection, n: int, *, metadata: dict[str, Any] | None = None) -> int:
        return 0

    async def release(self, n: int) -> None:
        return None

    def update_trainer(self, status: dict[str, Any]) -> None:
        self.trainer = dict(status)

    def status(self) -> dict[str, Any]:
        return {"policy": "always_admit", "trainer": self.trainer}
