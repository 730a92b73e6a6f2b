"""One statement on a pooled connection without a transaction around it.

A statement is atomic on its own: wrapped in `engine.begin()` it costs two more round trips
(BEGIN, COMMIT) for nothing. Where a unit of work is one statement (a call's row inserted or
moved, a batch of call events with their notification, a read), it runs here; where it takes
more than one, or locks rows for later statements, it keeps its transaction.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from psycopg import AsyncConnection as DriverConnection
from psycopg.pq import TransactionStatus
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def autocommit(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A pooled connection in autocommit: each statement commits as it completes.

    psycopg's connection is switched to autocommit and back here, around the block: what
    SQLAlchemy's `execution_options(isolation_level="AUTOCOMMIT")` ends up doing, without its
    characteristics' bookkeeping, set on the way out and reset again when the pool takes the
    connection back (about 40 us of a checkout's 110; a call's set-up and end take six or
    seven). Should the switch back fail, the connection is invalidated rather than returned
    to the pool in autocommit, where the next transaction's statements would each commit."""
    async with engine.connect() as conn:
        driver = _idle_driver(conn)
        if driver is None:  # not psycopg's, or not idle: SQLAlchemy's own way
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn
            return
        await driver.set_autocommit(True)
        try:
            yield conn
        finally:
            await _restore(conn, driver)


def _idle_driver(conn: AsyncConnection) -> DriverConnection[Any] | None:
    sync = conn.sync_connection
    if sync is None or sync.invalidated:
        return None
    driver = sync.connection.driver_connection
    if not isinstance(driver, DriverConnection) or driver.autocommit:
        return None
    if driver.info.transaction_status is not TransactionStatus.IDLE:
        return None
    return driver


async def _restore(conn: AsyncConnection, driver: DriverConnection[Any]) -> None:
    """Back out of autocommit, or out of the pool."""
    if conn.invalidated or driver.closed:
        return  # the pool discards it
    try:
        await driver.set_autocommit(False)
    except Exception as exc:
        log.warning("a pooled connection could not leave autocommit (%s): discarded", exc)
        await conn.invalidate()
    except BaseException:  # cancelled on the way back: discarded all the same
        await conn.invalidate()
        raise
