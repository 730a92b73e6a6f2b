"""Statements run on the pooled connection's psycopg connection (tools.driver_sql): the same
rows as through SQLAlchemy, and SQLAlchemy's errors and invalidation when they fail."""

from __future__ import annotations

import asyncio
import gc
import json
import uuid
from datetime import UTC, datetime

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import store
from app.calls.store import CallStatus, calls
from app.db import plain_url
from tools import driver_sql

_SLEEP = sa.text("SELECT pg_sleep(:s)")
_PID = sa.text("SELECT pg_backend_pid() AS pid")


async def _call(engine: AsyncEngine, sid: str) -> store.CallRow:
    row, _ = await store.create_call(
        engine, call_sid=sid, tenant_id="t1", from_number=None, to_number="+15550002"
    )
    return row


async def test_rows_are_those_sqlalchemy_returns(engine: AsyncEngine) -> None:
    row = await _call(engine, "CA-same")
    stmt = store._transition_statement(CallStatus.IN_PROGRESS, ("answered_at", "status"))
    by_sid = sa.select(calls).where(calls.c.call_sid == sa.bindparam("b_sid"))
    async with engine.connect() as conn:
        ours = await driver_sql.fetch(conn, by_sid, {"b_sid": "CA-same"})
        theirs = [dict(r) for r in (await conn.execute(by_sid, {"b_sid": "CA-same"})).mappings()]
        assert ours == theirs and len(ours) == 1
        assert await driver_sql.fetch_tuples(conn, _PID) == [
            tuple((await conn.execute(_PID)).one())
        ]
        # A literal IN list (the legal sources) is sent as SQLAlchemy sends it: a call in
        # progress cannot start again.
        moved = await driver_sql.fetch(
            conn,
            stmt,
            {"b_id": uuid.UUID(row.id), "set_status": "in_progress", "set_answered_at": None},
        )
        assert [m["status"] for m in moved] == ["in_progress"]
        again = await driver_sql.fetch(
            conn,
            stmt,
            {"b_id": uuid.UUID(row.id), "set_status": "in_progress", "set_answered_at": None},
        )
        assert again == []
        await conn.rollback()
    assert (await store.get_call(engine, row.id)).status == "ringing"  # type: ignore[union-attr]


async def test_rows_read_by_attribute_as_sqlalchemys(engine: AsyncEngine) -> None:
    await _call(engine, "CA-attrs")
    by_sid = sa.select(calls).where(calls.c.call_sid == sa.bindparam("b_sid"))
    async with engine.connect() as conn:
        [ours] = await driver_sql.fetch_rows(conn, by_sid, {"b_sid": "CA-attrs"})
        theirs = (await conn.execute(by_sid, {"b_sid": "CA-attrs"})).one()
    assert all(getattr(ours, c.name) == getattr(theirs, c.name) for c in calls.c)
    assert ours == dict(theirs._mapping)
    with pytest.raises(AttributeError, match="no_such_column"):
        _ = ours.no_such_column


async def test_a_literal_none_in_a_statement_is_sent(engine: AsyncEngine) -> None:
    """`.values(x=None)` is part of the statement, as SQLAlchemy sends it: not a parameter
    the caller must give (it was left out, and the statement failed for want of it)."""
    row = await _call(engine, "CA-none")
    clear = (
        calls.update()
        .where(calls.c.id == sa.bindparam("b_id"))
        .values(end_reason=None, status="completed")
        .returning(calls.c.end_reason, calls.c.status)
    )
    async with engine.begin() as conn:
        await conn.execute(
            calls.update().where(calls.c.id == uuid.UUID(row.id)).values(end_reason="before")
        )
        moved = await driver_sql.fetch(conn, clear, {"b_id": uuid.UUID(row.id)})
    assert moved == [{"end_reason": None, "status": "completed"}]


def test_rows_as_one_json_document() -> None:
    at = datetime(2026, 12, 7, 23, 0, 0, 123456, tzinfo=UTC)
    key = uuid.uuid4()
    text = driver_sql.json_rows([{"id": key, "at": at, "n": None, "s": 'a "b"'}])
    assert json.loads(text) == [{"id": str(key), "at": at.isoformat(), "n": None, "s": 'a "b"'}]
    with pytest.raises(TypeError, match="object is not a column value"):
        driver_sql.json_rows([{"x": object()}])


