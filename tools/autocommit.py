"""One statement on a pooled connection without a transaction around it.

A statement is atomic on its own: wrapped in `engine.begin()` it costs two more round trips
(BEGIN, COMMIT) for nothing. Where a unit of work is one statement (a call's row inserted or
moved, a batch of call events with their notification, a read), it runs here; where it takes
more than one, or locks rows for later statements, it keeps its transaction.

A process that runs such units all the time (the server, the worker) holds a few connections
out of the pool for them (`hold_autocommit`): already in autocommit, each unit takes one and
puts it back, where checking one out of SQLAlchemy's pool and back cost about 200 us a unit
(a call's set-up and end run six or seven).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg import AsyncConnection as DriverConnection
from psycopg.pq import TransactionStatus
from sqlalchemy import event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

log = logging.getLogger(__name__)

# A pooled connection idle longer than this is pinged before it is handed out: by the engine's
# pool (app.db), the connections held here, and the job queue's pool (tools.queue_connector).
# One back a moment ago is as alive as it was then.
PING_AFTER_IDLE_S = 5.0


def autocommit(engine: AsyncEngine) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
    """A connection in autocommit for one unit of work (`async with`): a held one where the
    process holds some for `engine` (`hold_autocommit`), else one from the pool
    (`pooled_autocommit`)."""
    hold = _HOLDS.get(engine)
    return pooled_autocommit(engine) if hold is None else hold.connection()


@contextlib.asynccontextmanager
async def pooled_autocommit(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
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


class AutocommitHold:
    """Up to `keep` connections kept out of `engine`'s pool in autocommit, between units.

    A unit takes a free one, or checks one out when none is free; it goes back to the free
    ones when the unit ends well and there is room, else to the pool. What the pool does at
    checkout is done here too: a connection unused for `idle_s` is pinged before it is handed
    out (a dead one is replaced), and after a disconnect anywhere on the engine (SQLAlchemy
    then invalidates its whole pool) every held connection goes back to the pool, which
    replaces it. A unit that raised, or left its connection in a transaction or invalidated,
    does not give it back to the hold."""

    def __init__(self, engine: AsyncEngine, *, keep: int, idle_s: float) -> None:
        self.engine = engine
        self.keep = keep
        self.idle_s = idle_s
        self.users = 0
        self.closed = False
        self._free: list[tuple[AsyncConnection, DriverConnection[Any], float, int]] = []
        self._generation = 0  # moves on at each disconnect the engine sees

    def _on_error(self, context: ExceptionContext) -> None:
        if context.is_disconnect:
            self._generation += 1

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection]:
        held = await self._take()
        if held is None:  # not psycopg's, or not idle: the pool's way for this unit
            async with pooled_autocommit(self.engine) as conn:
                yield conn
            return
        conn, driver = held
        kept = False
        try:
            yield conn
            if conn.in_transaction():
                # SQLAlchemy began one of its own at the unit's first `execute`: nothing is
                # open on the server (autocommit), as the pool's reset would find.
                await conn.rollback()
            kept = self._give_back(conn, driver)
        finally:
            if not kept:
                await _close(conn, driver)

    async def _take(self) -> tuple[AsyncConnection, DriverConnection[Any]] | None:
        while self._free:
            conn, driver, last_used, generation = self._free.pop()
            if generation != self._generation:
                await _close(conn, driver)
                continue
            if time.monotonic() - last_used >= self.idle_s and not await _alive(conn, driver):
                continue
            return conn, driver
        new = await self.engine.connect()
        new_driver = _idle_driver(new)
        if new_driver is None:
            await new.close()
            return None
        try:
            await new_driver.set_autocommit(True)
        except BaseException:
            await new.close()
            raise
        return new, new_driver

    def _give_back(self, conn: AsyncConnection, driver: DriverConnection[Any]) -> bool:
        if self.closed or len(self._free) >= self.keep or not _usable(conn, driver):
            return False
        self._free.append((conn, driver, time.monotonic(), self._generation))
        return True

    async def aclose(self) -> None:
        """Every held connection back to the pool; units still running give theirs back at
        their end."""
        self.closed = True
        while self._free:
            conn, driver, _, _ = self._free.pop()
            await _close(conn, driver)


_HOLDS: dict[AsyncEngine, AutocommitHold] = {}


def hold_autocommit(engine: AsyncEngine, *, keep: int = 2, idle_s: float) -> AutocommitHold:
    """Hold up to `keep` autocommit connections of `engine` for `autocommit`'s units, until
    `release_autocommit`. A process part that owns the engine's life calls both; a second
    holder of the same engine shares the first's hold (the last release ends it)."""
    hold = _HOLDS.get(engine)
    if hold is None:
        # A quarter of the pool at most: the held ones are out of it for everything else.
        size = getattr(engine.sync_engine.pool, "size", lambda: 0)()
        hold = _HOLDS[engine] = AutocommitHold(engine, keep=min(keep, size // 4), idle_s=idle_s)
        event.listen(engine.sync_engine, "handle_error", hold._on_error)
    hold.users += 1
    return hold


async def release_autocommit(engine: AsyncEngine) -> None:
    """One holder of `engine`'s hold is done; the last one gives its connections back."""
    hold = _HOLDS.get(engine)
    if hold is None:
        return
    hold.users -= 1
    if hold.users > 0:
        return
    del _HOLDS[engine]
    event.remove(engine.sync_engine, "handle_error", hold._on_error)
    await hold.aclose()


def _usable(conn: AsyncConnection, driver: DriverConnection[Any]) -> bool:
    """Still SQLAlchemy's and open, in autocommit, with nothing under way on the server."""
    return (
        not conn.invalidated
        and not conn.closed
        and driver.autocommit
        and driver.pgconn.transaction_status == TransactionStatus.IDLE
    )


async def _alive(conn: AsyncConnection, driver: DriverConnection[Any]) -> bool:
    """Ping a connection held unused a while, as the pool pings one idle as long; a dead one
    is invalidated and closed (False)."""
    try:
        await driver.execute("SELECT 1")
    except psycopg.Error as exc:
        log.info("a held connection was stale (%s): replaced", exc)
        await conn.invalidate()
        await conn.close()
        return False
    except BaseException:
        await conn.invalidate()
        await conn.close()
        raise
    return True


async def _close(conn: AsyncConnection, driver: DriverConnection[Any]) -> None:
    """Out of autocommit, and back to the pool (or discarded by it)."""
    await _restore(conn, driver)
    await conn.close()
