"""The console's seam to SMS delivery: what staff may see and do about an outcome's SMS.

The console asks two things of whatever delivers SMS follow-ups: "is there an SMS for this
operation, and may it be sent again?", and "send it again". `NoSmsDelivery` is what runs while
no SMS delivery is wired into this process: every operation has no SMS, so the console refuses
the action cleanly ("no SMS delivery exists for this operation"). The SMS delivery machinery
implements `SmsDeliveries` and is passed to `create_app` wiring in its place.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class SmsInfo:
    """The latest SMS of one operation's outcome, as staff see it."""

    delivery_id: str
    state: str  # queued | sent | delivered | undelivered | failed | not_deliverable | …
    to: str | None
    resendable: bool
    why_not: str | None = None  # when not resendable: why, in a sentence


@dataclass(frozen=True, slots=True)
class ResendResult:
    """What asking for a resend did."""

    delivery_id: str
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
