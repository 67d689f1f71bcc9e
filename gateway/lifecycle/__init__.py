"""Session lifecycle: from recorded sessions to queued GRPO groups, in four parts.

- :mod:`~gateway.lifecycle.settings`: ``ExportSettings`` (export, leasing and staleness, validated at
  start-up) and ``ExportStats`` (the counters of ``GET /v1/trajectories/stats``).
- :mod:`~gateway.lifecycle.inflight`: ``InFlight``, the sessions with a turn running now (the hot path
  enters it on every turn; the loop never cuts such a session off).
- :mod:`~gateway.lifecycle.admission`: ``StalenessAdmission``, the admission hook over the staleness budget.
- :mod:`~gateway.lifecycle.loop`: ``TrajectoryService``, the export loop (idle finish, readiness, timeouts,
  export at least once, upkeep) and what the trajectory routes call (lease, ack, stats).

The app builds all of them in one place (``gateway.app``'s lifespan) and hands them to the services typed
(``gateway.context.Services``). The names are re-exported here.
"""

from gateway.lifecycle.admission import StalenessAdmission
from gateway.lifecycle.inflight import InFlight
from gateway.lifecycle.loop import TrajectoryService, grpo_chunks, outage_of, target_group_size
from gateway.lifecycle.settings import ENV_PREFIX, ExportSettings, ExportStats

__all__ = [
    "ENV_PREFIX",
    "ExportSettings",
    "ExportStats",
    "InFlight",
    "StalenessAdmission",
    "TrajectoryService",
    "grpo_chunks",
    "outage_of",
    "target_group_size",
]
