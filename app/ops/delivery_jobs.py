"""Delivery work on the worker side: the Procrastinate tasks and the sweeper beside them.

Tasks (queue `deliveries`, see `tools.jobs`):
- `deliver_outcome(delivery_id)`: decide a pending delivery. A call live on another process
  is nudged (NOTIFY) and looked at again later; a call whose holder stopped heartbeating is
  ended here (reason on its timeline); a call that is over gets its SMS, persisted and sent.
  SMS channel only: a delivery whose call is over is decided in a batch with the others
  ready beside it (`decide_ready`): one transaction for a batch, one claim for its SMS.
  The job ends once its decisions have committed: the SMS it persisted are sent by the
  driver beside the worker's job slots (`_sending`), so commits landing meanwhile get a slot
  at once instead of waiting on Twilio's answers. Each message was persisted with its own
  job (the safety net) before any send, so a process that stops mid-send loses nothing; a
  graceful stop waits for the sends (`aclose`).
- `drive_sms(message_id)`: send, reconcile after a lost answer, or poll one SMS.
- `send_webhook(webhook_delivery_id)`: one POST of an integrator webhook.

The sweep finds what a lost notification, a dead worker or a dead replica left behind:
calls nobody holds any more, rows whose stream never came, pending deliveries no job looks
at, offers never reported back, SMS whose check is due, webhooks stuck in `sending`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import procrastinate
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.calls import liveness as call_liveness
from app.calls.store import CallStatus, calls
from app.ops.callback import CallbackChannel, sms_refused
from app.ops.delivery import (
    HOLD_RECHECK_S,
    call_state_of,
    evaluate,
    record_decision,
    settle_without_telling,
)
from app.ops.sms import SmsChannel
from tools import deliveries, driver_sql, jobs, ledger, measures, webhooks
from tools.deliveries import DeliveryRecord, SmsRecord
from tools.delivery_models import deliveries_table as dl_t
from tools.delivery_states import DeliveryState
from tools.ledger_models import operations_table as ops_t
from tools.outage import DATABASE
from tools.registry import Registry
from tools.relevance import Action, CallState

log = logging.getLogger(__name__)

D = DeliveryState
ACTOR = "delivery-worker"


@dataclass
class DeliveryConfig:
    """The knobs of delivery work (from `Settings`)."""

    dead_after_s: float = 30.0
    max_reoffers: int = 2
    announce_timeout_s: float = 120.0
    stream_wait_s: float = 90.0  # a ringing row this old can no longer start its stream
    # An outbound call's row is written before it is placed, then rings: this much longer.
    outbound_wait_s: float = 60.0
    nudge_s: float = 5.0  # a delivery waiting on another process's call: look again after
    # A delivery job also decides others whose call is over (SMS only): this many to a
    # transaction, for up to so many transactions.
    batch: int = 50
    batch_rounds: int = 1
    webhook_policy: webhooks.RetryPolicy = field(default_factory=webhooks.RetryPolicy)


# An SMS decided in a batch, started with the others: (delivery, operation, reason, newer,
# undone), as `SmsChannel.start_many` takes them.
Texting = tuple[DeliveryRecord, ledger.OperationRecord, str, list[str], list[str]]

# The calls whose deliveries their holder decides (or will, once the stream starts).
_OPEN_CALLS = (CallStatus.RINGING.value, CallStatus.IN_PROGRESS.value)


# `ready_out_of_call`'s statements, built once and run on the driver connection
# (tools.driver_sql): built per job they were about 8% of a worker's job CPU. The values are
# parameters, so each is one statement text (prepared once by psycopg): `first` NULL orders no
# row first, the ids are arrays.
_OPEN_CALL = (
    sa.select(sa.literal(1))
    .select_from(calls)
    .where(calls.c.status.in_(_OPEN_CALLS), sa.cast(calls.c.id, sa.String) == dl_t.c.call_id)
    .exists()
)
_READY = (
    sa.select(dl_t)
    .where(
        dl_t.c.state == D.PENDING.value,
        dl_t.c.call_id.is_not(None),
        sa.or_(dl_t.c.next_attempt_at.is_(None), dl_t.c.next_attempt_at <= sa.func.now()),
        ~_OPEN_CALL,
    )
    .order_by(
        sa.case((dl_t.c.id == sa.bindparam("first", type_=dl_t.c.id.type), 0), else_=1),
        dl_t.c.created_at,
    )
    .limit(sa.bindparam("limit", type_=sa.Integer))
    .with_for_update(of=dl_t, skip_locked=True)
)
# Read once the deliveries are locked, each in a statement of its own (a snapshot taken after
# the lock): the operations (not locked), then their calls' status. Joined into the locking
# statement instead, a delivery another transaction moved just before the lock would come
# with its operation as the lock statement's snapshot saw it, and the join would run over the
# whole backlog before the sort and the limit.
_OPERATIONS = sa.select(ops_t).where(
    ops_t.c.operation_id
    == sa.any_(sa.bindparam("ids", type_=postgresql.ARRAY(ops_t.c.operation_id.type)))
)
_CALLS_STATUS = sa.select(calls.c.id, calls.c.status).where(
    calls.c.id == sa.any_(sa.bindparam("ids", type_=postgresql.ARRAY(calls.c.id.type)))
)


async def ready_out_of_call(
    conn: AsyncConnection, limit: int, *, first: uuid.UUID | None = None
) -> list[tuple[DeliveryRecord, ledger.OperationRecord, CallState]]:
    """Pending deliveries due now whose call is over, locked FOR UPDATE (those another
    transaction holds are skipped), `first` if it is one of them, then oldest first, with
    their operations: three statements for the lot. A delivery of a call still open is not
    touched (its holder decides it)."""
    found = [
        DeliveryRecord.from_mapping(m)
        for m in await driver_sql.fetch(conn, _READY, {"first": first, "limit": limit})
    ]
    if not found:
        return []
    ops = {
        m["operation_id"]: ledger.OperationRecord.from_mapping(m)
        for m in await driver_sql.fetch(conn, _OPERATIONS, {"ids": [d.operation_id for d in found]})
    }
    keys = {d.call_id: _uuid(d.call_id) for d in found}
    ids = [k for k in set(keys.values()) if k is not None]
    status = {r[0]: r[1] for r in await driver_sql.fetch_tuples(conn, _CALLS_STATUS, {"ids": ids})}
    ready = []
    for delivery in found:
        key = keys[delivery.call_id]
        if key in status and status[key] in _OPEN_CALLS:
            continue  # opened again since the lock's look: its holder decides it
        call = CallState.ENDED if key in status else CallState.UNKNOWN
        ready.append((delivery, ops[delivery.operation_id], call))
    return ready


async def _quietly(sending: Coroutine[Any, Any, Any]) -> None:
    """A send handed over by its job: a failure is logged, not raised (nobody awaits it);
    each message keeps its own job, which looks at it again."""
    try:
        await sending
    except Exception as exc:
        if not DATABASE.failed("SMS send", exc):
            log.warning("sending SMS failed; each message's own job looks again: %r", exc)


def _uuid(value: str | None) -> uuid.UUID | None:
    try:
        return uuid.UUID(value) if value is not None else None
    except ValueError:
        return None


class DeliveryDriver:
    """The delivery tasks of one worker process; `register` puts them on an app."""

    def __init__(
        self,
        engine: AsyncEngine,
        registry: Registry,
        sms: SmsChannel,
        config: DeliveryConfig | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        callback: CallbackChannel | None = None,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.sms = sms
        # The "call" channel (LATE_RESULT_CHANNEL=call|auto); None: SMS only.
        self.callback = callback
        self.config = config or DeliveryConfig()
        self._http = http
        self._own_http = http is None
        self.rng = random.Random()
        # The sends a job handed over once its decisions committed (`deliver(hand_off=...)`).
        self._sending: set[asyncio.Task[None]] = set()

    def register(self, app: procrastinate.App) -> None:
        driver = self
        if jobs.DELIVER_TASK not in app.tasks:

            @app.task(name=jobs.DELIVER_TASK, queue=jobs.DELIVERY_QUEUE)
            async def deliver_outcome(delivery_id: str) -> None:
                await driver.deliver(uuid.UUID(delivery_id), hand_off=True)

            @app.task(name=jobs.SMS_TASK, queue=jobs.DELIVERY_QUEUE)
            async def drive_sms(message_id: str) -> None:
                await driver.sms.drive(uuid.UUID(message_id))

            @app.task(name=jobs.WEBHOOK_TASK, queue=jobs.DELIVERY_QUEUE)
            async def send_webhook(webhook_delivery_id: str) -> None:
                await driver.send_webhook(uuid.UUID(webhook_delivery_id))

    async def aclose(self, grace_s: float = 10.0) -> None:
        """Close, once the sends handed over have ended (`grace_s` at most; one cut off
        leaves its message claimed, and its own job reconciles it)."""
        if self._sending:
            _, late = await asyncio.wait(set(self._sending), timeout=grace_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        if self._http is not None and self._own_http:
            await self._http.aclose()
        self._http = None
        await self.sms.aclose()

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(follow_redirects=False)
        return self._http

    async def send_webhook(self, webhook_delivery_id: uuid.UUID) -> None:
        await webhooks.send(
            self.engine, webhook_delivery_id, self.http, self.config.webhook_policy, self.rng
        )

    async def deliver(self, delivery_id: uuid.UUID, *, hand_off: bool = False) -> str | None:
        """Decide one pending delivery (see the module docstring). SMS only: in a batch with
        the others ready beside it (`decide_ready`) when its call is over; alone otherwise
        (a call live elsewhere or dead, or a delivery another transaction holds).
        `hand_off` (the job): return once the decisions have committed and leave their SMS
        sending beside (`_sending`); otherwise return once they are sent."""
        if self.callback is None and self.config.batch >= 1:
            decided = await self._decide_ready(first=delivery_id, hand_off=hand_off)
            if delivery_id in decided:
                return decided[delivery_id]
        action, message, message_id = await self._deliver_one(delivery_id)
        # Persisted (its own job queued) before this send: a crash here loses nothing.
        if message is not None:
            await self._send(self.sms.send_started(message), hand_off)
        elif message_id is not None:
            await self._send(self.sms.drive(message_id), hand_off)
        return action

    async def _send(self, sending: Coroutine[Any, Any, Any], hand_off: bool) -> None:
        """Await a send, or hand it over (`hand_off`): it runs beside the job, which ends."""
        if not hand_off:
            await sending
            return
        task = asyncio.create_task(_quietly(sending), name="delivery-sms")
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def decide_ready(self) -> int:
        """Decide the pending deliveries whose call is over and that no other transaction
        holds (their own jobs then find nothing to do), `batch` to a transaction, for up to
        `batch_rounds` transactions; each transaction's SMS go out together once it has
        committed, while the next decides. A failure leaves its batch pending: their jobs,
        or the sweeper, take them. Returns the number of deliveries decided."""
        return len(await self._decide_ready())

    async def _decide_ready(
        self, *, first: uuid.UUID | None = None, hand_off: bool = False
    ) -> dict[uuid.UUID, str]:
        """`decide_ready`, `first` taken first when it is ready; the action taken for each
        delivery decided (none of a batch that failed). `hand_off`: the sends are left
        running beside (`deliver`)."""
        sends: list[asyncio.Task[None]] = []
        decided: dict[uuid.UUID, str] = {}
        try:
            for _ in range(self.config.batch_rounds):
                messages: list[SmsRecord] = []
                actions: dict[uuid.UUID, str] = {}
                async with self.engine.begin() as conn:
                    ready = await ready_out_of_call(conn, self.config.batch, first=first)
                    # Dropped first: their rows stay locked by this transaction until it ends,
                    # so other workers' fetches skip them (SKIP LOCKED) instead of running
                    # jobs that would find their delivery locked and nothing to do.
                    await deliveries.drop_waiting_jobs(
                        conn, [d.id for d, _, _ in ready if d.id != first]
                    )
                    # Their ledger facts are read, and their trail events and SMS written,
                    # together (the same rows, in a few statements rather than several each).
                    texting: list[Texting] = []
                    async with deliveries.events_together(conn):
                        contexts = await deliveries.ledger_contexts(conn, [o for _, o, _ in ready])
                        for delivery, op, call in ready:
                            actions[delivery.id], _, _ = await self._decide(
                                conn,
                                delivery,
                                op,
                                call,
                                texting=texting,
                                context=contexts[op.operation_id],
                            )
                        messages = await self.sms.start_many(conn, texting, actor=ACTOR)
                decided.update(actions)
                if messages and hand_off:
                    await self._send(self.sms.send_many(messages), hand_off)
                elif messages:
                    sends.append(asyncio.create_task(self.sms.send_many(messages)))
                if len(ready) < self.config.batch:
                    break
        except Exception as exc:
            if not DATABASE.failed("delivery batch", exc):
                log.exception("deciding ready deliveries failed; their own jobs will")
        finally:
            if sends:
                await asyncio.gather(*sends)
        return decided

    async def _deliver_one(
        self, delivery_id: uuid.UUID
    ) -> tuple[str | None, SmsRecord | None, uuid.UUID | None]:
        """The job's own delivery: the action taken, the SMS to send, the message to drive."""
        async with self.engine.begin() as conn:
            # Locked: the replica holding the call is deciding it right now. If that fails,
            # the sweeper finds the delivery pending with no job and queues one again.
            delivery = await deliveries.get(conn, delivery_id, for_update=True, skip_locked=True)
            if delivery is None:
                return None, None, None
            if self.callback is not None and delivery.state is not D.PENDING:
                return await self._follow_callback(conn, delivery), None, None
            if delivery.state is not D.PENDING:
                return None, None, None
            op = await ledger.get_operation(conn, delivery.operation_id)
            assert op is not None
            call, row = await call_state_of(
                conn, delivery.call_id, dead_after_s=self.config.dead_after_s
            )
            if call is CallState.DEAD:
                assert row is not None
                reason = call_liveness.dead_reason(row.holder, self.config.dead_after_s)
                await call_liveness.end_row(
                    conn,
                    str(row.id),
                    CallStatus.COMPLETED,
                    reason,
                    expect=CallStatus.IN_PROGRESS,
                    source=ACTOR,
                )
                call = CallState.ENDED
            if call is CallState.LIVE_ELSEWHERE:
                # The holder heard the NOTIFY sent with the commit and decides; if it has not
                # within a nudge interval (a lost notification), remind it; look again later.
                age = (datetime.now(UTC) - delivery.updated_at).total_seconds()
                if age >= self.config.nudge_s:
                    await deliveries.notify_ready(conn, delivery)
                delay = min(max(self.config.nudge_s, age / 2), 60.0)
                await deliveries.enqueue(
                    conn, delivery.id, datetime.now(UTC) + timedelta(seconds=delay)
                )
                return Action.WAIT.value, None, None
            return await self._decide(conn, delivery, op, call)

    async def _decide(
        self,
        conn: Any,
        delivery: deliveries.DeliveryRecord,
        op: ledger.OperationRecord,
        call: CallState,
        *,
        texting: list[Texting] | None = None,
        context: deliveries.LedgerContext | None = None,
    ) -> tuple[str, SmsRecord | None, uuid.UUID | None]:
        """Ask the gate about a pending delivery locked by this transaction, of a call not
        live anywhere, and record what it says; the SMS to send or the message to drive.
        `texting`: an SMS decided is added there, for `SmsChannel.start_many`, not started."""
        message: SmsRecord | None = None
        message_id: uuid.UUID | None = None
        found = await evaluate(
            conn,
            self.registry,
            delivery,
            op,
            call,
            max_reoffers=self.config.max_reoffers,
            context=context,
        )
        gate = found.gate
        await record_decision(conn, delivery, gate, ACTOR)
        if gate.action is Action.TEXT and (
            self.callback is not None and await self.callback.wants_call(conn, delivery)
        ):
            step = await self.callback.start(conn, delivery, op, reason=gate.reason)
            message_id = step.message.id if step.message is not None else None
        elif gate.action is Action.TEXT and texting is not None:
            texting.append((delivery, op, gate.reason, found.newer, found.undone))
        elif gate.action is Action.TEXT:
            # Locked at the top of this transaction; record_decision moved nothing.
            message = await self.sms.start(
                conn,
                delivery,
                op,
                reason=gate.reason,
                newer=found.newer,
                undone=found.undone,
                actor=ACTOR,
                locked=True,
            )
        elif gate.action in (Action.NOT_NEEDED, Action.NOT_DELIVERABLE):
            await settle_without_telling(conn, delivery, gate, ACTOR)
        elif gate.action is Action.HOLD:
            # The compensation's outcome re-drives it; until then nobody needs to look.
            await deliveries.defer_until(
                conn, delivery.id, datetime.now(UTC) + timedelta(seconds=HOLD_RECHECK_S)
            )
        return gate.action.value, message, message_id

    async def _follow_callback(self, conn: Any, delivery: deliveries.DeliveryRecord) -> str | None:
        """A delivery the callback channel carries (calling), or one whose SMS proved the
        number cannot take SMS (auto: call instead)."""
        assert self.callback is not None
        if delivery.state is D.CALLING:
            return (await self.callback.check(conn, delivery)).action
        if self.callback.wants_call_after_sms(delivery) and delivery.channel == "sms":
            if await sms_refused(conn, delivery.caller):
                op = await ledger.get_operation(conn, delivery.operation_id)
                assert op is not None
                step = await self.callback.start(
                    conn, delivery, op, reason="the number cannot take SMS"
                )
                return step.action
        return None


