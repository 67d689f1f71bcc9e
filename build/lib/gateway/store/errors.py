"""Errors raised by the conversation store.

    StoreError
    ├── NotFound          an id (session, interaction, api key) that the store does not hold
    ├── Conflict          the request contradicts stored state: a turn for a session that is no longer
    │                     active, a reward for a consumed session, a duplicate interaction id, a parent
    │                     from another session
    ├── InvalidValue      a value the store refuses to keep (NaN/inf reward, a malformed token array)
    └── StoreUnavailable  the database (or, for writes that must reach it, Redis) cannot be reached

SQLAlchemy and redis exceptions are translated where they enter the store (``raise ... from exc``), so
callers see only this tree. The gateway maps NotFound -> 404, Conflict -> 409, InvalidValue -> 400 and
StoreUnavailable -> 503 in its single error handler.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises."""


class NotFound(StoreError):
    """The session, interaction or api key is not in the store."""


class Conflict(StoreError):
    """The operation contradicts the stored state (inactive session, duplicate id, foreign parent...)."""


class InvalidValue(StoreError):
    """A value the store will not keep (non-finite reward, token arrays of mismatched lengths...)."""


class StoreUnavailable(StoreError):
    """The database could not be reached or failed for a reason unrelated to the data."""
