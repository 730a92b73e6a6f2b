"""Late results: every finished outcome reaches its caller once, in the call or by SMS.

The durable part lives in the ledger (`tools.deliveries`): the delivery row is opened in
the transaction that made the operation terminal, with a NOTIFY on `delivery_ready` and a
job. This module is the part that needs a process:

- `ResultDelivery` runs in every serving process. It hears `delivery_ready`, and for a call
  whose bridge runs here it asks the relevance gate (`tools.relevance`), records the
  decision, and hands the outcome to the bridge at its next safe moment. The bridge reports
  back (held, spoken in response R, heard, cut) and each report is made durable in order.
  A cut announcement is offered again, at most `max_reoffers` times, then goes by SMS.
- `decide_out_of_call` is what the delivery job (`app.ops.delivery_jobs`) does on any worker:
  the call is live elsewhere (nudge the holder), dead (end it), or over (SMS).
- `resend_sms` is the staff action behind the console's "resend SMS".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.calls.registry import LiveCallEntry
from app.calls.store import CallStatus, calls
from app.ops.sms import ResendRefused, SmsChannel
from app.owned_tasks import OwnedTasks
from app.pg_listener import PgListener
from telephony.tool_gateway import (
    AnnouncementReport,
    AnnouncementStatus,
    CallContext,
    LateResult,
)
from tools import deliveries, ledger, measures
from tools.agents import AgentSet
from tools.deliveries import DeliveryRecord, LedgerContext, SmsRecord
from tools.delivery_states import DeliveryState
from tools.ledger import OperationRecord
from tools.outage import DATABASE
from tools.registry import Registry
from tools.relevance import (
    Action,
    CallState,
    GateDecision,
    GateFacts,
    Newer,
    decide,
    sms_capable,
)
from tools.results import announcement_text, describe_operation
from tools.states import OperationStatus

log = logging.getLogger(__name__)

D = DeliveryState
CHANNEL = deliveries.NOTIFY_CHANNEL

__all__ = [
    "HOLD_RECHECK_S",
    "DeliveryDecision",
    "ResendRefused",
    "ResultDelivery",
    "call_state_of",
    "evaluate",
    "resend_sms",
]


# --- shared by the in-call side and the delivery job ------------------------------------------


async def call_state_of(
    conn: AsyncConnection, call_id: str | None, *, dead_after_s: float, here: bool = False
) -> tuple[CallState, Any]:
    """The call's state from the deciding process's point of view, and its row."""
    if here:
        return CallState.LIVE_HERE, None
    if call_id is None:
        return CallState.UNKNOWN, None
    try:
        key = uuid.UUID(call_id)
    except ValueError:
        return CallState.UNKNOWN, None
    row = (await conn.execute(sa.select(calls).where(calls.c.id == key))).first()
    if row is None:
        return CallState.UNKNOWN, None
    if row.status != CallStatus.IN_PROGRESS.value:
        return CallState.ENDED, row
    beat = row.heartbeat_at or row.answered_at or row.created_at
    if beat < datetime.now(UTC) - timedelta(seconds=dead_after_s):
        return CallState.DEAD, row
    return CallState.LIVE_ELSEWHERE, row


@dataclass(frozen=True, slots=True)
class DeliveryDecision:
    """A gate decision with what it was made about."""

    gate: GateDecision
    op: OperationRecord
    context: LedgerContext
    newer: list[str]  # descriptions of the newer, conflicting requests
    undone: list[str]  # descriptions of compensations of it that went through


async def evaluate(
    conn: AsyncConnection,
    registry: Registry,
    delivery: DeliveryRecord,
    op: OperationRecord,
    call: CallState,
    *,
    live_caller: str | None = None,
    turns_since: int | None = None,
    max_reoffers: int = 2,
    agents: AgentSet | None = None,
    active_agent: str | None = None,
    context: LedgerContext | None = None,
) -> DeliveryDecision:
    """Gather the facts and ask the relevance gate (nothing is recorded here). `context`:
    the ledger's side, read already (`deliveries.ledger_contexts`, for a batch)."""
    ctx = context if context is not None else await deliveries.ledger_context(conn, op)
    spec = registry.get(op.tool) if op.tool in registry else None
    newer: list[Newer] = []
    texts: list[str] = []
    for other in ctx.conflicts:
        other_spec = registry.get(other.tool) if other.tool in registry else None
        what = (
            describe_operation(other_spec, _as_record(op, other))
            if other_spec is not None
            else other.tool.replace("_", " ")
        )
        newer.append(Newer(other.operation_id, other.status, what, other.held_by_this))
        texts.append(what)
    facts = GateFacts(
        outcome=op.status,
        attempts=op.attempts,
        has_call=op.call_id is not None,
        call=call,
        caller=op.caller,
        live_caller=live_caller,
        told_in_reply=ctx.told_in_reply,
        told_with_original=ctx.told_with_original,
        newer=tuple(newer),
        compensation_statuses=tuple(c.status for c in ctx.compensations),
        turns_since=turns_since,
        cuts=delivery.cuts,
        max_reoffers=max_reoffers,
        sms_capable=sms_capable(op.caller),
        opted_out=ctx.opted_out,
        needs_verification=bool(spec and spec.needs_verification),
        active_agent=active_agent,
        agent_may_disclose=agents is None or agents.may_disclose(active_agent, op.tool),
    )
    undone = [
        describe_operation(registry.get(c.tool), _as_record(op, c))
        if c.tool in registry
        else c.tool.replace("_", " ")
        for c in ctx.compensations
        if c.status is OperationStatus.COMMITTED
    ]
    return DeliveryDecision(decide(facts), op, ctx, texts, undone)


