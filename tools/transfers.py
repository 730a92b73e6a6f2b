"""Transfers to a person: the targets a deployment names, and the `transfer_call` tool.

`TRANSFER_TARGETS` names where a caller may be sent, as `name=destination` pairs
(`front_desk=+15550100009,billing=sip:billing@pbx.example`): a destination is an E.164 number or
a `sip:`/`sips:` URI. The model is offered `transfer_call` only when targets exist, with their
names as the only values `target` may take; the engine checks the name again (an unknown one is
refused with a speakable error and nothing is sent), records the request on the ledger's tool
call row, and the call's leg carries it out (Twilio `<Dial>`, SIP REFER, the interconnect's
`refer`). The model hears "transferring" only once the transfer is under way, and the outcome
(answered, busy, no answer, refused) is written back to the same row.

A tools file can declare the targets instead (`transfers:`), each with its opening hours in its
own time zone and who may be put through (anyone, or only a caller who proved who they are): a
transfer outside the hours or for a caller not verified is refused with a speakable reason (when
the target opens next) and nothing is sent.

A warm transfer (`mode: "warm"`, on legs that can: Twilio, our own SIP leg) rings the person
first and reads them a briefing the engine composes here (`briefing`): who is calling (their
name once they proved who they are, else their number's last digits), what they want, the
operations of the call still open and what the caller was told is done; the caller stays with
the agent until the person has heard it, and only then are the two joined.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from telephony.tool_gateway import CallContext, TransferOutcome
from tools import measures
from tools.delivery_models import deliveries_table as dl_t
from tools.delivery_states import COMMUNICATED
from tools.ledger_models import OperationRecord
from tools.ledger_models import operations_table as ops_t
from tools.ledger_models import tool_calls_table as calls_t
from tools.registry import ToolKind, ToolSpec
from tools.states import IN_FLIGHT, OperationStatus

log = logging.getLogger(__name__)

TRANSFER_CALL = "transfer_call"
TARGET_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
E164 = re.compile(r"^\+[1-9][0-9]{6,14}$")
SIP_URI = re.compile(r"^sips?:[^\s<>\"]{1,250}@[^\s<>\"]{1,250}$")
# What a briefing may list of the call's operations (it is read to a person on the phone).
BRIEFING_MAX_OPS = 5
BRIEFING_MAX_CHARS = 900


class TransferTargetError(ValueError):
    """TRANSFER_TARGETS that cannot be used; the message names the entry and the fix."""


DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
DAY_NAMES = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_SPAN = re.compile(r"^([a-z]{3})(?:-([a-z]{3}))?\s+(\d{2}):(\d{2})-(\d{2}):(\d{2})$")


@dataclass(frozen=True, slots=True)
class OpenHours:
    """When a target takes calls: spans of days and times in its own time zone
    (`mon-fri 09:00-17:00; sat 10:00-14:00`; a span ending before it starts runs past
    midnight, `fri 22:00-02:00`)."""

    spans: tuple[tuple[frozenset[int], int, int], ...]  # (weekdays, start minute, end minute)
    zone: str
    text: str

    @classmethod
    def parse(cls, text: str, zone: str = "UTC") -> OpenHours:
        zone_name(zone)
        spans = []
        for part in text.lower().split(";"):
            found = _SPAN.match(part.strip())
            if (
                found is None
                or found.group(1) not in DAYS
                or (found.group(2) is not None and found.group(2) not in DAYS)
            ):
                raise TransferTargetError(
                    f"hours {part.strip()[:64]!r}: write days and times as "
                    "`mon-fri 09:00-17:00; sat 10:00-14:00`"
                )
            first = DAYS.index(found.group(1))
            last = DAYS.index(found.group(2) or found.group(1))
            days = frozenset((first + i) % 7 for i in range((last - first) % 7 + 1))
            h1, m1, h2, m2 = (int(found.group(i)) for i in range(3, 7))
            if h1 > 23 or h2 > 24 or m1 > 59 or m2 > 59 or (h2 == 24 and m2):
                raise TransferTargetError(f"hours {part.strip()[:64]!r}: a time is out of range")
            start, end = h1 * 60 + m1, h2 * 60 + m2
            if start == end:
                raise TransferTargetError(f"hours {part.strip()[:64]!r}: the span is empty")
            spans.append((days, start, end))
        return cls(tuple(spans), zone, text.strip())

    def is_open(self, now: datetime) -> bool:
        local = now.astimezone(ZoneInfo(self.zone))
        minute = local.hour * 60 + local.minute
        day = local.weekday()
        for days, start, end in self.spans:
            if start < end and day in days and start <= minute < end:
                return True
            if start > end and (
                (day in days and minute >= start) or ((day - 1) % 7 in days and minute < end)
            ):
                return True
        return False

    def next_opening(self, now: datetime) -> datetime | None:
        """When it opens next (local time), within a week; None if never."""
        local = now.astimezone(ZoneInfo(self.zone)).replace(second=0, microsecond=0)
        candidates = []
        for offset in range(8):
            day = local + timedelta(days=offset)
            for days, start, _ in self.spans:
                if day.weekday() in days:
                    at = day.replace(hour=start // 60, minute=start % 60)
                    if at > local:
                        candidates.append(at)
        return min(candidates) if candidates else None


@dataclass(frozen=True, slots=True)
class TransferTarget:
    """A place a caller may be transferred to."""

    name: str
    destination: str  # E.164 number or sip:/sips: URI
    hours: OpenHours | None = None  # None: always
    verified_only: bool = False  # only a caller who proved who they are (PIN)

    def unavailable(self, now: datetime, verified: bool) -> str | None:
        """Why the caller cannot be put through now, as the agent can say it; None: they can."""
        said = self.name.replace("_", " ")
        if self.verified_only and not verified:
            return (
                f"Only callers who have confirmed who they are can be put through to {said}. "
                "Nothing was sent. Offer to verify them first, or help them yourself."
            )
        if self.hours is not None and not self.hours.is_open(now):
            opens = self.hours.next_opening(now)
            when = (
                f" It opens {DAY_NAMES[opens.weekday()]} at {opens:%H:%M} ({self.hours.zone})."
                if opens is not None
                else ""
            )
            return (
                f"{said.capitalize()} is closed now.{when} Nothing was sent. Offer to arrange a "
                "call back for when it opens (schedule_callback with this target) instead."
            )
        return None

    @property
    def is_sip(self) -> bool:
        return self.destination.startswith(("sip:", "sips:"))

    def masked(self) -> str:
        """The destination as logs and timelines show it (a number's last digits only)."""
        if self.is_sip:
            return self.destination
        return "+" + "*" * (len(self.destination) - 5) + self.destination[-4:]


def check_destination(destination: str) -> str:
    """An E.164 number or a sip:/sips: URI, as given; TransferTargetError otherwise."""
    if not (E164.match(destination) or SIP_URI.match(destination)):
        raise TransferTargetError(
            f"{destination[:64]!r} is neither an E.164 number (+15550100009) "
            "nor a sip: URI (sip:desk@pbx.example)"
        )
    return destination


def zone_name(zone: str) -> str:
    """An IANA time zone, as given; TransferTargetError otherwise."""
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        raise TransferTargetError(
            f"time zone {zone[:64]!r} is unknown (use an IANA name such as Europe/Rome)"
        ) from None
    return zone


def check_name(name: str) -> None:
    """A target's name as the model and the tools file use it; TransferTargetError if not."""
    if not TARGET_NAME.match(name):
        raise TransferTargetError(
            f"target name {name!r}: use lowercase letters, digits, _ or - (e.g. front_desk)"
        )


def parse_targets(text: str | None) -> dict[str, TransferTarget]:
    """`name=destination` pairs, comma separated; empty or None: no targets."""
    targets: dict[str, TransferTarget] = {}
    for raw in (text or "").split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, destination = (part.strip() for part in entry.partition("="))
        if not sep or not name or not destination:
            raise TransferTargetError(
                f"{entry!r} is not name=destination (e.g. front_desk=+15550100009)"
            )
        check_name(name)
        try:
            check_destination(destination)
        except TransferTargetError as exc:
            raise TransferTargetError(f"target {name!r}: {exc}") from None
        if name in targets:
            raise TransferTargetError(f"target {name!r} is named twice")
        targets[name] = TransferTarget(name, destination)
    return targets


def declared_target(name: str, to: str, hours: str | None, zone: str, who: str) -> TransferTarget:
    """A target as a tools file declares it; TransferTargetError names what is wrong."""
    check_name(name)
    return TransferTarget(
        name,
        check_destination(to),
        OpenHours.parse(hours, zone) if hours else None,
        verified_only=who == "verified",
    )


class TransferArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)

    target: str = Field(min_length=1, max_length=40, description="Where to transfer (by name).")
    reason: str = Field(
        min_length=1, max_length=300, description="Why, in a few words (the person reads it)."
    )
    mode: Literal["cold", "warm"] = Field(
        default="cold",
        description="cold: the caller is put through at once; warm: the person is briefed first.",
    )


