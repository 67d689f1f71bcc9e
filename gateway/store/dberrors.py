"""Translate SQLAlchemy/driver exceptions into the store's error tree where they enter the store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import exc as sa_exc

from gateway.store.errors import Conflict, InvalidValue, StoreError, StoreUnavailable


def translate(exc: BaseException) -> StoreError | None:
    """The store error for a database exception, or None when it is a bug to let through unchanged."""
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
    if isinstance(exc, (OSError, asyncio.TimeoutError)):
        return StoreUnavailable(f"database unreachable: {exc}")
    return None


@asynccontextmanager
async def db_errors() -> AsyncIterator[None]:
    """Re-raise database exceptions raised in the block as StoreError (``raise ... from exc``)."""
    try:
        yield
    except (sa_exc.SQLAlchemyError, OSError, asyncio.TimeoutError) as exc:
        err = translate(exc)
        if err is None:
            raise
        raise err from exc
