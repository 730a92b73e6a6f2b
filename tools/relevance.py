"""The relevance gate: before an outcome is spoken or texted, decide whether and how.

A pure function over facts (gathered from the ledger, the calls table and the live call by
whoever asks). Each check is answered and kept in the decision, so the delivery's trail
says why: same caller and call; not already communicated; still current (a newer
operation of the same caller on the same conflict key contradicts it, or newer turns only
moved the talk on); may be disclosed on this channel (in a live call: by the agent active
now, whichever agent admitted it); must a conflicting effect be settled
first. A contradicted outcome is still told, with the conflict, never as if it answered the
newer request.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tools.states import IN_FLIGHT, OperationStatus

S = OperationStatus


class Action(StrEnum):
    """What to do with an outcome now."""

    ANNOUNCE = "announce"  # speak it in the live call this process holds
    TEXT = "text"  # send an SMS
    WAIT = "wait"  # the call is live on another process: that one decides
    HOLD = "hold"  # not yet: a conflicting effect must settle first
    NOT_NEEDED = "not_needed"  # nothing to tell, or told already
    NOT_DELIVERABLE = "not_deliverable"  # nobody can be reached


class CallState(StrEnum):
    """The call the outcome belongs to, as seen from the process deciding."""

    LIVE_HERE = "live_here"  # its bridge runs in this process
    LIVE_ELSEWHERE = "live_elsewhere"  # in progress, its holder's heartbeat is fresh
    ENDED = "ended"
    DEAD = "dead"  # in progress on paper, but its holder stopped heartbeating
    UNKNOWN = "unknown"  # no such call row


@dataclass(frozen=True, slots=True)
class Newer:
    """A newer operation of the same caller on the same conflict key."""

    operation_id: uuid.UUID
    status: OperationStatus
    description: str
    held: bool  # waiting for this outcome to settle before it may run


@dataclass(frozen=True, slots=True)
class GateFacts:
    """Everything the gate looks at."""

    outcome: OperationStatus
    attempts: int
    has_call: bool
    call: CallState
    # The number that made the request, and the number on the live call here (if any).
    caller: str | None
    live_caller: str | None = None
    told_in_reply: bool = False
    told_with_original: bool = False  # a compensation whose original's delivery waited for it
    newer: tuple[Newer, ...] = ()
    compensation_statuses: tuple[OperationStatus, ...] = ()
    turns_since: int | None = None  # caller turns since the request (live calls only)
    cuts: int = 0  # announcements of it cut by a barge-in so far
    max_reoffers: int = 2
    sms_capable: bool = False  # the caller's number is a number an SMS can reach
    opted_out: bool = False
    needs_verification: bool = False  # the tool acts on something only its owner may know
    # The agent talking in the live call now (AGENTS_FILE), and whether it may tell this
    # tool's results; one that may not leaves it to another channel (SMS).
    active_agent: str | None = None
    agent_may_disclose: bool = True


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The verdict, its one-line reason, and every check's answer (for the trail)."""

    action: Action
    reason: str
    contradicted: bool = False
    checks: dict[str, Any] = field(default_factory=dict)

    def as_data(self) -> dict[str, Any]:
        return {"action": self.action.value, "contradicted": self.contradicted, **self.checks}


