"""Executing admitted operations: the Procrastinate task, transactional enqueue, attempts.

Admission inserts the operation and defers its job on the same connection (`enqueue`), so
both commit or neither does. A worker then:

1. claims the operation with a conditional update (admitted|failed_retryable -> running,
   attempts + 1, attempt deadline set), so of two workers exactly one proceeds;
2. calls the provider once, with the operation's idempotency key and a timeout;
3. records the outcome. `failed_retryable` is retried (re-deferred with a backoff and
   jitter) only when the provider honours idempotency keys and the total deadline allows;
   a timeout or lost answer after sending is `unknown` and goes to reconciliation, never
   to a blind replay.

A worker that dies between 2 and 3 leaves the operation `running`; the sweeper moves it to
`unknown` once its attempt deadline passes and reconciles it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import procrastinate
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tools import faults, ledger, log_context, measures, tracing
from tools.autocommit import autocommit
from tools.compensation import compensate
from tools.errors import ToolError
from tools.ledger import OperationRecord
from tools.outage import DATABASE, DatabaseHealth
from tools.pg_url import plain_url
from tools.provider import ActionResult, Outcome, Provider
from tools.queue_connector import OutageTolerantConnector
from tools.reconcile import Reconciler, plan_retry
from tools.registry import Registry, ToolSpec
from tools.states import OperationStatus

S = OperationStatus
log = logging.getLogger(__name__)

TASK_NAME = "execute_operation"
QUEUE = "operations"
# Placing a call over our own SIP leg needs the SIP listener of the process that runs the job:
# only a worker beside one (`serve` with SIP_BIND) takes this queue.
SIP_QUEUE = "operations-sip"
# Which operations go on SIP_QUEUE, read from the operation's row (app/ops/outbound.py writes
# `via` into a place_call's args; a `sip:` target is SIP whatever the row says).
_QUEUE_OF = sa.text(
    "SELECT CASE WHEN tool = 'place_call' AND (args->>'via' = 'sip' OR args->>'to' ILIKE 'sip:%') "
    f"THEN '{SIP_QUEUE}' ELSE '{QUEUE}' END FROM operations WHERE operation_id = :id"
)
# A provider's answer that cannot be recorded (the database is away) is tried again, first
# after this long, doubling up to the most, for so long; after that the sweeper's deadline and
# the reconciler take over (they ask the provider by the idempotency key).
RECORD_RETRY_FIRST_S = 0.1
RECORD_RETRY_MAX_S = 0.5
RECORD_RETRY_FOR_S = 600.0


def make_app(database_url: str, *, max_pool_size: int = 10) -> procrastinate.App:
    """A Procrastinate app on `database_url` (open it with `await app.open_async()`)."""
    connector = OutageTolerantConnector(
        conninfo=plain_url(database_url), min_size=1, max_size=max_pool_size
    )
    return procrastinate.App(connector=connector)


async def enqueue_operation(
    app: procrastinate.App,
    conn: AsyncConnection,
    operation_id: uuid.UUID,
    *,
    schedule_at: datetime | None = None,
    queue: str | None = None,
) -> int:
    """Defer the operation's job on `conn`'s own psycopg connection, inside its transaction.

    The job row commits or rolls back with whatever else `conn` does (the admission).
    The app need not be open: the INSERT runs on `conn`, not on the app's pool. `queue`:
    None reads it from the operation's row (`queue_of`); a caller that knows it admits only
    the catalog's tools passes QUEUE and saves that read.
    """
    if queue is None:
        queue = await queue_of(conn, operation_id)
    raw = await conn.get_raw_connection()
    pg = raw.driver_connection
    deferrer = app.configure_task(TASK_NAME, queue=queue, connection=pg, schedule_at=schedule_at)
    return await deferrer.defer_async(operation_id=str(operation_id))


async def queue_of(conn: AsyncConnection, operation_id: uuid.UUID) -> str:
    """The queue of the operation's jobs: SIP_QUEUE for a place_call over SIP, else QUEUE."""
    return str(await conn.scalar(_QUEUE_OF, {"id": operation_id}) or QUEUE)


