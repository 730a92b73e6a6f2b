"""The executor on real Postgres, real Procrastinate and the real SOR over HTTP."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.ops.worker import OperationWorker, start_inprocess_worker
from app.settings import Settings
from tests.sor_support import (
    admit,
    count_jobs,
    events_of,
    exec_registry,
    get_op,
    start_sor,
    transitions,
    wait_for,
    wait_status,
)
from tools import ledger
from tools.compensation import compensate
from tools.executor import Executor, make_app, make_enqueue
from tools.registry import Registry
from tools.restaurant.client import SorClient
from tools.restaurant.provider import SorProvider
from tools.restaurant.sor import Faults, SystemOfRecord
from tools.states import OperationStatus as S

WorkerFactory = Callable[..., Awaitable[OperationWorker]]


@pytest.fixture
async def sor(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    server = await start_sor(clean_db)
    yield server
    await server.stop()


@pytest.fixture
async def sor_client(sor: SystemOfRecord) -> AsyncIterator[SorClient]:
    async with SorClient(sor.url) as client:
        yield client


@pytest.fixture
async def start_worker(
    clean_db: str, engine: AsyncEngine, sor_client: SorClient
) -> AsyncIterator[WorkerFactory]:
    """Start in-process workers (real Procrastinate workers); all stopped at teardown."""
    started: list[OperationWorker] = []

    async def factory(
        registry: Registry | None = None, concurrency: int = 2, sweep: bool = True
    ) -> OperationWorker:
        worker = OperationWorker(
            database_url=clean_db,
            engine=engine,
            registry=registry or exec_registry(),
            provider=SorProvider(sor_client),
            concurrency=concurrency,
            sweep_interval_s=0.2,
            deadline_margin_s=0.5,
            poll_interval_s=0.2,
            shutdown_grace_s=2.0,
            sweep=sweep,
        )
        await worker.start()
        started.append(worker)
        return worker

    yield factory
    for worker in started:
        await worker.stop()


def _executor(engine: AsyncEngine, database_url: str, client: SorClient, **kw: object) -> Executor:
    return Executor(
        app=make_app(database_url),
        engine=engine,
        registry=exec_registry(),
        provider=SorProvider(client),
        deadline_margin_s=0.5,
        **kw,  # type: ignore[arg-type]
    )


async def test_admitted_operation_runs_once_and_commits(
    engine: AsyncEngine, sor: SystemOfRecord, start_worker: WorkerFactory
) -> None:
    worker = await start_worker()
    op_id = await admit(engine, worker.executor.enqueue)
    op = await wait_status(engine, op_id, S.COMMITTED)
    assert op.attempts == 1
    assert op.provider_ref is not None and op.result is not None
    assert op.result["id"] == op.provider_ref
    assert transitions(await events_of(engine, op_id)) == [
        (None, "admitted"),
        ("admitted", "running"),
        ("running", "committed"),
    ]
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_rolled_back_admission_leaves_no_operation_and_no_job(
    engine: AsyncEngine, clean_db: str, sor_client: SorClient
) -> None:
    executor = _executor(engine, clean_db, sor_client)

    class Abort(Exception):
        pass

    with pytest.raises(Abort):
        async with engine.begin() as conn:
            await ledger.admit_operation(
                conn,
                tenant_id="t",
                tool="book_table",
                args={"date": "2026-12-05", "time": "21:00", "party_size": 2, "name": "Bo"},
                idempotency_key="rolled-back",
                enqueue=executor.enqueue,
            )
            assert await _jobs_visible_to(conn) == 1  # deferred on this very connection
            raise Abort
    assert await count_jobs(clean_db) == 0
    async with engine.connect() as conn:
        assert await ledger.find_by_idempotency_key(conn, "t", "rolled-back") is None
    # The same admission committed leaves exactly one job.
    await admit(engine, executor.enqueue, key="committed")
    assert await count_jobs(clean_db) == 1


async def _jobs_visible_to(conn: object) -> int:
    result = await conn.execute(  # type: ignore[attr-defined]
        sa.text("SELECT count(*) FROM procrastinate_jobs WHERE queue_name = 'operations'")
    )
    return int(result.scalar_one())


async def test_two_workers_racing_for_one_operation_one_wins(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, sor_client: SorClient
) -> None:
    first = _executor(engine, clean_db, sor_client, worker_id="w1")
    second = _executor(engine, clean_db, sor_client, worker_id="w2")
    op_id = await admit(engine, first.enqueue)
    sor.set_faults(Faults(latency_s=0.2))  # both are in flight at once
    results = await asyncio.gather(first.execute(op_id), second.execute(op_id))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1 and winners[0].status is S.COMMITTED
    op = await get_op(engine, op_id)
    assert op.status is S.COMMITTED and op.attempts == 1
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_duplicate_enqueue_makes_one_side_effect(
    engine: AsyncEngine, sor: SystemOfRecord, start_worker: WorkerFactory
) -> None:
    sor.set_faults(Faults(latency_s=0.1))
    worker = await start_worker(concurrency=3)
    op_id = await admit(engine, worker.executor.enqueue)
    for _ in range(2):
        async with engine.begin() as conn:
            await worker.executor.enqueue(conn, op_id)
    await wait_status(engine, op_id, S.COMMITTED)
    # Let the duplicate jobs run too: they must find nothing to do.
    await wait_for(lambda: _jobs_left(engine), lambda n: n == 0, what="duplicate jobs to finish")
    op = await get_op(engine, op_id)
    assert op.status is S.COMMITTED and op.attempts == 1
    assert (await sor.side_effects()).bookings_inserted == 1


async def _jobs_left(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        result = await conn.execute(
            sa.text(
                "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing') "
                "AND queue_name = 'operations'"
            )
        )
        return int(result.scalar_one())


async def test_fail_before_commit_is_retried_with_backoff_until_committed(
    engine: AsyncEngine, sor: SystemOfRecord, start_worker: WorkerFactory
) -> None:
    sor.set_faults(Faults(fail_before_commit=2))
    worker = await start_worker()
    op_id = await admit(engine, worker.executor.enqueue)
    op = await wait_status(engine, op_id, S.COMMITTED)
    assert op.attempts == 3
    events = await events_of(engine, op_id)
    retries = [e for e in events if e.to_status is S.FAILED_RETRYABLE]
    runs = [e for e in events if e.to_status is S.RUNNING]
    assert len(retries) == 2 and len(runs) == 3
    for failed_run, retry, next_run in zip(runs, retries, runs[1:], strict=False):
        # Each retry was scheduled for later than its failed attempt began, and did not run
        # before then (not at once). (Not against the failure's own row time: under load
        # the row can be written after a short backoff has passed.)
        retry_at = datetime.fromisoformat(retry.data["retry_at"])
        assert failed_run.at < retry_at <= next_run.at
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_non_idempotent_operation_is_never_retried_automatically(
    engine: AsyncEngine, sor: SystemOfRecord, start_worker: WorkerFactory
) -> None:
    sor.set_faults(Faults(fail_before_commit=1))
    worker = await start_worker()
    op_id = await admit(engine, worker.executor.enqueue, tool="book_table_once")
    op = await wait_status(engine, op_id, S.FAILED_FINAL, S.COMMITTED)
    assert op.status is S.FAILED_FINAL
    assert op.attempts == 1
    events = await events_of(engine, op_id)
    assert "no automatic retry" in (events[-1].reason or "")
    assert (await sor.side_effects()).bookings_inserted == 0


async def test_retry_stops_at_the_total_deadline(
    engine: AsyncEngine, sor: SystemOfRecord, start_worker: WorkerFactory
) -> None:
    sor.set_faults(Faults(fail_before_commit=1000))
    registry = exec_registry(
        max_attempts=50, base_backoff_s=0.1, max_backoff_s=0.1, total_deadline_s=1.0
    )
    worker = await start_worker(registry=registry)
    op_id = await admit(engine, worker.executor.enqueue)
    op = await wait_status(engine, op_id, S.FAILED_FINAL)
    assert 1 < op.attempts < 50
    events = await events_of(engine, op_id)
    assert "total deadline" in (events[-1].reason or "")
    assert (await sor.side_effects()).bookings_inserted == 0


async def test_timeout_after_sending_is_unknown_then_reconciled_committed(
    engine: AsyncEngine, sor: SystemOfRecord, start_worker: WorkerFactory
) -> None:
    sor.set_faults(Faults(lose_response=1))
    worker = await start_worker(registry=exec_registry(deadline_s=0.5))
    op_id = await admit(engine, worker.executor.enqueue)
    op = await wait_status(engine, op_id, S.COMMITTED)
    assert op.attempts == 1  # resolved by asking, not by sending again
    assert transitions(await events_of(engine, op_id)) == [
        (None, "admitted"),
        ("admitted", "running"),
        ("running", "unknown"),
        ("unknown", "committed"),
    ]
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_cancel_request_while_running_is_settled_by_the_provider(
    engine: AsyncEngine, sor: SystemOfRecord, start_worker: WorkerFactory
) -> None:
    sor.set_faults(Faults(hang=1))
    worker = await start_worker(registry=exec_registry(deadline_s=5.0))
    op_id = await admit(engine, worker.executor.enqueue)
    await wait_status(engine, op_id, S.RUNNING)
    async with engine.begin() as conn:
        marked = await ledger.request_cancel(conn, op_id, actor="caller", reason="changed mind")
    # Sent already: only the provider can say whether it happened.
    assert marked.status is S.RUNNING and marked.cancel_requested
    sor.release()
    op = await wait_status(engine, op_id, S.COMMITTED, S.CANCELLED)
    assert op.status is S.COMMITTED  # the provider booked it: that is the truth
    # ...so the cancel becomes a compensating operation, linked to the original.
    comp_id = await _compensation_of(engine, op_id)
    comp = await wait_status(engine, comp_id, S.COMMITTED)
    assert comp.tool == "cancel_booking" and comp.args["booking_id"] == op.provider_ref
    effects = await sor.side_effects()
    assert effects.bookings_inserted == 1 and effects.cancellations == 1


async def _compensation_of(engine: AsyncEngine, op_id: uuid.UUID) -> uuid.UUID:
    async def probe() -> uuid.UUID | None:
        async with engine.connect() as conn:
            result = await conn.execute(
                sa.text("SELECT operation_id FROM operations WHERE compensates_operation_id = :o"),
                {"o": op_id},
            )
            return result.scalar_one_or_none()

    found = await wait_for(probe, lambda v: v is not None, what="compensating operation")
    assert found is not None
    return found


async def test_compensation_is_a_new_operation_linked_to_the_original(
    engine: AsyncEngine, sor: SystemOfRecord, start_worker: WorkerFactory
) -> None:
    worker = await start_worker()
    op_id = await admit(engine, worker.executor.enqueue)
    original = await wait_status(engine, op_id, S.COMMITTED)
    async with engine.begin() as conn:
        comp = await compensate(
            conn,
            worker.executor.registry,
            original,
            enqueue=worker.executor.enqueue,
            actor="staff",
            reason="caller asked to cancel",
        )
        assert comp is not None
        again = await compensate(
            conn,
            worker.executor.registry,
            original,
            enqueue=worker.executor.enqueue,
            actor="staff",
            reason="asked twice",
        )
    assert again is not None and again.operation_id == comp.operation_id
    assert comp.compensates_operation_id == op_id and comp.tool == "cancel_booking"
    done = await wait_status(engine, comp.operation_id, S.COMMITTED)
    assert done.result is not None and done.result["status"] == "cancelled"
    assert (await get_op(engine, op_id)).status is S.COMMITTED  # history is not rewritten
    effects = await sor.side_effects()
    assert effects.bookings_inserted == 1 and effects.cancellations == 1


async def test_provider_refusal_fails_for_good(
    engine: AsyncEngine, sor: SystemOfRecord, start_worker: WorkerFactory
) -> None:
    worker = await start_worker()
    op_id = await admit(engine, worker.executor.enqueue, args={**_ARGS, "party_size": 41})
    op = await wait_status(engine, op_id, S.FAILED_FINAL)
    assert op.attempts == 1 and op.error == "no_availability"


_ARGS = {"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada"}


async def test_inprocess_worker_from_settings_runs_operations_and_stops(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    settings = Settings(database_url=clean_db, sor_base_url=sor.url, worker_concurrency=1)
    worker = await start_inprocess_worker(
        settings, engine, database_url=clean_db, registry=exec_registry()
    )
    try:
        op_id = await admit(engine, make_enqueue(make_app(clean_db)))
        await wait_status(engine, op_id, S.COMMITTED)
    finally:
        await worker.stop()
    assert (await sor.side_effects()).bookings_inserted == 1
