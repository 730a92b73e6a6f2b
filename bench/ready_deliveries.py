"""CPU of `ready_out_of_call` (a delivery job's look for the deliveries ready beside its own):
its statements built per job through SQLAlchemy (the builder before, kept here as the
baseline) vs built once and run on the driver connection (app.ops.delivery_jobs).

`--ready` pending deliveries of ended calls on a scratch database; each call asks for up to
`limit` of them, the newest first (as a job passes its own delivery), in a transaction of its
own. Both ways alternate round by round in one process, so the machine's load falls on both;
`time.process_time` around the call only (not the transaction's begin and commit), per call.
The two ways' results are compared once. No assertions.

    .venv/bin/python bench/ready_deliveries.py [--calls 300] [--rounds 3] [--limits 1,50]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _scratch import scratch_database  # bench/ is on sys.path when run as a script

from app.calls.store import calls
from app.db import make_engine
from app.ops.delivery_jobs import _OPEN_CALLS, _uuid, ready_out_of_call
from tools import ledger
from tools.deliveries import DeliveryRecord
from tools.delivery_models import deliveries_table as dl_t
from tools.delivery_states import DeliveryState
from tools.ledger_models import operations_table as ops_t
from tools.relevance import CallState
from tools.states import OperationStatus

S = OperationStatus
D = DeliveryState
Ready = list[tuple[DeliveryRecord, ledger.OperationRecord, CallState]]
Way = Callable[..., Awaitable[Ready]]


async def built_per_job(
    conn: AsyncConnection, limit: int, *, first: uuid.UUID | None = None
) -> Ready:
    """`ready_out_of_call` before: three statements built through SQLAlchemy each call (its
    `first=None` form, `ORDER BY NULL`, was refused by Postgres; the bench passes `first`)."""
    open_call = (
        sa.select(sa.literal(1))
        .select_from(calls)
        .where(calls.c.status.in_(_OPEN_CALLS), sa.cast(calls.c.id, sa.String) == dl_t.c.call_id)
        .exists()
    )
    stmt = (
        sa.select(dl_t)
        .where(
            dl_t.c.state == D.PENDING.value,
            dl_t.c.call_id.is_not(None),
            sa.or_(dl_t.c.next_attempt_at.is_(None), dl_t.c.next_attempt_at <= sa.func.now()),
            ~open_call,
        )
        .order_by(
            sa.case((dl_t.c.id == first, 0), else_=1) if first is not None else sa.null(),
            dl_t.c.created_at,
        )
        .limit(limit)
        .with_for_update(of=dl_t, skip_locked=True)
    )
    found = [DeliveryRecord.from_row(r) for r in await conn.execute(stmt)]
    if not found:
        return []
    ops = {
        r.operation_id: ledger.OperationRecord.from_row(r)
        for r in await conn.execute(
            sa.select(ops_t).where(ops_t.c.operation_id.in_([d.operation_id for d in found]))
        )
    }
    keys = {d.call_id: _uuid(d.call_id) for d in found}
    rows = {
        str(r.id): r
        for r in await conn.execute(
            sa.select(calls.c.id, calls.c.status).where(
                calls.c.id.in_([k for k in keys.values() if k is not None])
            )
        )
    }
    ready = []
    for delivery in found:
        row = rows.get(str(keys[delivery.call_id]))
        if row is not None and row.status in _OPEN_CALLS:
            continue
        call = CallState.ENDED if row is not None else CallState.UNKNOWN
        ready.append((delivery, ops[delivery.operation_id], call))
    return ready


async def _no_job(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
    """The bench moves its operations itself."""


async def seed(engine: AsyncEngine, n: int) -> uuid.UUID:
    """`n` committed operations of ended calls, each with its pending delivery; the newest
    delivery's id."""
    for i in range(n):
        call_id = uuid.uuid4()
        async with engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "INSERT INTO calls (id, call_sid, status, from_number, ended_at, answered_at)"
                    " VALUES (:id, :sid, 'completed', '+15550001', :end, now())"
                ),
                {"id": call_id, "sid": f"CA{call_id.hex}", "end": datetime.now(UTC)},
            )
            adm = await ledger.admit_operation(
                conn,
                tenant_id="default",
                tool="book_table",
                args={"party_size": 2, "time": "21:00", "i": i},
                idempotency_key=f"k{i}",
                call_id=str(call_id),
                caller="+15550001",
                enqueue=_no_job,
            )
            op_id = adm.operation.operation_id
            await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="b", reason="run")
        async with engine.begin() as conn:
            await ledger.transition(
                conn, op_id, S.RUNNING, S.COMMITTED, actor="b", reason="ok", provider_ref=f"R{i}"
            )
    async with engine.connect() as conn:
        newest = await conn.scalar(sa.select(dl_t.c.id).order_by(dl_t.c.created_at.desc()).limit(1))
    assert isinstance(newest, uuid.UUID)
    return newest


async def one_way(engine: AsyncEngine, way: Way, calls_: int, limit: int, first: Any) -> float:
    """CPU ms per call of `way` over `calls_` calls."""
    spent = 0.0
    for _ in range(calls_):
        async with engine.begin() as conn:
            t0 = time.process_time()
            await way(conn, limit, first=first)
            spent += time.process_time() - t0
    return spent * 1000 / calls_


async def main_async(url: str, calls_: int, rounds: int, limits: list[int], ready: int) -> None:
    engine = make_engine(url)
    try:
        first = await seed(engine, ready)
        for limit in limits:
            async with engine.begin() as conn:
                before = await built_per_job(conn, limit, first=first)
            async with engine.begin() as conn:
                after = await ready_out_of_call(conn, limit, first=first)
            print(f"limit {limit}: {len(after)} ready, the same both ways: {before == after}")
        ways: list[tuple[str, Way]] = [("built per job", built_per_job)]
        ways.append(("built once", ready_out_of_call))
        for _, way in ways:  # warm-up: connections, caches, psycopg's prepared statements
            for limit in limits:
                await one_way(engine, way, 20, limit, first)
        for r in range(rounds):
            for name, way in ways if r % 2 == 0 else ways[::-1]:
                cells = []
                for limit in limits:
                    ms = await one_way(engine, way, calls_, limit, first)
                    cells.append(f"limit {limit}: {ms:.3f}")
                print(f"round {r + 1} {name:14} ms CPU a call: {'  '.join(cells)}", flush=True)
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limits", default="1,50", help="batch sizes asked for (comma list)")
    parser.add_argument("--ready", type=int, default=50, help="pending deliveries seeded")
    args = parser.parse_args()
    limits = [int(x) for x in args.limits.split(",")]
    with scratch_database("bench_ready") as url:
        asyncio.run(main_async(url, args.calls, args.rounds, limits, args.ready))


if __name__ == "__main__":
    main()
