"""Admission control: whether a new session or implicit episode may start now.

The gateway asks ``app.state.admission.check(kind=...)`` before it creates a session (``POST /v1/sessions``)
and before it starts an implicit-mode episode. :class:`AlwaysAdmit` is the default; the staleness budget of
DESIGN.md section 5 replaces it (``app.state.admission = ...``), raising :class:`gateway.errors.Overloaded`
(429 with ``Retry-After``) when admitting would exceed ``(k + v + 1) * B``. ``POST /admin/trainer`` hands
the trainer's status to ``update_trainer``.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

AdmissionKind = Literal["session", "implicit_episode"]


class Admission(Protocol):
    async def check(self, *, kind: AdmissionKind, metadata: dict[str, Any] | None = None) -> None:
        """Return if a new session/episode may start; raise ``Overloaded`` if not (``metadata`` of a new
        session: eval sessions do not count against the staleness budget)."""

    def update_trainer(self, status: dict[str, Any]) -> None:
        """The trainer's ``{"version", "batch_size", "staleness_bound"}``, as posted to /admin/trainer."""

    def status(self) -> dict[str, Any]:
        """For ``GET /admin/trainer``."""


class AlwaysAdmit:
    def __init__(self) -> None:
        self.trainer: dict[str, Any] | None = None

    async def check(self, *, kind: AdmissionKind, metadata: dict[str, Any] | None = None) -> None:
        return None

    def update_trainer(self, status: dict[str, Any]) -> None:
        self.trainer = dict(status)

    def status(self) -> dict[str, Any]:
        return {"policy": "always_admit", "trainer": self.trainer}
