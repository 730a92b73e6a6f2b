"""Transfers to a person: the targets a deployment names, and the `transfer_call` tool.

`TRANSFER_TARGETS` names where a caller may be sent, as `name=destination` pairs
(`front_desk=+15550100009,billing=sip:billing@pbx.example`): a destination is an E.164 number or
a `sip:`/`sips:` URI. The model is offered `transfer_call` only when targets exist, with their
names as the only values `target` may take; the engine checks the name again (an unknown one is
refused with a speakable error and nothing is sent), records the request on the ledger's tool
call row, and the call's leg carries it out (Twilio `<Dial>`, SIP REFER, the interconnect's
`refer`). The model hears "transferring" only once the transfer is under way, and the outcome
(answered, busy, no answer, refused) is written back to the same row.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.tool_gateway import TransferOutcome
from tools.ledger_models import tool_calls_table as calls_t
from tools.registry import ToolKind, ToolSpec

log = logging.getLogger(__name__)

TRANSFER_CALL = "transfer_call"
TARGET_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
E164 = re.compile(r"^\+[1-9][0-9]{6,14}$")
SIP_URI = re.compile(r"^sips?:[^\s<>\"]{1,250}@[^\s<>\"]{1,250}$")


class TransferTargetError(ValueError):
    """TRANSFER_TARGETS that cannot be used; the message names the entry and the fix."""


@dataclass(frozen=True, slots=True)
class TransferTarget:
    """A place a caller may be transferred to."""

    name: str
    destination: str  # E.164 number or sip:/sips: URI

    @property
    def is_sip(self) -> bool:
        return self.destination.startswith(("sip:", "sips:"))

    def masked(self) -> str:
        """The destination as logs and timelines show it (a number's last digits only)."""
        if self.is_sip:
            return self.destination
        return "+" + "*" * (len(self.destination) - 5) + self.destination[-4:]


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
        if not TARGET_NAME.match(name):
            raise TransferTargetError(
                f"target name {name!r}: use lowercase letters, digits, _ or - (e.g. front_desk)"
            )
        if not (E164.match(destination) or SIP_URI.match(destination)):
            raise TransferTargetError(
                f"target {name!r}: {destination!r} is neither an E.164 number (+15550100009) "
                "nor a sip: URI (sip:desk@pbx.example)"
            )
        if name in targets:
            raise TransferTargetError(f"target {name!r} is named twice")
        targets[name] = TransferTarget(name, destination)
    return targets


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
    """The tool's definition with exactly these targets as the values `target` may take."""
    definition = TRANSFER_SPEC.definition()
    definition["parameters"]["properties"]["target"]["enum"] = sorted(targets)
    return definition


# A dial's outcome (Twilio's DialCallStatus; SIP's by the same names) as the agent says it.
DIAL_SAID = {
    "busy": "the line was busy",
    "no-answer": "nobody answered",
    "failed": "the call could not be placed",
    "canceled": "the call was cancelled",
    "declined": "the call was declined",
}


def dial_outcome_said(status: str) -> str:
    return DIAL_SAID.get(status, "the call did not go through")


# Under way (the caller left the agent), put through to the person, or not at all.
UNDER_WAY = frozenset({"dialing", "referred", "ringing"})
PUT_THROUGH = frozenset({"answered", "completed", "transferred"})


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
                    sa.select(calls_t.c.id, calls_t.c.output)
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
        return True
    except Exception:
        log.exception("call %s: could not record a transfer's outcome", call_id)
        return False
