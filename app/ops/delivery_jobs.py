"""Delivery work on the worker side: the Procrastinate tasks and the sweeper beside them.

Tasks (queue `deliveries`, see `tools.jobs`):
- `deliver_outcome(delivery_id)`: decide a pending delivery. A call live on another process
  is nudged (NOTIFY) and looked at again later; a call whose holder stopped heartbeating is
  ended here (reason on its timeline); a call that is over gets its SMS, persisted and sent.
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
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import procrastinate
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import liveness as call_liveness
from app.calls.store import CallStatus
from app.ops.callback import CallbackChannel, sms_refused
from app.ops.delivery import (
    HOLD_RECHECK_S,
    call_state_of,
    evaluate,
    record_decision,
    settle_without_telling,
)
from app.ops.sms import SmsChannel
from tools import deliveries, jobs, ledger, measures, webhooks
from tools.deliveries import SmsRecord
from tools.delivery_states import DeliveryState
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
    webhook_policy: webhooks.RetryPolicy = field(default_factory=webhooks.RetryPolicy)


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

    def register(self, app: procrastinate.App) -> None:
        driver = self
        if jobs.DELIVER_TASK not in app.tasks:

            @app.task(name=jobs.DELIVER_TASK, queue=jobs.DELIVERY_QUEUE)
            async def deliver_outcome(delivery_id: str) -> None:
                await driver.deliver(uuid.UUID(delivery_id))

            @app.task(name=jobs.SMS_TASK, queue=jobs.DELIVERY_QUEUE)
            async def drive_sms(message_id: str) -> None:
                await driver.sms.drive(uuid.UUID(message_id))

            @app.task(name=jobs.WEBHOOK_TASK, queue=jobs.DELIVERY_QUEUE)
            async def send_webhook(webhook_delivery_id: str) -> None:
                await driver.send_webhook(uuid.UUID(webhook_delivery_id))

    async def aclose(self) -> None:
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

    async def deliver(self, delivery_id: uuid.UUID) -> str | None:
        """Decide one pending delivery out of the call (see the module docstring)."""
        message: SmsRecord | None = None
        message_id: uuid.UUID | None = None
        async with self.engine.begin() as conn:
            # Locked: the replica holding the call is deciding it right now. If that fails,
            # the sweeper finds the delivery pending with no job and queues one again.
            delivery = await deliveries.get(conn, delivery_id, for_update=True, skip_locked=True)
            if delivery is None:
                return None
            if self.callback is not None and delivery.state is not D.PENDING:
                return await self._follow_callback(conn, delivery)
            if delivery.state is not D.PENDING:
                return None
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
                return Action.WAIT.value
            found = await evaluate(
                conn, self.registry, delivery, op, call, max_reoffers=self.config.max_reoffers
            )
            gate = found.gate
            await record_decision(conn, delivery, gate, ACTOR)
            if gate.action is Action.TEXT and (
                self.callback is not None and await self.callback.wants_call(conn, delivery)
            ):
                step = await self.callback.start(conn, delivery, op, reason=gate.reason)
                message_id = step.message.id if step.message is not None else None
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
        if message is not None:
            # Persisted (and its own job queued) before this send: a crash here loses nothing.
            await self.sms.send_started(message)
        elif message_id is not None:
            await self.sms.drive(message_id)
        return gate.action.value

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
