"""Reconciliation and the sweeper, step by step (no worker runs the queued jobs here)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.sor_support import (
    BOOKING_ARGS,
    admit,
    count_jobs,
    events_of,
    exec_registry,
    get_op,
    start_sor,
    transitions,
)
from tools import ledger
from tools.executor import Executor, make_app
from tools.restaurant.client import SorClient
from tools.restaurant.protocol import BookingRequest
from tools.restaurant.provider import SorProvider
from tools.restaurant.sor import Faults, SystemOfRecord
from tools.states import OperationStatus as S
from tools.sweeper import Sweeper

LONG_AGO = timedelta(minutes=5)


@pytest.fixture
async def sor(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    server = await start_sor(clean_db)
    yield server
    await server.stop()


@pytest.fixture
async def sor_client(sor: SystemOfRecord) -> AsyncIterator[SorClient]:
    async with SorClient(sor.url, timeout_s=1.0) as client:
        yield client


@pytest.fixture
def executor(engine: AsyncEngine, clean_db: str, sor_client: SorClient) -> Executor:
    return Executor(
        app=make_app(clean_db),
        engine=engine,
        registry=exec_registry(),
        provider=SorProvider(sor_client),
        worker_id="test",
    )


@pytest.fixture
def sweeper(engine: AsyncEngine, executor: Executor) -> Sweeper:
    return Sweeper(engine=engine, reconciler=executor.reconciler)


async def _running(
    engine: AsyncEngine, executor: Executor, *, tool: str = "book_table", started_ago: timedelta
) -> ledger.OperationRecord:
    """An operation a worker claimed `started_ago` (its attempt deadline set from then)."""
    op_id = await admit(engine, executor.enqueue, tool=tool)
    async with engine.begin() as conn:
        op = await ledger.claim_for_execution(
            conn,
            op_id,
            worker_id="gone",
            attempt_deadline_s=2.0,
            now=datetime.now(UTC) - started_ago,
        )
    assert op is not None and op.status is S.RUNNING
    return op


async def _unknown(
    engine: AsyncEngine, executor: Executor, *, tool: str = "book_table", started_ago: timedelta
) -> ledger.OperationRecord:
    op = await _running(engine, executor, tool=tool, started_ago=started_ago)
    async with engine.begin() as conn:
        moved = await ledger.transition(
            conn, op.operation_id, S.RUNNING, S.UNKNOWN, actor="test", reason="answer lost"
        )
    assert moved is not None
    return moved


async def _apply_at_sor(client: SorClient, op: ledger.OperationRecord) -> str:
    """What a lost request did: the SOR applied it under the operation's key."""
    result = await client.book_table(op.idempotency_key, BookingRequest(**BOOKING_ARGS))
    assert result.reference is not None
    return result.reference


async def test_unknown_applied_at_the_provider_reconciles_to_committed(
    engine: AsyncEngine, executor: Executor, sor: SystemOfRecord, sor_client: SorClient
) -> None:
    op = await _unknown(engine, executor, started_ago=LONG_AGO)
    ref = await _apply_at_sor(sor_client, op)
    after = await executor.reconciler.reconcile(op.operation_id)
    assert after is not None and after.status is S.COMMITTED
    assert after.provider_ref == ref
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_unknown_never_applied_and_idempotent_is_retried_by_a_new_job(
    engine: AsyncEngine, executor: Executor, clean_db: str
) -> None:
    op = await _unknown(engine, executor, started_ago=LONG_AGO)
    jobs_before = await count_jobs(clean_db)
    after = await executor.reconciler.reconcile(op.operation_id)
    assert after is not None and after.status is S.FAILED_RETRYABLE
    assert after.next_attempt_at is not None
    assert await count_jobs(clean_db) == jobs_before + 1


async def test_never_applied_is_not_trusted_before_the_attempt_deadline(
    engine: AsyncEngine, executor: Executor
) -> None:
    # The request may still be on its way to the provider: "not found" proves nothing yet.
    op = await _unknown(engine, executor, started_ago=timedelta(seconds=0))
    after = await executor.reconciler.reconcile(op.operation_id)
    assert after is not None and after.status is S.UNKNOWN
    assert after.next_attempt_at is not None and op.deadline is not None
    assert after.next_attempt_at >= op.deadline


async def test_unknown_never_applied_and_not_idempotent_fails_without_resending(
    engine: AsyncEngine, executor: Executor, clean_db: str, sor: SystemOfRecord
) -> None:
    op = await _unknown(engine, executor, tool="book_table_once", started_ago=LONG_AGO)
    jobs_before = await count_jobs(clean_db)
    after = await executor.reconciler.reconcile(op.operation_id)
    assert after is not None and after.status is S.FAILED_FINAL
    assert await count_jobs(clean_db) == jobs_before  # nothing re-sent
    assert (await sor.side_effects()).bookings_inserted == 0


