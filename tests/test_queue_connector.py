"""The job queue's pool (tools/queue_connector.py): connections in autocommit, checked when
taken only once idle a while, and one found dead then replaced; over a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import psycopg
import psycopg_pool
import pytest

from app.db import plain_url
from tools.queue_connector import quiet_pool_factory

IDLE_S = 0.3
NEVER_IDLE_S = 3600.0  # a pool that, within a test, never finds a connection idle long enough


@asynccontextmanager
async def pool_on(
    url: str, idle_s: float = IDLE_S
) -> AsyncIterator[psycopg_pool.AsyncConnectionPool]:
    pool = quiet_pool_factory(idle_s)(conninfo=plain_url(url), min_size=1, max_size=1, open=False)
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close()


async def _pid(pool: psycopg_pool.AsyncConnectionPool) -> int:
    async with pool.connection() as conn:
        assert conn.autocommit
        row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
        assert row is not None
        return int(row[0])


async def _terminate(url: str, pid: int) -> None:
    async with await psycopg.AsyncConnection.connect(plain_url(url), autocommit=True) as admin:
        await admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))


async def test_a_query_commits_by_itself_with_no_transaction_left_open(clean_db: str) -> None:
    async with pool_on(clean_db) as pool:
        async with pool.connection() as conn:
            await conn.execute("CREATE TEMP TABLE t (x int)")
            await conn.execute("INSERT INTO t VALUES (1)")
            assert conn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE


async def test_a_connection_back_a_moment_ago_is_not_checked_one_idle_longer_is(
    clean_db: str,
) -> None:
    # Killed just after it came back: taken again within the threshold (however slow the
    # machine: an hour), it is not checked, so the query meets it dead
    # (OutageTolerantConnector tries such a query again).
    async with pool_on(clean_db, NEVER_IDLE_S) as pool:
        first = await _pid(pool)
        await _terminate(clean_db, first)
        with pytest.raises(psycopg.OperationalError):
            await _pid(pool)
        replaced = await _pid(pool)  # the pool replaced the broken one
        assert replaced != first
    async with pool_on(clean_db) as pool:
        second = await _pid(pool)
        # Killed, then left idle past the threshold: the check finds it dead and the pool
        # hands out a new one; the query never sees the dead one.
        await _terminate(clean_db, second)
        await asyncio.sleep(IDLE_S * 2)
        third = await _pid(pool)
        assert third not in (first, second)
