"""Reconciliation: resolving `unknown` by asking the provider, never by blind replay.

An operation is `unknown` when a request was (or may have been) sent and no answer came.
The reconciler asks the provider what happened to the operation's idempotency key:

- applied -> `committed` (with the provider's result);
- rejected for good -> `failed_final`;
- still in progress -> stays `unknown`, asked again later;
- never seen -> proved not applied: `cancelled` if a cancel was requested, else
  `failed_retryable` (re-enqueued) when the provider is idempotent and the retry budget
  allows, else `failed_final`. "Never seen" only counts once the attempt's deadline has
  passed, so a request still travelling to the provider cannot land afterwards unnoticed.

A tool whose provider offers no lookup (`on_unknown: ask_staff`) is never asked and never
resent: the operation waits for a person (`tools.staff`).
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tools import ledger, measures
from tools.compensation import compensate
from tools.errors import IdempotencyConflict, OperationNotFound, ToolError
from tools.ledger import OperationRecord
from tools.ledger_models import operations_table as ops_t
from tools.provider import Provider
from tools.registry import OnUnknown, Registry, ToolSpec
from tools.staff import ask_staff
from tools.states import OperationStatus

S = OperationStatus
log = logging.getLogger(__name__)

EnqueueAt = Callable[[AsyncConnection, uuid.UUID, datetime | None], Awaitable[None]]


def _now() -> datetime:
    return datetime.now(UTC)


def total_deadline(op: OperationRecord, spec: ToolSpec) -> datetime:
    """No attempt starts after this: the admission's `expires_at`, else the retry budget."""
    if op.expires_at is not None:
        return op.expires_at
    return op.created_at + timedelta(seconds=spec.retry.total_deadline_s)


@dataclass(frozen=True, slots=True)
class RetryPlan:
    """Either when to try again, or why not."""

    at: datetime | None
    why_not: str | None


def plan_retry(
    op: OperationRecord, spec: ToolSpec, now: datetime, rng: random.Random | None = None
) -> RetryPlan:
    """Retry only idempotent operations, within attempts and the total deadline."""
    if not spec.provider_idempotent:
        return RetryPlan(None, "the provider does not honour idempotency keys: no automatic retry")
    if not spec.may_retry(op.attempts):
        return RetryPlan(None, f"gave up after {op.attempts} attempts")
    at = now + timedelta(seconds=spec.retry.backoff_s(op.attempts, rng))
    if at >= total_deadline(op, spec):
        return RetryPlan(None, "the total deadline leaves no time for another attempt")
    return RetryPlan(at, None)


async def schedule_recheck(conn: AsyncConnection, operation_id: uuid.UUID, at: datetime) -> None:
    """When the sweeper should ask about an `unknown` operation again (no status change)."""
    await conn.execute(
        ops_t.update()
        .where(ops_t.c.operation_id == operation_id, ops_t.c.status == S.UNKNOWN.value)
        .values(next_attempt_at=at, updated_at=sa.func.now())
    )


