"""The call-event writer: ordered per-call seq, never blocking, nothing lost, DB hiccups."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import store as call_store
from app.calls.events import EventWriter
from telephony.call_events import CallEvent, CallEventKind
from tests.e2e_support import event_rows, wait_until


async def _call(engine: AsyncEngine, sid: str) -> str:
    row, _ = await call_store.create_call(
        engine, call_sid=sid, tenant_id="t", from_number=None, to_number=None
    )
    return row.id


async def test_events_of_interleaved_calls_get_per_call_seq_in_emit_order(
    engine: AsyncEngine,
) -> None:
    a, b = await _call(engine, "CAa"), await _call(engine, "CAb")
    writer = EventWriter(engine, batch_size=7)
    writer.start()
    for i in range(50):
        writer.emit(CallEvent(a if i % 3 else b, CallEventKind.DTMF, {"i": i}))
    assert await writer.flush(10)
    await writer.close()
    rows_a, rows_b = await event_rows(engine, a), await event_rows(engine, b)
    assert [r["seq"] for r in rows_a] == list(range(1, len(rows_a) + 1))
    assert [r["seq"] for r in rows_b] == list(range(1, len(rows_b) + 1))
    assert [r["data"]["i"] for r in rows_a] == [i for i in range(50) if i % 3]
    assert [r["data"]["i"] for r in rows_b] == [i for i in range(50) if not i % 3]
    assert writer.written == 50 and writer.dropped == 0


async def test_emit_never_waits_and_a_full_queue_counts_drops(engine: AsyncEngine) -> None:
    call_id = await _call(engine, "CAfull")
    writer = EventWriter(engine, max_queue=3)  # not started: nothing drains the queue
    for _ in range(5):
        writer.emit(CallEvent(call_id, CallEventKind.SPEECH_STARTED))
    assert (writer.queue_depth, writer.dropped) == (3, 2)
    writer.start()
    await writer.close()
    assert len(await event_rows(engine, call_id)) == 3


async def test_close_writes_everything_still_queued(engine: AsyncEngine) -> None:
    call_id = await _call(engine, "CAclose")
    writer = EventWriter(engine)
    writer.start()
    for i in range(200):
        writer.emit(CallEvent(call_id, CallEventKind.DTMF, {"i": i}))
    writer.emit(CallEvent(call_id, CallEventKind.CALL_ENDED, {"reason": "stop"}))
    await writer.close()
    rows = await event_rows(engine, call_id)
    assert len(rows) == 201 and rows[-1]["kind"] == "call_ended"


async def test_events_after_call_end_continue_the_seq(engine: AsyncEngine) -> None:
    call_id = await _call(engine, "CAlate")
    first = EventWriter(engine)
    first.start()
    first.emit(CallEvent(call_id, CallEventKind.CALL_STARTED))
    first.emit(CallEvent(call_id, CallEventKind.CALL_ENDED))
    await first.close()
    # Another process (a fresh writer) records a late outcome for the same call.
    second = EventWriter(engine)
    second.start()
    second.emit(CallEvent(call_id, CallEventKind.RESULT_ANNOUNCED, {"via": "sms"}))
    await second.close()
    assert [r["seq"] for r in await event_rows(engine, call_id)] == [1, 2, 3]


async def test_events_for_an_unknown_call_are_dropped_without_sinking_the_batch(
    engine: AsyncEngine,
) -> None:
    call_id = await _call(engine, "CAknown")
    writer = EventWriter(engine)
    writer.emit(CallEvent(call_id, CallEventKind.DTMF, {"i": 1}))
    writer.emit(CallEvent(str(uuid.uuid4()), CallEventKind.DTMF, {"i": 2}))  # no such call
    writer.emit(CallEvent("not-a-uuid", CallEventKind.DTMF, {"i": 3}))
    writer.emit(CallEvent(call_id, CallEventKind.DTMF, {"i": 4}))
    writer.start()
    await writer.close()
    assert [r["data"]["i"] for r in await event_rows(engine, call_id)] == [1, 4]
    assert writer.dropped == 2


async def test_a_database_hiccup_is_retried_and_nothing_is_lost(engine: AsyncEngine) -> None:
    call_id = await _call(engine, "CAhiccup")
    writer = EventWriter(engine, retry_initial_s=0.02, retry_max_s=0.05)
    writer.start()
    async with engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE call_events RENAME TO call_events_away"))
    try:
        for i in range(10):
            writer.emit(CallEvent(call_id, CallEventKind.DTMF, {"i": i}))
        await wait_until(lambda: writer.retries >= 2, 5, "writer retrying")
        assert writer.written == 0
    finally:
        async with engine.begin() as conn:
            await conn.execute(sa.text("ALTER TABLE call_events_away RENAME TO call_events"))
    assert await writer.flush(10)
    await writer.close()
    assert [r["data"]["i"] for r in await event_rows(engine, call_id)] == list(range(10))
    assert writer.dropped == 0


async def test_data_that_is_not_json_is_stored_as_text(engine: AsyncEngine) -> None:
    call_id = await _call(engine, "CAjson")
    writer = EventWriter(engine)
    writer.start()
    marker = uuid.uuid4()
    writer.emit(CallEvent(call_id, CallEventKind.ERROR, {"id": marker, "n": 1}))
    await writer.close()
    rows = await event_rows(engine, call_id)
    assert rows[0]["data"] == {"id": str(marker), "n": 1}


async def test_every_value_is_stored_as_emitted(engine: AsyncEngine) -> None:
    """The batch travels as one JSON document: quotes, backslashes, non-ASCII text, a NUL
    (replaced), nested data, a time with microseconds in another offset and the largest
    monotonic time a BIGINT holds come back as they were given."""
    call_id = await _call(engine, "CAvalues")
    at = datetime(2026, 12, 7, 23, 59, 59, 999_999, tzinfo=timezone(timedelta(hours=-5)))
    data = {
        "text": 'He said "book it" \\ then {left}\n',
        "names": ["Zoë", "李", "🙂"],
        "nested": {"a": [1, 2.5, None, True], "b": {"c": ""}},
        "nul": "a\x00b",
    }
    writer = EventWriter(engine)
    writer.start()
    writer.emit(CallEvent(call_id, CallEventKind.ERROR, data, mono_ns=2**63 - 1, at=at))
    writer.emit(CallEvent(call_id, CallEventKind.DTMF, {}, mono_ns=0, at=at))
    await writer.close()
    rows = await event_rows(engine, call_id)
    assert [r["kind"] for r in rows] == ["error", "dtmf"]
    assert rows[0]["data"] == {**data, "nul": "a\ufffdb"}
    assert rows[1]["data"] == {}
    assert [r["mono_ns"] for r in rows] == [2**63 - 1, 0]
    async with engine.connect() as conn:
        stamps = await conn.scalars(
            sa.text("SELECT at FROM call_events WHERE call_id = :c ORDER BY seq"),
            {"c": uuid.UUID(call_id)},
        )
        assert list(stamps) == [at, at]
    assert writer.written == 2 and writer.dropped == 0


async def test_an_event_the_database_refuses_is_dropped_alone_and_the_writer_goes_on(
    engine: AsyncEngine,
) -> None:
    a, b = await _call(engine, "CApoison"), await _call(engine, "CAfine")
    writer = EventWriter(engine, retry_initial_s=0.01)
    writer.start()
    writer.emit(CallEvent(a, CallEventKind.DTMF, {"i": 1}))
    # A value no BIGINT column holds: retrying it can never succeed.
    writer.emit(CallEvent(a, CallEventKind.DTMF, {"i": 2}, mono_ns=2**70))
    writer.emit(CallEvent(a, CallEventKind.DTMF, {"i": 3}))
    writer.emit(CallEvent(b, CallEventKind.DTMF, {"i": 4}))
    assert await writer.flush(10)
    # Later events of any call keep flowing.
    writer.emit(CallEvent(b, CallEventKind.CALL_ENDED, {"reason": "stop"}))
    await writer.close()
    rows_a, rows_b = await event_rows(engine, a), await event_rows(engine, b)
    assert [r["data"]["i"] for r in rows_a] == [1, 3]
    assert [r["seq"] for r in rows_a] == [1, 2]
    assert [r["kind"] for r in rows_b] == ["dtmf", "call_ended"]
    assert (writer.dropped, writer.poisoned, writer.written) == (1, 1, 4)


async def test_events_moments_apart_share_one_statement_and_a_flush_cuts_the_wait(
    engine: AsyncEngine,
) -> None:
    call_id = await _call(engine, "CAlinger")
    inserts: list[str] = []

    def executed(conn: object, cursor: object, statement: str, *args: object) -> None:
        if "INSERT INTO call_events" in statement:
            inserts.append(statement)

    sa.event.listen(engine.sync_engine, "after_cursor_execute", executed)
    try:
        # A linger far longer than the flush's wait: the flush can only succeed by cutting it.
        writer = EventWriter(engine, linger_s=60)
        writer.start()
        writer.emit(CallEvent(call_id, CallEventKind.CALL_STARTED))
        for _ in range(5):
            await asyncio.sleep(0)  # the writer takes the first event and waits for company
        writer.emit(CallEvent(call_id, CallEventKind.STREAM_STARTED))
        writer.emit(CallEvent(call_id, CallEventKind.REALTIME_CONNECTED))
        assert await writer.flush(10)
        assert len(inserts) == 1  # the three events, one statement
        await writer.close()
    finally:
        sa.event.remove(engine.sync_engine, "after_cursor_execute", executed)
    rows = await event_rows(engine, call_id)
    assert [(r["seq"], r["kind"]) for r in rows] == [
        (1, "call_started"),
        (2, "stream_started"),
        (3, "realtime_connected"),
    ]


async def test_a_call_said_new_that_has_events_already_still_numbers_after_them(
    engine: AsyncEngine,
) -> None:
    call_id = await _call(engine, "CAnotnew")
    other = EventWriter(engine)  # another process wrote the call's first events
    other.start()
    other.emit(CallEvent(call_id, CallEventKind.CALL_STARTED))
    other.emit(CallEvent(call_id, CallEventKind.STREAM_STARTED))
    await other.close()
    writer = EventWriter(engine)
    writer.new_call(call_id)  # wrongly: the seq taken makes it look the last one up
    writer.start()
    writer.emit(CallEvent(call_id, CallEventKind.DTMF, {"i": 1}))
    await writer.close()
    assert [r["seq"] for r in await event_rows(engine, call_id)] == [1, 2, 3]
    assert writer.dropped == 0
