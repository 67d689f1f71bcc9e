"""Staleness admission: the gateway's admission hook (``gateway.admission.Admission``) backed by the
staleness budget (``gateway.staleness.StalenessControl``) that the export loop gives places back to."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncConnection

if TYPE_CHECKING:
    from gateway.lifecycle.loop import TrajectoryService


def _is_eval(metadata: dict[str, Any] | None) -> bool:
    return bool(metadata and metadata.get("eval") is True)


class StalenessAdmission:
    """The gateway's admission hook (``gateway.admission.Admission``) backed by :class:`StalenessControl`."""

    def __init__(self, service: TrajectoryService) -> None:
        self.service = service
        self._pending: list[asyncio.Future[Any]] = []

    async def _settle(self) -> None:
        """Let trainer updates posted just before this check land first (their errors went to the
        admin route that posted them, not to this caller)."""
        while self._pending:
            task = self._pending.pop(0)
            try:
                await task
            except Exception:
                pass

    async def reserve(self, n: int, *, metadata: dict[str, Any] | None = None) -> int:
        await self._settle()
        return await self.service.staleness.admit(n=n, is_eval=_is_eval(metadata))

    async def settle(self) -> None:
        await self._settle()

    async def reserve_in(self, conn: AsyncConnection, n: int, *, metadata: dict[str, Any] | None = None) -> int:
        return await self.service.staleness.admit_in(conn, n=n, is_eval=_is_eval(metadata))

    async def release(self, n: int) -> None:
        await self.service.staleness.release(n)

    def update_trainer(self, status: dict[str, Any]) -> asyncio.Future[Any]:
        """Register the trainer / move its version. Returns an awaitable; callers that do not await it
        still have it applied before the next admission check."""
        task = asyncio.ensure_future(self._configure(status))
        self._pending = [t for t in self._pending if not t.done()] + [task]
        return task

    async def _configure(self, status: dict[str, Any]) -> None:
        await self.service.configure_trainer(
            version=int(status["version"]), batch_size=int(status["batch_size"]),
            staleness_bound=int(status["staleness_bound"]), group_size=status.get("group_size"))

    async def status(self) -> dict[str, Any]:
        """The trainer as stored in SQL (shared by every worker and replica), not as last posted here."""
        await self._settle()
        state = await self.service.staleness.state()
        return {"policy": "staleness", "trainer": state.as_dict() if state is not None else None}