async def test_unknown_still_in_progress_at_the_provider_stays_unknown(
    engine: AsyncEngine, executor: Executor, sor: SystemOfRecord
) -> None:
    op = await _unknown(engine, executor, started_ago=LONG_AGO)
    sor.set_faults(Faults(hang=1))
    async with SorClient(sor.url, timeout_s=0.2) as impatient:
        await impatient.book_table(op.idempotency_key, BookingRequest(**BOOKING_ARGS))
    after = await executor.reconciler.reconcile(op.operation_id)
    assert after is not None and after.status is S.UNKNOWN
    assert after.next_attempt_at is not None


async def test_unknown_never_applied_with_a_cancel_request_is_cancelled(
    engine: AsyncEngine, executor: Executor
) -> None:
    op = await _unknown(engine, executor, started_ago=LONG_AGO)
    async with engine.begin() as conn:
        marked = await ledger.request_cancel(
            conn, op.operation_id, actor="caller", reason="changed mind"
        )
    assert marked.status is S.UNKNOWN  # not ours to decide yet
    after = await executor.reconciler.reconcile(op.operation_id)
    assert after is not None and after.status is S.CANCELLED


async def test_unknown_refused_by_the_provider_fails_final(
    engine: AsyncEngine, executor: Executor, sor_client: SorClient
) -> None:
    op = await _unknown(engine, executor, started_ago=LONG_AGO)
    refused = await sor_client.book_table(
        op.idempotency_key, BookingRequest(**{**BOOKING_ARGS, "party_size": 41})
    )
    assert refused.error == "no_availability"
    after = await executor.reconciler.reconcile(op.operation_id)
    assert after is not None and after.status is S.FAILED_FINAL


async def test_sweeper_moves_running_past_deadline_to_unknown_and_reconciles(
    engine: AsyncEngine,
    executor: Executor,
    sweeper: Sweeper,
    sor: SystemOfRecord,
    sor_client: SorClient,
) -> None:
    op = await _running(engine, executor, started_ago=LONG_AGO)
    fresh = await _running(engine, executor, started_ago=timedelta(0))
    await _apply_at_sor(sor_client, op)
    report = await sweeper.sweep_once()
    assert report.timed_out == [op.operation_id]
    assert report.reconciled[op.operation_id] == "committed"
    assert transitions(await events_of(engine, op.operation_id))[-2:] == [
        ("running", "unknown"),
        ("unknown", "committed"),
    ]
    assert (await get_op(engine, fresh.operation_id)).status is S.RUNNING  # still in time
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_sweeper_cancels_expired_confirmations(engine: AsyncEngine, sweeper: Sweeper) -> None:
    async with engine.begin() as conn:
        admission = await ledger.admit_operation(
            conn,
            tenant_id="t",
            tool="book_table",
            args=BOOKING_ARGS,
            idempotency_key=f"k-{uuid.uuid4().hex}",
            status=S.AWAITING_CONFIRMATION,
            confirm_by=datetime.now(UTC) - timedelta(seconds=1),
        )
    report = await sweeper.sweep_once()
    assert report.expired == [admission.operation.operation_id]
    assert (await get_op(engine, admission.operation.operation_id)).status is S.CANCELLED


async def test_reconcile_leaves_settled_operations_alone(
    engine: AsyncEngine, executor: Executor, sor_client: SorClient
) -> None:
    op = await _running(engine, executor, started_ago=LONG_AGO)
    after = await executor.reconciler.reconcile(op.operation_id)
    assert after is not None and after.status is S.RUNNING


async def test_sweeper_requeues_a_runnable_operation_whose_job_was_lost(
    engine: AsyncEngine, executor: Executor, clean_db: str
) -> None:
    async def lost(conn: object, operation_id: uuid.UUID) -> None:
        return None  # as if the job died with a worker before anyone claimed it

    op_id = await admit(engine, lost)
    queued = await admit(engine, executor.enqueue)  # has its job: not an orphan
    sweeper = Sweeper(engine=engine, reconciler=executor.reconciler, orphan_grace_s=0)
    later = datetime.now(UTC) + timedelta(seconds=1)
    report = await sweeper.sweep_once(now=later)
    assert report.requeued == [op_id]
    assert queued not in report.requeued
    assert await count_jobs(clean_db) == 2
    again = await sweeper.sweep_once(now=later)
    assert again.requeued == []  # it has a live job now
