"""The durable conversation store: sessions, turn trees, rewards (SQL) and shared hot state (Redis).

Public API: ``Store`` (``api``, in parts: ``sessions``, ``turns``, ``rewards`` over ``caches``), the
records (``records``), the errors (``errors``); ``backend`` is what differs between SQLite and PostgreSQL.
"""

from gateway.store.api import Store
from gateway.store.records import (
    SESSION_STATUSES,
    CommitStats,
    GroupRecord,
    Interaction,
    NewSession,
    ParentMatch,
    RewardRecord,
    SessionRecord,
)
from gateway.store.redis_state import Continued, Marker
from gateway.store.errors import Conflict, InvalidValue, NotFound, StoreError, StoreUnavailable

__all__ = [
    "SESSION_STATUSES",
    "CommitStats",
    "Conflict",
    "Continued",
    "GroupRecord",
    "Interaction",
    "InvalidValue",
    "Marker",
    "NewSession",
    "NotFound",
    "ParentMatch",
    "RewardRecord",
    "SessionRecord",
    "Store",
    "StoreError",
    "StoreUnavailable",
]