def make_enqueue(app: procrastinate.App, queue: str | None = None) -> ledger.Enqueue:
    """The gateway's `enqueue(conn, operation_id)` hook for a process that only admits
    (the app need not be opened: deferral runs on the admitting connection); `queue` as
    `enqueue_operation` takes it."""

    async def enqueue(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
        await enqueue_operation(app, conn, operation_id, queue=queue)

    return enqueue


def _now() -> datetime:
    return datetime.now(UTC)


class Executor:
    """Runs operations for one worker process; register its task on a Procrastinate app."""

    def __init__(
        self,
        *,
        app: procrastinate.App,
        engine: AsyncEngine,
        registry: Registry,
        provider: Provider,
        worker_id: str | None = None,
        deadline_margin_s: float = 2.0,
        callback_base_url: str | None = None,
        rng: random.Random | None = None,
        health: DatabaseHealth = DATABASE,
    ) -> None:
        self.app = app
        self.health = health
        self.engine = engine
        self.registry = registry
        self.provider = provider
        self.worker_id = worker_id or f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}"
        # The sweeper's deadline = the provider timeout plus this margin, so a live worker
        # always records its outcome before the sweeper may call the attempt lost.
        self.deadline_margin_s = deadline_margin_s
        self.callback_base_url = callback_base_url.rstrip("/") if callback_base_url else None
        self.rng = rng or random.Random()
        self.reconciler = Reconciler(
            engine=engine, registry=registry, provider=provider, enqueue=self.enqueue_at
        )
        if TASK_NAME not in app.tasks:
            executor = self

            @app.task(name=TASK_NAME, queue=QUEUE)
            async def execute_operation(operation_id: str) -> None:
                await executor.execute(uuid.UUID(operation_id))

    async def enqueue(self, conn: AsyncConnection, operation_id: uuid.UUID) -> None:
        """The gateway's `Enqueue` hook: defer now, inside the admitting transaction."""
        await enqueue_operation(self.app, conn, operation_id)

    async def enqueue_at(
        self, conn: AsyncConnection, operation_id: uuid.UUID, at: datetime | None
    ) -> None:
        """Defer a (re)try to run no earlier than `at`, inside `conn`'s transaction."""
        await enqueue_operation(self.app, conn, operation_id, schedule_at=at)

    def callback_url(self, operation_id: uuid.UUID) -> str | None:
        if self.callback_base_url is None:
            return None
        return f"{self.callback_base_url}/operations/{operation_id}/callback"

    @property
    def actor(self) -> str:
        return f"worker:{self.worker_id}"

    async def execute(self, operation_id: uuid.UUID) -> OperationRecord | None:
        """One attempt of an operation; returns its record after the attempt (None: not ours)."""
        log_context.operation_id.set(str(operation_id))  # this job's task only
        async with self.engine.connect() as conn:
            op = await ledger.get_operation(conn, operation_id)
            events = await ledger.get_events(conn, operation_id) if op is not None else []
        if op is not None and op.call_id:
            log_context.call_id.set(op.call_id)
        # The call's trace goes on here, in whatever process runs the job (tools.tracing).
        parent = tracing.context_from(events[0].data if events else None)
        with tracing.tracer.start_as_current_span(
            f"operation {op.tool if op else 'unknown'}",
            context=parent,
            attributes={
                tracing.OPERATION_ID: str(operation_id),
                tracing.CALL_ID: (op.call_id if op else None) or "",
                tracing.IDEMPOTENCY_KEY: op.idempotency_key if op else "",
                tracing.AGENT: (op.agent if op else None) or "",
            },
        ) as span:
            after = await self._execute(operation_id, op)
            if after is not None:
                span.add_event(after.status.value, {"attempt": after.attempts})
            return after

    async def _execute(
        self, operation_id: uuid.UUID, op: OperationRecord | None
    ) -> OperationRecord | None:
        if op is None:
            log.warning("job for unknown operation %s", operation_id)
            return None
        spec = self.registry.get(op.tool)
        async with self.engine.begin() as conn:
            running = await ledger.claim_for_execution(
                conn,
                operation_id,
                worker_id=self.worker_id,
                attempt_deadline_s=spec.deadline_s + self.deadline_margin_s,
            )
        if running is None:
            # Another worker won, it is finished, or the claim cancelled/failed it.
            return None
        await faults.reach("executor.claimed", operation_id=operation_id, tool=op.tool)
        try:
            # The client's own timeouts are per read/write; this bounds the whole attempt,
            # well inside the sweeper's deadline (deadline_s + margin).
            async with asyncio.timeout(spec.deadline_s + self.deadline_margin_s / 2):
                result = await self.provider.perform(
                    running,
                    spec,
                    timeout_s=spec.deadline_s,
                    callback_url=self.callback_url(operation_id),
                )
        except TimeoutError:
            measures.TOOL_TIMEOUTS.labels(spec.kind.value).inc()
            result = ActionResult(Outcome.unknown, error="no answer within the deadline")
        except ToolError as exc:
            # The provider adapter could not even tell; treat as sent-and-lost.
            result = ActionResult(Outcome.unknown, error=f"provider error: {exc}")
        await faults.reach(
            "executor.answered",
            operation_id=operation_id,
            tool=op.tool,
            outcome=result.outcome,
            reference=result.reference,
            result=result.result,
        )
        return await self._record_until_stored(running, spec, result)

    async def _record_until_stored(
        self, running: OperationRecord, spec: ToolSpec, result: ActionResult
    ) -> OperationRecord | None:
        """Record the provider's answer, trying again while the database does not answer:
        the answer is in hand only here, and the operation must move on within a moment of
        the database's return, not wait in `running` for a sweep and a reconciliation."""
        delay = RECORD_RETRY_FIRST_S
        give_up = time.monotonic() + RECORD_RETRY_FOR_S
        while True:
            try:
                recorded = await self.record(running, spec, result)
            except Exception as exc:
                if time.monotonic() > give_up or not self.health.failed(
                    "recording an operation's outcome", exc
                ):
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECORD_RETRY_MAX_S)
                continue
            self.health.ok()
            return recorded

    async def record(
        self, running: OperationRecord, spec: ToolSpec, result: ActionResult
    ) -> OperationRecord | None:
        """Apply one attempt's outcome to the ledger (conditional on it still being ours)."""
        op_id = running.operation_id
        data: dict[str, Any] = {"attempt": running.attempts}

        async def commit(conn: AsyncConnection, *, alone: bool) -> OperationRecord | None:
            # The transition itself checks that the operation is still on this attempt.
            return await ledger.transition(
                conn,
                op_id,
                (S.RUNNING, S.UNKNOWN),
                S.COMMITTED,
                actor=self.actor,
                reason="the provider confirmed it",
                data=data,
                attempt=running.attempts,
                alone=alone,
                result=result.result,
                provider_ref=result.reference,
                error=None,
            )

        if result.outcome is Outcome.committed:
            # The usual answer is one statement, atomic on its own: no BEGIN, no COMMIT. A
            # lost race, a cancel requested or a compensation takes the transaction below.
            async with autocommit(self.engine) as conn:
                done = await commit(conn, alone=True)
            if done is not None:
                return done
        async with self.engine.begin() as conn:
            if result.outcome is Outcome.committed:
                done = await commit(conn, alone=False)
                if done is None:
                    return await self._ignored(conn, running, result)
                if done.cancel_requested:
                    await self.compensate(conn, done, reason="cancel requested while running")
                return done
            current = await ledger.get_operation(conn, op_id, for_update=True)
            assert current is not None
            if current.attempts != running.attempts or current.status not in (
                S.RUNNING,
                S.UNKNOWN,
            ):
                return await self._ignored(conn, running, result, current)
            if result.outcome is Outcome.pending:
                await ledger.record_event(
                    conn,
                    op_id,
                    kind="note",
                    actor=self.actor,
                    reason="accepted by the provider; it will report the outcome",
                    data=data,
                )
                return current
            if result.outcome is Outcome.failed_final:
                # With a cancel requested, the provider not doing it (it may have withdrawn it
                # for that very cancel, racing this answer) is what was asked for.
                cancelled = current.cancel_requested
                return await ledger.transition(
                    conn,
                    op_id,
                    (S.RUNNING, S.UNKNOWN),
                    S.CANCELLED if cancelled else S.FAILED_FINAL,
                    actor=self.actor,
                    reason="cancel requested, and the provider did not do it"
                    if cancelled
                    else "the provider refused it",
                    data=data,
                    error=result.error,
                )
            if result.outcome is Outcome.failed_retryable:
                return await self.retry_or_fail(conn, current, spec, result.error, data)
            # unknown: sent, no answer. Only the provider can say what happened.
            if current.status is S.UNKNOWN:
                return current
            moved = await ledger.transition(
                conn,
                op_id,
                S.RUNNING,
                S.UNKNOWN,
                actor=self.actor,
                reason="sent, and the answer was lost",
                data=data,
                error=result.error,
            )
        if moved is None:
            return current
        # Often the answer was merely lost: ask the provider now, not after a sweep.
        return await self.reconciler.reconcile(op_id)

    async def _ignored(
        self,
        conn: AsyncConnection,
        running: OperationRecord,
        result: ActionResult,
        current: OperationRecord | None = None,
    ) -> OperationRecord:
        """A newer attempt or another actor settled it; our answer is history (noted).
        Returns the operation as it is (`current` when the caller read it, locked)."""
        op_id = running.operation_id
        await ledger.record_event(
            conn,
            op_id,
            kind="note",
            actor=self.actor,
            reason=f"late outcome of attempt {running.attempts} ignored",
            data={"outcome": result.outcome.value, "error": result.error},
        )
        if current is None:
            current = await ledger.get_operation(conn, op_id)
            assert current is not None
        return current

    async def retry_or_fail(
        self,
        conn: AsyncConnection,
        op: OperationRecord,
        spec: ToolSpec,
        error: str | None,
        data: dict[str, Any],
    ) -> OperationRecord | None:
        """Provably not applied: re-defer with backoff if allowed, else fail for good."""
        plan = plan_retry(op, spec, _now(), self.rng)
        why_not, next_at = plan.why_not, plan.at
        froms = (S.RUNNING, S.UNKNOWN) if op.status in (S.RUNNING, S.UNKNOWN) else op.status
        if why_not is not None:
            return await ledger.transition(
                conn,
                op.operation_id,
                froms,
                S.FAILED_FINAL,
                actor=self.actor,
                reason=why_not,
                data={**data, "last_error": error},
                error=error or why_not,
            )
        assert next_at is not None
        moved = await ledger.transition(
            conn,
            op.operation_id,
            froms,
            S.FAILED_RETRYABLE,
            actor=self.actor,
            reason=f"not applied; retry at {next_at.isoformat()}",
            data={**data, "retry_at": next_at.isoformat()},
            error=error,
            next_attempt_at=next_at,
        )
        if moved is not None:
            await self.enqueue_at(conn, op.operation_id, next_at)
        return moved

    async def compensate(
        self, conn: AsyncConnection, original: OperationRecord, *, reason: str
    ) -> OperationRecord | None:
        """Admit the compensating operation of a committed one, in this transaction."""
        return await compensate(
            conn, self.registry, original, enqueue=self.enqueue, actor=self.actor, reason=reason
        )
