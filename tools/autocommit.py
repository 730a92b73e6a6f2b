"""One statement on a pooled connection without a transaction around it.

A statement is atomic on its own: wrapped in `engine.begin()` it costs two more round trips
(BEGIN, COMMIT) for nothing. Where a unit of work is one statement (a call's row inserted or
moved, a batch of call events with their notification, a read), it runs here; where it takes
more than one, or locks rows for later statements, it keeps its transaction.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine


@contextlib.asynccontextmanager
async def autocommit(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A pooled connection in autocommit: each statement commits as it completes (the pool
    restores the engine's isolation level when the connection goes back)."""
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        yield conn
