"""tools.autocommit: each statement commits as it runs, and the pooled connection goes back to
the pool as it came (a transaction on it after is one, its rollback undoing its writes); a
process's hold keeps a few such connections between units, and hands back only sound ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import make_engine, plain_url
from tools import driver_sql
from tools.autocommit import autocommit, hold_autocommit, release_autocommit

_PID = sa.text("SELECT pg_backend_pid()")
# Ends a backend and waits (up to 5 s) until it is gone: without the wait, the statement the
# test sends next can reach the backend before it has acted on the signal.
_TERMINATE = "SELECT pg_terminate_backend(%s, 5000)"


async def _probe_engine(url: str, size: int) -> AsyncEngine:
    """An engine of `size` connections (no overflow), and an empty table to write to."""
    engine = make_engine(url, pool_size=size, max_overflow=0)
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE IF NOT EXISTS ac_probe (n int)"))
        await conn.execute(sa.text("TRUNCATE ac_probe"))
    return engine


@pytest.fixture
async def one_connection(clean_db: str) -> AsyncIterator[AsyncEngine]:
    """An engine whose pool holds one connection: every checkout is the same one."""
    engine = await _probe_engine(clean_db, 1)
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
            await admin.execute(_TERMINATE, (pid,))
        with pytest.raises(sa.exc.DBAPIError):
            await driver_sql.execute(conn, sa.text("INSERT INTO ac_probe VALUES (1)"))
    # The next checkout is a new connection, in a transaction of its own.
    async with engine.connect() as conn:
        assert (await conn.execute(_PID)).scalar_one() != pid
        await conn.execute(sa.text("INSERT INTO ac_probe VALUES (2)"))
        await conn.rollback()
    assert await _count(engine) == 0


@pytest.fixture
async def held(clean_db: str) -> AsyncIterator[AsyncEngine]:
    """An engine of 8 connections whose process holds 2 of them for autocommit units."""
    engine = await _probe_engine(clean_db, 8)
    _CHECKOUTS[engine] = []
    sa.event.listen(engine.sync_engine.pool, "checkout", lambda *_: _CHECKOUTS[engine].append(1))
    hold_autocommit(engine, idle_s=60.0)
    try:
        yield engine
    finally:
        await release_autocommit(engine)
        await engine.dispose()
        del _CHECKOUTS[engine]


_CHECKOUTS: dict[AsyncEngine, list[int]] = {}  # the held engine's pool checkouts


def _checkouts(engine: AsyncEngine) -> int:
    return len(_CHECKOUTS[engine])


async def _unit(engine: AsyncEngine, n: int) -> int:
    """One autocommit unit: an insert, and the backend that ran it."""
    async with autocommit(engine) as conn:
        await driver_sql.execute(conn, sa.text("INSERT INTO ac_probe VALUES (:n)"), {"n": n})
        rows = await driver_sql.fetch_tuples(conn, _PID)
        return int(rows[0][0])


async def _every_pooled_one_in_a_transaction(engine: AsyncEngine, size: int) -> list[int]:
    """Check out all `size` of the pool's connections at once: each is out of autocommit (its
    rollback undoes its insert). Their backends' pids."""
    conns = [await engine.connect() for _ in range(size)]
    try:
        pids = []
        for c in conns:
            pids.append((await c.execute(_PID)).scalar_one())
            raw = await c.get_raw_connection()
            assert raw.driver_connection is not None and not raw.driver_connection.autocommit
            await c.execute(sa.text("INSERT INTO ac_probe VALUES (-1)"))
            await c.rollback()
        return pids
    finally:
        for c in conns:
            await c.close()


async def test_held_units_reuse_one_connection_and_each_commits(held: AsyncEngine) -> None:
    before = _checkouts(held)
    pids = {await _unit(held, n) for n in range(20)}
    assert len(pids) == 1  # the same connection, not checked out of the pool again
    assert _checkouts(held) - before == 1
    assert await _count(held) == 20  # committed: read on another connection
    # Two units at once: two connections, both kept (the hold keeps two).
    both = await asyncio.gather(_unit(held, 100), _unit(held, 101))
    assert len(set(both)) == 2
    assert {await _unit(held, 102), await _unit(held, 103)} <= set(both)


async def test_a_held_unit_through_sqlalchemy_leaves_nothing_open(held: AsyncEngine) -> None:
    async with autocommit(held) as conn:
        pid = (await conn.execute(_PID)).scalar_one()
        await conn.execute(sa.text("INSERT INTO ac_probe VALUES (1)"))  # no commit asked
    assert await _count(held) == 1
    assert await _unit(held, 2) == pid  # kept, and in autocommit still
    assert await _count(held) == 2


async def test_a_unit_that_raised_gives_its_connection_back_to_the_pool_out_of_autocommit(
    held: AsyncEngine,
) -> None:
    pid = await _unit(held, 1)
    with pytest.raises(sa.exc.ProgrammingError):
        async with autocommit(held) as conn:
            await driver_sql.execute(conn, sa.text("INSERT INTO no_such_table VALUES (1)"))
    # Back in the pool, in a transaction again (every pooled connection is).
    assert pid in await _every_pooled_one_in_a_transaction(held, 8)
    before = _checkouts(held)
    await _unit(held, 2)
    assert _checkouts(held) - before == 1  # the hold had none left: it checked one out
    assert await _count(held) == 2


async def test_a_held_connection_idle_past_the_ping_age_that_died_is_replaced(
    clean_db: str,
) -> None:
    engine = await _probe_engine(clean_db, 8)
    hold_autocommit(engine, idle_s=0.0)  # every held connection is pinged before a unit
    try:
        pid = await _unit(engine, 1)
        async with await psycopg.AsyncConnection.connect(plain_url(clean_db)) as admin:
            await admin.execute(_TERMINATE, (pid,))
        assert await _unit(engine, 2) != pid  # no error: replaced before the unit
    finally:
        await release_autocommit(engine)
        await engine.dispose()


async def test_after_a_disconnect_the_held_connections_go_back_to_the_pool(
    held: AsyncEngine, clean_db: str
) -> None:
    first, second = await asyncio.gather(_unit(held, 1), _unit(held, 2))
    async with await psycopg.AsyncConnection.connect(plain_url(clean_db)) as admin:
        await admin.execute(_TERMINATE, (first,))
        await admin.execute(_TERMINATE, (second,))
    # Used within the ping age, a dead one fails its unit, as a pooled one would ...
    with pytest.raises(sa.exc.DBAPIError):
        await _unit(held, 3)
    # ... and the engine's disconnect sends the other held one back to the pool, which
    # replaces it: the next units run on new connections.
    pids = {await _unit(held, n) for n in (4, 5)}
    assert not pids & {first, second}
    assert await _count(held) == 4  # 1, 2, 4 and 5


async def test_released_the_hold_gives_its_connections_back_out_of_autocommit(
    clean_db: str,
) -> None:
    engine = await _probe_engine(clean_db, 4)  # keeps one
    hold_autocommit(engine, idle_s=60.0)
    hold_autocommit(engine, idle_s=60.0)  # a second holder shares it
    try:
        pid = await _unit(engine, 1)
        await release_autocommit(engine)
        assert await _unit(engine, 2) == pid  # still held: one holder left
        await release_autocommit(engine)
        # Every pooled connection, the held one included, is in a transaction again.
        assert pid in await _every_pooled_one_in_a_transaction(engine, 4)
        assert await _count(engine) == 2
    finally:
        await engine.dispose()
