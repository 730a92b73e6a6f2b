"""Whether a call's holder process is alive, answered by PostgreSQL at once.

Each serving process holds a session-level advisory lock named by its holder id on a
connection of its own for its whole life (`HolderLock`). A killed process's socket is closed by
the kernel, so PostgreSQL drops the lock within moments, long before the heartbeat sweep
(`CALL_DEAD_AFTER_S`) would call it dead. `holder_alive` asks with `pg_try_advisory_lock` and
gives the lock straight back when it got it.

A false "dead" (the lock's connection broke while the process lives) takes no call from it:
a call is only resumed when Twilio asks our `<Connect action>` URL, which it does once the
stream has already ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

log = logging.getLogger(__name__)


def _key(holder: str) -> sa.ColumnElement[int]:
    return sa.func.hashtextextended(f"call-holder:{holder}", 0)


async def holder_alive(engine: AsyncEngine, holder: str) -> bool:
    """True while the process `holder` holds its lock (it is running)."""
    async with engine.connect() as conn:
        got = await conn.scalar(sa.select(sa.func.pg_try_advisory_lock(_key(holder))))
        if got:
            await conn.scalar(sa.select(sa.func.pg_advisory_unlock(_key(holder))))
        await conn.commit()
    return not got


class HolderLock:
    """This process's lock, held on a connection of its own; taken again if that breaks."""

    def __init__(self, engine: AsyncEngine, holder: str, *, check_s: float = 5.0) -> None:
        self._engine = engine
        self.holder = holder
        self._check_s = check_s
        self._conn: AsyncConnection | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._take()
        self._task = asyncio.create_task(self._watch(), name="holder-lock")

    async def _take(self) -> None:
        conn = await self._engine.connect()
        try:
            await conn.scalar(sa.select(sa.func.pg_advisory_lock(_key(self.holder))))
            await conn.commit()
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.invalidate()  # closing the session releases the lock

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._check_s)
            try:
                if self._conn is None:
                    await self._take()
                else:
                    await self._conn.scalar(sa.select(1))
                    await self._conn.commit()
            except Exception:
                log.warning("the holder lock's connection broke; taking the lock again")
                await self._drop()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._release()
        await self._drop()

    async def _release(self) -> None:
        """Give the lock back on its own connection before closing it: a closed socket
        releases it only once the server's backend has noticed and exited, which can be
        after this process already asked `holder_alive` (a restart under the same name)."""
        if self._conn is None:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self._conn.scalar(sa.select(sa.func.pg_advisory_unlock(_key(self.holder))))
                await self._conn.commit()