class Reconciler:
    """Resolves `unknown` operations by key lookup at the provider."""

    def __init__(
        self,
        *,
        engine: AsyncEngine,
        registry: Registry,
        provider: Provider,
        enqueue: EnqueueAt,
        actor: str = "reconciler",
        recheck_s: float = 2.0,
        staff_recheck_s: float = 3600.0,
        rng: random.Random | None = None,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.provider = provider
        self.enqueue = enqueue
        self.actor = actor
        self.recheck_s = recheck_s
        # An operation waiting for staff is looked at again this rarely (nothing to ask).
        self.staff_recheck_s = staff_recheck_s
        self.rng = rng or random.Random()

    async def _enqueue_now(self, conn: AsyncConnection, operation_id: uuid.UUID) -> None:
        await self.enqueue(conn, operation_id, None)

    async def reconcile(
        self, operation_id: uuid.UUID, *, now: datetime | None = None
    ) -> OperationRecord | None:
        """Ask the provider about one `unknown` operation and apply the answer."""
        async with self.engine.connect() as conn:
            op = await ledger.get_operation(conn, operation_id)
        if op is None or op.status is not S.UNKNOWN:
            return op
        spec = self.registry.get(op.tool)
        if spec.on_unknown is OnUnknown.ASK_STAFF:
            return await self._ask_staff(operation_id)
        try:
            finding = await self.provider.lookup(op, spec)
        except ToolError as exc:
            measures.RECONCILIATION_FAILURES.inc()
            log.warning("cannot reconcile %s yet: %s", operation_id, exc)
            async with self.engine.begin() as conn:
                await schedule_recheck(
                    conn, operation_id, _now() + timedelta(seconds=self.recheck_s)
                )
            return op
        now = now or _now()
        async with self.engine.begin() as conn:
            cur = await ledger.get_operation(conn, operation_id, for_update=True)
            if cur is None or cur.status is not S.UNKNOWN:
                return cur  # a callback or another reconciler got there first
            data = {"finding": finding.state, "attempt": cur.attempts}
            if finding.state == "applied":
                done = await ledger.transition(
                    conn,
                    operation_id,
                    S.UNKNOWN,
                    S.COMMITTED,
                    actor=self.actor,
                    reason="the provider has it applied (lookup by idempotency key)",
                    data=data,
                    result=finding.result,
                    provider_ref=finding.reference,
                    error=None,
                )
                if done is not None and done.cancel_requested:
                    await compensate(
                        conn,
                        self.registry,
                        done,
                        enqueue=self._enqueue_now,
                        actor=self.actor,
                        reason="cancel requested; the provider had applied it",
                    )
                return done
            if finding.state == "rejected":
                return await ledger.transition(
                    conn,
                    operation_id,
                    S.UNKNOWN,
                    S.FAILED_FINAL,
                    actor=self.actor,
                    reason="the provider refused it (lookup by idempotency key)",
                    data=data,
                    error=finding.error,
                )
            in_flight = finding.state == "in_progress" or (
                cur.deadline is not None and now < cur.deadline
            )
            if in_flight:
                # Not settled at the provider yet (or a request may still be on its way).
                at = now + timedelta(seconds=self.recheck_s)
                if finding.state == "not_found" and cur.deadline is not None:
                    at = max(cur.deadline, now)
                await schedule_recheck(conn, operation_id, at)
                return await ledger.get_operation(conn, operation_id)
            # Proved never applied.
            if cur.cancel_requested:
                return await ledger.transition(
                    conn,
                    operation_id,
                    S.UNKNOWN,
                    S.CANCELLED,
                    actor=self.actor,
                    reason="the provider never applied it; the cancel request stands",
                    data=data,
                )
            plan = plan_retry(cur, spec, now, self.rng)
            if plan.at is None:
                return await ledger.transition(
                    conn,
                    operation_id,
                    S.UNKNOWN,
                    S.FAILED_FINAL,
                    actor=self.actor,
                    reason=f"the provider never applied it; {plan.why_not}",
                    data=data,
                    error=cur.error or "not applied at the provider",
                )
            moved = await ledger.transition(
                conn,
                operation_id,
                S.UNKNOWN,
                S.FAILED_RETRYABLE,
                actor=self.actor,
                reason=f"the provider never applied it; retry at {plan.at.isoformat()}",
                data={**data, "retry_at": plan.at.isoformat()},
                next_attempt_at=plan.at,
            )
            if moved is not None:
                await self.enqueue(conn, operation_id, plan.at)
            return moved

    async def _ask_staff(self, operation_id: uuid.UUID) -> OperationRecord | None:
        """No lookup exists: record that a person must settle it, and ask nothing."""
        async with self.engine.begin() as conn:
            cur = await ledger.get_operation(conn, operation_id, for_update=True)
            if cur is None or cur.status is not S.UNKNOWN:
                return cur
            if await ask_staff(conn, cur, actor=self.actor):
                log.warning("operation %s (%s) waits for staff", operation_id, cur.tool)
            await schedule_recheck(
                conn, operation_id, _now() + timedelta(seconds=self.staff_recheck_s)
            )
            return await ledger.get_operation(conn, operation_id)


@dataclass(frozen=True, slots=True)
class Compensation:
    """What undoing a committed operation needs: the catalog and a transactional enqueue."""

    registry: Registry
    enqueue: ledger.Enqueue


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    """What a provider's report did to the operation."""

    applied: bool
    status: OperationStatus
    reason: str


async def apply_report(
    engine: AsyncEngine,
    operation_id: uuid.UUID,
    *,
    idempotency_key: str,
    status: str,
    result: dict[str, Any] | None = None,
    reference: str | None = None,
    error: str | None = None,
    actor: str = "provider-callback",
    compensation: Compensation | None = None,
) -> ReportOutcome:
    """Apply a provider's own report (e.g. an async completion callback) to an operation.

    Idempotent and order-safe: only `running`/`unknown` operations move (to `committed` or
    `failed_final`); a duplicate or stale report about a settled operation changes nothing.
    A commit of an operation whose cancel was requested is compensated in the same
    transaction when `compensation` is given, as the worker and reconciler do.
    Raises `OperationNotFound`, or `IdempotencyConflict` for a report about another key.
    """
    async with engine.begin() as conn:
        op = await ledger.get_operation(conn, operation_id, for_update=True)
        if op is None:
            raise OperationNotFound(f"no operation {operation_id}")
        if op.idempotency_key != idempotency_key:
            raise IdempotencyConflict("the report names another idempotency key")
        if status == "pending":
            return ReportOutcome(False, op.status, "pending reports change nothing")
        if op.status not in (S.RUNNING, S.UNKNOWN):
            return ReportOutcome(False, op.status, f"already {op.status.value}; report ignored")
        data = {"report": status}
        if status == "committed":
            moved = await ledger.transition(
                conn,
                operation_id,
                (S.RUNNING, S.UNKNOWN),
                S.COMMITTED,
                actor=actor,
                reason="the provider reported it committed",
                data=data,
                result=result,
                provider_ref=reference,
                error=None,
            )
            if moved is not None and moved.cancel_requested and compensation is not None:
                await compensate(
                    conn,
                    compensation.registry,
                    moved,
                    enqueue=compensation.enqueue,
                    actor=actor,
                    reason="cancel requested; the provider reported it committed",
                )
        else:
            moved = await ledger.transition(
                conn,
                operation_id,
                (S.RUNNING, S.UNKNOWN),
                S.FAILED_FINAL,
                actor=actor,
                reason="the provider reported it failed",
                data=data,
                error=error or "failed at the provider",
            )
        assert moved is not None  # the row is locked and was running/unknown
        return ReportOutcome(True, moved.status, "applied")
