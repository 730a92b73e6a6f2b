"""The sweeper: nothing stays stranded, whatever died or hung.

Each sweep:
1. jobs of dead workers (Procrastinate's stalled jobs: no heartbeat) are closed, and their
   operations, if still `running`, go to `unknown` at once;
2. `running` operations past their attempt deadline go to `unknown` (a dead worker is not
   the only way to hang);
3. `unknown` operations due for a check are reconciled with the provider;
4. runnable operations (`admitted`, `failed_retryable` and due) with no live job, which
   only a job lost with a dead worker leaves behind, are enqueued again;
5. confirmations whose window passed are cancelled;
6. jobs waiting on a queue only some processes take (`QueueWait`: SIP placings, which need
   a SIP listener) that nobody took long after they were due: the operation fails with the
   wait's reason (nobody claimed it, so nothing was sent) instead of hanging in `admitted`.

Several sweepers may run at once (one per worker): every move is a conditional transition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import procrastinate
import sqlalchemy as sa
from procrastinate.jobs import Status as JobStatus
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tools import ledger, measures
from tools.ledger import OperationRecord
from tools.ledger_models import operations_table as ops_t
from tools.outage import DATABASE
from tools.reconcile import Reconciler
from tools.states import OperationStatus

S = OperationStatus
log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    """What one sweep did."""

    timed_out: list[uuid.UUID] = field(default_factory=list)
    reconciled: dict[uuid.UUID, str] = field(default_factory=dict)  # id -> status after
    expired: list[uuid.UUID] = field(default_factory=list)
    requeued: list[uuid.UUID] = field(default_factory=list)
    stalled_jobs: int = 0
    untaken: list[uuid.UUID] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class QueueWait:
    """A queue only some processes take: its job due `wait_s` ago and still not taken fails
    its operation with `reason`; `on_failed` runs in the same transaction (the call's row)."""

    wait_s: float
    reason: str
    on_failed: Callable[[AsyncConnection, OperationRecord], Awaitable[None]] | None = None


def _now() -> datetime:
    return datetime.now(UTC)


class Sweeper:
    """Periodic recovery of running, unknown and expired operations."""

    def __init__(
        self,
        *,
        engine: AsyncEngine,
        reconciler: Reconciler,
        app: procrastinate.App | None = None,
        task_name: str | None = None,
        interval_s: float = 5.0,
        stalled_after_s: float = 30.0,
        orphan_grace_s: float = 60.0,
        batch: int = 100,
        actor: str = "sweeper",
        queue_waits: Mapping[str, QueueWait] | None = None,
    ) -> None:
        self.engine = engine
        self.reconciler = reconciler
        self.app = app
        self.task_name = task_name
        self.interval_s = interval_s
        self.stalled_after_s = stalled_after_s
        self.orphan_grace_s = orphan_grace_s
        self.batch = batch
        self.actor = actor
        self.queue_waits = dict(queue_waits or {})

    async def sweep_once(self, now: datetime | None = None) -> SweepReport:
        report = SweepReport()
        now = now or _now()
        if self.app is not None:
            await self._close_stalled_jobs(report)
        async with self.engine.begin() as conn:
            for op in await ledger.list_running_past_deadline(conn, now, self.batch):
                moved = await ledger.transition(
                    conn,
                    op.operation_id,
                    S.RUNNING,
                    S.UNKNOWN,
                    actor=self.actor,
                    reason="running past its deadline; outcome unknown until reconciled",
                    data={"deadline": op.deadline.isoformat() if op.deadline else None},
                )
                if moved is not None:
                    report.timed_out.append(op.operation_id)
        for op_id in await self._unknown_due(now):
            after = await self.reconciler.reconcile(op_id, now=now)
            if after is not None:
                report.reconciled[op_id] = after.status.value
        report.requeued = await self._requeue_orphans(now)
        for queue, wait in self.queue_waits.items():
            report.untaken += await self._fail_untaken(queue, wait, now)
        async with self.engine.begin() as conn:
            report.expired = await ledger.expire_confirmations(conn, now, actor=self.actor)
            measures.OPERATIONS_UNKNOWN.set(
                await conn.scalar(
                    sa.select(sa.func.count()).where(ops_t.c.status == S.UNKNOWN.value)
                )
                or 0
            )
        return report

    async def _requeue_orphans(self, now: datetime) -> list[uuid.UUID]:
        """Enqueue runnable operations that no queued or running job will pick up."""
        cutoff = now - timedelta(seconds=self.orphan_grace_s)
        requeued = []
        async with self.engine.begin() as conn:
            rows = await conn.execute(
                sa.text(
                    "SELECT o.operation_id FROM operations o "
                    "WHERE o.status IN ('admitted', 'failed_retryable') "
                    "AND coalesce(o.next_attempt_at, o.updated_at) < :cutoff "
                    "AND NOT EXISTS (SELECT 1 FROM procrastinate_jobs j "
                    "  WHERE j.status IN ('todo', 'doing') "
                    "  AND j.args->>'operation_id' = o.operation_id::text) "
                    "ORDER BY o.updated_at LIMIT :n FOR UPDATE OF o SKIP LOCKED"
                ),
                {"cutoff": cutoff, "n": self.batch},
            )
            for (op_id,) in rows.all():
                await self.reconciler.enqueue(conn, op_id, None)
                await ledger.record_event(
                    conn,
                    op_id,
                    kind="note",
                    actor=self.actor,
                    reason="no job would run it (lost with a worker); enqueued again",
                )
                requeued.append(op_id)
        return requeued

    async def _fail_untaken(self, queue: str, wait: QueueWait, now: datetime) -> list[uuid.UUID]:
        """Fail the runnable operations whose job on `queue` nobody took within `wait`."""
        cutoff = now - timedelta(seconds=wait.wait_s)
        failed = []
        async with self.engine.begin() as conn:
            rows = await conn.execute(
                sa.text(
                    "SELECT o.operation_id, j.id FROM procrastinate_jobs j "
                    "JOIN operations o ON o.operation_id::text = j.args->>'operation_id' "
                    "WHERE j.queue_name = :queue AND j.status = 'todo' "
                    "AND o.status IN ('admitted', 'failed_retryable') "
                    "AND coalesce(j.scheduled_at, (SELECT max(e.at) FROM procrastinate_events e "
                    "  WHERE e.job_id = j.id AND e.type = 'deferred')) < :cutoff "
                    "ORDER BY j.id LIMIT :n FOR UPDATE OF o SKIP LOCKED"
                ),
                {"queue": queue, "cutoff": cutoff, "n": self.batch},
            )
            for op_id, job_id in rows.all():
                # Conditional: a worker claiming it now either ran first (we move nothing)
                # or finds it failed and sends nothing.
                moved = await ledger.transition(
                    conn,
                    op_id,
                    (S.ADMITTED, S.FAILED_RETRYABLE),
                    S.FAILED_FINAL,
                    actor=self.actor,
                    reason=wait.reason,
                    data={"queue": queue, "job_id": job_id},
                    error=wait.reason,
                )
                if moved is None:
                    continue
                await conn.execute(
                    sa.text(
                        "UPDATE procrastinate_jobs SET status = 'cancelled' "
                        "WHERE id = :id AND status = 'todo'"
                    ),
                    {"id": job_id},
                )
                if wait.on_failed is not None:
                    await wait.on_failed(conn, moved)
                failed.append(op_id)
        if failed:
            log.warning("sweep: %d operations on %s failed: %s", len(failed), queue, wait.reason)
        return failed

    async def _unknown_due(self, now: datetime) -> list[uuid.UUID]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                sa.select(ops_t.c.operation_id)
                .where(
                    ops_t.c.status == S.UNKNOWN.value,
                    sa.or_(ops_t.c.next_attempt_at.is_(None), ops_t.c.next_attempt_at <= now),
                )
                .order_by(ops_t.c.updated_at)
                .limit(self.batch)
            )
            return [r.operation_id for r in rows]

    async def _close_stalled_jobs(self, report: SweepReport) -> None:
        """Jobs whose worker stopped heartbeating will never finish: close them, and move
        their running operations to `unknown` without waiting for the attempt deadline."""
        assert self.app is not None
        manager = self.app.job_manager
        jobs = await manager.get_stalled_jobs(
            task_name=self.task_name, seconds_since_heartbeat=self.stalled_after_s
        )
        for job in jobs:
            assert job.id is not None
            await manager.finish_job_by_id_async(
                job_id=job.id, status=JobStatus.FAILED, delete_job=False
            )
            report.stalled_jobs += 1
            raw_id = job.task_kwargs.get("operation_id")
            if not isinstance(raw_id, str):
                continue
            async with self.engine.begin() as conn:
                moved = await ledger.transition(
                    conn,
                    uuid.UUID(raw_id),
                    S.RUNNING,
                    S.UNKNOWN,
                    actor=self.actor,
                    reason="its worker stopped (stalled job); outcome unknown until reconciled",
                    data={"job_id": job.id},
                )
            if moved is not None:
                report.timed_out.append(moved.operation_id)

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every `interval_s` until `stop` is set; a failed sweep is logged, not fatal."""
        while not stop.is_set():
            try:
                report = await self.sweep_once()
                if report.timed_out or report.reconciled or report.expired:
                    log.info(
                        "sweep: %d timed out, %d reconciled, %d confirmations expired",
                        len(report.timed_out),
                        len(report.reconciled),
                        len(report.expired),
                    )
            except Exception as exc:
                if not DATABASE.failed("operation sweep", exc):
                    log.exception("sweep failed; trying again next interval")
            else:
                DATABASE.ok()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await stop.wait()