def decide(f: GateFacts) -> GateDecision:
    """Apply the checks in order; the first that settles the matter wins."""
    checks: dict[str, Any] = {"call": f.call.value}

    def done(action: Action, reason: str, contradicted: bool = False) -> GateDecision:
        return GateDecision(action, reason, contradicted, checks)

    # Same caller and call: an outcome belongs to the call (and number) that asked for it.
    if not f.has_call:
        checks["same_call"] = False
        return done(Action.NOT_NEEDED, "no call asked for it: nobody to tell")
    same_caller = f.call is not CallState.LIVE_HERE or f.live_caller == f.caller
    checks["same_call"] = same_caller
    if not same_caller:
        return done(Action.NOT_DELIVERABLE, "the live call is not the caller who asked")

    # Not already communicated.
    if f.outcome is S.CANCELLED and f.attempts == 0:
        checks["already_communicated"] = "withdrawn in the call before anything was sent"
        return done(Action.NOT_NEEDED, "nothing was done, and the call was told so")
    if f.told_in_reply:
        checks["already_communicated"] = "the tool reply carried this outcome"
        return done(Action.NOT_NEEDED, "already told: the tool reply carried this outcome")
    if f.told_with_original:
        checks["already_communicated"] = "told with the outcome it undoes"
        return done(Action.NOT_NEEDED, "told together with the outcome it undoes")
    checks["already_communicated"] = False

    # A conflicting effect settles first: a booking being undone is told with its undoing.
    settling = [s for s in f.compensation_statuses if s in IN_FLIGHT]
    checks["reconcile_first"] = bool(settling)
    if settling:
        return done(Action.HOLD, "its compensation is still in flight: told once it settles")

    # Still current? A newer request of the same caller on the same key contradicts it.
    contradicted = bool(f.newer)
    if contradicted:
        checks["current"] = "contradicted by " + ", ".join(
            f"{n.operation_id} ({n.status.value}{', held' if n.held else ''})" for n in f.newer
        )
    elif f.turns_since:
        checks["current"] = f"current; the talk moved on {f.turns_since} turn(s)"
    else:
        checks["current"] = "current"

    # Which channel, and may it be disclosed there?
    if f.call is CallState.LIVE_HERE:
        if f.active_agent is not None:
            checks["agent"] = f.active_agent
        if not f.agent_may_disclose:
            checks["channel"] = "sms"
            return _text(
                f,
                checks,
                f"the active agent ({f.active_agent}) may not disclose it: by SMS",
                contradicted,
            )
        checks["disclosure"] = "the same call that asked, and its caller"
        if f.cuts > f.max_reoffers:
            checks["channel"] = "sms"
            return _text(f, checks, f"cut {f.cuts} times in the call: by SMS", contradicted)
        checks["channel"] = "call"
        why = "announce in the call" + (" with the conflict" if contradicted else "")
        if f.cuts:
            why += f" (offered again after {f.cuts} cut{'s' if f.cuts > 1 else ''})"
        return done(Action.ANNOUNCE, why, contradicted)
    if f.call is CallState.LIVE_ELSEWHERE:
        checks["channel"] = "call (another process)"
        return done(Action.WAIT, "the call is live on another process: it announces")
    ended = {
        CallState.ENDED: "the call has ended",
        CallState.DEAD: "the call's process stopped",
        CallState.UNKNOWN: "the call is unknown",
    }[f.call]
    checks["channel"] = "sms"
    return _text(f, checks, f"{ended}: by SMS", contradicted)


def _text(f: GateFacts, checks: dict[str, Any], reason: str, contradicted: bool) -> GateDecision:
    if not f.sms_capable:
        checks["disclosure"] = "no SMS-capable number"
        return GateDecision(
            Action.NOT_DELIVERABLE, "no SMS-capable number to text", contradicted, checks
        )
    if f.opted_out:
        checks["disclosure"] = "the number opted out of SMS (STOP)"
        return GateDecision(
            Action.NOT_DELIVERABLE, "the caller opted out of SMS", contradicted, checks
        )
    checks["disclosure"] = (
        "to the number that made the request, which the policy accepted as its owner"
        if f.needs_verification
        else "to the number that made the request"
    )
    return GateDecision(Action.TEXT, reason, contradicted, checks)


def sms_capable(number: str | None) -> bool:
    """An E.164 number (`+` and 8 to 15 digits); withheld, `anonymous` and SIP URIs are not."""
    if not number or not number.startswith("+"):
        return False
    digits = number[1:]
    return digits.isdigit() and 8 <= len(digits) <= 15
