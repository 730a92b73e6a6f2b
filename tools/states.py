"""The operation state machine: its states and the one table of legal transitions.

Only `tools.ledger.transition` changes an operation's status (with a conditional update);
this module is the pure part it consults.

    awaiting_confirmation -> admitted          the caller confirmed in time, in the call
                          -> cancelled         declined, expired, call ended, refused
    admitted              -> running           a worker claimed it (attempts + 1)
                          -> cancelled         cancel requested before any attempt
                          -> failed_final      total deadline passed before any attempt
    running               -> committed | failed_retryable | failed_final | unknown
                          -> cancelled         only when the provider confirmed a cancel
    failed_retryable      -> running | failed_final | cancelled
    unknown               -> committed | failed_final | failed_retryable | cancelled
                             (reconciliation only; never straight back to running)
    committed, failed_final, cancelled: terminal
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from tools.errors import IllegalTransition


class OperationStatus(StrEnum):
    """Where an operation stands. `cancel_requested` is a separate mark, not a status."""

    AWAITING_CONFIRMATION = "awaiting_confirmation"
    ADMITTED = "admitted"
    RUNNING = "running"
    COMMITTED = "committed"
    FAILED_RETRYABLE = "failed_retryable"
    FAILED_FINAL = "failed_final"
    UNKNOWN = "unknown"
    CANCELLED = "cancelled"


S = OperationStatus

# Statuses an operation may be created in (by admission, not by a transition).
INITIAL: frozenset[OperationStatus] = frozenset({S.AWAITING_CONFIRMATION, S.ADMITTED})

TERMINAL: frozenset[OperationStatus] = frozenset({S.COMMITTED, S.FAILED_FINAL, S.CANCELLED})

# Work that may still reach the provider or whose outcome is not settled yet.
IN_FLIGHT: frozenset[OperationStatus] = frozenset(
    {S.ADMITTED, S.RUNNING, S.FAILED_RETRYABLE, S.UNKNOWN}
)

TRANSITIONS: dict[OperationStatus, frozenset[OperationStatus]] = {
    # Confirmed by the caller -> admitted; declined, expired or call ended -> cancelled.
    S.AWAITING_CONFIRMATION: frozenset({S.ADMITTED, S.CANCELLED}),
    # Claimed by a worker -> running. Nothing was sent yet, so a cancel is final, and an
    # operation whose total deadline passed before any attempt may fail for good.
    S.ADMITTED: frozenset({S.RUNNING, S.CANCELLED, S.FAILED_FINAL}),
    # An attempt ends in exactly one of these. A timeout or lost response after sending is
    # `unknown`, never a failure. `cancelled` only when the provider confirmed the cancel.
    S.RUNNING: frozenset({S.COMMITTED, S.FAILED_RETRYABLE, S.FAILED_FINAL, S.UNKNOWN, S.CANCELLED}),
    # Proven not to have happened: retry, give up, or honour a cancel request.
    S.FAILED_RETRYABLE: frozenset({S.RUNNING, S.FAILED_FINAL, S.CANCELLED}),
    # Resolved only by reconciliation (asking the system of record), never by blind replay:
    # it happened -> committed; it never happened -> failed_retryable (retry allowed),
    # failed_final (no retry) or cancelled (a cancel was requested meanwhile).
    S.UNKNOWN: frozenset({S.COMMITTED, S.FAILED_FINAL, S.FAILED_RETRYABLE, S.CANCELLED}),
    S.COMMITTED: frozenset(),
    S.FAILED_FINAL: frozenset(),
    S.CANCELLED: frozenset(),
}


def is_legal(from_status: OperationStatus, to_status: OperationStatus) -> bool:
    """Whether the state machine allows `from_status -> to_status`."""
    return to_status in TRANSITIONS[from_status]


def check_transition(
    from_statuses: OperationStatus | Iterable[OperationStatus], to_status: OperationStatus
) -> tuple[OperationStatus, ...]:
    """Normalize the expected source statuses and refuse any illegal edge among them."""
    froms = (
        (OperationStatus(from_statuses),)
        if isinstance(from_statuses, str)
        else tuple(OperationStatus(s) for s in from_statuses)
    )
    if not froms:
        raise IllegalTransition(f"no source status given for -> {to_status}")
    to = OperationStatus(to_status)
    for f in froms:
        if not is_legal(f, to):
            raise IllegalTransition(f"illegal transition {f} -> {to}")
    return froms


def is_terminal(status: OperationStatus) -> bool:
    """No transition leaves a terminal status."""
    return status in TERMINAL