TRANSFER_SPEC = ToolSpec(
    name=TRANSFER_CALL,
    description=(
        "Transfer the caller to a person (a target named below) when they ask for one or when "
        "what they need is beyond what you can do. Call it without saying goodbye first: the "
        "answer tells you what to say while the call is put through, or that it could not be."
    ),
    args_model=TransferArgs,
    kind=ToolKind.CONTROL,
)


SCHEDULE_CALLBACK = "schedule_callback"


@dataclass(frozen=True, slots=True)
class ScheduledCallback:
    """A call back admitted: the outbound call's row and its `place_call` operation, due `at`."""

    call_id: str
    operation_id: str
    at: datetime


class CallbackScheduler(Protocol):
    """The app's way to arrange a call back inside the admitting transaction (`key` makes a
    retried tool call arrange the same one)."""

    async def __call__(
        self, conn: AsyncConnection, ctx: CallContext, purpose: str, at: datetime, key: str
    ) -> ScheduledCallback: ...


class ScheduleCallbackArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)

    reason: str = Field(
        min_length=1, max_length=300, description="What the call back is about, in a few words."
    )
    target: str | None = Field(
        default=None,
        max_length=40,
        description="The transfer target the caller wanted, if any: when it is closed, the call "
        "back comes when it opens.",
    )
    minutes_from_now: int | None = Field(
        default=None, ge=1, le=10080, description="When to call back, in minutes from now."
    )


