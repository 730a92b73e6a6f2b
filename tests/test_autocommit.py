"""tools.autocommit: each statement commits as it runs, and the pooled connection goes back to
the pool as it came (a transaction on it after is one, its rollback undoing its writes)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import make_engine, plain_url
from tools import driver_sql
from tools.autocommit import autocommit

_PID = sa.text("SELECT pg_backend_pid()")


@pytest.fixture
async def one_connection(clean_db: str) -> AsyncIterator[AsyncEngine]:
    """An engine whose pool holds one connection: every checkout is the same one."""
    engine = make_engine(clean_db, pool_size=1, max_overflow=0)
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE IF NOT EXISTS ac_probe (n int)"))
        await conn.execute(sa.text("TRUNCATE ac_probe"))
    try:
        yield engine
    finally:
        await engine.dispose()


async def _count(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(sa.text("SELECT count(*) FROM ac_probe"))).scalar_one())


async def test_each_statement_commits_and_the_connection_leaves_autocommit(
    one_connection: AsyncEngine,
) -> None:
    engine = one_connection
    async with autocommit(engine) as conn:
        # psycopg's connection switched itself, not through SQLAlchemy's option.
        assert "isolation_level" not in conn.sync_connection.get_execution_options()  # type: ignore[union-attr]
        raw = await conn.get_raw_connection()
        assert raw.driver_connection is not None and raw.driver_connection.autocommit
        pid = (await conn.execute(_PID)).scalar_one()
        await driver_sql.execute(conn, sa.text("INSERT INTO ac_probe VALUES (1)"))
        # Through SQLAlchemy too; no commit is asked for, and the block's end rolls back.
        await conn.execute(sa.text("INSERT INTO ac_probe VALUES (2)"))
    assert await _count(engine) == 2
    # The same connection, back in a transaction: its rollback undoes its writes.
    async with engine.connect() as conn:
        assert (await conn.execute(_PID)).scalar_one() == pid
        await conn.execute(sa.text("INSERT INTO ac_probe VALUES (3)"))
        await conn.rollback()
    async with engine.begin() as conn:
        assert (await conn.execute(_PID)).scalar_one() == pid
        await conn.execute(sa.text("INSERT INTO ac_probe VALUES (4)"))
        raw = await conn.get_raw_connection()
        assert raw.driver_connection is not None and not raw.driver_connection.autocommit
    assert await _count(engine) == 3


async def test_a_connection_lost_in_the_block_is_not_returned_to_the_pool(
    one_connection: AsyncEngine, clean_db: str
) -> None:
    engine = one_connection
    async with autocommit(engine) as conn:
        pid = (await conn.execute(_PID)).scalar_one()
        async with await psycopg.AsyncConnection.connect(plain_url(clean_db)) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(sa.exc.DBAPIError):
            await driver_sql.execute(conn, sa.text("INSERT INTO ac_probe VALUES (1)"))
    # The next checkout is a new connection, in a transaction of its own.
    async with engine.connect() as conn:
        assert (await conn.execute(_PID)).scalar_one() != pid
        await conn.execute(sa.text("INSERT INTO ac_probe VALUES (2)"))
        await conn.rollback()
    assert await _count(engine) == 0
