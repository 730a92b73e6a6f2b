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
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, LiteralString, TypeVar

import procrastinate
from procrastinate import connector as base

from tools.outage import DATABASE, DatabaseHealth

T = TypeVar("T")

FIRST_RETRY_S = 0.1
MAX_RETRY_S = 1.0


class OutageTolerantConnector(procrastinate.PsycopgConnector):
    """A `PsycopgConnector` whose pooled queries and listener wait out a database outage."""

    def __init__(self, *, health: DatabaseHealth = DATABASE, **pool_args: Any) -> None:
        # Procrastinate's pool already checks a connection when it is taken, so one the
        # outage broke is found out there, not when it is used.
        super().__init__(**pool_args)
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