def _as_record(op: OperationRecord, other: deliveries.Related) -> OperationRecord:
    """A record of `other` good enough to describe it (its tool and arguments)."""
    from dataclasses import replace

    return replace(op, operation_id=other.operation_id, tool=other.tool, args=other.args)


HOLD_RECHECK_S = 30.0
# A report that cannot be written (the database is away) is tried again this often, for so
# long; after that the delivery sweep finds the delivery where the last written report left it.
REPORT_RETRY_FIRST_S = 0.1
REPORT_RETRY_MAX_S = 0.5
REPORT_RETRY_FOR_S = 120.0


def _hold_until() -> datetime:
    return datetime.now(UTC) + timedelta(seconds=HOLD_RECHECK_S)


async def record_decision(
    conn: AsyncConnection, delivery: DeliveryRecord, decision: GateDecision, actor: str
) -> None:
    await deliveries.record_event(
        conn,
        delivery.id,
        kind="decision",
        actor=actor,
        reason=decision.reason,
        data=decision.as_data(),
    )


async def settle_without_telling(
    conn: AsyncConnection, delivery: DeliveryRecord, decision: GateDecision, actor: str
) -> None:
    """NOT_NEEDED / NOT_DELIVERABLE decisions end the delivery here."""
    target = D.NOT_NEEDED if decision.action is Action.NOT_NEEDED else D.NOT_DELIVERABLE
    await deliveries.move(conn, delivery.id, D.PENDING, target, actor=actor, reason=decision.reason)


# --- the in-call side ---------------------------------------------------------------------------


class _Serial:
    """Runs coroutines one after another, per key, in the order they were queued."""

    def __init__(self, tasks: OwnedTasks) -> None:
        self._tasks = tasks
        self._queues: dict[str, deque[Callable[[], Any]]] = {}
        self._idle: dict[str, asyncio.Event] = {}

    def push(self, key: str, make: Callable[[], Any]) -> None:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._idle[key] = asyncio.Event()
            queue.append(make)
            self._tasks.spawn(self._run(key), f"delivery-reports-{key}")
        else:
            queue.append(make)

    async def _run(self, key: str) -> None:
        queue = self._queues[key]
        try:
            while queue:
                make = queue[0]
                delay = REPORT_RETRY_FIRST_S
                give_up = time.monotonic() + REPORT_RETRY_FOR_S
                while True:
                    try:
                        await make()
                    except Exception as exc:
                        # What the caller heard is written once the database answers again
                        # (in order, this call's later reports wait behind it): a lost
                        # "heard" would have the outcome told again.
                        if time.monotonic() < give_up and DATABASE.failed("delivery report", exc):
                            await asyncio.sleep(delay)
                            delay = min(delay * 2, REPORT_RETRY_MAX_S)
                            continue
                        log.exception("delivery report for call %s failed", key)
                    else:
                        DATABASE.ok()
                    break
                queue.popleft()
        finally:
            del self._queues[key]
            self._idle.pop(key).set()

    async def flush(self, key: str, timeout_s: float = 10.0) -> None:
        idle = self._idle.get(key)
        if idle is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await idle.wait()