class DeliverySweeper:
    """Recovery of delivery work nobody would otherwise finish (see the module docstring)."""

    def __init__(
        self,
        engine: AsyncEngine,
        config: DeliveryConfig,
        *,
        interval_s: float = 5.0,
        grace_s: float = 5.0,
    ) -> None:
        self.engine = engine
        self.config = config
        self.interval_s = interval_s
        self.grace_s = grace_s  # how long a pending delivery may sit before a nudge

    async def sweep_once(self, now: datetime | None = None) -> dict[str, int]:
        now = now or datetime.now(UTC)
        report: dict[str, Any] = {}
        dead = await call_liveness.end_dead_calls(
            self.engine, dead_after_s=self.config.dead_after_s, now=now
        )
        report["dead_calls"] = len(dead)
        unstreamed = await call_liveness.end_unstreamed_calls(
            self.engine,
            stream_wait_s=self.config.stream_wait_s,
            now=now,
            outbound_wait_s=self.config.outbound_wait_s,
        )
        report["unstreamed_calls"] = len(unstreamed)
        async with self.engine.begin() as conn:
            stale = await deliveries.offers_unreported(
                conn, now - timedelta(seconds=self.config.announce_timeout_s)
            )
            for delivery in stale:
                back = await deliveries.move(
                    conn,
                    delivery.id,
                    D.OFFERED,
                    D.PENDING,
                    actor="sweeper",
                    reason="the call never reported it heard or cut: offered again",
                    holder=None,
                    cuts=delivery.cuts + 1,
                )
                if back is not None:
                    await deliveries.notify_ready(conn, back)
                    await deliveries.enqueue(conn, back.id)
            report["offers_taken_back"] = len(stale)
        async with self.engine.begin() as conn:
            orphans = await deliveries.pending_without_job(
                conn, now - timedelta(seconds=self.grace_s)
            )
            for delivery_id in orphans:
                await deliveries.enqueue(conn, delivery_id)
            report["deliveries_requeued"] = len(orphans)
        async with self.engine.begin() as conn:
            due = await deliveries.sms_due(conn, now)
            for message_id in due:
                await deliveries.enqueue_sms(conn, message_id)
            report["sms_checks"] = len(due)
        report["webhooks_recovered"] = await webhooks.recover(
            self.engine, stuck_after_s=self.config.webhook_policy.timeout_s * 3
        )
        async with self.engine.connect() as conn:
            count, oldest_s = await deliveries.waiting(conn, now)
        measures.DELIVERIES_WAITING.set(count)
        measures.DELIVERY_OLDEST_WAITING.set(oldest_s)
        return report

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every `interval_s` until `stop` is set; a failed sweep is logged, not fatal."""
        while not stop.is_set():
            try:
                report = await self.sweep_once()
                if any(report.values()):
                    log.info("delivery sweep: %s", {k: v for k, v in report.items() if v})
            except Exception as exc:
                if not DATABASE.failed("delivery sweep", exc):
                    log.exception("delivery sweep failed; trying again next interval")
            else:
                DATABASE.ok()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await stop.wait()
