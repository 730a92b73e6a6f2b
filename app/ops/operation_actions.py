"""What staff may do about an operation, allowed only where the engine allows it.

Every action is recorded in the operation's trail (`operation_events`) with who asked
(`staff:<name>` or `token:<name>`) and why, in the same transaction as what it does, and is
checked again against the operation's state under a row lock, so two people (or a person
and a worker) acting at once cannot both win.

    reconcile       `unknown`, and its tool reconciles automatically: ask the system of
                    record now (by idempotency key) instead of at the sweeper's next pass
    retry           `failed_retryable`, and its tool allows automatic retries (idempotent at
                    the provider, attempts left): run the next attempt now
    record_outcome  what a person checked at the system of record: for `unknown` operations
                    no lookup can settle (`on_unknown: ask_staff`), and for stuck ones
                    (`unknown` or running with no change for OPERATION_STUCK_AFTER_S, or
                    running past its attempt deadline): committed (with its reference) or
                    failed_final
    compensate      `committed`, its tool declares a compensating tool, it has a provider
                    reference, and nothing compensates it yet: admit the compensation
    resend_sms      the outcome has an SMS that may be sent again (`app.ops.sms_resend`)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.ops.operation_query import needs_a_person
from app.ops.sms_resend import NoSmsDelivery, SmsDeliveries, SmsInfo, SmsResendRefused
from tools import ledger
from tools.compensation import compensate
from tools.ledger import OperationRecord
from tools.ledger_models import operations_table as ops_t
from tools.reconcile import Reconciler
from tools.registry import Registry, ToolSpec
from tools.states import OperationStatus

S = OperationStatus

TRAIL_CHANNEL = "operation_trail"
MAX_WHY = 500
MAX_REFERENCE = 200


class Action(StrEnum):
    RECONCILE = "reconcile"
    RETRY = "retry"
    RECORD_OUTCOME = "record_outcome"
    COMPENSATE = "compensate"
    RESEND_SMS = "resend_sms"


TITLES = {
    Action.RECONCILE: "Reconcile now",
    Action.RETRY: "Retry now",
    Action.RECORD_OUTCOME: "Record the outcome checked by hand",
    Action.COMPENSATE: "Start a compensation",
    Action.RESEND_SMS: "Resend the SMS",
}


class ManualOutcome(StrEnum):
    """What a person found at the system of record."""

    COMMITTED = "committed"  # it happened
    FAILED_FINAL = "failed_final"  # it did not happen, and will not


class ActionRefused(Exception):
    """The action is not allowed now; the message says why, for staff."""


@dataclass(frozen=True, slots=True)
class Availability:
    allowed: bool
    why: str


@dataclass(frozen=True, slots=True)
class ActionDone:
    """What an action did, in a sentence, and the operation afterwards."""

    message: str
    status: str
    new_operation_id: str | None = None


def _stale(op: OperationRecord, now: datetime, stuck_after_s: float) -> bool:
    return op.updated_at < now - timedelta(seconds=stuck_after_s)


def available_actions(
    op: OperationRecord,
    spec: ToolSpec | None,
    *,
    now: datetime,
    stuck_after_s: float,
    has_compensation: bool,
    sms: SmsInfo | None,
    can_reconcile: bool,
) -> dict[Action, Availability]:
    """Which actions the engine allows on `op` now, and why (not)."""
    out: dict[Action, Availability] = {}
    no = Availability

    # Reconcile.
    if op.status is not S.UNKNOWN:
        out[Action.RECONCILE] = no(
            False, f"only an unknown outcome is reconciled; it is {op.status}"
        )
    elif needs_a_person(spec):
        out[Action.RECONCILE] = no(
            False, "this tool has no automatic lookup: check by hand and record the outcome"
        )
    elif not can_reconcile:
        out[Action.RECONCILE] = no(False, "this process has no connection to the system of record")
    else:
        out[Action.RECONCILE] = no(True, "ask the system of record now, by idempotency key")

    # Retry.
    if op.status is not S.FAILED_RETRYABLE:
        out[Action.RETRY] = no(False, f"only a retryable failure is retried; it is {op.status}")
    elif spec is None or not spec.provider_idempotent or spec.retry.max_attempts <= 1:
        out[Action.RETRY] = no(False, "this tool does not allow automatic retries")
    elif op.cancel_requested:
        out[Action.RETRY] = no(False, "a cancel was requested")
    elif not spec.may_retry(op.attempts):
        out[Action.RETRY] = no(False, f"no attempts left ({op.attempts} made)")
    else:
        out[Action.RETRY] = no(True, "run the next attempt now instead of after its backoff")

    # Record an outcome checked by hand.
    overdue = op.status is S.RUNNING and op.deadline is not None and op.deadline < now
    if op.status is S.UNKNOWN and needs_a_person(spec):
        out[Action.RECORD_OUTCOME] = no(True, "only a person can settle this outcome")
    elif op.status in (S.UNKNOWN, S.RUNNING) and (overdue or _stale(op, now, stuck_after_s)):
        out[Action.RECORD_OUTCOME] = no(True, "the operation is stuck")
    elif op.status in (S.UNKNOWN, S.RUNNING):
        out[Action.RECORD_OUTCOME] = no(
            False, "the engine is still settling it (reconciliation or a running attempt)"
        )
    else:
        out[Action.RECORD_OUTCOME] = no(
            False, f"only an unsettled outcome is recorded; it is {op.status}"
        )

    # Compensate.
    if op.status is not S.COMMITTED:
        out[Action.COMPENSATE] = no(
            False, f"only a committed operation is compensated; it is {op.status}"
        )
    elif spec is None or spec.compensated_by is None:
        out[Action.COMPENSATE] = no(False, "this tool declares no compensating tool")
    elif not op.provider_ref:
        out[Action.COMPENSATE] = no(False, "it has no provider reference to compensate")
    elif has_compensation:
        out[Action.COMPENSATE] = no(False, "a compensation was already started")
    else:
        out[Action.COMPENSATE] = no(True, f"admit {spec.compensated_by} for {op.provider_ref}")

    # Resend the SMS.
    if sms is None:
        out[Action.RESEND_SMS] = no(False, "no SMS delivery exists for this operation")
    elif not sms.resendable:
        out[Action.RESEND_SMS] = no(False, sms.why_not or f"its SMS is {sms.state}")
    else:
        out[Action.RESEND_SMS] = no(True, f"its SMS is {sms.state}")
    return out


def clean_why(why: str) -> str:
    """The reason staff gave, as stored (required, one line, bounded)."""
    text = " ".join(why.split())
    if not text:
        raise ActionRefused("say why (it is recorded in the operation's history)")
    return text[:MAX_WHY]


ReconcilerFactory = Callable[[str], Reconciler | None]


class OperationActions:
    """The actions, over the ledger of one deployment."""

    def __init__(
        self,
        engine: AsyncEngine,
        registry: Registry,
        *,
        enqueue: ledger.Enqueue | None,
        reconciler: ReconcilerFactory,
        sms: SmsDeliveries | None = None,
        stuck_after_s: float = 600.0,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.enqueue = enqueue
        self.make_reconciler = reconciler
        self.sms: SmsDeliveries = sms or NoSmsDelivery()
        self.stuck_after_s = stuck_after_s

    def _spec(self, op: OperationRecord) -> ToolSpec | None:
        return self.registry.get(op.tool) if op.tool in self.registry else None

    async def _has_compensation(self, conn: AsyncConnection, op_id: uuid.UUID) -> bool:
        row = (
            await conn.execute(
                sa.select(sa.literal(1)).where(ops_t.c.compensates_operation_id == op_id).limit(1)
            )
        ).first()
        return row is not None

    async def availability(self, op: OperationRecord) -> dict[Action, Availability]:
        """What may be done about `op` right now."""
        async with self.engine.connect() as conn:
            has_comp = await self._has_compensation(conn, op.operation_id)
        return available_actions(
            op,
            self._spec(op),
            now=datetime.now(UTC),
            stuck_after_s=self.stuck_after_s,
            has_compensation=has_comp,
            sms=await self.sms.latest_for_operation(op.operation_id),
            can_reconcile=self.make_reconciler("staff") is not None,
        )

    async def _locked(
        self, conn: AsyncConnection, op_id: uuid.UUID, action: Action
    ) -> OperationRecord:
        """The operation, row-locked, if `action` is allowed on it now; else ActionRefused."""
        op = await ledger.get_operation(conn, op_id, for_update=True)
        if op is None:
            raise ActionRefused("no such operation")
        allowed = available_actions(
            op,
            self._spec(op),
            now=datetime.now(UTC),
            stuck_after_s=self.stuck_after_s,
            has_compensation=await self._has_compensation(conn, op_id),
            sms=await self.sms.latest_for_operation(op_id) if action is Action.RESEND_SMS else None,
            can_reconcile=self.make_reconciler("staff") is not None,
        )[action]
        if not allowed.allowed:
            raise ActionRefused(f"{TITLES[action]}: not allowed ({allowed.why})")
        return op

    async def _record(
        self,
        conn: AsyncConnection,
        op: OperationRecord,
        action: Action,
        *,
        actor: str,
        why: str,
        data: dict[str, Any] | None = None,
    ) -> None:
        await ledger.record_event(
            conn,
            op.operation_id,
            kind="decision",
            actor=actor,
            reason=f"{TITLES[action].lower()}: {why}",
            data={"action": action.value, "why": why, **(data or {})},
        )
        await notify_trail(conn, op)

    async def reconcile(self, op_id: uuid.UUID, *, actor: str, why: str) -> ActionDone:
        why = clean_why(why)
        reconciler = self.make_reconciler(actor)
        async with self.engine.begin() as conn:
            op = await self._locked(conn, op_id, Action.RECONCILE)
            await self._record(conn, op, Action.RECONCILE, actor=actor, why=why)
        assert reconciler is not None  # _locked refuses when there is none
        after = await reconciler.reconcile(op_id)
        status = after.status.value if after is not None else op.status.value
        if status == S.UNKNOWN.value:
            return ActionDone("Asked; the system of record has not settled it yet.", status)
        return ActionDone(f"Reconciled: {status}.", status)

    async def retry(self, op_id: uuid.UUID, *, actor: str, why: str) -> ActionDone:
        why = clean_why(why)
        if self.enqueue is None:
            raise ActionRefused("this process cannot enqueue work")
        async with self.engine.begin() as conn:
            op = await self._locked(conn, op_id, Action.RETRY)
            await conn.execute(
                ops_t.update()
                .where(ops_t.c.operation_id == op_id, ops_t.c.status == S.FAILED_RETRYABLE.value)
                .values(next_attempt_at=sa.func.now(), updated_at=sa.func.now())
            )
            await self._record(conn, op, Action.RETRY, actor=actor, why=why)
            await self.enqueue(conn, op_id)
        return ActionDone("The next attempt is queued now.", op.status.value)

    async def record_outcome(
        self,
        op_id: uuid.UUID,
        outcome: ManualOutcome,
        *,
        actor: str,
        why: str,
        reference: str | None = None,
    ) -> ActionDone:
        why = clean_why(why)
        ref = " ".join((reference or "").split())[:MAX_REFERENCE] or None
        async with self.engine.begin() as conn:
            op = await self._locked(conn, op_id, Action.RECORD_OUTCOME)
            data = {"action": Action.RECORD_OUTCOME.value, "why": why, "outcome": outcome.value}
            if outcome is ManualOutcome.COMMITTED:
                done = await ledger.transition(
                    conn,
                    op_id,
                    op.status,
                    S.COMMITTED,
                    actor=actor,
                    reason=f"checked by hand at the system of record: {why}",
                    data={**data, "reference": ref},
                    provider_ref=ref or op.provider_ref,
                    result={**(op.result or {}), "checked_by_hand": True},
                    error=None,
                )
                if done is not None and done.cancel_requested and self.enqueue is not None:
                    await compensate(
                        conn,
                        self.registry,
                        done,
                        enqueue=self.enqueue,
                        actor=actor,
                        reason="cancel requested; staff found it committed",
                    )
            else:
                done = await ledger.transition(
                    conn,
                    op_id,
                    op.status,
                    S.FAILED_FINAL,
                    actor=actor,
                    reason=f"checked by hand at the system of record: {why}",
                    data=data,
                    # What the caller may be told; the staff's own words stay in the trail.
                    error="it did not go through (checked by our staff)",
                )
            assert done is not None  # the row is locked in the status just checked
            await notify_trail(conn, done)
        return ActionDone(f"Recorded as {done.status.value}.", done.status.value)

    async def compensate(self, op_id: uuid.UUID, *, actor: str, why: str) -> ActionDone:
        why = clean_why(why)
        if self.enqueue is None:
            raise ActionRefused("this process cannot enqueue work")
        async with self.engine.begin() as conn:
            op = await self._locked(conn, op_id, Action.COMPENSATE)
            await self._record(conn, op, Action.COMPENSATE, actor=actor, why=why)
            new = await compensate(
                conn,
                self.registry,
                op,
                enqueue=self.enqueue,
                actor=actor,
                reason=f"started by staff: {why}",
            )
        if new is None:
            raise ActionRefused("nothing can compensate it automatically")
        return ActionDone(
            f"Compensation {new.tool} admitted.", op.status.value, str(new.operation_id)
        )

    async def resend_sms(self, op_id: uuid.UUID, *, actor: str, why: str) -> ActionDone:
        why = clean_why(why)
        async with self.engine.begin() as conn:
            op = await self._locked(conn, op_id, Action.RESEND_SMS)
            await self._record(conn, op, Action.RESEND_SMS, actor=actor, why=why)
        try:
            result = await self.sms.resend(op_id, actor=actor, reason=why)
        except SmsResendRefused as exc:
            raise ActionRefused(str(exc)) from exc
        return ActionDone(f"SMS {result.delivery_id} is {result.state}.", op.status.value)


async def notify_trail(conn: AsyncConnection, op: OperationRecord) -> None:
    """Wake whoever watches this operation or its call (a note is not a status change)."""
    payload = ledger.canonical_json({"operation_id": str(op.operation_id), "call_id": op.call_id})
    await conn.execute(
        sa.select(sa.func.pg_notify(TRAIL_CHANNEL, sa.bindparam("p", payload, sa.Text)))
    )
