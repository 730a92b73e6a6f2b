"""The console's seam to SMS delivery: what staff may see and do about an outcome's SMS.

The console asks two things of whatever delivers SMS follow-ups: "is there an SMS for this
operation, and may it be sent again?", and "send it again". `NoSmsDelivery` is what runs while
no SMS delivery is wired into this process: every operation has no SMS, so the console refuses
the action cleanly ("no SMS delivery exists for this operation"). `LedgerSmsDeliveries` is the
real one, over the delivery ledger and the SMS channel.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from app.ops.sms import ResendRefused, SmsChannel
from tools import deliveries
from tools.deliveries import SmsRecord
from tools.delivery_states import SmsStatus


@dataclass(frozen=True, slots=True)
class SmsInfo:
    """The latest SMS of one operation's outcome, as staff see it."""

    delivery_id: uuid.UUID
    state: str  # queued | sent | delivered | undelivered | failed | not_deliverable | …
    to: str | None
    resendable: bool
    why_not: str | None = None  # when not resendable: why, in a sentence


@dataclass(frozen=True, slots=True)
class ResendResult:
    """What asking for a resend did."""

    delivery_id: uuid.UUID
    state: str


class SmsDeliveries(Protocol):
    """SMS follow-ups of operation outcomes."""

    async def latest_for_operation(self, operation_id: uuid.UUID) -> SmsInfo | None:
        """The operation's latest SMS, or None if it has none."""
        ...

    async def resend(self, operation_id: uuid.UUID, *, actor: str, reason: str) -> ResendResult:
        """Send the outcome's SMS again (a new message, persisted before it is sent).

        Raises `SmsResendRefused` when that is not possible now.
        """
        ...


class SmsResendRefused(Exception):
    """The SMS cannot be sent again; the message says why."""


class NoSmsDelivery:
    """No SMS delivery in this process: nothing to show, nothing to resend."""

    async def latest_for_operation(self, operation_id: uuid.UUID) -> SmsInfo | None:
        return None

    async def resend(self, operation_id: uuid.UUID, *, actor: str, reason: str) -> ResendResult:
        raise SmsResendRefused("no SMS delivery exists for this operation")


class LedgerSmsDeliveries:
    """The console's view of the delivery ledger's SMS (`tools.deliveries`, `app.ops.sms`)."""

    def __init__(self, engine: AsyncEngine, sms: SmsChannel) -> None:
        self._engine = engine
        self._sms = sms

    async def latest_for_operation(self, operation_id: uuid.UUID) -> SmsInfo | None:
        async with self._engine.connect() as conn:
            delivery = await deliveries.for_operation(conn, operation_id)
            if delivery is None:
                return None
            messages = await deliveries.sms_for_delivery(conn, delivery.id)
        if not messages and delivery.channel != "sms":
            return None
        last = messages[-1] if messages else None
        state = last.status.value if last is not None else delivery.state.value
        why_not = _why_not_resendable(delivery.state.value, last)
        return SmsInfo(
            delivery_id=delivery.id,
            state=state,
            to=last.to_number if last is not None else delivery.caller,
            resendable=why_not is None,
            why_not=why_not,
        )

    async def resend(self, operation_id: uuid.UUID, *, actor: str, reason: str) -> ResendResult:
        async with self._engine.connect() as conn:
            delivery = await deliveries.for_operation(conn, operation_id)
        if delivery is None:
            raise SmsResendRefused("no SMS delivery exists for this operation")
        # The channel names staff itself ("staff:<name>"); the console's actor already does.
        name = actor.removeprefix("staff:")
        try:
            message = await self._sms.resend(delivery.id, name, reason)
        except ResendRefused as exc:
            raise SmsResendRefused(str(exc)) from exc
        return ResendResult(delivery_id=delivery.id, state=message.status.value)


def _why_not_resendable(delivery_state: str, last: SmsRecord | None) -> str | None:
    if last is not None and last.status in (SmsStatus.PENDING, SmsStatus.REQUESTING):
        return "a send of this SMS is still under way"
    if last is not None and last.status is SmsStatus.UNKNOWN:
        return "the last send is being checked with Twilio"
    if delivery_state in ("pending", "offered", "not_needed"):
        return f"the delivery is {delivery_state}"
    return None