SCHEDULE_CALLBACK_SPEC = ToolSpec(
    name=SCHEDULE_CALLBACK,
    description=(
        "Arrange for this service to call the caller back on the number they are calling from, "
        "for example when a transfer did not go through or the person they want is closed. "
        "Ask them when suits them (minutes_from_now), or give the target that is closed (the "
        "call back comes when it opens). Say the call back is arranged only after this answers "
        "that it is."
    ),
    args_model=ScheduleCallbackArgs,
    kind=ToolKind.CONTROL,
)


SEND_DTMF = "send_dtmf"


class SendDtmfArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)

    digits: str = Field(
        pattern=r"^[0-9*#A-Dw,]{1,32}$",
        description="Keys to press, in order: 0-9, *, #, A-D; a comma waits half a second.",
    )


SEND_DTMF_SPEC = ToolSpec(
    name=SEND_DTMF,
    description=(
        "Press keys on the phone line, to choose options of an automated menu on the other "
        "side (for example 1, or 2# for an extension). Only for a menu you hear; never to "
        "enter the caller's own numbers or PIN."
    ),
    args_model=SendDtmfArgs,
    kind=ToolKind.CONTROL,
)


def transfer_definition(targets: Mapping[str, TransferTarget]) -> dict[str, Any]:
    """The tool's definition with exactly these targets as the values `target` may take (and
    when each takes calls, where it has hours or takes only verified callers)."""
    definition = TRANSFER_SPEC.definition()
    definition["parameters"]["properties"]["target"]["enum"] = sorted(targets)
    notes = [
        f"{t.name}: "
        + ", ".join(
            ([f"open {t.hours.text} ({t.hours.zone})"] if t.hours else [])
            + (["verified callers only"] if t.verified_only else [])
        )
        for _, t in sorted(targets.items())
        if t.hours is not None or t.verified_only
    ]
    if notes:
        definition["description"] += " Targets with limits: " + "; ".join(notes) + "."
    return definition


# A dial's outcome (Twilio's DialCallStatus; SIP's by the same names) as the agent says it.
DIAL_SAID = {
    "busy": "the line was busy",
    "no-answer": "nobody answered",
    "failed": "the call could not be placed",
    "canceled": "the call was cancelled",
    "declined": "the call was declined",
    "voicemail": "a voicemail answered, not a person",
}


def dial_outcome_said(status: str) -> str:
    return DIAL_SAID.get(status, "the call did not go through")


# Under way (the caller left the agent), put through to the person, or not at all.
UNDER_WAY = frozenset({"dialing", "referred", "ringing"})
PUT_THROUGH = frozenset({"answered", "completed", "transferred"})


# A transfer's tool call row once it has ended.
ENDED = frozenset({"transferred", "transfer_failed"})


