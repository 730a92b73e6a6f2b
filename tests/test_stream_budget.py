"""The per-stream budget (telephony.legs.twilio.budget) with a fake clock: Twilio's pace never
trips it, a flood does, once, with one event."""

from __future__ import annotations

from telephony.call_events import CallEventKind, MemorySink
from telephony.legs.twilio.budget import BudgetLimits, StreamBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_twilio_pace_never_trips_the_frame_budget() -> None:
    sink, clock = MemorySink(), Clock()
    budget = StreamBudget(sink, "c1", BudgetLimits(frames_per_s=200, frame_burst=2000), clock)
    for _ in range(50 * 3600):  # an hour of 20 ms frames
        clock.now += 0.02
        budget.frame()
    assert budget.tripped is None and sink.events == []


def test_a_frame_flood_trips_once_with_one_event() -> None:
    sink, clock = MemorySink(), Clock()
    budget = StreamBudget(sink, "c1", BudgetLimits(frames_per_s=200, frame_burst=2000), clock)
    for _ in range(1984):
        budget.frame()
    assert budget.tripped is None
    for _ in range(10_000):
        budget.frame()
    assert budget.tripped is not None and "frames a second" in budget.tripped
    assert [e.kind for e in sink.events] == [CallEventKind.STREAM_ABUSIVE]
    assert sink.events[0].data["budget"] == "frames"


def test_malformed_frames_are_recorded_up_to_the_budget_then_trip() -> None:
    sink = MemorySink()
    budget = StreamBudget(sink, "c1", BudgetLimits(max_malformed=3))
    recorded = 0
    for _ in range(10):
        if budget.may_record():
            recorded += 1
        budget.malformed()
    assert recorded == 3
    assert [e.data["budget"] for e in sink.events] == ["malformed_frames"]


def test_frames_reported_in_batches_count_as_the_same_frames_one_by_one() -> None:
    """The leg counts its frames and reports every BATCH: the budget trips at the same frame
    as with one call per frame, under the same clock."""
    from telephony.legs.twilio.budget import BATCH

    def trips_after(batched: bool) -> int:
        clock = Clock()
        budget = StreamBudget(
            MemorySink(), "c1", BudgetLimits(frames_per_s=200, frame_burst=2000), clock
        )
        frames = 0
        while budget.tripped is None:
            frames += 1
            clock.now += 0.001  # 1,000 frames a second: five times the limit
            if batched:
                if frames % BATCH == 0:
                    budget.batch()
            else:
                budget.frame()
        return frames

    assert trips_after(batched=True) == trips_after(batched=False) < 10_000
