"""One LISTEN connection per process, dispatching Postgres notifications to handlers.

NOTIFY is how replicas reach each other: the one holding a call hears about an operation
that finished on a worker elsewhere, or a status callback that landed on another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from tools.outage import DATABASE

log = logging.getLogger(__name__)

Handler = Callable[[str], None]


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
                async with await psycopg.AsyncConnection.connect(
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
                    await self._hear(conn)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Notifications sent while reconnecting are lost; `on_listen` subscribers
                # catch up from the database once the connection is back.
                if not DATABASE.failed("notification listener", exc):
                    log.warning("notification listener lost its connection (%s); reconnecting", exc)
                await asyncio.sleep(self._reconnect_s)

    async def _hear(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Dispatch notifications until the connection fails.

        The event loop watches the socket, and libpq reads it when there is something to
        read (`consume_input`, then its queue of notifications: what psycopg's `notifies()`
        does once it has waited). psycopg's own wait wakes every 0.1 s to look again: ten
        wake-ups a second of a process that has nothing to do. A connection that breaks
        makes the socket readable, and the read fails as it would have."""
        async for note in conn.notifies(timeout=0):  # any that came with LISTEN's replies
            self._dispatch(note.channel, note.payload)
        pgconn = conn.pgconn
        encoding = conn.info.encoding
        loop = asyncio.get_running_loop()
        fd = conn.fileno()
        readable = asyncio.Event()
        loop.add_reader(fd, readable.set)
        try:
            while True:
                await readable.wait()
                readable.clear()
                pgconn.consume_input()
                while (pgn := pgconn.notifies()) is not None:
                    self._dispatch(pgn.relname.decode(encoding), pgn.extra.decode(encoding))
        finally:
            loop.remove_reader(fd)

    def _dispatch(self, channel: str, payload: str) -> None:
        for handler in self._handlers.get(channel, []):
            try:
                handler(payload)
            except Exception:
                log.exception("handler for %s notification failed", channel)