async def test_a_refused_value_raises_sqlalchemys_error_and_the_pool_goes_on(
    engine: AsyncEngine,
) -> None:
    with pytest.raises(sa.exc.DataError) as caught:  # a DBAPIError, as callers catch
        await store.create_call(
            engine, call_sid="CA-long", tenant_id="t" * 200, from_number=None, to_number=None
        )
    assert not caught.value.connection_invalidated
    assert "INSERT INTO calls" in str(caught.value.statement)
    # In a transaction: it is rolled back, the connection is fine for the next one.
    async with engine.connect() as conn:
        with pytest.raises(sa.exc.DataError):
            async with conn.begin():
                await driver_sql.execute(conn, _SLEEP, {"s": "not a number"})
        assert not conn.invalidated
        assert (await conn.execute(sa.text("SELECT 1"))).scalar() == 1
    assert (await _call(engine, "CA-after")).status == "ringing"


async def test_a_failed_statement_leaves_no_reference_cycle_behind(engine: AsyncEngine) -> None:
    # SQLAlchemy's handling keeps the error it raises in its own frame, which the error's
    # traceback holds: without the frames cleared, every failed write (an event batch's
    # taken seq) left its frames and rows to a full collection.
    await _call(engine, "CA-taken")
    gc.collect()
    gc.disable()
    debug = gc.get_debug()
    gc.set_debug(debug | gc.DEBUG_SAVEALL)
    try:
        async with engine.connect() as conn:
            insert = sa.insert(calls).values(
                id=sa.bindparam("b_id"), call_sid="CA-taken", tenant_id="t1", status="ringing"
            )
            try:
                await driver_sql.execute(conn, insert, {"b_id": uuid.uuid4()})
            except sa.exc.IntegrityError as exc:
                assert "calls" in str(exc.statement)
                assert "Traceback" not in str(exc)
            else:
                raise AssertionError("a taken call_sid was inserted")
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, BaseException)]
    finally:
        gc.garbage.clear()
        gc.set_debug(debug)
        gc.enable()
    assert left == []


async def test_a_dropped_connection_invalidates_it_and_the_pool(
    engine: AsyncEngine, clean_db: str
) -> None:
    await _call(engine, "CA-warm")  # the pool holds its connection
    pool = engine.sync_engine.pool
    invalidated_before = pool._invalidate_time  # type: ignore[attr-defined]
    # A database restart: every connection of this database but the killer's is cut.
    async with await psycopg.AsyncConnection.connect(plain_url(clean_db), autocommit=True) as k:
        await k.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    with pytest.raises(sa.exc.DBAPIError) as caught:  # what the voice webhook answers 503 to
        await _call(engine, "CA-dropped")
    assert caught.value.connection_invalidated
    assert pool._invalidate_time > invalidated_before  # type: ignore[attr-defined]
    assert (await _call(engine, "CA-dropped")).status == "ringing"  # Twilio's retry: a new one


async def test_a_cancelled_statement_invalidates_its_connection(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        task = asyncio.create_task(driver_sql.execute(conn, _SLEEP, {"s": 30}))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert conn.invalidated
    assert (await _call(engine, "CA-cancel")).status == "ringing"


async def test_statement_listeners_see_driver_statements(engine: AsyncEngine) -> None:
    seen: list[tuple[str, str]] = []

    def before(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(("before", statement))

    def after(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(("after", statement))

    sa.event.listen(engine.sync_engine, "before_cursor_execute", before)
    sa.event.listen(engine.sync_engine, "after_cursor_execute", after)
    try:
        await _call(engine, "CA-seen")
    finally:
        sa.event.remove(engine.sync_engine, "before_cursor_execute", before)
        sa.event.remove(engine.sync_engine, "after_cursor_execute", after)
    inserts = [(when, s) for when, s in seen if s.startswith("INSERT INTO calls")]
    assert [when for when, _ in inserts] == ["before", "after"]


async def test_statements_built_per_call_are_not_kept_for_ever(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver_sql, "MAX_COMPILED", 4)
    async with engine.connect() as conn:
        for n in range(10):  # ten statement objects, as a caller building one per call would
            stmt = sa.text(f"SELECT CAST(:x AS int) + {n} AS y")
            assert await driver_sql.fetch(conn, stmt, {"x": 1}) == [{"y": 1 + n}]
            assert len(driver_sql._COMPILED) <= 4 and len(driver_sql._KEEP) <= 4
