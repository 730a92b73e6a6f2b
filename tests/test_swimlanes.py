"""The swimlane layout of a call (pure): what lands on which lane, heard versus generated."""

from __future__ import annotations

from typing import Any

from app.console.swimlanes import layout, seconds


def ev(source: str, kind: str, t_ms: float, **data: Any) -> dict[str, Any]:
    entry = {"source": source, "seq": None, "kind": kind, "at": "", "t_ms": t_ms, "data": data}
    if kind == "agent_transcript":  # the timeline places speech at its start, says its end
        entry["until_ms"] = t_ms + data.get("heard_ms", 0)
    return entry


VIEW: dict[str, Any] = {
    "call": {"id": "c"},
    "operations": [],
    "recording": {"offset_ms": 300.0, "duration_ms": 12_000},
    "events": [
        ev("call", "call_started", 0),
        ev("call", "speech_started", 1000, turn_id=1),
        ev("call", "speech_stopped", 2500, turn_id=1),
        ev("call", "caller_transcript", 2700, turn_id=1, text="Book a table for four"),
        ev("call", "barge_in", 6000, item_id="item_2", played_ms=1500, truncated=True),
        ev("call", "agent_transcript", 3200, item_id="item_1", text="One moment.", cut=False,
           heard_ms=800, audio_ms=800),
        ev("call", "agent_transcript", 4500, item_id="item_2", text="Good news, we", cut=True,
           heard_ms=1500, audio_ms=6000, full_text="Good news, we have a table at eight."),
        ev("tool_call", "tool_call", 3000, tool="book_table", decision="needs_confirmation",
           operation_id="op1", arguments={"name": "Ada"}),
        ev("operation", "op_transition", 3000, operation_id="op1", tool="book_table",
           to="awaiting_confirmation", actor="policy"),
        ev("operation", "op_transition", 8000, operation_id="op1", tool="book_table",
           to="committed", actor="worker:w1", reference="BK1"),
        ev("operation", "op_transition", 8100, operation_id="op2", tool="book_table",
           to="committed", actor="provider-callback"),
        ev("operation", "op_decision", 8200, operation_id="op1", tool="book_table",
           actor="delivery", reason="announced in call"),
        ev("call", "result_announced", 8300, operation_ids=["op1"]),
        ev("call", "agent_transcript", 8500, item_id="item_3", text="It is booked.", cut=False,
           heard_ms=1000, audio_ms=1000),
        ev("call", "dtmf", 9600, digit="•"),
        ev("call", "call_ended", 11000, reason="stop"),
    ],
}  # fmt: skip


def test_each_kind_of_event_lands_on_its_lane_on_one_time_axis() -> None:
    lanes = {lane.key: lane for lane in layout(VIEW).lanes}
    assert list(lanes) == ["caller", "agent", "tools", "operations", "sor", "delivery", "call"]
    (speech,) = lanes["caller"].items
    assert (speech.start_ms, speech.end_ms, speech.title) == (1000, 2500, "Book a table for four")
    assert [i.label for i in lanes["tools"].items] == ["book_table → needs_confirmation"]
    assert lanes["tools"].items[0].href == "/console/operations/op1"
    assert [i.label for i in lanes["operations"].items] == [
        "book_table: awaiting_confirmation", "book_table: committed", "book_table: committed"
    ]  # fmt: skip
    assert [i.label for i in lanes["sor"].items] == ["confirmed BK1", "callback: confirmed"]
    assert [i.label for i in lanes["delivery"].items] == [
        "announced in call", "announced · heard in full"
    ]  # fmt: skip
    assert [i.label for i in lanes["call"].items] == [
        "call started",
        "keypad •",
        "call ended: stop",
    ]


def test_a_barge_in_shows_what_was_heard_and_what_was_generated_but_never_heard() -> None:
    agent = next(lane for lane in layout(VIEW).lanes if lane.key == "agent")
    cut = next(i for i in agent.items if "cut" in i.css)
    whole = next(i for i in agent.items if i.label == "One moment.")
    barge = next(i for i in agent.items if i.css == "barge")
    # Heard from 4500 to the barge-in at 6000; generated on to 10 500.
    assert (cut.start_ms, cut.heard_end_ms, cut.end_ms) == (4500, 6000, 10_500)
    assert "never heard" in cut.title and "have a table at eight." in cut.title
    assert (whole.start_ms, whole.end_ms, whole.heard_end_ms) == (3200, 4000, None)
    assert barge.start_ms == 6000


def test_the_transcript_keeps_the_unheard_words_apart() -> None:
    lines = layout(VIEW).transcript
    assert [(line.speaker, line.text) for line in lines] == [
        ("caller", "Book a table for four"),
        ("agent", "One moment."),
        ("agent", "Good news, we"),
        ("agent", "It is booked."),
    ]
    assert lines[2].unheard == "have a table at eight."
    assert lines[2].note == "cut by a barge-in after 1500 of 6000 ms"


def test_overlapping_items_go_on_separate_rows_and_the_axis_covers_the_recording() -> None:
    lanes = layout(VIEW)
    ops = next(lane for lane in lanes.lanes if lane.key == "operations")
    assert ops.rows == 2 and {i.row for i in ops.items} == {0, 1}
    assert lanes.duration_ms >= 12_300  # the recording runs to 12.3 s on the axis
    assert lanes.ticks[0] == (0, "0.0 s") and lanes.pct(lanes.duration_ms) == 100
    assert seconds(83_500) == "1:23.5"


def test_a_handoff_shows_on_the_call_lane_naming_both_agents() -> None:
    view = {
        **VIEW,
        "events": [
            *VIEW["events"][:-1],
            ev("call", "agent_handoff", 10000, from_agent="host", to_agent="manager",
               reason="a deposit question"),
            VIEW["events"][-1],
        ],
    }  # fmt: skip
    lanes = {lane.key: lane for lane in layout(view).lanes}
    (handoff,) = [i for i in lanes["call"].items if i.label.startswith("handoff")]
    assert handoff.label == "handoff host → manager"
    assert "reason=a deposit question" in handoff.title


def test_speech_is_drawn_where_it_was_heard_and_the_transcript_keeps_the_lanes_order() -> None:
    view = {
        "call": {"id": "c"},
        "operations": [],
        "events": [
            ev("call", "speech_started", 1000, turn_id=1),
            ev("call", "speech_stopped", 2500, turn_id=1),
            ev("tool_call", "tool_call", 2600, tool="book_table", decision="needs_confirmation"),
            # Heard from 2800 ms for 3000 ms; the caller's words were transcribed after that.
            ev("call", "agent_transcript", 2800, text="Please confirm", heard_ms=3000,
               audio_ms=3000),
            ev("call", "caller_transcript", 3100, turn_id=1, text="Book it"),
        ],
    }  # fmt: skip
    lanes = layout(view)
    agent = next(lane for lane in lanes.lanes if lane.key == "agent")
    (readback,) = agent.items
    assert (readback.start_ms, readback.end_ms) == (2800, 5800)  # not its end minus its length
    assert [(line.speaker, line.t_ms) for line in lanes.transcript] == [
        ("caller", 1000),
        ("agent", 2800),
    ]
