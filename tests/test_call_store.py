"""The call's row: inserted once per CallSid, moved only along legal transitions.

`create_call` and `transition` run statements built once (values as parameters); these hold
them to what the row must show, on real PostgreSQL.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import store
from app.calls.store import CallStatus
from tests.delivery_support import booked, delivery_of, make_call, moves, trail, waiting_jobs
from tools import deliveries
from tools.delivery_states import DeliveryState as D


async def _create(engine: AsyncEngine, sid: str, **kw: object) -> tuple[store.CallRow, bool]:
    return await store.create_call(
        engine, call_sid=sid, tenant_id="t1", from_number="+15550001", to_number="+15550002",
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def test_a_replayed_callsid_gets_the_row_it_made_first(engine: AsyncEngine) -> None:
    first, created = await _create(engine, "CA-replay")
    again, created_again = await _create(engine, "CA-replay")
    assert created and not created_again
    assert again == first
    assert (first.status, first.leg, first.tenant_id) == ("ringing", "twilio", "t1")
    assert (first.from_number, first.to_number, first.ended_at, first.end_reason) == (
        "+15550001", "+15550002", None, None,
    )  # fmt: skip


async def test_a_call_refused_at_once_is_inserted_ended(engine: AsyncEngine) -> None:
    row, created = await _create(engine, "CA-busy", status=CallStatus.BUSY, leg="sip")
    assert created and row.status == "busy" and row.leg == "sip"
    assert row.end_reason == "busy" and row.ended_at is not None


async def test_a_call_moves_only_along_legal_transitions(engine: AsyncEngine) -> None:
    row, _ = await _create(engine, "CA-moves")
    started = await store.transition(engine, row.id, CallStatus.IN_PROGRESS, stream_sid="MZ1")
    assert started is not None and started.status == "in_progress"
    assert started.stream_sid == "MZ1" and started.answered_at is not None
    # A stream starts once.
    assert await store.transition(engine, row.id, CallStatus.IN_PROGRESS, stream_sid="MZ2") is None
    assert await store.transition(engine, row.id, CallStatus.BUSY) is None  # not from in progress
    ended = await store.transition(engine, row.id, CallStatus.COMPLETED, end_reason="stop")
    assert ended is not None and ended.status == "completed" and ended.end_reason == "stop"
    assert ended.ended_at is not None and ended.stream_sid == "MZ1"
    assert await store.transition(engine, row.id, CallStatus.FAILED, end_reason="x") is None
    assert (await store.get_call(engine, row.id)) == ended


async def test_two_parties_ending_a_call_at_once_one_wins(engine: AsyncEngine) -> None:
    row, _ = await _create(engine, "CA-race")
    results = await asyncio.gather(
        *(
            store.transition(engine, row.id, status, end_reason=status.value)
            for status in (CallStatus.COMPLETED, CallStatus.FAILED, CallStatus.CANCELED)
        )
    )
    won = [r for r in results if r is not None]
    assert len(won) == 1
    assert (await store.get_call(engine, row.id)) == won[0]


async def test_a_busy_call_reopens_with_its_end_cleared(engine: AsyncEngine) -> None:
    row, _ = await _create(engine, "CA-reopen", status=CallStatus.BUSY)
    reopened = await store.transition(
        engine, row.id, CallStatus.RINGING, ended_at=None, end_reason=None
    )
    assert reopened is not None and reopened.status == "ringing"
    assert reopened.ended_at is None and reopened.end_reason is None


async def test_a_value_given_as_sql_is_still_applied(engine: AsyncEngine) -> None:
    row, _ = await _create(engine, "CA-sql")
    ended = await store.transition(
        engine, row.id, CallStatus.COMPLETED, ended_at=sa.func.now(), end_reason="stop"
    )
    assert ended is not None and ended.status == "completed" and ended.end_reason == "stop"
    assert ended.ended_at is not None
    assert abs((ended.ended_at - datetime.now(UTC)).total_seconds()) < 60


async def test_a_call_ends_in_one_statement_unless_a_delivery_waits_then_it_is_redriven_with_it(
    engine: AsyncEngine,
) -> None:
    """Most calls leave no late result: their end is one statement, no transaction. A call
    whose result is still being offered ends as before: in one transaction with the offer
    taken back to pending (not heard) and a job to decide it."""
    seen: list[str] = []

    def before(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement.split(None, 1)[0].upper())

    def began(conn: object) -> None:
        seen.append("BEGIN")

    quiet = await make_call(engine)
    waiting = await make_call(engine)
    op_id = await booked(engine, waiting)
    offered = await delivery_of(engine, op_id)
    async with engine.begin() as conn:
        assert await deliveries.move(
            conn, offered.id, D.PENDING, D.OFFERED, actor="t", reason="offered in the call"
        )
    sa.event.listen(engine.sync_engine, "before_cursor_execute", before)
    sa.event.listen(engine.sync_engine, "begin", began)
    try:
        ended = await store.transition(engine, quiet, CallStatus.COMPLETED, end_reason="stop")
        alone = list(seen)
        seen.clear()
        ended_too = await store.transition(engine, waiting, CallStatus.COMPLETED, end_reason="x")
        again = await store.transition(engine, quiet, CallStatus.FAILED, end_reason="again")
    finally:
        sa.event.remove(engine.sync_engine, "before_cursor_execute", before)
        sa.event.remove(engine.sync_engine, "begin", began)
    assert ended is not None and (ended.status, ended.end_reason) == ("completed", "stop")
    assert alone == ["WITH"]  # the one statement
    assert again is None  # already over: nothing moves
    assert ended_too is not None and ended_too.status == "completed"
    assert "BEGIN" in seen  # the end and the re-drive together
    assert (await store.get_call(engine, waiting)) == ended_too
    back = await delivery_of(engine, op_id)
    assert back.state is D.PENDING
    assert moves(await trail(engine, op_id))[-1] == "pending"
    assert await waiting_jobs(engine, back.id) == 2  # its commit's, and the re-drive's
