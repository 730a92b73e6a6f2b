"""The relevance gate as a pure function: each check answered, the first that settles wins."""

from __future__ import annotations

import uuid

import pytest

from tools.relevance import Action, CallState, GateFacts, Newer, decide, sms_capable
from tools.states import OperationStatus

S = OperationStatus
CALLER = "+15551230000"


def facts(**kw: object) -> GateFacts:
    values: dict[str, object] = {
        "outcome": S.COMMITTED,
        "attempts": 1,
        "has_call": True,
        "call": CallState.LIVE_HERE,
        "caller": CALLER,
        "live_caller": CALLER,
        "sms_capable": True,
        **kw,
    }
    return GateFacts(**values)  # type: ignore[arg-type]


def test_a_live_call_here_with_its_own_caller_is_told_in_the_call() -> None:
    d = decide(facts())
    assert d.action is Action.ANNOUNCE and not d.contradicted
    assert d.checks == {
        "call": "live_here",
        "same_call": True,
        "already_communicated": False,
        "reconcile_first": False,
        "current": "current",
        "disclosure": "the same call that asked, and its caller",
        "channel": "call",
    }


def test_another_caller_on_the_line_is_never_told() -> None:
    d = decide(facts(live_caller="+15559990000"))
    assert d.action is Action.NOT_DELIVERABLE and d.checks["same_call"] is False


def test_nothing_done_or_told_already_needs_no_delivery() -> None:
    assert decide(facts(outcome=S.CANCELLED, attempts=0)).action is Action.NOT_NEEDED
    told = decide(facts(told_in_reply=True))
    assert told.action is Action.NOT_NEEDED
    assert told.checks["already_communicated"] == "the tool reply carried this outcome"
    assert decide(facts(has_call=False)).action is Action.NOT_NEEDED


def test_a_compensation_in_flight_holds_the_outcome_until_it_settles() -> None:
    held = decide(facts(compensation_statuses=(S.RUNNING,)))
    assert held.action is Action.HOLD and held.checks["reconcile_first"] is True
    settled = decide(facts(compensation_statuses=(S.COMMITTED,)))
    assert settled.action is Action.ANNOUNCE


def test_a_newer_request_on_the_same_key_makes_it_told_with_the_conflict() -> None:
    other = uuid.UUID("00000000-0000-4000-8000-000000000002")
    newer = Newer(other, S.AWAITING_CONFIRMATION, "a table at 21:30", held=True)
    d = decide(facts(newer=(newer,)))
    assert d.action is Action.ANNOUNCE and d.contradicted
    assert d.checks["current"] == f"contradicted by {other} (awaiting_confirmation, held)"
    assert d.reason == "announce in the call with the conflict"
    by_sms = decide(facts(newer=(newer,), call=CallState.ENDED))
    assert by_sms.action is Action.TEXT and by_sms.contradicted


def test_newer_turns_alone_only_note_that_the_talk_moved_on() -> None:
    d = decide(facts(turns_since=3))
    assert d.action is Action.ANNOUNCE and not d.contradicted
    assert d.checks["current"] == "current; the talk moved on 3 turn(s)"


def test_cut_announcements_are_offered_again_up_to_the_limit_then_texted() -> None:
    assert decide(facts(cuts=1, max_reoffers=2)).action is Action.ANNOUNCE
    assert decide(facts(cuts=2, max_reoffers=2)).action is Action.ANNOUNCE
    last = decide(facts(cuts=3, max_reoffers=2))
    assert last.action is Action.TEXT and last.reason == "cut 3 times in the call: by SMS"


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (CallState.ENDED, "the call has ended: by SMS"),
        (CallState.DEAD, "the call's process stopped: by SMS"),
        (CallState.UNKNOWN, "the call is unknown: by SMS"),
    ],
)
def test_a_call_that_is_over_gets_an_sms(call: CallState, reason: str) -> None:
    d = decide(facts(call=call))
    assert d.action is Action.TEXT and d.reason == reason
    assert d.checks["disclosure"] == "to the number that made the request"


def test_a_call_live_elsewhere_is_left_to_its_holder() -> None:
    assert decide(facts(call=CallState.LIVE_ELSEWHERE)).action is Action.WAIT


def test_no_sms_capable_number_or_an_opt_out_is_not_deliverable() -> None:
    no_number = decide(facts(call=CallState.ENDED, sms_capable=False))
    assert no_number.action is Action.NOT_DELIVERABLE
    assert no_number.reason == "no SMS-capable number to text"
    stopped = decide(facts(call=CallState.ENDED, opted_out=True))
    assert stopped.action is Action.NOT_DELIVERABLE
    assert stopped.reason == "the caller opted out of SMS"


@pytest.mark.parametrize(
    ("number", "capable"),
    [
        ("+15551230000", True),
        ("+4915112345678", True),
        ("anonymous", False),
        ("", False),
        (None, False),
        ("+1555", False),
        ("sip:alice@example.com", False),
        ("15551230000", False),
        ("+1555123000012345", False),
    ],
)
def test_sms_capable_numbers_are_e164(number: str | None, capable: bool) -> None:
    assert sms_capable(number) is capable
