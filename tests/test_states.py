"""The operation state machine as a pure table."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.errors import IllegalTransition
from tools.states import (
    INITIAL,
    TERMINAL,
    TRANSITIONS,
    OperationStatus,
    check_transition,
    is_legal,
)

S = OperationStatus


def test_terminal_statuses_have_no_way_out() -> None:
    assert {S.COMMITTED, S.FAILED_FINAL, S.CANCELLED} == TERMINAL
    for status in TERMINAL:
        assert TRANSITIONS[status] == frozenset()


def test_every_status_is_reachable_from_an_initial_status() -> None:
    seen = set(INITIAL)
    frontier = list(INITIAL)
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(S)


def test_every_non_terminal_status_can_still_end() -> None:
    for status in set(S) - TERMINAL:
        assert TRANSITIONS[status], status


def test_unknown_is_resolved_only_by_reconciliation_never_rerun_directly() -> None:
    assert not is_legal(S.UNKNOWN, S.RUNNING)
    assert is_legal(S.UNKNOWN, S.COMMITTED)
    assert is_legal(S.UNKNOWN, S.FAILED_RETRYABLE)


def test_nothing_reaches_committed_without_running_or_reconciling() -> None:
    sources = {s for s, targets in TRANSITIONS.items() if S.COMMITTED in targets}
    assert sources == {S.RUNNING, S.UNKNOWN}


def test_awaiting_confirmation_cannot_skip_admission() -> None:
    assert TRANSITIONS[S.AWAITING_CONFIRMATION] == {S.ADMITTED, S.CANCELLED}


def test_check_transition_refuses_any_illegal_source_in_a_set() -> None:
    assert check_transition([S.ADMITTED, S.FAILED_RETRYABLE], S.RUNNING) == (
        S.ADMITTED,
        S.FAILED_RETRYABLE,
    )
    with pytest.raises(IllegalTransition):
        check_transition([S.ADMITTED, S.UNKNOWN], S.RUNNING)
    with pytest.raises(IllegalTransition):
        check_transition([], S.RUNNING)


@given(st.lists(st.sampled_from(list(S)), max_size=30), st.sampled_from(sorted(INITIAL)))
def test_applying_only_checked_transitions_never_leaves_the_table(
    targets: list[OperationStatus], start: OperationStatus
) -> None:
    status = start
    path = [status]
    for to in targets:
        try:
            check_transition(status, to)
        except IllegalTransition:
            assert to not in TRANSITIONS[status]
            continue
        status = to
        path.append(status)
    for a, b in itertools.pairwise(path):
        assert b in TRANSITIONS[a]
    # Once terminal, nothing moves it.
    for i, s in enumerate(path):
        if s in TERMINAL:
            assert i == len(path) - 1
