"""The call timeline as staff and the demo read it: agent speech where it began, nothing cut."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import store as call_store
from app.calls.events import EventWriter
from app.calls.timeline import format_table, load_timeline
from telephony.call_events import CallEvent, CallEventKind

READBACK = (
    "Please confirm: a table for 4 people on Wednesday 02 December 2026 at 20:00 under the "
    "name Alex. Shall I book it?"
)


def _timeline(*entries: tuple[float, str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "events": [
            {"source": "call", "seq": i, "kind": kind, "at": "", "t_ms": t, "data": data}
            for i, (t, kind, data) in enumerate(entries, 1)
        ]
    }


def test_long_details_wrap_under_the_details_column_and_nothing_is_cut() -> None:
    timeline = _timeline(
        (0.0, "call_started", {"from": "+15551230000", "to": "+15550000000"}),
        (18088.9, "agent_transcript", {"text": READBACK, "cut": False, "heard_ms": 5200}),
    )
    table = format_table(timeline, width=80)
    lines = table.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert "…" not in table
    start = lines.index(next(line for line in lines if "agent_transcript" in line))
    continued = lines[start + 1 :]
    assert continued and all(line.startswith(" " * 33) and line[33] != " " for line in continued)
    flowing = " ".join(line[33:] for line in lines[start:])
    assert f'text="{READBACK}"' in flowing


def test_wide_table_keeps_one_line_per_entry() -> None:
    timeline = _timeline((1.0, "agent_transcript", {"text": READBACK * 3, "cut": False}))
    lines = format_table(timeline, width=None).splitlines()
    assert len(lines) == 3 and READBACK * 3 in lines[2]


async def test_agent_speech_is_placed_where_the_caller_began_hearing_it(
    engine: AsyncEngine,
) -> None:
    row, _ = await call_store.create_call(
        engine, call_sid="CA" + "1" * 32, tenant_id="default", from_number=None, to_number=None
    )
    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    mono0 = 5_000_000_000

    def at(ms: int, kind: CallEventKind, **data: Any) -> CallEvent:
        wall = t0 + timedelta(milliseconds=ms)
        return CallEvent(row.id, kind, data, mono0 + ms * 1_000_000, wall)

    writer = EventWriter(engine)
    writer.start()
    for event in (
        at(0, CallEventKind.CALL_STARTED),
        at(400, CallEventKind.RESPONSE_CREATED, reason="greeting"),
        at(1500, CallEventKind.SPEECH_STARTED, audio_start_ms=1480),
        # Recorded when its audio had played out (at 3100 ms), heard from 500 ms on.
        at(3100, CallEventKind.AGENT_TRANSCRIPT, text="Hello", started_mono_ns=mono0 + 500_000_000),
        # A stamp that cannot be this event's (after it was recorded) is not used.
        at(3200, CallEventKind.AGENT_TRANSCRIPT, text="Odd", started_mono_ns=mono0 + 9_000_000_000),
    ):
        writer.emit(event)
    await writer.close()

    timeline = await load_timeline(engine, row.id)
    assert timeline is not None
    shown = [(e["kind"], e["t_ms"], e["data"].get("text")) for e in timeline["events"]]
    assert shown == [
        ("call_started", 0.0, None),
        ("response_created", 400.0, None),
        ("agent_transcript", 500.0, "Hello"),
        ("speech_started", 1500.0, None),
        ("agent_transcript", 3200.0, "Odd"),
    ]
    hello = timeline["events"][2]
    assert datetime.fromisoformat(hello["at"]) == t0 + timedelta(milliseconds=500)


def test_compact_json_arguments_wrap_between_fields_not_inside_them() -> None:
    arguments = '{"date":"2026-12-02","time":"20:00","party_size":4,"name":"Alexandra Smith"}'
    timeline = _timeline((1.0, "function_call", {"name": "book_table", "arguments": arguments}))
    lines = format_table(timeline, width=80).splitlines()[2:]
    assert len(lines) > 1
    for field in ('"date":"2026-12-02"', '"party_size":4', '"name":"Alexandra Smith"'):
        assert any(field in line for line in lines), (field, lines)


async def test_speech_spans_what_was_heard_and_no_entry_is_before_zero(
    engine: AsyncEngine,
) -> None:
    row, _ = await call_store.create_call(
        engine, call_sid="CA" + "2" * 32, tenant_id="default", from_number=None, to_number=None
    )
    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    mono0 = 5_000_000_000

    def at(ms: int, kind: CallEventKind, **data: Any) -> CallEvent:
        return CallEvent(
            row.id, kind, data, mono0 + ms * 1_000_000, t0 + timedelta(milliseconds=ms)
        )

    writer = EventWriter(engine)
    writer.start()
    for event in (
        at(0, CallEventKind.CALL_STARTED),
        # The greeting began playing 200 ms before the call's first event was written.
        at(2400, CallEventKind.AGENT_TRANSCRIPT, text="Hi", heard_ms=2600, audio_ms=2600,
           started_mono_ns=mono0 - 200_000_000),
        # No playout stamp: recorded when the caller stopped hearing it, 800 ms in.
        at(5000, CallEventKind.AGENT_TRANSCRIPT, text="Sure", heard_ms=800, audio_ms=1100),
    ):  # fmt: skip
        writer.emit(event)
    await writer.close()

    timeline = await load_timeline(engine, row.id)
    assert timeline is not None
    shown = [(e["kind"], e["t_ms"], e.get("until_ms")) for e in timeline["events"]]
    assert shown == [
        ("agent_transcript", 0.0, 2600.0),
        ("call_started", 200.0, None),
        ("agent_transcript", 4400.0, 5200.0),
    ]
