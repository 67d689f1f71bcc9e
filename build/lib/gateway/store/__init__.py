"""The durable conversation store: sessions, turn trees, rewards (SQL) and shared hot state (Redis).

Public API: ``Store``, the records in ``gateway.store.api`` and the errors in ``gateway.store.errors``.
"""

from gateway.store.api import (
    SESSION_STATUSES,
    CommitStats,
    Continued,
    GroupRecord,
    Interaction,
    Marker,
    NewSession,
    ParentMatch,
    RewardRecord,
    SessionRecord,
    Store,
)
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
