"""Translate SQLAlchemy/driver exceptions into the store's error tree where they enter the store.

One mapping per way into a database: :func:`translate` for what comes through SQLAlchemy (and the
outage classes of any driver), :func:`postgres_error` for the store's own ``asyncpg`` connections and
:func:`sqlite_error` for its own ``sqlite3`` connection; a backend (``gateway.store.backend``) says which
applies to it (``Backend.translate``)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import exc as sa_exc

from gateway.store.errors import Conflict, InvalidValue, StoreError, StoreUnavailable


# SQLSTATE classes that mean "the server cannot serve now, try again": connection exceptions (08),
# insufficient resources (53: too many connections), operator intervention (57P01 admin shutdown, 57P02
# crash shutdown, 57P03 cannot connect now: starting up, 57014 statement cancelled), system errors (58: I/O
# of the server) and transaction rollbacks on conflicts (40).
_UNAVAILABLE_SQLSTATE_PREFIXES = ("08", "53", "57P", "57014", "58", "40")


def _driver_failures() -> tuple[type[BaseException], ...]:
    """asyncpg's client-side failures that say nothing about the data: the connection is closed, in use,
    lost mid-message (InterfaceError, InternalClientError incl. ProtocolError); plus any socket error or
    timeout. Raised raw by the store's own asyncpg connection, wrapped by SQLAlchemy's adapter elsewhere
    (as InterfaceError, or as the generic InternalError the adapter makes of InternalClientError)."""
    try:
        import asyncpg
    except ImportError:  # pragma: no cover - a SQLite-only install
        return (OSError, asyncio.TimeoutError)
    return (asyncpg.InterfaceError, asyncpg.InternalClientError, OSError, asyncio.TimeoutError)


def _driver_failure(exc: BaseException) -> BaseException | None:
    """The connection-level driver failure behind ``exc`` (itself, its ``orig`` or its cause), if any.
    asyncpg's ClientConfigurationError (also a ValueError: a bad option) is not one."""
    kinds = _driver_failures()
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        if isinstance(seen, kinds) and not isinstance(seen, ValueError):
            return seen
        seen = getattr(seen, "orig", None) or seen.__cause__
    return None


def _sqlstate(exc: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE of a driver error (asyncpg's error, or SQLAlchemy's adapter around it)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        code = getattr(seen, "sqlstate", None) or getattr(seen, "pgcode", None)
        if isinstance(code, str) and code:
            return code
        seen = getattr(seen, "orig", None) or seen.__cause__
    return None


def translate(exc: BaseException) -> StoreError | None:
    """The store error for a database exception, or None when it is a bug to let through unchanged."""
    code = _sqlstate(exc)
    if code is not None and code.startswith(_UNAVAILABLE_SQLSTATE_PREFIXES):
        return StoreUnavailable(f"database unavailable (SQLSTATE {code}): {exc}")
    if isinstance(exc, sa_exc.IntegrityError):
        return Conflict(f"the database refused the write: {exc.orig}")
    if isinstance(exc, sa_exc.DataError):
        return InvalidValue(f"the database refused a value: {exc.orig}")
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)):
        return StoreUnavailable(f"database unavailable: {exc}")
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return StoreUnavailable(f"database connection lost: {exc}")
    if isinstance(exc, sa_exc.StatementError) and isinstance(exc.orig, (TypeError, ValueError)):
        return InvalidValue(f"a value could not be stored: {exc.orig}")  # e.g. JSON that cannot serialise
    if isinstance(exc, (sa_exc.DisconnectionError, sa_exc.TimeoutError)):
        return StoreUnavailable(f"database unavailable: {exc}")
    failure = _driver_failure(exc)
    if failure is not None:
        return StoreUnavailable(f"database unreachable: {type(failure).__name__}: {failure}")
    return None


def postgres_error(exc: BaseException) -> StoreError | None:
    """The store error for an exception of the PostgreSQL writer (as ``gateway.store.dberrors.translate``
    maps the same errors coming through SQLAlchemy), or None for a bug."""
    import asyncpg

    if isinstance(exc, asyncpg.IntegrityConstraintViolationError):
        return Conflict(f"the database refused the write: {exc}")
    if isinstance(exc, asyncpg.DataError):
        return InvalidValue(f"the database refused a value: {exc}")
    # SQLSTATE classes of an unavailable server; asyncpg's client-side failures (InterfaceError,
    # InternalClientError); OSError, timeouts
    translated = translate(exc)
    if translated is not None:
        return translated
    if isinstance(exc, (TypeError, ValueError, OverflowError)):  # incl. asyncpg's client-side DataError
        return InvalidValue(f"a value could not be stored: {exc}")
    return None


def sqlite_error(exc: BaseException) -> StoreError | None:
    """The store error for an exception of the SQLite writer (as ``gateway.store.dberrors.translate``
    maps the same errors coming through SQLAlchemy), or None for a bug."""
    if isinstance(exc, sqlite3.IntegrityError):
        return Conflict(f"the database refused the write: {exc}")
    if isinstance(exc, sqlite3.DataError):
        return InvalidValue(f"the database refused a value: {exc}")
    if isinstance(exc, sqlite3.ProgrammingError):
        return None
    if isinstance(exc, sqlite3.Error):
        return StoreUnavailable(f"database unavailable: {type(exc).__name__}: {exc}")
    if isinstance(exc, (TypeError, ValueError, OverflowError)):
        return InvalidValue(f"a value could not be stored: {exc}")
    return None


@asynccontextmanager
async def db_errors() -> AsyncIterator[None]:
    """Re-raise database exceptions raised in the block as StoreError (``raise ... from exc``)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - translated or re-raised unchanged (a bug stays a bug)
        err = translate(exc)
        if err is None:
            raise
        raise err from exc
