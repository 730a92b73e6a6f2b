"""Late results by a callback call: the "call" channel beside SMS (LATE_RESULT_CHANNEL).

The delivery job (`app.ops.delivery_jobs`) hands an outcome that must go out of call here when
the channel is `call`, or `auto` and the number cannot take SMS (its SMS came back
not_deliverable, or an earlier SMS to that number did). In one transaction the delivery moves
`pending -> calling` and the callback call is requested: its row (`outbound.delivery_id`,
`outbound.attempt`) and its `place_call` operation with the idempotency key
`callback:<delivery>:<attempt>`, so a job run twice or a worker killed mid-way never places a
second call for the same attempt (placing it is the place_call operation's exactly-once:
a lost create answer is reconciled, never re-sent).

What became of the call settles the delivery (app/legs/twilio/outbound.py):
- a person answered and heard the result to its end (the in-call announcement's heard
  accounting, `ResultDelivery`): `called`;
- a machine answered and the short message (no details) was heard to its end: `voicemail`;
- otherwise (busy, no answer, failed, hung up before hearing it): when the call's row has
  ended, `check` moves the delivery back to `pending` with the next attempt after a backoff
  (CALLBACK_RETRY_S, doubled each time); after CALLBACK_MAX_ATTEMPTS calls it goes by SMS where
  the number can take one, else ends `not_deliverable` (on the operation's delivery lane).

Quiet hours (QUIET_HOURS in QUIET_HOURS_TZ): a callback due in them waits for their end. SMS
is not held back by them (a text does not ring anyone awake).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.calls.liveness import append_call_event
from app.calls.store import TERMINAL, CallStatus, calls
from app.ops.outbound import OutboundRefused, request_call_in, requested_events
from app.ops.sms import NOT_DELIVERABLE_CODES, NOT_DELIVERABLE_DELIVERY_CODES, SmsChannel
from app.settings import Settings
from tools import deliveries
from tools.deliveries import DeliveryRecord, SmsRecord
from tools.delivery_models import sms_messages_table as sms_t
from tools.delivery_states import DeliveryState
from tools.ledger import Enqueue, OperationRecord
from tools.quiet_hours import QuietHours
from tools.relevance import sms_capable

log = logging.getLogger(__name__)

D = DeliveryState
ACTOR = "callback"
# What a callback call is about, as its opening and its voicemail say it: never a detail.
PURPOSE = "an update on your recent request"
LANDLINE_CODES = NOT_DELIVERABLE_CODES | NOT_DELIVERABLE_DELIVERY_CODES


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class CallbackConfig:
    """The callback knobs of a deployment (from `Settings`)."""

    channel: str = "sms"  # sms | call | auto
    max_attempts: int = 3
    retry_s: float = 300.0
    quiet: QuietHours | None = None
    # A call's row still ringing or live: look again this often.
    check_s: float = 15.0
    # An answered call ended this recently: its heard report may still be on its way.
    heard_grace_s: float = 5.0
    clock: Callable[[], datetime] = _now

    @classmethod
    def from_settings(cls, settings: Settings) -> CallbackConfig:
        quiet = (
            QuietHours.parse(settings.quiet_hours, settings.quiet_hours_tz)
            if settings.quiet_hours
            else None
        )
        return cls(
            channel=settings.late_result_channel,
            max_attempts=settings.callback_max_attempts,
            retry_s=settings.callback_retry_s,
            quiet=quiet,
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one step of the callback channel did (for the job's return and the tests)."""

    action: str  # calling | quiet | waiting | retry | sms | not_deliverable | none
    message: SmsRecord | None = None
    at: datetime | None = None


async def callback_calls(conn: AsyncConnection, delivery_id: uuid.UUID) -> list[Any]:
    """The callback calls of a delivery, oldest first."""
    rows = await conn.execute(
        sa.select(calls)
        .where(
            calls.c.direction == "outbound",
            calls.c.outbound["delivery_id"].astext == str(delivery_id),
        )
        .order_by(calls.c.created_at)
    )
    return list(rows.all())


