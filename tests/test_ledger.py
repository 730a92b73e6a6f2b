"""The operations ledger on real Postgres: admission, transitions, races, idempotency."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db import make_engine
from tools import ledger
from tools.errors import IdempotencyConflict, IllegalTransition, OperationNotFound
from tools.states import TRANSITIONS, OperationStatus

S = OperationStatus
ARGS = {"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada"}


class ListQueue:
    """Enqueue hook that records into a table on the admitting connection."""

    async def __call__(self, conn: AsyncConnection, operation_id: uuid.UUID) -> None:
        await conn.execute(
            sa.text("INSERT INTO test_jobs (operation_id) VALUES (:id)"), {"id": operation_id}
        )


@pytest.fixture
async def jobs(engine: AsyncEngine) -> ListQueue:
    async with engine.begin() as conn:
        await conn.execute(
            sa.text("CREATE TABLE IF NOT EXISTS test_jobs (operation_id uuid NOT NULL)")
        )
        await conn.execute(sa.text("TRUNCATE test_jobs"))
    return ListQueue()


async def _job_ids(engine: AsyncEngine) -> list[uuid.UUID]:
    async with engine.connect() as conn:
        return [r[0] for r in await conn.execute(sa.text("SELECT operation_id FROM test_jobs"))]


async def _admit(
    conn: AsyncConnection,
    enqueue: ledger.Enqueue | None,
    *,
    key: str = "k1",
    args: dict[str, object] | None = None,
    status: OperationStatus = S.ADMITTED,
) -> ledger.Admission:
    return await ledger.admit_operation(
        conn,
        tenant_id="t1",
        tool="book_table",
        args=args or ARGS,
        idempotency_key=key,
        call_id="call-1",
        caller="+15550001",
        status=status,
        enqueue=enqueue,
    )


async def test_admission_inserts_the_operation_and_enqueues_in_one_transaction(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    async with engine.begin() as conn:
        adm = await _admit(conn, jobs)
    assert adm.created
    assert await _job_ids(engine) == [adm.operation.operation_id]
    async with engine.connect() as conn:
        events = await ledger.get_events(conn, adm.operation.operation_id)
    assert [(e.from_status, e.to_status, e.kind) for e in events] == [
        (None, S.ADMITTED, "transition")
    ]


async def test_rolled_back_admission_leaves_neither_operation_nor_job(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    class Boom(Exception):
        pass

    op_id = None
    with pytest.raises(Boom):
        async with engine.begin() as conn:
            adm = await _admit(conn, jobs)
            op_id = adm.operation.operation_id
            raise Boom
    assert op_id is not None
    assert await _job_ids(engine) == []
    async with engine.connect() as conn:
        assert await ledger.get_operation(conn, op_id) is None


async def test_failing_enqueue_rolls_back_the_operation(engine: AsyncEngine) -> None:
    async def broken(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
        raise RuntimeError("queue down")

    with pytest.raises(RuntimeError):
        async with engine.begin() as conn:
            await _admit(conn, broken)
    async with engine.connect() as conn:
        assert await ledger.find_by_idempotency_key(conn, "t1", "k1") is None


async def test_same_key_same_args_maps_to_one_operation_and_one_job(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    async with engine.begin() as conn:
        first = await _admit(conn, jobs)
    async with engine.begin() as conn:
        second = await _admit(conn, jobs)
    assert not second.created
    assert second.operation.operation_id == first.operation.operation_id
    assert len(await _job_ids(engine)) == 1


async def test_same_key_with_different_args_is_a_conflict(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    async with engine.begin() as conn:
        await _admit(conn, jobs)
    with pytest.raises(IdempotencyConflict):
        async with engine.begin() as conn:
            await _admit(conn, jobs, args={**ARGS, "party_size": 5})


async def test_concurrent_admissions_of_one_key_create_one_operation(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    async def admit() -> ledger.Admission:
        async with engine.begin() as conn:
            return await _admit(conn, jobs)

    results = await asyncio.gather(*(admit() for _ in range(5)))
    assert sum(r.created for r in results) == 1
    assert len({r.operation.operation_id for r in results}) == 1
    assert len(await _job_ids(engine)) == 1


def test_derived_key_is_stable_and_depends_on_intent() -> None:
    k = ledger.derive_idempotency_key("t1", "call-1", "book_table", ARGS)
    assert k == ledger.derive_idempotency_key(
        "t1", "call-1", "book_table", dict(reversed(ARGS.items()))
    )
    assert k != ledger.derive_idempotency_key("t1", "call-2", "book_table", ARGS)
    assert k != ledger.derive_idempotency_key(
        "t1", "call-1", "book_table", {**ARGS, "time": "21:30"}
    )
    assert k != ledger.derive_idempotency_key("t1", "call-1", "book_table", ARGS, generation=2)


async def test_two_concurrent_transitions_from_the_same_status_one_wins(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    async with engine.begin() as conn:
        op_id = (await _admit(conn, jobs)).operation.operation_id

    async def claim(worker: str) -> ledger.OperationRecord | None:
        async with engine.begin() as conn:
            return await ledger.claim_for_execution(
                conn, op_id, worker_id=worker, attempt_deadline_s=30
            )

    a, b = await asyncio.gather(claim("a"), claim("b"))
    winners = [r for r in (a, b) if r is not None]
    assert len(winners) == 1
    assert winners[0].attempts == 1
    async with engine.connect() as conn:
        events = await ledger.get_events(conn, op_id)
    assert [e.to_status for e in events] == [S.ADMITTED, S.RUNNING]


async def test_racing_different_targets_from_running_only_one_lands(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    async with engine.begin() as conn:
        op_id = (await _admit(conn, jobs)).operation.operation_id
        await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="worker:a", reason="t")

    async def move(to: OperationStatus, actor: str) -> ledger.OperationRecord | None:
        async with engine.begin() as conn:
            return await ledger.transition(conn, op_id, S.RUNNING, to, actor=actor, reason="t")

    res = await asyncio.gather(move(S.COMMITTED, "worker:a"), move(S.UNKNOWN, "sweeper"))
    assert sum(r is not None for r in res) == 1


async def test_illegal_transition_is_refused_and_changes_nothing(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    async with engine.begin() as conn:
        op_id = (await _admit(conn, jobs)).operation.operation_id
    with pytest.raises(IllegalTransition):
        async with engine.begin() as conn:
            await ledger.transition(conn, op_id, S.ADMITTED, S.COMMITTED, actor="x", reason="y")
    with pytest.raises(TypeError):
        async with engine.begin() as conn:
            await ledger.transition(
                conn, op_id, S.ADMITTED, S.RUNNING, actor="x", reason="y", status="committed"
            )
    async with engine.connect() as conn:
        op = await ledger.get_operation(conn, op_id)
        assert op is not None and op.status is S.ADMITTED
        assert len(await ledger.get_events(conn, op_id)) == 1


async def test_transition_of_missing_operation_raises(engine: AsyncEngine) -> None:
    with pytest.raises(OperationNotFound):
        async with engine.begin() as conn:
            await ledger.transition(
                conn, uuid.uuid4(), S.ADMITTED, S.RUNNING, actor="x", reason="y"
            )


async def test_commit_sets_result_timestamps_and_notifies(
    engine: AsyncEngine, jobs: ListQueue, clean_db: str
) -> None:
    import psycopg

    async with engine.begin() as conn:
        op_id = (await _admit(conn, jobs)).operation.operation_id
    listener = await psycopg.AsyncConnection.connect(clean_db, autocommit=True)
    try:
        await listener.execute("LISTEN operation_status")
        async with engine.begin() as conn:
            await ledger.claim_for_execution(conn, op_id, worker_id="w", attempt_deadline_s=5)
            done = await ledger.transition(
                conn,
                op_id,
                S.RUNNING,
                S.COMMITTED,
                actor="worker:w",
                reason="provider confirmed",
                result={"booking_id": "B1"},
                provider_ref="B1",
            )
        assert done is not None
        assert done.committed_at is not None and done.finished_at is not None
        assert done.result == {"booking_id": "B1"} and done.provider_ref == "B1"
        seen: list[str] = []
        async with asyncio.timeout(5):
            async for note in listener.notifies():
                seen.append(note.payload)
                if '"committed"' in note.payload:
                    break
        assert str(op_id) in seen[-1] and '"call_id":"call-1"' in seen[-1]
    finally:
        await listener.close()


async def test_claim_honours_cancel_request_and_total_deadline(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    async with engine.begin() as conn:
        a = (await _admit(conn, jobs, key="a")).operation
        b = await ledger.admit_operation(
            conn,
            tenant_id="t1",
            tool="book_table",
            args=ARGS,
            idempotency_key="b",
            expires_at=datetime.now(UTC) - timedelta(seconds=1),
            enqueue=jobs,
        )
        op_b = b.operation
    async with engine.begin() as conn:
        await ledger.transition(conn, a.operation_id, S.ADMITTED, S.RUNNING, actor="w", reason="")
        marked = await ledger.request_cancel(conn, a.operation_id, actor="staff", reason="asked")
        # Running: the mark is recorded, the status is left for the provider to settle.
        assert marked.cancel_requested and marked.status is S.RUNNING
        assert (
            await ledger.claim_for_execution(
                conn, op_b.operation_id, worker_id="w", attempt_deadline_s=5
            )
            is None
        )
        after = await ledger.get_operation(conn, op_b.operation_id)
        assert after is not None and after.status is S.FAILED_FINAL


async def test_cancel_before_start_is_final_at_once(engine: AsyncEngine, jobs: ListQueue) -> None:
    async with engine.begin() as conn:
        op = (await _admit(conn, jobs)).operation
        cancelled = await ledger.request_cancel(
            conn, op.operation_id, actor="model", reason="caller changed their mind"
        )
        assert cancelled.status is S.CANCELLED
        assert (
            await ledger.claim_for_execution(
                conn, op.operation_id, worker_id="w", attempt_deadline_s=5
            )
            is None
        )


async def test_expired_confirmations_are_cancelled(engine: AsyncEngine) -> None:
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        old = await ledger.admit_operation(
            conn,
            tenant_id="t1",
            tool="book_table",
            args=ARGS,
            idempotency_key="old",
            status=S.AWAITING_CONFIRMATION,
            confirm_by=now - timedelta(seconds=1),
        )
        fresh = await ledger.admit_operation(
            conn,
            tenant_id="t1",
            tool="book_table",
            args=ARGS,
            idempotency_key="fresh",
            status=S.AWAITING_CONFIRMATION,
            confirm_by=now + timedelta(seconds=60),
        )
    async with engine.begin() as conn:
        done = await ledger.expire_confirmations(conn, now)
    assert done == [old.operation.operation_id]
    async with engine.connect() as conn:
        f = await ledger.get_operation(conn, fresh.operation.operation_id)
        assert f is not None and f.status is S.AWAITING_CONFIRMATION


async def test_tool_call_duplicate_delivery_returns_the_first_row(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        row, created = await ledger.record_tool_call(
            conn,
            call_id="c",
            function_call_id="fc_1",
            tenant_id="t1",
            tool="x",
            raw_arguments="{}",
            turn_id=1,
        )
        await ledger.complete_tool_call(conn, row.id, decision="allow", output={"ok": True})
    async with engine.begin() as conn:
        again, created2 = await ledger.record_tool_call(
            conn,
            call_id="c",
            function_call_id="fc_1",
            tenant_id="t1",
            tool="x",
            raw_arguments="{}",
            turn_id=2,
        )
    assert created and not created2
    assert again.id == row.id and again.output == {"ok": True} and again.turn_id == 1


# --- property: random attempted transitions on a real row ------------------------------

_attempt = st.tuples(
    st.one_of(st.none(), st.sampled_from(list(S))),  # None: "from the current status"
    st.sampled_from(list(S)),
)


async def _run_attempts(url: str, start: OperationStatus, attempts: list) -> None:
    eng = make_engine(url, pool_size=1, max_overflow=0)
    try:
        async with eng.begin() as conn:
            op = (
                await ledger.admit_operation(
                    conn,
                    tenant_id="prop",
                    tool="t",
                    args={"n": 1},
                    idempotency_key=str(uuid.uuid4()),
                    status=start,
                    enqueue=(lambda c, i: asyncio.sleep(0)),
                )
            ).operation
        model = start
        for guess, to in attempts:
            frm = model if guess is None else guess
            async with eng.begin() as conn:
                if to not in TRANSITIONS[frm]:
                    with pytest.raises(IllegalTransition):
                        await ledger.transition(
                            conn, op.operation_id, frm, to, actor="prop", reason="p"
                        )
                    continue
                moved = await ledger.transition(
                    conn, op.operation_id, frm, to, actor="prop", reason="p"
                )
            if frm == model:
                assert moved is not None and moved.status is to
                model = to
            else:
                assert moved is None
        async with eng.connect() as conn:
            row = await ledger.get_operation(conn, op.operation_id)
            events = await ledger.get_events(conn, op.operation_id)
        assert row is not None and row.status is model
        # The trail replays to the row: a chain of legal edges from creation to now.
        replay = None
        for e in events:
            assert e.from_status == replay
            if replay is not None:
                assert e.to_status in TRANSITIONS[replay]
            replay = e.to_status
        assert replay is row.status
    finally:
        await eng.dispose()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    start=st.sampled_from([S.ADMITTED, S.AWAITING_CONFIRMATION]),
    attempts=st.lists(_attempt, max_size=12),
)
def test_no_sequence_of_attempted_transitions_reaches_an_illegal_state(
    clean_db: str, start: OperationStatus, attempts: list
) -> None:
    asyncio.run(_run_attempts(clean_db, start, attempts))


async def test_cancel_request_on_a_finished_operation_changes_nothing_but_the_trail(
    engine: AsyncEngine, jobs: ListQueue
) -> None:
    async with engine.begin() as conn:
        op = (await _admit(conn, jobs)).operation
        await ledger.claim_for_execution(conn, op.operation_id, worker_id="w", attempt_deadline_s=5)
        await ledger.transition(
            conn, op.operation_id, S.RUNNING, S.COMMITTED, actor="worker:w", reason="ok"
        )
        after = await ledger.request_cancel(conn, op.operation_id, actor="staff", reason="oops")
        events = await ledger.get_events(conn, op.operation_id)
    assert after.status is S.COMMITTED and not after.cancel_requested
    assert events[-1].kind == "decision" and "after the outcome was final" in (
        events[-1].reason or ""
    )