class ResultDelivery:
    """The in-call side of deliveries for one serving process (an `AnnouncementSink`)."""

    def __init__(
        self,
        engine: AsyncEngine,
        registry: Registry,
        find_live: Callable[[str], LiveCallEntry | None],
        live_call_ids: Callable[[], list[str]],
        *,
        holder: str = "replica",
        max_reoffers: int = 2,
        sms: SmsChannel | None = None,
        agents: AgentSet | None = None,
    ) -> None:
        self._engine = engine
        # Agents declared: a result is told by the agent active when it lands, if it may.
        self.agents = agents
        self._registry = registry
        self._find_live = find_live
        self._live_call_ids = live_call_ids
        self.holder = holder
        self.max_reoffers = max_reoffers
        self._sms = sms
        self._work = OwnedTasks()
        self._serial = _Serial(self._work)
        self.offered = 0  # handed to a bridge by this process (benchmarks, tests)
        self._call_of: dict[str, str] = {}  # delivery id -> call id, for offers made here

    @property
    def actor(self) -> str:
        return f"replica:{self.holder}"

    def subscribe(self, listener: PgListener) -> None:
        """Hear every delivery that wants deciding through the process's listener."""
        listener.subscribe(CHANNEL, self._on_notify)
        listener.on_listen(self._schedule_catch_up)

    def _schedule_catch_up(self) -> None:
        self._work.spawn(self.catch_up(), "delivery-catch-up")

    async def catch_up(self) -> int:
        """Offer the pending deliveries of this process's live calls (their notification
        may have been missed while the listener was down)."""
        call_ids = self._live_call_ids()
        if not call_ids:
            return 0
        async with self._engine.connect() as conn:
            rows = (
                await conn.execute(
                    sa.text(
                        "SELECT id, call_id FROM deliveries WHERE state = 'pending' "
                        "AND call_id = ANY(:calls) ORDER BY created_at"
                    ),
                    {"calls": call_ids},
                )
            ).all()
        for row in rows:
            self._serial.push(row.call_id, functools.partial(self.offer, row.id))
        return len(rows)

    async def stop(self) -> None:
        """Cancel work still under way (the calls it was for are ending too)."""
        await self._work.cancel_all()

    def _on_notify(self, payload: str) -> None:
        try:
            data = json.loads(payload)
            delivery_id = uuid.UUID(str(data["delivery_id"]))
            call_id = data.get("call_id")
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed %s notification", CHANNEL)
            return
        if not call_id or self._find_live(str(call_id)) is None:
            return  # not a call of this process: whoever holds it (or the job) decides
        self._serial.push(str(call_id), functools.partial(self.offer, delivery_id))

    async def offer(self, delivery_id: uuid.UUID) -> GateDecision | None:
        """Decide a pending delivery of a call live here; hand it to the bridge if the
        gate says announce. Returns the decision (None: not ours or not pending)."""
        try:
            return await self._offer(delivery_id)
        except Exception:
            log.exception("offering delivery %s failed", delivery_id)
            return None

    async def _offer(self, delivery_id: uuid.UUID) -> GateDecision | None:
        result: LateResult | None = None
        entry: LiveCallEntry | None = None
        message: SmsRecord | None = None
        async with self._engine.begin() as conn:
            delivery = await deliveries.get(conn, delivery_id, for_update=True)
            if delivery is None or delivery.state is not D.PENDING or delivery.call_id is None:
                return None
            entry = self._find_live(delivery.call_id)
            if entry is None:
                return None
            op = await ledger.get_operation(conn, delivery.operation_id)
            assert op is not None
            turn = getattr(entry.live, "turn_id", None)
            turns_since = (
                max(0, turn - op.turn_id)
                if isinstance(turn, int) and op.turn_id is not None
                else None
            )
            agent = getattr(entry.live, "agent", None) if self.agents is not None else None
            found = await evaluate(
                conn,
                self._registry,
                delivery,
                op,
                CallState.LIVE_HERE,
                live_caller=entry.from_number,
                turns_since=turns_since,
                max_reoffers=self.max_reoffers,
                agents=self.agents,
                active_agent=agent,
            )
            gate = found.gate
            await record_decision(conn, delivery, gate, self.actor)
            if agent is not None and agent != delivery.agent:
                # The ledger keeps who was talking when the result landed (told or kept back).
                await deliveries.update(
                    conn,
                    delivery.id,
                    D.PENDING,
                    actor=self.actor,
                    reason=f"the active agent is {agent}",
                    agent=agent,
                )
            if gate.action is Action.ANNOUNCE:
                moved = await deliveries.move(
                    conn,
                    delivery.id,
                    D.PENDING,
                    D.OFFERED,
                    locked=delivery,
                    actor=self.actor,
                    reason="handed to the live call",
                    channel="call",
                    offers=delivery.offers + 1,
                    holder=self.holder,
                    offered_at=sa.func.now(),
                    response_id=None,
                )
                assert moved is not None
                result = self._late_result(moved, op, found, turns_since)
            elif gate.action is Action.TEXT:
                if self._sms is None:
                    await deliveries.enqueue(conn, delivery.id)  # a worker sends it
                else:
                    # Locked above; an agent note (update) changes no state.
                    message = await self._sms.start(
                        conn,
                        delivery,
                        op,
                        reason=gate.reason,
                        newer=found.newer,
                        undone=found.undone,
                        actor=self.actor,
                        locked=True,
                    )
            elif gate.action in (Action.NOT_NEEDED, Action.NOT_DELIVERABLE):
                await settle_without_telling(conn, delivery, gate, self.actor)
            elif gate.action is Action.HOLD:
                # The compensation's outcome re-drives it; until then nobody needs to look.
                await deliveries.defer_until(conn, delivery.id, _hold_until())
        if message is not None and self._sms is not None:
            # Persisted with its job first; sending right away only saves the job's pickup.
            await self._sms.send_started(message)
        if result is not None:
            assert entry is not None and delivery.call_id is not None
            self._call_of[str(delivery_id)] = delivery.call_id
            self.offered += 1
            accepted = await entry.live.deliver_result(result)
            if not accepted:
                async with self._engine.begin() as conn:
                    back = await deliveries.move(
                        conn,
                        delivery_id,
                        D.OFFERED,
                        D.PENDING,
                        actor=self.actor,
                        reason="the call is ending: not spoken",
                        holder=None,
                    )
                    if back is not None:
                        await deliveries.enqueue(conn, delivery_id)
        return gate

    def _late_result(
        self,
        delivery: DeliveryRecord,
        op: OperationRecord,
        found: DeliveryDecision,
        turns_since: int | None,
    ) -> LateResult:
        if found.gate.contradicted and delivery.cuts == 0:
            measures.LATE_RESULTS_AFTER_TURN_CHANGE.inc()  # once per outcome, not per retelling
        if op.tool in self._registry:
            text = announcement_text(
                self._registry.get(op.tool),
                op,
                newer=found.newer,
                repeat=delivery.cuts > 0,
                turns_since=turns_since,
                undone=found.undone,
            )
        else:
            text = f"The request {op.tool} ended as {op.status.value}."
        return LateResult(
            operation_id=str(op.operation_id),
            text=text,
            data={
                "status": op.status.value,
                "tool": op.tool,
                "reference": op.provider_ref,
                "contradicted": found.gate.contradicted,
            },
            delivery_id=str(delivery.id),
        )

    async def tell_on_callback(self, live: Any, call_id: str, delivery_id: uuid.UUID) -> bool:
        """A person answered the callback call `call_id` of a `calling` delivery: hand its
        outcome to that call's bridge as an announcement; its heard report (the same
        accounting as in the caller's own call) makes the delivery `called`. False when the
        delivery is not calling any more or the call is ending."""
        async with self._engine.connect() as conn:
            delivery = await deliveries.get(conn, delivery_id)
            if delivery is None or delivery.state is not D.CALLING:
                return False
            op = await ledger.get_operation(conn, delivery.operation_id)
            assert op is not None
            found = await evaluate(conn, self._registry, delivery, op, CallState.ENDED)
        result = self._late_result(delivery, op, found, None)
        self._call_of[str(delivery_id)] = call_id
        return bool(await live.deliver_result(result))

    # AnnouncementSink: the bridge's reports, made durable in order.

    def report(self, report: AnnouncementReport) -> None:
        if report.delivery_id is None:
            return
        try:
            delivery_id = uuid.UUID(report.delivery_id)
        except ValueError:
            return
        # Same queue as the call's offers: reports apply in order, and flush() sees them.
        key = self._call_of.get(report.delivery_id, report.delivery_id)
        self._serial.push(key, functools.partial(self._apply, delivery_id, report))

    async def _apply(self, delivery_id: uuid.UUID, report: AnnouncementReport) -> None:
        data: dict[str, Any] = {
            "response_id": report.response_id,
            "heard_ms": report.heard_ms,
            "audio_ms": report.audio_ms,
        }
        if report.item_ids:
            data["item_ids"] = list(report.item_ids)
        again = False
        async with self._engine.begin() as conn:
            delivery = await deliveries.get(conn, delivery_id, for_update=True)
            if delivery is None:
                return
            match report.status:
                case AnnouncementStatus.HELD:
                    await deliveries.record_event(
                        conn,
                        delivery_id,
                        kind="note",
                        actor=self.actor,
                        reason=f"held: {report.reason}",
                        data=data,
                    )
                case AnnouncementStatus.SPOKEN:
                    await deliveries.update(
                        conn,
                        delivery_id,
                        D.OFFERED,
                        actor=self.actor,
                        reason=f"announced in response {report.response_id}",
                        data=data,
                        response_id=report.response_id,
                    )
                case AnnouncementStatus.HEARD if delivery.state is D.CALLING:
                    # Told on a callback call: a person heard it to its end.
                    await deliveries.move(
                        conn,
                        delivery_id,
                        D.CALLING,
                        D.CALLED,
                        locked=delivery,
                        actor=self.actor,
                        reason="the callback's person heard it: its audio played out in full",
                        data=data,
                        heard_at=sa.func.now(),
                        response_id=report.response_id,
                    )
                case _ if delivery.state is D.CALLING:
                    # Held, spoken or cut on a callback call: a note; the call's end decides.
                    await deliveries.record_event(
                        conn,
                        delivery_id,
                        kind="note",
                        actor=self.actor,
                        reason=f"callback announcement {report.status.value}: {report.reason}",
                        data=data,
                    )
                case AnnouncementStatus.HEARD:
                    moved = await deliveries.move(
                        conn,
                        delivery_id,
                        D.OFFERED,
                        D.HEARD,
                        actor=self.actor,
                        reason="the caller heard it: its audio played out in full",
                        data=data,
                        heard_at=sa.func.now(),
                        response_id=report.response_id or delivery.response_id,
                    )
                    if moved is not None:
                        op = await ledger.get_operation(conn, delivery.operation_id)
                        if op is not None and op.committed_at is not None:
                            measures.COMMIT_TO_HEARD.observe(
                                max(0.0, (datetime.now(UTC) - op.committed_at).total_seconds())
                            )
                case AnnouncementStatus.CUT | AnnouncementStatus.NOT_SPOKEN:
                    cut = report.status is AnnouncementStatus.CUT
                    why = (
                        f"not heard: cut ({report.reason}) after {report.heard_ms} of "
                        f"{report.audio_ms} ms"
                        if cut
                        else f"not spoken: {report.reason}"
                    )
                    live = delivery.call_id is not None and self._find_live(delivery.call_id)
                    # An announcement that keeps failing in a live call counts as cut too.
                    counts = cut or bool(live)
                    back = await deliveries.move(
                        conn,
                        delivery_id,
                        D.OFFERED,
                        D.PENDING,
                        actor=self.actor,
                        reason=why,
                        data=data,
                        holder=None,
                        cuts=delivery.cuts + (1 if counts else 0),
                    )
                    if back is not None:
                        if live:
                            again = True
                        else:
                            await deliveries.enqueue(conn, delivery_id)
        if again:
            await self.offer(delivery_id)

    async def flush(self, call_id: str, timeout_s: float = 10.0) -> None:
        """Until every offer and report of the call is durable (the call is ending)."""
        await self._serial.flush(call_id, timeout_s)
        for delivery_id in [d for d, c in self._call_of.items() if c == call_id]:
            del self._call_of[delivery_id]

    async def call_ended(self, ctx: CallContext, pending: list[OperationRecord]) -> None:
        """The call ended with operations still in flight: their outcomes go out of call
        (their deliveries open when they finish; the call row says it is over)."""
        for op in pending:
            try:
                async with self._engine.begin() as conn:
                    await ledger.record_event(
                        conn,
                        op.operation_id,
                        kind="note",
                        actor="delivery",
                        reason="call ended while in flight: the outcome will be delivered "
                        "out of call",
                        data={"call_id": ctx.call_id, "status": op.status.value},
                    )
            except Exception:
                log.exception("could not note the pending outcome of %s", op.operation_id)


async def resend_sms(
    engine: AsyncEngine,
    delivery_id: uuid.UUID,
    actor: str,
    reason: str,
    *,
    sms: SmsChannel,
) -> SmsRecord:
    """Staff: send a delivery's outcome again by SMS (the console's "resend SMS").

    A new message row on the same delivery, persisted and driven like any other (never a
    second send of the same message). Raises `ResendRefused` with a reason staff can read
    while an earlier send is still under way, when the caller opted out or has no
    SMS-capable number, or when the delivery is still being decided.
    """
    return await sms.resend(delivery_id, actor, reason)