def outcome_decision(outcome: TransferOutcome) -> str:
    """The tool call row's decision for a transfer's outcome."""
    if outcome.accepted and outcome.status in PUT_THROUGH:
        return "transferred"
    if outcome.accepted:
        return "transferring"
    return "transfer_failed"


async def record_transfer_outcome(
    engine: AsyncEngine, call_id: str, function_call_id: str, outcome: TransferOutcome
) -> bool:
    """Write a transfer's outcome on its tool call row (decision, reason, and `outcome` in its
    output). False when there is no such row or the database would not take it (logged)."""
    try:
        async with engine.begin() as conn:
            row = (
                await conn.execute(
                    sa.select(calls_t.c.id, calls_t.c.output, calls_t.c.decision)
                    .where(
                        calls_t.c.call_id == call_id,
                        calls_t.c.provider_call_id == function_call_id[:128],
                        calls_t.c.tool == TRANSFER_CALL,
                    )
                    .with_for_update()
                )
            ).first()
            if row is None:
                return False
            output = dict(row.output or {})
            output["outcome"] = {"status": outcome.status, "detail": outcome.detail[:300]}
            await conn.execute(
                calls_t.update()
                .where(calls_t.c.id == row.id)
                .values(
                    decision=outcome_decision(outcome),
                    decision_reason=f"{outcome.status}: {outcome.detail}"[:500],
                    output=output,
                    completed_at=sa.func.now(),
                )
            )
        decision = outcome_decision(outcome)
        if decision != "transferring" and row.decision not in ENDED:
            # Counted once, when the transfer ends (a repeated webhook writes it again).
            measures.TRANSFERS.labels(
                "transferred" if decision == "transferred" else "failed"
            ).inc()
        return True
    except Exception:
        log.exception("call %s: could not record a transfer's outcome", call_id)
        return False


def masked_number(number: str | None) -> str:
    """How a briefing names a caller who has not proved who they are: the number's end."""
    digits = "".join(ch for ch in (number or "") if ch.isdigit())
    if len(digits) < 4:
        return "a caller whose number is withheld"
    return "a caller whose number ends " + " ".join(digits[-4:])


async def briefing(
    conn: AsyncConnection,
    call_id: str,
    *,
    who: str,
    reason: str,
    describe: Callable[[OperationRecord], str],
) -> str:
    """What the person of a warm transfer hears before the caller joins (see the module
    docstring). Only what the ledger says: an operation still open is never called done."""
    open_statuses = [OperationStatus.AWAITING_CONFIRMATION, *IN_FLIGHT]
    told = (
        sa.select(sa.literal(1))
        .select_from(dl_t)
        .where(
            dl_t.c.operation_id == ops_t.c.operation_id,
            dl_t.c.state.in_([s.value for s in COMMUNICATED]),
        )
        .exists()
    )
    told_in_reply = (
        sa.select(sa.literal(1))
        .select_from(calls_t)
        .where(
            calls_t.c.operation_id == ops_t.c.operation_id,
            calls_t.c.output["status"].astext == OperationStatus.COMMITTED.value,
        )
        .exists()
    )
    rows = (
        await conn.execute(
            sa.select(ops_t, sa.or_(told, told_in_reply).label("told"))
            .where(
                ops_t.c.call_id == call_id,
                ops_t.c.status.in_(
                    [s.value for s in open_statuses] + [OperationStatus.COMMITTED.value]
                ),
            )
            .order_by(ops_t.c.created_at)
        )
    ).all()
    still_open: list[str] = []
    promised: list[str] = []
    for row in rows:
        op = OperationRecord.from_row(row)
        if op.status is OperationStatus.COMMITTED:
            if row.told:
                promised.append(describe(op))
        elif op.status is OperationStatus.AWAITING_CONFIRMATION:
            still_open.append(f"{describe(op)}, waiting for the caller's yes")
        else:
            still_open.append(f"{describe(op)}, not confirmed yet")
    parts = [f"Hello, this is the voice assistant with {who} for you.", f"They want: {reason}."]
    if still_open:
        parts.append("Still open: " + "; ".join(still_open[:BRIEFING_MAX_OPS]) + ".")
    if promised:
        parts.append(
            "Done, and the caller was told: " + "; ".join(promised[:BRIEFING_MAX_OPS]) + "."
        )
    if not still_open and not promised:
        parts.append("Nothing was booked or changed on this call.")
    parts.append("Connecting you now.")
    text = " ".join(" ".join(part.split()) for part in parts)
    return text[:BRIEFING_MAX_CHARS]
