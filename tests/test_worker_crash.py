"""A worker process killed with SIGKILL mid-operation: no loss, no duplicate, for both
domains (the restaurant plugin and the tools-file appointments) through the same engine."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.ops.worker import OperationWorker
from tests.domains import DOMAINS, Backend, Domain
from tests.sor_support import (
    admit,
    events_of,
    get_op,
    transitions,
    wait_for,
    wait_status,
)
from tools.executor import enqueue_operation, make_app
from tools.states import OperationStatus as S

ROOT = Path(__file__).resolve().parent.parent


async def _jobs(engine: AsyncEngine, status: str) -> int:
    async with engine.connect() as conn:
        result = await conn.execute(
            sa.text("SELECT count(*) FROM procrastinate_jobs WHERE status = :s"), {"s": status}
        )
        return int(result.scalar_one())


@pytest.mark.parametrize("domain", DOMAINS, ids=str)
async def test_worker_killed_mid_operation_is_recovered_without_loss_or_duplicate(
    engine: AsyncEngine, clean_db: str, domain: Domain
) -> None:
    async with domain.start(clean_db) as backend:
        await _killed_mid_operation(engine, clean_db, domain, backend)


async def _killed_mid_operation(
    engine: AsyncEngine, clean_db: str, domain: Domain, backend: Backend
) -> None:
    # The SOR applies the booking and then never answers: the worker is mid-request,
    # after the side effect and before recording it, when it dies.
    backend.set_faults(lose_response=1)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.worker_main",
        "--database-url",
        clean_db,
        "--domain",
        domain.name,
        "--url",
        backend.url,
        "--deadline",
        "30",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = await proc.stdout.readline()
        assert line.startswith(b"ready"), line

        queue = make_app(clean_db)

        async def enqueue(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
            await enqueue_operation(queue, conn, operation_id)

        op_id = await admit(engine, enqueue, tool=domain.book_tool, args=domain.ledger_args)
        await wait_for(backend.booked, lambda n: n == 1, what="SOR apply")
        assert (await get_op(engine, op_id)).status is S.RUNNING

        os.kill(proc.pid, signal.SIGKILL)
        async with asyncio.timeout(10):
            await proc.wait()
        # Stranded: nobody will record the outcome the dead worker was waiting for.
        assert (await get_op(engine, op_id)).status is S.RUNNING
        assert await _jobs(engine, "doing") == 1

        # A fresh worker's sweeper notices the dead worker's stalled job, moves the
        # operation to unknown and asks the SOR by idempotency key.
        catalog = backend.catalog(deadline_s=30)
        rescuer = OperationWorker(
            database_url=clean_db,
            engine=engine,
            registry=catalog.registry,
            provider=catalog.router,
            heartbeat_s=0.2,
            stalled_after_s=1.0,
            sweep_interval_s=0.2,
            poll_interval_s=0.2,
        )
        await rescuer.start()
        try:
            op = await wait_status(engine, op_id, S.COMMITTED, S.FAILED_FINAL, timeout_s=30)
        finally:
            await rescuer.stop()
            await catalog.aclose()

        assert op.status is S.COMMITTED
        assert op.attempts == 1  # recovered by asking, never by sending again
        events = await events_of(engine, op_id)
        assert transitions(events) == [
            (None, "admitted"),
            ("admitted", "running"),
            ("running", "unknown"),
            ("unknown", "committed"),
        ]
        assert [e.actor for e in events if e.to_status is S.UNKNOWN] == ["sweeper"]
        assert await _jobs(engine, "doing") == 0
        assert await backend.booked() == 1
        assert op.provider_ref is not None and op.provider_ref.startswith(domain.reference_prefix)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
