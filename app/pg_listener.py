"""One LISTEN connection per process, dispatching Postgres notifications to handlers.

NOTIFY is how replicas reach each other: the one holding a call hears about an operation
that finished on a worker elsewhere, or a status callback that landed on another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from tools.outage import DATABASE

log = logging.getLogger(__name__)

Handler = Callable[[str], None]

# psycopg's wait for a notification wakes every 0.1 s (its wait interval, so that a blocking
# wait notices Ctrl-C) to find nothing and wait again: ten wake-ups a second of a process with
# nothing to do, each ~0.1 ms of CPU on a virtual machine. An asyncio task is cancelled
# without such a wake, and the socket turning readable (a notification, the server gone) ends
# the wait at once whatever the interval, so the LISTEN connection waits this long between
# wakes. psycopg still does all the reading.
LISTEN_WAKE_S = 30.0


def long_wait_fits() -> bool:
    """Whether psycopg's `AsyncConnection.wait` still takes the interval second (what
    `_ListenConnection` sets); if not, the listener uses psycopg's connection as it is."""
    try:
        names = list(inspect.signature(psycopg.AsyncConnection.wait).parameters)
    except (TypeError, ValueError):
        return False
    return names[:3] == ["self", "gen", "interval"]


class _ListenConnection(psycopg.AsyncConnection[Any]):
    """psycopg's connection, waiting `LISTEN_WAKE_S` between idle wakes."""

    async def wait(self, gen: Any, interval: Any = LISTEN_WAKE_S, *args: Any, **kwargs: Any) -> Any:
        return await super().wait(gen, LISTEN_WAKE_S, *args, **kwargs)


LISTEN_CONNECTION: type[psycopg.AsyncConnection[Any]] = (
    _ListenConnection if long_wait_fits() else psycopg.AsyncConnection
)


class PgListener:
    """LISTENs on every channel that has a handler; reconnects after a lost connection.

    Handlers run on the event loop and must not block: they schedule their own work.
    """

    def __init__(self, database_url: str, *, reconnect_s: float = 1.0) -> None:
        self._url = database_url
        self._reconnect_s = reconnect_s
        self._handlers: dict[str, list[Handler]] = {}
        self._on_listen: list[Callable[[], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()

    def subscribe(self, channel: str, handler: Handler) -> None:
        """Call `handler(payload)` for each notification on `channel` (before `start`)."""
        if self._task is not None:
            raise RuntimeError("subscribe before start()")
        self._handlers.setdefault(channel, []).append(handler)

    def on_listen(self, callback: Callable[[], None]) -> None:
        """Call `callback()` each time LISTEN is (re)established: notifications sent while
        the connection was down are lost, so subscribers catch up from the database."""
        self._on_listen.append(callback)

    async def start(self) -> None:
        """Start listening; returns once LISTEN is in place (or after a short wait)."""
        self._task = asyncio.create_task(self._run(), name="pg-listener")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._listening.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                async with await LISTEN_CONNECTION.connect(
                    self._url, autocommit=True, connect_timeout=10
                ) as conn:
                    for channel in self._handlers:
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    self._listening.set()
                    for callback in self._on_listen:
                        try:
                            callback()
                        except Exception:
                            log.exception("catch-up after LISTEN failed")
                    async for note in conn.notifies():
                        self._dispatch(note.channel, note.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Notifications sent while reconnecting are lost; `on_listen` subscribers
                # catch up from the database once the connection is back.
                if not DATABASE.failed("notification listener", exc):
                    log.warning("notification listener lost its connection (%s); reconnecting", exc)
                await asyncio.sleep(self._reconnect_s)

    def _dispatch(self, channel: str, payload: str) -> None:
        for handler in self._handlers.get(channel, []):
            try:
                handler(payload)
            except Exception:
                log.exception("handler for %s notification failed", channel)
