"""The job queue's connection to PostgreSQL, made to ride out a database outage.

Procrastinate's worker stops when one of its side tasks fails (the heartbeat, the
notification listener), and its listener gives up when it cannot reconnect: a database blip of
a few seconds would leave a process with no worker at all, running jobs cut off at shutdown
grace. This connector waits the outage out instead: a query of the worker's own (fetch a job,
heartbeat, finish a job) that fails because the database is unreachable is tried again until
it answers, and the listener reconnects for as long as the worker runs. Queries on a caller's
connection (an admission deferring its job inside its transaction) are never retried here:
their transaction is the caller's to retry.

Retrying a worker query whose answer was lost is safe for the engine: a job fetched twice or
finished twice runs an operation whose claim is a conditional update (one attempt wins), and
a job lost in between is found again by the sweeper.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, LiteralString, TypeVar

import procrastinate
import psycopg
import psycopg_pool
from procrastinate import connector as base

from tools.autocommit import PING_AFTER_IDLE_S
from tools.outage import DATABASE, DatabaseHealth

T = TypeVar("T")

FIRST_RETRY_S = 0.1
MAX_RETRY_S = 1.0


def quiet_pool_factory(
    ping_after_idle_s: float = PING_AFTER_IDLE_S,
) -> Callable[..., psycopg_pool.AsyncConnectionPool]:
    """Procrastinate's pool (`pool_factory`) without two round trips on each of its queries
    (a job fetched, finished, a heartbeat): its connections are in autocommit (each query is
    one statement, its own transaction, where the pool committed after every one), and one is
    checked when taken only once idle for `ping_after_idle_s` (Procrastinate checks every
    checkout). A connection an outage broke meanwhile fails its query, which
    `OutageTolerantConnector` tries again, and the pool replaces the broken one."""
    idle_since: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], float] = (
        weakref.WeakKeyDictionary()
    )

    async def made(conn: psycopg.AsyncConnection[Any]) -> None:
        # Not `autocommit` in the pool's connection kwargs: Procrastinate's listener
        # connects with those and autocommit=True of its own.
        await conn.set_autocommit(True)

    async def returned(conn: psycopg.AsyncConnection[Any]) -> None:
        idle_since[conn] = time.monotonic()

    async def check(conn: psycopg.AsyncConnection[Any]) -> None:
        since = idle_since.get(conn)
        if since is None or time.monotonic() - since < ping_after_idle_s:
            return  # new, or back in the pool a moment ago
        await psycopg_pool.AsyncConnectionPool.check_connection(conn)

    def factory(**pool_args: Any) -> psycopg_pool.AsyncConnectionPool:
        pool_args["check"] = check
        pool_args["reset"] = returned
        pool_args["configure"] = made
        return psycopg_pool.AsyncConnectionPool(**pool_args)

    return factory


class OutageTolerantConnector(procrastinate.PsycopgConnector):
    """A `PsycopgConnector` whose pooled queries and listener wait out a database outage."""

    def __init__(
        self,
        *,
        health: DatabaseHealth = DATABASE,
        ping_after_idle_s: float = PING_AFTER_IDLE_S,
        **pool_args: Any,
    ) -> None:
        super().__init__(pool_factory=quiet_pool_factory(ping_after_idle_s), **pool_args)
        self.health = health

    async def _until_answered(self, where: str, attempt: Callable[[], Awaitable[T]]) -> T:
        delay = FIRST_RETRY_S
        while True:
            try:
                value = await attempt()
            except Exception as exc:
                if not self.health.failed(where, exc):
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)
                continue
            self.health.ok()
            return value

    async def execute_query_async(self, query: LiteralString, **arguments: Any) -> None:
        parent = super().execute_query_async
        await self._until_answered("job queue", lambda: parent(query, **arguments))

    async def execute_query_one_async(
        self, query: LiteralString, **arguments: Any
    ) -> dict[str, Any]:
        parent = super().execute_query_one_async
        return await self._until_answered("job queue", lambda: parent(query, **arguments))

    async def execute_query_all_async(
        self, query: LiteralString, **arguments: Any
    ) -> list[dict[str, Any]]:
        parent = super().execute_query_all_async
        return await self._until_answered("job queue", lambda: parent(query, **arguments))

    async def listen_notify(self, on_notification: base.Notify, channels: Iterable[str]) -> None:
        """Listen for as long as the worker runs: a listener that cannot reconnect tries
        again (the worker polls for jobs meanwhile) instead of stopping the worker."""
        channels = list(channels)
        delay = FIRST_RETRY_S
        parent = super().listen_notify
        while True:
            try:
                await parent(on_notification, channels)
            except Exception as exc:
                if not self.health.failed("job queue listener", exc):
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)
            else:
                delay = FIRST_RETRY_S
