"""SMS follow-ups through Twilio's Messaging API (the twilio library), exactly once.

An SMS is persisted (`sms_messages`, status `pending`) before anything is sent, in the same
transaction that hands the delivery to SMS, with a job that drives it. Then:

- send: a conditional claim (pending -> requesting) lets exactly one worker send, whatever
  the number of retries, restarts or replicas. The create carries a StatusCallback to
  `POST /twilio/sms-status?delivery_id=...&message_id=...`, so callbacks find their record
  even before the create's answer does.
- the answer is lost (timeout, reset): `unknown`. Reconciled by asking Twilio (list the
  messages to that number and match our body, which carries the booking reference; queued
  messages have no `date_sent` yet, so nothing filters on it), never by sending again
  blindly. Only when Twilio has no such message well after the attempt is it sent again.
- status callbacks (and polls, when callbacks are lost) only move a message forward.
- STOP is honoured: an inbound STOP, or Twilio error 21610, records the opt-out; numbers
  that cannot take SMS end `not_deliverable` instead of being retried forever.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from twilio.base.exceptions import TwilioRestException

from app.ops.twilio_rest import close_twilio_client, make_twilio_client
from tools import deliveries
from tools.autocommit import autocommit
from tools.deliveries import DeliveryRecord, SmsRecord, SmsUpdate
from tools.delivery_states import SMS_FAILURES, SMS_FINAL, DeliveryState, SmsStatus
from tools.ledger import OperationRecord
from tools.registry import Registry
from tools.results import sms_text

log = logging.getLogger(__name__)

D = DeliveryState
M = SmsStatus

OPT_OUT_CODE = 21610  # "Attempt to send to unsubscribed recipient"
# The number cannot take SMS: invalid, unreachable, not mobile, region not enabled.
NOT_DELIVERABLE_CODES = frozenset({21211, 21214, 21217, 21407, 21408, 21612, 21614})
# Carrier-side final failures that mean the same (landline, unknown destination handset).
NOT_DELIVERABLE_DELIVERY_CODES = frozenset({30005, 30006})
STOP_WORDS = frozenset({"STOP", "STOPALL", "UNSUBSCRIBE", "CANCEL", "END", "QUIT", "OPTOUT"})
START_WORDS = frozenset({"START", "UNSTOP", "YES", "OPTIN"})
# How far back from an attempt a listed message may have been created (clock skew).
CLOCK_SKEW = timedelta(minutes=5)
# Create answers recorded at once by one channel, one by one (see `SmsChannel.__init__`).
ANSWERS_AT_ONCE = 4
# The most ordinary create answers one statement records (`deliveries.report_answers`).
ANSWERS_A_STATEMENT = 64
# Create answers that settle nothing: recorded together, a group at a time.
TOGETHER = frozenset({M.QUEUED, M.SENT})


# An answer waiting for the channel's writer, and the sender's future for its report.
_Arrived = tuple[deliveries.SmsAnswer, SmsStatus, "asyncio.Future[deliveries.SmsReport]"]


class ResendRefused(ValueError):
    """A resend that cannot be done (a send is under way, the number opted out...)."""


@dataclass(frozen=True, slots=True)
class SmsConfig:
    """Where SMS come from and how patiently they are followed."""

    public_base_url: str
    from_number: str | None
    messaging_service_sid: str | None = None
    sender_name: str | None = None
    send_timeout_s: float = 10.0
    status_poll_s: float = 60.0
    settle_s: float = 6 * 3600.0
    # After a lost answer, how long Twilio gets to show the message before "never sent".
    reconcile_grace_s: float = 10.0
    retry_s: float = 5.0  # after a send proved not to have reached Twilio


class SmsChannel:
    """Sends, reconciles and follows the SMS of deliveries."""

    def __init__(
        self,
        engine: AsyncEngine,
        client: Any,
        registry: Registry,
        config: SmsConfig,
        *,
        actor: str = "sms",
        owns_client: bool = False,
    ) -> None:
        self._engine = engine
        self._client = client
        self._registry = registry
        self.config = config
        self.actor = actor
        self._owns_client = owns_client
        self.sent = 0  # create requests made by this process
        # The create answers of a batch sent at once come back together: those recorded one
        # by one (a failure, one under the message's lock) go a few at a time, on connections
        # the pool keeps, not on one opened (and closed) for each beyond the pool's size.
        self._answers = asyncio.Semaphore(ANSWERS_AT_ONCE)
        # Ordinary answers (queued, sent) wait here for the one writer of this channel, which
        # records whatever has arrived in one statement, then what arrived meanwhile.
        self._arrived: list[_Arrived] = []
        self._writer: asyncio.Task[None] | None = None
        self.answer_statements = 0  # statements that recorded ordinary answers

    @classmethod
    def from_settings(
        cls, settings: Any, engine: AsyncEngine, registry: Registry, *, actor: str = "sms"
    ) -> SmsChannel:
        """The channel of a deployment, with its own Twilio client (send timeout applied)."""
        client = make_twilio_client(
            settings.twilio_account_sid,
            settings.twilio_auth_token.get_secret_value(),
            settings.twilio_api_base_url,
            timeout=settings.sms_send_timeout_s,
        )
        config = SmsConfig(
            public_base_url=settings.public_base_url.rstrip("/"),
            from_number=None
            if settings.twilio_messaging_service_sid
            else settings.twilio_from_number,
            messaging_service_sid=settings.twilio_messaging_service_sid,
            sender_name=settings.sms_sender_name,
            send_timeout_s=settings.sms_send_timeout_s,
            status_poll_s=settings.sms_status_poll_s,
            settle_s=settings.sms_settle_s,
        )
        return cls(engine, client, registry, config, actor=actor, owns_client=True)

    async def aclose(self) -> None:
        if self._writer is not None:
            await self._writer  # answers already arrived are recorded, not dropped
        if self._owns_client:
            await close_twilio_client(self._client)

    # --- composing (inside the caller's transaction) ---------------------------------------

    def body(
        self,
        op: OperationRecord,
        newer: list[str] | None = None,
        undone: list[str] | None = None,
    ) -> str:
        if op.tool in self._registry:
            return sms_text(
                self._registry.get(op.tool),
                op,
                sender=self.config.sender_name,
                newer=newer,
                undone=undone,
            )
        text = f"Update on your request: it ended {op.status.value}."
        return f"{self.config.sender_name}: {text}" if self.config.sender_name else text

    async def start(
        self,
        conn: AsyncConnection,
        delivery: DeliveryRecord,
        op: OperationRecord,
        *,
        reason: str,
        newer: list[str] | None = None,
        undone: list[str] | None = None,
        actor: str | None = None,
        data: dict[str, Any] | None = None,
        locked: bool = False,
    ) -> SmsRecord | None:
        """Hand a pending delivery to SMS: the delivery moves to `texting` and its message
        is persisted (with its job) in this transaction. None if the delivery moved on.
        `locked`: this transaction read `delivery` FOR UPDATE and has not moved it since."""
        who = actor or self.actor
        moved = await deliveries.move(
            conn,
            delivery.id,
            D.PENDING,
            D.TEXTING,
            locked=delivery if locked else None,
            actor=who,
            reason=reason,
            data=data,
            channel="sms",
        )
        if moved is None:
            return None
        assert delivery.caller is not None
        return await deliveries.create_sms(
            conn,
            moved,
            to_number=delivery.caller,
            from_number=self.config.from_number,
            messaging_service_sid=self.config.messaging_service_sid,
            body=self.body(op, newer, undone),
            reference=op.provider_ref,
            requested_by=who,
            check_at=self._safety_net(),
        )

    async def start_many(
        self,
        conn: AsyncConnection,
        items: list[tuple[DeliveryRecord, OperationRecord, str, list[str], list[str]]],
        *,
        actor: str | None = None,
    ) -> list[SmsRecord]:
        """`start` (locked) for a batch of decisions: each (delivery, operation, reason,
        newer, undone) of a pending delivery this transaction read FOR UPDATE and has not
        moved since; the same rows, events and jobs in a few statements for the lot."""
        who = actor or self.actor
        new = []
        for delivery, op, reason, newer, undone in items:
            assert delivery.caller is not None
            new.append(
                deliveries.NewSms(
                    delivery=delivery,
                    reason=reason,
                    to_number=delivery.caller,
                    body=self.body(op, newer, undone),
                    reference=op.provider_ref,
                )
            )
        return await deliveries.text_many(
            conn,
            new,
            from_number=self.config.from_number,
            messaging_service_sid=self.config.messaging_service_sid,
            requested_by=who,
            check_at=self._safety_net(),
        )

    def _safety_net(self) -> datetime:
        """When a message's own job looks at it: whoever persisted it sends it at once, so
        the job only matters if that process died before sending."""
        return datetime.now(UTC) + timedelta(seconds=self.config.send_timeout_s + 5)

    def status_callback(self, message: SmsRecord) -> str:
        return (
            f"{self.config.public_base_url}/twilio/sms-status"
            f"?delivery_id={message.delivery_id}&message_id={message.id}"
        )

    # --- driving one message ----------------------------------------------------------------

    async def send_started(self, message: SmsRecord) -> SmsRecord | None:
        """Send a message `start` persisted in a transaction that has committed since: it
        is pending (its own job waits until the safety net), so it is sent without reading
        it again. The claim is conditional: if anything else got to it first, nothing is sent."""
        if message.status is not M.PENDING:
            return await self.drive(message.id)
        return await self._send(message)

    async def drive(self, message_id: uuid.UUID, now: datetime | None = None) -> SmsRecord | None:
        """Do what the message needs next: send, reconcile, poll, or nothing."""
        now = now or datetime.now(UTC)
        async with self._engine.connect() as conn:
            message = await deliveries.get_sms(conn, message_id)
        if message is None or message.status in SMS_FINAL:
            return message
        if message.status is M.PENDING:
            return await self._send(message)
        if message.status is M.REQUESTING:
            due = (message.attempted_at or now) + timedelta(seconds=self.config.send_timeout_s + 5)
            if now < due:
                await self._check_at(message.id, due)
                return message
            # The sender died or hung mid-request: whether Twilio got it is unknown.
            update = await self._record(
                message.id, M.UNKNOWN, source="sweep", error="no answer recorded for the send"
            )
            message = update.message if update else message
        if message.status is M.UNKNOWN:
            return await self._reconcile(message, now)
        return await self._poll(message, now)

    async def _check_at(self, message_id: uuid.UUID, at: datetime | None) -> None:
        async with self._engine.begin() as conn:
            await deliveries.schedule_sms_check(conn, message_id, at)

    async def _record(
        self, message_id: uuid.UUID, status: SmsStatus, **kw: Any
    ) -> SmsUpdate | None:
        async with self._engine.begin() as conn:
            return await deliveries.record_sms(conn, message_id, status, actor=self.actor, **kw)

    async def _send(self, message: SmsRecord) -> SmsRecord | None:
        check = timedelta(seconds=self.config.send_timeout_s + 5)
        async with self._engine.begin() as conn:
            if await deliveries.is_opted_out(conn, message.to_number):
                update = await deliveries.record_sms(
                    conn,
                    message.id,
                    M.FAILED,
                    actor=self.actor,
                    source="opt-out",
                    error="the number opted out of SMS",
                    not_deliverable=True,
                )
                return update.message if update else message
            claimed = await deliveries.claim_send(conn, message.id, check_after=check)
        if claimed is None:
            return None  # another worker has it (or it moved on)
        return await self._post(claimed)

    async def send_many(self, messages: list[SmsRecord]) -> None:
        """`send_started` for messages persisted together (a delivery job's batch): one
        claim for all of them, then their create requests at once. A message the claim
        leaves out (its number opted out, or it moved on) takes `send_started` alone."""
        if len(messages) < 2:
            for message in messages:
                await self.send_started(message)
            return
        check = timedelta(seconds=self.config.send_timeout_s + 5)
        async with self._engine.begin() as conn:
            claimed = await deliveries.claim_sends(
                conn, [m.id for m in messages], check_after=check
            )
        taken = {c.id for c in claimed}
        rest = [m for m in messages if m.id not in taken]
        results = await asyncio.gather(
            *(self._post(c) for c in claimed),
            *(self.send_started(m) for m in rest),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            # Each message keeps its own job (claimed and unanswered: it reconciles); the
            # others' sends are not held back by one failure.
            raise failed[0]

    async def _post(self, claimed: SmsRecord) -> SmsRecord | None:
        """The create request of a claimed message, and what its answer says."""
        kwargs: dict[str, Any] = {
            "to": claimed.to_number,
            "body": claimed.body,
            "status_callback": self.status_callback(claimed),
        }
        if claimed.messaging_service_sid:
            kwargs["messaging_service_sid"] = claimed.messaging_service_sid
        else:
            kwargs["from_"] = claimed.from_number
        self.sent += 1
        try:
            created = await self._client.messages.create_async(**kwargs)
        except TwilioRestException as exc:
            return await self._refused(claimed, exc)
        except aiohttp.ClientConnectorError as exc:
            # Never connected: Twilio cannot have it. Try again shortly.
            log.warning("SMS %s not sent (cannot connect): %s", claimed.id, exc)
            return await self._release(claimed, f"could not connect: {exc}"[:200])
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("SMS %s: the answer to the send was lost (%r)", claimed.id, exc)
            at = datetime.now(UTC) + timedelta(seconds=1)
            update = await self._record(
                claimed.id,
                M.UNKNOWN,
                source="send",
                error=f"answer lost: {exc!r}"[:200],
                next_check_at=at,
            )
            message = update.message if update else claimed
            return await self._reconcile(message, datetime.now(UTC))
        status = _twilio_status(getattr(created, "status", None)) or M.QUEUED
        if status in TOGETHER and created.sid:
            update = await self._answered(claimed.id, status, created.sid)
        else:
            update = await self.record_answer(claimed.id, status, created.sid)
        return update.message if update else claimed

    async def _answered(
        self, message_id: uuid.UUID, status: SmsStatus, message_sid: str
    ) -> SmsUpdate | None:
        """`record_answer` of an ordinary answer (queued or sent, with its MessageSid), with
        the others that have arrived: the channel's writer records whatever is waiting in
        one statement (`deliveries.report_answers`: the same rows as `report_sms` one by
        one), then what arrived during that write, so no answer waits for more than one
        statement and 50 answers at once take a few statements, not 50. An answer the
        statement cannot say (under_lock, foreign_sid) takes `record_answer`'s locked way."""
        poll = datetime.now(UTC) + timedelta(seconds=self.config.status_poll_s)
        done: asyncio.Future[deliveries.SmsReport] = asyncio.get_running_loop().create_future()
        self._arrived.append((deliveries.SmsAnswer(message_id, message_sid, poll), status, done))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_answers())
        # Shielded: a sender cancelled while its answer is being written leaves the write be.
        report = await asyncio.shield(done)
        if not report.under_lock and not report.foreign_sid:
            return report.update
        return await self._record_locked(message_id, status, self._said(message_sid, poll))

    async def _write_answers(self) -> None:
        """The writer: one statement a group until no answer waits, then it ends."""
        try:
            while self._arrived:
                group: list[_Arrived] = []
                rest: list[_Arrived] = []
                ids: set[uuid.UUID] = set()
                first = self._arrived[0][1]
                for item in self._arrived:
                    # One status a statement, one answer a message: the rest go next time.
                    answer, status, _ = item
                    if (
                        status is first
                        and answer.message_id not in ids
                        and (len(group) < ANSWERS_A_STATEMENT)
                    ):
                        group.append(item)
                        ids.add(answer.message_id)
                    else:
                        rest.append(item)
                self._arrived = rest
                await self._write_group(group)
        finally:
            self._writer = None
            # Only a cancelled writer leaves answers waiting: their senders are cancelled too.
            left, self._arrived = self._arrived, []
            for _, _, done in left:
                done.cancel()

    async def _write_group(self, group: list[_Arrived]) -> None:
        """Record a group of answers of one status and hand each sender its report."""
        status = group[0][1]
        try:
            async with autocommit(self._engine) as conn:
                if len(group) == 1:
                    answer = group[0][0]
                    reports = [
                        await deliveries.report_sms(
                            conn,
                            answer.message_id,
                            status,
                            actor=self.actor,
                            source="send",
                            message_sid=answer.message_sid,
                            next_check_at=answer.next_check_at,
                        )
                    ]
                else:
                    reports = await deliveries.report_answers(
                        conn, status, [a for a, _, _ in group], actor=self.actor, source="send"
                    )
            self.answer_statements += 1
        except Exception as exc:
            # Each sender raises it as its own (its message keeps its job and reconciles).
            for _, _, done in group:
                if not done.done():
                    done.set_exception(exc)
            return
        except BaseException:
            for _, _, done in group:
                done.cancel()
            raise
        for (_, _, done), report in zip(group, reports, strict=True):
            if not done.done():
                done.set_result(report)

    async def record_answer(
        self, message_id: uuid.UUID, status: SmsStatus, message_sid: str | None
    ) -> SmsUpdate | None:
        """The create's answer (its status and MessageSid), as a status callback is recorded:
        one statement without a transaction around it (`deliveries.report_sms`), or under the
        message's lock as before where that cannot say it (the answer only teaches the
        MessageSid or names another one) and for a failure."""
        said = self._said(
            message_sid, datetime.now(UTC) + timedelta(seconds=self.config.status_poll_s)
        )
        if status not in SMS_FAILURES:
            async with self._answers:
                report = await self._report(message_id, status, said)
            if not report.under_lock and not report.foreign_sid:
                return report.update
        return await self._record_locked(message_id, status, said)

    def _said(self, message_sid: str | None, poll: datetime) -> dict[str, Any]:
        """What a create's answer says, as `record_sms` and `report_sms` take it."""
        return {
            "actor": self.actor,
            "source": "send",
            "message_sid": message_sid,
            "next_check_at": poll,
        }

    async def _record_locked(
        self, message_id: uuid.UUID, status: SmsStatus, said: dict[str, Any]
    ) -> SmsUpdate | None:
        """A create's answer recorded under the message's lock (`record_sms`), a few at a
        time (`ANSWERS_AT_ONCE`)."""
        async with self._answers, self._engine.begin() as conn:
            return await deliveries.record_sms(conn, message_id, status, **said)

    async def _report(
        self, message_id: uuid.UUID, status: SmsStatus, said: dict[str, Any]
    ) -> deliveries.SmsReport:
        """`deliveries.report_sms` of what a report `said`: one statement, no transaction
        around it."""
        async with autocommit(self._engine) as conn:
            return await deliveries.report_sms(conn, message_id, status, **said)

    async def _release(self, message: SmsRecord, why: str) -> SmsRecord:
        """Provably not sent: back to pending, to be tried again by its job."""
        at = datetime.now(UTC) + timedelta(seconds=self.config.retry_s)
        async with self._engine.begin() as conn:
            released = await deliveries.release_send(conn, message.id, at=at, error=why)
            await deliveries.enqueue_sms(conn, message.id, at=at)
        return released or message

    async def _refused(self, message: SmsRecord, exc: TwilioRestException) -> SmsRecord:
        code = int(exc.code) if exc.code is not None else None
        status = int(exc.status)
        why = f"Twilio refused the send: HTTP {status} code {code}"
        if status == 429 or (code is not None and code in (20429, 14107)):
            return await self._release(message, why)
        if status >= 500:
            # A server error may come after the message was made: ask before anything else.
            update = await self._record(
                message.id,
                M.UNKNOWN,
                source="send",
                error=why,
                next_check_at=datetime.now(UTC) + timedelta(seconds=1),
            )
            return update.message if update else message
        async with self._engine.begin() as conn:
            if code == OPT_OUT_CODE:
                await deliveries.set_opt_out(
                    conn, message.to_number, opted_out=True, source="21610"
                )
            update = await deliveries.record_sms(
                conn,
                message.id,
                M.FAILED,
                actor=self.actor,
                source="send",
                error_code=code,
                error=why,
                not_deliverable=code == OPT_OUT_CODE or code in NOT_DELIVERABLE_CODES,
            )
        log.warning("SMS %s refused by Twilio: HTTP %s code %s", message.id, status, code)
        return update.message if update else message

    async def _reconcile(self, message: SmsRecord, now: datetime) -> SmsRecord:
        """Find the message at Twilio by its number and body; resend only once it is
        proved Twilio never made it."""
        attempted = message.attempted_at or message.created_at
        try:
            found = await self._find_at_twilio(message, attempted)
        except (TwilioRestException, aiohttp.ClientError, TimeoutError) as exc:
            log.warning("SMS %s: cannot list messages yet (%r)", message.id, exc)
            await self._check_at(message.id, now + timedelta(seconds=self.config.retry_s))
            return message
        if found is not None:
            status = _twilio_status(getattr(found, "status", None)) or M.QUEUED
            update = await self._record(
                message.id,
                status,
                source="reconciled by listing messages",
                message_sid=found.sid,
                error_code=_int(getattr(found, "error_code", None)),
                next_check_at=now + timedelta(seconds=self.config.status_poll_s),
            )
            return update.message if update else message
        grace = timedelta(seconds=self.config.send_timeout_s + self.config.reconcile_grace_s)
        if now < attempted + grace:
            await self._check_at(message.id, attempted + grace)
            return message
        # Twilio has no such message well after the attempt: it never got it. Send again.
        update = await self._record(
            message.id,
            M.PENDING,
            source="reconciled by listing messages",
            error="not found at Twilio: sending again",
        )
        if update is None:
            return message
        return await self._send(update.message) or update.message

    async def _find_at_twilio(self, message: SmsRecord, attempted: datetime) -> Any:
        """Our message among those to the same number (newest first), matched by body."""
        kwargs: dict[str, Any] = {"to": message.to_number, "page_size": 50}
        if message.from_number:
            kwargs["from_"] = message.from_number
        oldest = message.created_at - CLOCK_SKEW
        async for candidate in await self._client.messages.stream_async(**kwargs):
            created = getattr(candidate, "date_created", None)
            if created is not None and created < oldest:
                break  # older than our message: it is not further down either
            if candidate.body != message.body or candidate.to != message.to_number:
                continue
            if message.messaging_service_sid and (
                candidate.messaging_service_sid not in (None, message.messaging_service_sid)
            ):
                continue
            if message.reference and message.reference not in (candidate.body or ""):
                continue
            if await self._sid_taken(candidate.sid, message.id):
                continue  # another message of ours (a deliberate resend) owns it
            return candidate
        return None

    async def _sid_taken(self, sid: str | None, mine: uuid.UUID) -> bool:
        if not sid:
            return True
        async with self._engine.connect() as conn:
            other = await deliveries.sms_by_sid(conn, sid)
        return other is not None and other.id != mine

    async def _poll(self, message: SmsRecord, now: datetime) -> SmsRecord:
        """Queued or sent, and no callback moved it on: ask Twilio for its status."""
        if message.message_sid is None:
            return await self._reconcile(message, now)
        try:
            fetched = await self._client.messages(message.message_sid).fetch_async()
        except (TwilioRestException, aiohttp.ClientError, TimeoutError) as exc:
            log.info("SMS %s: status fetch failed (%r)", message.id, exc)
            await self._check_at(message.id, now + timedelta(seconds=self.config.status_poll_s))
            return message
        status = _twilio_status(getattr(fetched, "status", None))
        accepted = message.accepted_at or message.created_at
        poll = timedelta(seconds=self.config.status_poll_s)
        if status is not None and status is not message.status:
            code = _int(getattr(fetched, "error_code", None))
            update = await self._record(
                message.id,
                status,
                source="status fetched",
                error_code=code,
                next_check_at=now + poll,
                not_deliverable=code in NOT_DELIVERABLE_DELIVERY_CODES,
            )
            if update is not None and update.changed:
                return update.message
        if message.status is M.SENT and now - accepted > timedelta(seconds=self.config.settle_s):
            async with self._engine.begin() as conn:
                await deliveries.settle_sent(
                    conn,
                    message,
                    actor=self.actor,
                    reason="sent; the carrier gave no delivery receipt",
                )
            return message
        await self._check_at(message.id, now + min(2 * poll, poll * 8))
        return message

    # --- Twilio's status callbacks and inbound messages --------------------------------------

    async def apply_callback(
        self, message_id: uuid.UUID, params: dict[str, str]
    ) -> SmsUpdate | None:
        """A signed status callback: move the message forward if it says something new.

        Most callbacks are one statement without a transaction around it
        (`deliveries.report_sms`: the same rows as `record_sms` under a lock); one that
        records an opt-out, ends the delivery not_deliverable (its job is deferred) or
        only teaches the message its MessageSid takes the transaction."""
        status = _twilio_status(params.get("MessageStatus") or params.get("SmsStatus"))
        if status is None:
            return None
        code = _int(params.get("ErrorCode"))
        sid = params.get("MessageSid") or params.get("SmsSid")
        poll = datetime.now(UTC) + timedelta(seconds=self.config.status_poll_s)
        next_check_at = None if status in SMS_FINAL else poll
        not_deliverable = (
            code == OPT_OUT_CODE
            or code in NOT_DELIVERABLE_CODES
            or code in NOT_DELIVERABLE_DELIVERY_CODES
        )
        said: dict[str, Any] = {
            "actor": "twilio",
            "source": "status callback",
            "message_sid": sid,
            "error_code": code,
            "next_check_at": next_check_at,
        }
        if code != OPT_OUT_CODE and not (status in SMS_FAILURES and not_deliverable):
            report = await self._report(message_id, status, said)
            if report.foreign_sid:
                log.warning("SMS status callback for %s names another MessageSid", message_id)
            if not report.under_lock:
                return report.update
        async with self._engine.begin() as conn:
            message = await deliveries.get_sms(conn, message_id, for_update=True)
            if message is None:
                return None
            if message.message_sid and sid and sid != message.message_sid:
                log.warning("SMS status callback for %s names another MessageSid", message_id)
                return None
            if code == OPT_OUT_CODE:
                await deliveries.set_opt_out(
                    conn, message.to_number, opted_out=True, source="21610"
                )
            return await deliveries.record_sms(
                conn, message_id, status, **said, not_deliverable=not_deliverable, locked=message
            )

    # --- staff resend -----------------------------------------------------------------------

    async def resend(self, delivery_id: uuid.UUID, actor: str, reason: str) -> SmsRecord:
        """Send the delivery's outcome again by SMS, on staff's word. Refused while a send
        of it is still under way, or when the caller opted out."""
        from tools import ledger

        async with self._engine.begin() as conn:
            delivery = await deliveries.get(conn, delivery_id, for_update=True)
            if delivery is None:
                raise ResendRefused("no such delivery")
            if delivery.caller is None or not _capable(delivery.caller):
                raise ResendRefused("the caller has no SMS-capable number")
            if await deliveries.is_opted_out(conn, delivery.caller):
                raise ResendRefused("the caller opted out of SMS")
            for previous in await deliveries.sms_for_delivery(conn, delivery.id):
                if previous.status in (M.PENDING, M.REQUESTING, M.UNKNOWN):
                    raise ResendRefused("a send of this delivery is still under way")
            op = await ledger.get_operation(conn, delivery.operation_id)
            assert op is not None
            who = f"staff:{actor}"
            if delivery.state in (D.PENDING, D.OFFERED, D.NOT_NEEDED):
                raise ResendRefused(f"the delivery is {delivery.state.value}")
            moved = await deliveries.move(
                conn,
                delivery.id,
                delivery.state,
                D.TEXTING,
                actor=who,
                reason=f"resent by staff: {reason}",
                channel="sms",
            )
            assert moved is not None
            message = await deliveries.create_sms(
                conn,
                moved,
                to_number=delivery.caller,
                from_number=self.config.from_number,
                messaging_service_sid=self.config.messaging_service_sid,
                body=self.body(op),
                reference=op.provider_ref,
                requested_by=who,
                check_at=self._safety_net(),
            )
        return await self.drive(message.id) or message


async def apply_inbound(engine: AsyncEngine, params: dict[str, str]) -> str | None:
    """An inbound SMS: STOP (and its synonyms) opts the sender out, START opts back in.
    Returns what was recorded ("opted_out" / "opted_in"), or None."""
    sender = params.get("From") or ""
    word = (params.get("Body") or "").strip().upper().rstrip(".!")
    if not sender or not word:
        return None
    if word in STOP_WORDS or params.get("OptOutType") == "STOP":
        async with engine.begin() as conn:
            await deliveries.set_opt_out(conn, sender, opted_out=True, source="inbound STOP")
        return "opted_out"
    if word in START_WORDS or params.get("OptOutType") == "START":
        async with engine.begin() as conn:
            await deliveries.set_opt_out(conn, sender, opted_out=False, source="inbound START")
        return "opted_in"
    return None


def _twilio_status(value: Any) -> SmsStatus | None:
    if value is None:
        return None
    from tools.delivery_states import TWILIO_STATUS

    return TWILIO_STATUS.get(str(value).lower())


def _int(value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _capable(number: str) -> bool:
    from tools.relevance import sms_capable

    return sms_capable(number)
