"""The judgement behind a caller's yes (telephony.caller_evidence), on a fake clock."""

from __future__ import annotations

from telephony.caller_evidence import EvidenceLog, SpokenItem
from telephony.playback import PlaybackTracker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def readback(started: float, ended: float | None, heard: int = 2000) -> SpokenItem:
    return SpokenItem("item_rb", "resp_rb", started, ended, heard, 2000)


def asked_and_read(clock: Clock) -> EvidenceLog:
    log = EvidenceLog(clock)
    log.readback_asked("op1")
    clock.now += 0.1
    log.response_created("resp_rb")
    clock.now += 2.5  # the readback plays
    return log


def test_a_key_pressed_after_the_readback_counts_and_names_the_digit() -> None:
    clock = Clock()
    log = asked_and_read(clock)
    log.digit("1")
    found = log.judge("op1", [readback(100.2, 102.4)])
    assert found.counts and found.digit == "1" and found.readback_item_id == "item_rb"
    assert found.record()["confirmed_by"] == "caller"


def test_speech_that_began_but_was_never_committed_is_no_answer() -> None:
    clock = Clock()
    log = asked_and_read(clock)
    log.speech_started("item_yes")
    found = log.judge("op1", [readback(100.2, 102.4)])
    assert not found.counts and "still speaking" in found.reason
    log.speech_heard("item_yes")
    assert log.judge("op1", [readback(100.2, 102.4)]).counts


def test_a_readback_still_playing_or_cut_is_not_heard() -> None:
    clock = Clock()
    log = asked_and_read(clock)
    log.speech_started("item_yes")
    log.speech_heard("item_yes")
    cut = log.judge("op1", [readback(100.2, None, heard=700)])
    assert not cut.counts and "not heard to its end" in cut.reason
    assert cut.readback_heard_ms == 700
    late = log.judge("op1", [readback(100.2, clock.now + 1)])
    assert not late.counts and "before the readback ended" in late.reason


def test_items_from_before_the_readback_was_asked_are_not_a_readback() -> None:
    clock = Clock()
    log = EvidenceLog(clock)
    log.response_created("resp_old")
    clock.now += 1
    log.readback_asked("op1")
    clock.now += 1
    log.speech_started("item_yes")
    log.speech_heard("item_yes")
    old = SpokenItem("item_old", "resp_old", 100.5, 100.9, 400, 400)
    found = log.judge("op1", [old])
    assert not found.counts and "before hearing the readback" in found.reason


def test_an_operation_never_read_back_in_this_call_has_no_evidence() -> None:
    clock = Clock()
    log = asked_and_read(clock)
    log.digit("1")
    assert not log.judge("op-other", [readback(100.2, 102.4)]).counts


def test_the_tracker_knows_when_an_item_was_heard_to_its_end_not_when_it_was_sent() -> None:
    clock = Clock()
    tracker = PlaybackTracker(clock)
    epoch, _ = tracker.queued("item_rb", 1000)
    assert tracker.ended_at("item_rb") is None  # sent, not heard
    clock.now += 0.5
    tracker.played(epoch, "item_rb", 500)
    assert tracker.ended_at("item_rb") is None
    clock.now += 0.5
    tracker.played(epoch, "item_rb", 1000)
    assert tracker.ended_at("item_rb") == clock.now
    # An item that follows finishes the earlier one when it is confirmed playing.
    epoch, _ = tracker.queued("item_a", 400)
    tracker.queued("item_b", 400)
    clock.now += 1.0
    tracker.played(epoch, "item_b", 600)
    assert tracker.ended_at("item_a") == clock.now


def test_an_item_confirmed_before_the_item_ahead_of_it_ended_still_has_a_start() -> None:
    """The second item's first mark can be read before the first item's last one: it was heard
    from about (now - its confirmed audio) on, never "not started" (which made the caller's
    yes to a heard readback count as spoken before it)."""
    clock = Clock()
    tracker = PlaybackTracker(clock)
    epoch, _ = tracker.queued("item_a", 1000)
    tracker.queued("item_rb", 2000)
    clock.now += 1.0
    tracker.played(epoch, "item_a", 900)
    clock.now += 0.3
    tracker.played(epoch, "item_rb", 200)  # item_a's last mark never came first
    started = tracker.started_at("item_rb")
    assert started is not None and abs(started - (clock.now - 0.2)) < 1e-9
    clock.now += 1.8
    tracker.played(epoch, "item_rb", 2000)
    assert tracker.ended_at("item_rb") == clock.now
    assert tracker.started_at("item_a") == 100.0


def test_an_item_whose_audio_ran_out_before_its_last_mark_came_back_is_settled_as_ended() -> None:
    """The caller's yes 0.1 s after the readback's end, its last mark echo still on its way:
    the readback ended when its audio ran out, and nothing is playing (no barge-in on it)."""
    clock = Clock()
    tracker = PlaybackTracker(clock)
    epoch, _ = tracker.queued("item_rb", 900.375)
    clock.now += 0.5
    tracker.played(epoch, "item_rb", 500)
    clock.now += 0.3
    tracker.settle()
    assert tracker.is_playing()  # 100.375 ms of it still to hear
    clock.now += 0.2
    tracker.settle()
    assert not tracker.is_playing()
    ended = tracker.ended_at("item_rb")
    assert ended is not None and abs(ended - (100.5 + 0.400375)) < 1e-9
    assert tracker.heard_ms("item_rb") == 900
    # The late echo changes nothing.
    tracker.played(epoch, "item_rb", 900.375)
    assert tracker.ended_at("item_rb") == ended


def test_settling_starts_the_item_behind_when_the_one_ahead_ran_out() -> None:
    clock = Clock()
    tracker = PlaybackTracker(clock)
    tracker.queued("item_a", 300)
    tracker.queued("item_b", 1000)
    clock.now += 0.5
    tracker.settle()
    assert tracker.current_item() == "item_b"
    assert tracker.started_at("item_b") == 100.3
    assert tracker.heard_ms("item_b") == 200
    clock.now += 1.0
    tracker.settle()
    assert not tracker.is_playing() and tracker.ended_at("item_b") == 101.3


def test_a_clear_after_an_item_ran_out_keeps_when_it_ended_not_when_it_was_cleared() -> None:
    clock = Clock()
    tracker = PlaybackTracker(clock)
    tracker.queued("item_rb", 400.125)
    clock.now += 1.0
    tracker.cleared()
    assert tracker.heard_ms("item_rb") == 400
    ended = tracker.ended_at("item_rb")
    assert ended is not None and abs(ended - 100.400125) < 1e-9
