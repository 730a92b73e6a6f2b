"""SIP placings go only to a process that can place them: a standalone `voice-agent worker` (no
SIP listener) and a serve-like process with one (its in-process worker on `operations-sip`)
on the same database; sipp is the callee behind SIP_OUTBOUND_PROXY. A SIP placing nobody can
take fails with the reason, not hangs."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from app.ops.outbound import request_call
from app.ops.worker import OperationWorker, standalone_worker
from app.tool_wiring import load_configured_catalog
from tests.console_support import bearer
from tests.e2e_support import make_settings, wait_until
from tests.sipp_support import needs_sipp
from tests.sipp_uas import sipp_uas
from tests.test_outbound import CALLEE, PURPOSE, call_row, operation, outbound_stack, place
from tools import ledger
from tools.executor import QUEUE, SIP_QUEUE, make_enqueue

pytestmark = needs_sipp
WAIT_S = 20.0
SIP_CALLEE = "sip:callee@127.0.0.1"


def _ran_by(events: list[dict[str, Any]]) -> list[str]:
    """Who claimed the operation, once per attempt (its -> running transitions)."""
    return [e["actor"] for e in events if e["to_status"] == "running"]


async def _settled(engine: AsyncEngine, op_id: str) -> dict[str, Any]:
    async def done() -> bool:
        op, _ = await operation(engine, op_id)
        return op["status"] not in ("admitted", "running", "unknown")

    op, events = await operation(engine, op_id)
    try:
        await wait_until(done, WAIT_S, f"operation {op_id} settled")
    except TimeoutError:
        op, events = await operation(engine, op_id)
        raise AssertionError(f"{op_id} {op['args']} {op['status']}: {events}") from None
    op, _ = await operation(engine, op_id)
    return op


async def test_a_sip_placing_runs_beside_the_listener_and_everything_else_on_the_worker(
    engine: AsyncEngine, clean_db: str, tmp_path: Path
) -> None:
    standalone: OperationWorker | None = None
    async with (
        sipp_uas("uac_busy.xml", tmp_path) as far,
        outbound_stack(
            engine,
            clean_db,
            sip_bind="127.0.0.1:0",
            sip_rtp_ports="0",
            sip_t1_s=0.1,
            sip_outbound_proxy=f"127.0.0.1:{far.port}",
            outbound_ring_timeout_s=5,
            # The replica's worker places SIP calls only; the standalone one does the rest.
            worker_queues="operations-sip",
        ) as stack,
    ):
        # The standalone worker: the same deployment, the default queues.
        settings = stack.service.settings.model_copy(
            update={"worker_queues": "operations,deliveries"}
        )
        catalog = load_configured_catalog(settings)
        standalone = standalone_worker(settings, engine, clean_db, catalog, worker_id="alone")
        try:
            await standalone.start()
            stack.api.call_outcomes[CALLEE] = "busy"
            headers = await bearer(engine, Role.OPERATOR)
            # The SIP placing first, while the standalone worker is idle and could take it.
            sip = await place(stack, {"to": SIP_CALLEE, "purpose": PURPOSE}, headers)
            assert sip.status_code == 202, sip.text
            sip_call, sip_op = sip.json()["call_id"], sip.json()["operation_id"]
            twilio = await place(stack, {"to": CALLEE, "purpose": PURPOSE}, headers)
            twilio_op = twilio.json()["operation_id"]
            # A catalog tool admitted as the console's retry or a compensation would be.
            tool = next(spec.name for spec in catalog.registry)
            async with engine.begin() as conn:
                admitted = await ledger.admit_operation(
                    conn,
                    tenant_id=settings.tenant_id,
                    tool=tool,
                    args={},
                    idempotency_key=f"routing-{uuid.uuid4()}",
                    key_source="client",
                    caller="+15550001111",
                    actor="test",
                    reason="a tool beside the placings",
                    enqueue=make_enqueue(standalone.app),
                )
            tool_op = str(admitted.operation.operation_id)
            run = await far.finish()
            placed = await _settled(engine, sip_op)
            await _settled(engine, twilio_op)
            await _settled(engine, tool_op)
            _, sip_events = await operation(engine, sip_op)
            _, twilio_events = await operation(engine, twilio_op)
            _, tool_events = await operation(engine, tool_op)
            row = await call_row(engine, sip_call)
        finally:
            if standalone is not None:
                await standalone.stop()
            await catalog.aclose()
    print(
        f"sip placing by {_ran_by(sip_events)}, twilio placing by {_ran_by(twilio_events)}, "
        f"{tool} by {_ran_by(tool_events)}"
    )
    assert run.returncode == 0, run.explain()  # one INVITE, answered 486, ACKed
    # The SIP placing was claimed once, by the replica's worker (beside the listener).
    [sip_actor] = _ran_by(sip_events)
    assert sip_actor.startswith("worker:") and sip_actor != "worker:alone", sip_actor
    assert placed["status"] == "committed" and row["end_reason"].startswith("sip 486")
    seen = far.seen()
    assert len(set(re.findall(r"Call-ID: (\S+)", seen))) == 1, seen
    assert len(re.findall(r"^INVITE sip:callee@127\.0\.0\.1 SIP/2\.0", seen, re.M)) == 1
    # The Twilio placing and the catalog's tool ran on the standalone worker.
    assert _ran_by(twilio_events) == ["worker:alone"]
    assert _ran_by(tool_events) == ["worker:alone"]


async def test_a_sip_placing_no_process_can_take_fails_with_the_reason_instead_of_hanging(
    engine: AsyncEngine, clean_db: str
) -> None:
    settings = make_settings(
        1, outbound_via="sip", sip_place_wait_s=1.0, sweep_interval_s=0.3, database_url=clean_db
    )
    catalog = load_configured_catalog(settings)
    worker = standalone_worker(settings, engine, clean_db, catalog, worker_id="alone")
    try:
        await worker.start()
        enqueue = make_enqueue(worker.app)
        placed = await request_call(
            engine, settings, enqueue, to=CALLEE, purpose=PURPOSE, about_operation_id=None, by="t"
        )
        async with engine.connect() as conn:
            queue = await conn.scalar(
                sa.text(
                    "SELECT queue_name FROM procrastinate_jobs WHERE args->>'operation_id' = :o"
                ),
                {"o": placed.operation_id},
            )
        op = await _settled(engine, placed.operation_id)
        _, events = await operation(engine, placed.operation_id)
        row = await call_row(engine, placed.call_id)
        async with engine.connect() as conn:
            job = await conn.scalar(
                sa.text("SELECT status FROM procrastinate_jobs WHERE args->>'operation_id' = :o"),
                {"o": placed.operation_id},
            )
    finally:
        await worker.stop()
        await catalog.aclose()
    reason = "no replica with a SIP listener took it within 1 s"
    print(f"queue {queue}; {op['status']}: {op['error']}; row {row['status']}: {row['end_reason']}")
    assert queue == SIP_QUEUE != QUEUE
    # Nobody claimed it (so no INVITE left): admitted -> failed_final by the sweeper, with why.
    assert _ran_by(events) == []
    assert op["status"] == "failed_final" and op["error"] == reason
    assert [e["actor"] for e in events if e["to_status"] == "failed_final"] == ["sweeper"]
    assert row["status"] == "failed" and row["end_reason"] == reason
    assert job == "cancelled"


async def _job(engine: AsyncEngine, op_id: str) -> tuple[str, Any] | None:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                sa.text(
                    "SELECT queue_name, scheduled_at FROM procrastinate_jobs "
                    "WHERE args->>'operation_id' = :o AND status = 'todo'"
                ),
                {"o": op_id},
            )
        ).one_or_none()
    return None if row is None else (row[0], row[1])


async def test_a_call_back_and_the_sweepers_re_enqueue_keep_a_sip_placing_on_its_queue(
    engine: AsyncEngine, clean_db: str
) -> None:
    """The other ways a placing is deferred: `schedule_callback` (due later) and the sweeper's
    re-enqueue of a job lost with a worker, each read from the operation's row."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from app.ops.outbound import callback_scheduler

    settings = make_settings(1, outbound_via="sip", sip_place_wait_s=600.0, database_url=clean_db)
    catalog = load_configured_catalog(settings)
    worker = standalone_worker(settings, engine, clean_db, catalog, worker_id="alone")
    await worker.app.open_async()  # its sweeper's, not started: nothing takes the jobs
    try:
        due = datetime.now(UTC) + timedelta(hours=1)
        schedule = callback_scheduler(settings, worker.app)
        async with engine.begin() as conn:
            asked = SimpleNamespace(from_number=CALLEE, call_id=str(uuid.uuid4()))
            arranged = await schedule(conn, asked, "call me back", due, "fc_1")
        twilio = await request_call(
            engine,
            settings.model_copy(update={"outbound_via": "twilio"}),
            make_enqueue(worker.app),
            to=CALLEE,
            purpose=PURPOSE,
            about_operation_id=None,
            by="t",
        )
        callback_job = await _job(engine, arranged.operation_id)
        # Both jobs lost (a worker died with them): the sweeper defers them again.
        async with engine.begin() as conn:
            await conn.execute(sa.text("DELETE FROM procrastinate_jobs"))
        later = datetime.now(UTC) + timedelta(seconds=worker.sweeper.orphan_grace_s + 1)
        report = await worker.sweeper.sweep_once(now=later)
        requeued = await _job(engine, arranged.operation_id)
        twilio_requeued = await _job(engine, twilio.operation_id)
    finally:
        await worker.app.close_async()
        await catalog.aclose()
    print(f"callback job {callback_job}, re-enqueued {requeued}, twilio {twilio_requeued}")
    assert callback_job is not None and callback_job[0] == SIP_QUEUE
    assert callback_job[1] == due
    assert len(report.requeued) == 2 and report.untaken == []
    assert requeued is not None and requeued[0] == SIP_QUEUE
    assert twilio_requeued is not None and twilio_requeued[0] == QUEUE