async def sms_refused(conn: AsyncConnection, number: str | None) -> bool:
    """Whether an SMS to `number` ever came back with an error that means it cannot take
    SMS (a landline, an invalid or unreachable number)."""
    if not number:
        return True
    found = await conn.scalar(
        sa.select(sa.literal(1))
        .select_from(sms_t)
        .where(sms_t.c.to_number == number, sms_t.c.error_code.in_(sorted(LANDLINE_CODES)))
        .limit(1)
    )
    return found is not None


class CallbackChannel:
    """Places, follows and falls back from the callback calls of deliveries (a worker's)."""

    def __init__(
        self,
        settings: Settings,
        config: CallbackConfig,
        sms: SmsChannel,
        enqueue_operation: Enqueue | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        self.sms = sms
        # Set by the worker that runs place_call operations (its Procrastinate app).
        self.enqueue_operation = enqueue_operation

    async def wants_call(self, conn: AsyncConnection, delivery: DeliveryRecord) -> bool:
        """Whether an outcome going out of call should be a call rather than an SMS."""
        if self.config.channel == "call":
            return True
        if self.config.channel == "auto":
            return await sms_refused(conn, delivery.caller)
        return False

    def wants_call_after_sms(self, delivery: DeliveryRecord) -> bool:
        """`auto`: an SMS that proved the number cannot take SMS hands over to a call."""
        return self.config.channel == "auto" and delivery.state is D.NOT_DELIVERABLE

    async def start(
        self,
        conn: AsyncConnection,
        delivery: DeliveryRecord,
        op: OperationRecord,
        *,
        reason: str,
    ) -> Outcome:
        """Call the caller back (or wait for quiet hours to end, or fall back when the
        attempts are spent). `delivery` is pending, or not_deliverable after an SMS (auto),
        and locked by this transaction."""
        made = await callback_calls(conn, delivery.id)
        now = self.config.clock()
        if len(made) >= self.config.max_attempts:
            return await self._fall_back(conn, delivery, op, len(made))
        if not sms_capable(delivery.caller):
            # Not a dialable E.164 number either (withheld, a SIP URI).
            return await self._give_up(conn, delivery, "no number to call back")
        if self.config.quiet is not None:
            until = self.config.quiet.end_if_quiet(now)
            if until is not None:
                await deliveries.record_event(
                    conn,
                    delivery.id,
                    kind="note",
                    actor=ACTOR,
                    reason=f"quiet hours: the callback waits until {until.isoformat()}",
                    data={"callback_at": until.isoformat()},
                )
                await deliveries.defer_until(conn, delivery.id, until)
                await deliveries.enqueue(conn, delivery.id, until)
                return Outcome("quiet", at=until)
        if self.enqueue_operation is None:
            raise RuntimeError("a callback needs a worker that runs place_call operations")
        attempt = len(made) + 1
        moved = await deliveries.move(
            conn,
            delivery.id,
            delivery.state,
            D.CALLING,
            locked=delivery,
            actor=ACTOR,
            reason=f"callback {attempt} of {self.config.max_attempts}: {reason}",
            data={"attempt": attempt},
            channel="call",
            next_attempt_at=None,
        )
        if moved is None:
            return Outcome("none")
        assert delivery.caller is not None
        try:
            placed = await request_call_in(
                conn,
                self.settings,
                self.enqueue_operation,
                to=delivery.caller,
                purpose=PURPOSE,
                about_operation_id=str(op.operation_id),
                by=f"{ACTOR}:{delivery.id}",
                idempotency_key=f"callback:{delivery.id}:{attempt}",
                extra={"delivery_id": str(delivery.id), "attempt": attempt},
            )
        except OutboundRefused as exc:  # the number passed sms_capable: not expected
            raise RuntimeError(f"callback refused: {exc}") from exc
        if placed.created:
            # The callback call's timeline starts as an API-requested call's does.
            who = f"{ACTOR}:{delivery.id}"
            for kind, data in requested_events(placed, delivery.caller, PURPOSE, who):
                await append_call_event(conn, uuid.UUID(placed.call_id), kind, data)
        await deliveries.record_event(
            conn,
            delivery.id,
            kind="note",
            actor=ACTOR,
            reason=f"callback call {attempt} requested",
            data={"call_id": placed.call_id, "operation_id": placed.operation_id},
        )
        # Safety net: the job looks at the call again once it should have rung out.
        await deliveries.enqueue(conn, delivery.id, now + timedelta(seconds=self._ring_s()))
        return Outcome("calling")

    def _ring_s(self) -> float:
        s = self.settings
        return 2 * s.outbound_create_timeout_s + s.outbound_ring_timeout_s + self.config.check_s

    async def check(self, conn: AsyncConnection, delivery: DeliveryRecord) -> Outcome:
        """A delivery still `calling`: its call ended without the result heard (or a
        message left) is a failed attempt: pending again after a backoff."""
        made = await callback_calls(conn, delivery.id)
        now = self.config.clock()
        if not made:  # cannot be (requested in the same transaction); be safe
            return await self._retry(conn, delivery, 0, "no callback call was requested", now)
        last = made[-1]
        status = CallStatus(last.status)
        if status not in TERMINAL:
            await deliveries.enqueue(
                conn, delivery.id, now + timedelta(seconds=self.config.check_s)
            )
            return Outcome("waiting")
        ended = last.ended_at or now
        settle_at = ended + timedelta(seconds=self.config.heard_grace_s)
        if last.answered_at is not None and settle_at > now:
            # The heard report of a call that just ended may still be being written.
            await deliveries.enqueue(conn, delivery.id, settle_at)
            return Outcome("waiting", at=settle_at)
        why = last.end_reason or status.value
        return await self._retry(conn, delivery, len(made), f"callback {len(made)}: {why}", now)

    async def _retry(
        self,
        conn: AsyncConnection,
        delivery: DeliveryRecord,
        attempts: int,
        why: str,
        now: datetime,
    ) -> Outcome:
        delay = self.config.retry_s * (2 ** max(0, attempts - 1))
        at = now + timedelta(seconds=delay)
        last = attempts >= self.config.max_attempts
        back = await deliveries.move(
            conn,
            delivery.id,
            D.CALLING,
            D.PENDING,
            locked=delivery,
            actor=ACTOR,
            reason=f"not told: {why}"
            + ("" if last else f"; calling again at {at.isoformat(timespec='seconds')}"),
            data={"attempts": attempts},
            next_attempt_at=None if last else at,
        )
        if back is None:
            return Outcome("none")
        await deliveries.enqueue(conn, delivery.id, None if last else at)
        return Outcome("retry", at=None if last else at)

    async def _fall_back(
        self, conn: AsyncConnection, delivery: DeliveryRecord, op: OperationRecord, calls_made: int
    ) -> Outcome:
        why = f"{calls_made} callback calls did not reach the caller"
        if (
            delivery.state is D.PENDING
            and sms_capable(delivery.caller)
            and not await sms_refused(conn, delivery.caller)
        ):
            message = await self.sms.start(
                conn, delivery, op, reason=f"{why}: by SMS instead", actor=ACTOR
            )
            return Outcome("sms", message=message)
        return await self._give_up(conn, delivery, f"{why} and no SMS can reach them")

    async def _give_up(self, conn: AsyncConnection, delivery: DeliveryRecord, why: str) -> Outcome:
        if delivery.state is D.NOT_DELIVERABLE:
            await deliveries.record_event(conn, delivery.id, kind="note", actor=ACTOR, reason=why)
        else:
            await deliveries.move(
                conn,
                delivery.id,
                delivery.state,
                D.NOT_DELIVERABLE,
                locked=delivery,
                actor=ACTOR,
                reason=why,
            )
        return Outcome("not_deliverable")


async def voicemail_left(
    conn: AsyncConnection, delivery_id: uuid.UUID, call_id: str, answered_by: str
) -> DeliveryRecord | None:
    """A callback's short message was heard to its end by a machine: `voicemail`."""
    return await deliveries.move(
        conn,
        delivery_id,
        D.CALLING,
        D.VOICEMAIL,
        actor=ACTOR,
        reason=f"a voicemail message was left ({answered_by}): it names no details",
        data={"call_id": call_id, "answered_by": answered_by},
    )
