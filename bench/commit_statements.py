"""Statements one terminal transition costs: the worker's commit of one operation.

Counts the round trips the ledger makes to Postgres (SQLAlchemy's `before_cursor_execute`,
plus the driver-level statements `jobs.defer` runs on the same connection, plus BEGIN and
COMMIT) for `transition(running -> committed)` of an operation with a call (so its delivery
opens) and `--subscriptions` active webhook subscriptions (so its outbox rows go out), in a
transaction, and as the executor commits it where the tree has that form (`alone=True`, no
transaction around it). Prints the statements and their count, and the jobs deferred; no
assertions. (The pool's checkout ping, one per transaction either way, is not counted.)

Then the CPU this process spends (`time.process_time`: SQLAlchemy, the driver, the loop) on
each of an operation's three transactions, over `--cpu` operations: its admission (row,
event, outbox row, notification), `admitted -> running`, and `running -> committed` (with
the delivery it opens; and again as the executor runs it, alone). Baseline: a transaction of
one `SELECT 1` on the same engine, the floor of a round trip through the pool and driver. To
compare two commits, run this on each in turn, several times (the machine is shared).

    .venv/bin/python bench/commit_statements.py [--subscriptions 1] [--repeat 5] [--cpu 300]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.db import create_database, drop_database, make_engine, resolve_database_url, upgrade
from tools import jobs, ledger, webhooks
from tools.autocommit import autocommit
from tools.states import OperationStatus

S = OperationStatus


async def _enqueue(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
    """The bench measures the commit, not admission's queue."""


async def main(subscriptions: int, repeat: int, cpu: int) -> None:
    server = resolve_database_url(
        os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL"),
        Path(tempfile.gettempdir()) / "voice-agent-bench-pg",
    )
    name = f"bench_commit_{uuid.uuid4().hex[:8]}"
    url = create_database(server, name)
    try:
        await asyncio.to_thread(upgrade, url)
        engine = make_engine(url)
        seen: list[str] = []

        @sa.event.listens_for(engine.sync_engine, "before_cursor_execute")
        def _count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            seen.append(statement)

        async with engine.begin() as conn:
            for i in range(subscriptions):
                await webhooks.subscribe(conn, tenant_id="bench", url=f"https://example.com/{i}")
        forms = [("in a transaction", False)] + ([("alone", True)] if _HAS_ALONE else [])
        for form, alone in forms:
            counts: list[int] = []
            elapsed: list[float] = []
            for i in range(repeat):
                async with engine.begin() as conn:
                    op_id = await _admit(conn, i, f"{form}-")
                    await ledger.transition(
                        conn,
                        op_id,
                        S.ADMITTED,
                        S.RUNNING,
                        actor="bench",
                        reason="attempt 1",
                        attempts=1,
                    )
                jobs_before = await _jobs(engine)
                seen.clear()
                defers.clear()
                t0 = time.perf_counter()
                done = await _commit(engine, op_id, "ref", alone)
                elapsed.append((time.perf_counter() - t0) * 1000)
                assert done is not None
                statements = list(seen)
                jobs_made = await _jobs(engine) - jobs_before
                # BEGIN and COMMIT are round trips too (the driver's, not in `seen`).
                counts.append(len(statements) + len(defers) + (0 if alone else 2))
                if i == 0:
                    print(f"commit {form}:")
                    for s in statements:
                        print("  ", " ".join(s.split())[:110])
                    print(
                        f"   + {len(defers)} defer(s) on the driver connection"
                        + ("" if alone else ", BEGIN, COMMIT")
                        + f"; {jobs_made} job(s) deferred"
                    )
            print(
                f"commit of one operation {form} ({subscriptions} webhook subscription(s)): "
                f"{counts[0]} round trip(s); wall ms over {repeat}: "
                f"min {min(elapsed):.2f} median {sorted(elapsed)[len(elapsed) // 2]:.2f}\n"
            )
        if cpu:
            await _cpu_table(engine, cpu)
        await engine.dispose()
    finally:
        drop_database(server, name)


# Whether this tree commits without a transaction (`transition(..., alone=True)`).
_HAS_ALONE = "alone" in inspect.signature(ledger.transition).parameters

# `jobs.defer` calls: one driver-level statement each, outside SQLAlchemy's events.
defers: list[str] = []
_defer = jobs.defer


async def _counted_defer(conn: AsyncConnection, task: str, **kw: Any) -> int:
    defers.append(task)
    return await _defer(conn, task, **kw)


jobs.defer = _counted_defer  # type: ignore[assignment]


async def _commit(engine: Any, op_id: uuid.UUID, ref: str, alone: bool) -> Any:
    """`running -> committed` as the executor records a provider's confirmation."""
    kw: dict[str, Any] = {"alone": True} if alone else {}
    begin = autocommit(engine) if alone else engine.begin()
    async with begin as conn:
        return await ledger.transition(
            conn,
            op_id,
            (S.RUNNING, S.UNKNOWN),
            S.COMMITTED,
            actor="bench",
            reason="the provider confirmed it",
            data={"attempt": 1},
            attempt=1,
            result={"ok": True},
            provider_ref=ref,
            error=None,
            **kw,
        )


async def _admit(conn: AsyncConnection, i: int, prefix: str) -> uuid.UUID:
    """Admit the bench's `i`-th operation (a booking with a call, keys under `prefix`)."""
    adm = await ledger.admit_operation(
        conn,
        tenant_id="bench",
        tool="book_table",
        args={"i": i},
        idempotency_key=f"{prefix}k{i}",
        call_id=f"{prefix}call-{i}",
        caller="+15550001",
        enqueue=_enqueue,
    )
    return adm.operation.operation_id


async def _cpu_table(engine: Any, n: int) -> None:
    """CPU ms per transaction of each kind, over `n` operations (after a warm-up)."""
    spent = {"admission": 0.0, "admitted -> running": 0.0, "running -> committed": 0.0}
    if _HAS_ALONE:
        spent["  the same, alone"] = 0.0
    floor = 0.0
    for i in range(-20, n):  # the first 20 warm the statement cache and the pool
        warm = i >= 0
        t0 = time.process_time()
        async with engine.begin() as conn:
            op_id = await _admit(conn, i, "cpu-")
        t1 = time.process_time()
        async with engine.begin() as conn:
            await ledger.transition(
                conn, op_id, S.ADMITTED, S.RUNNING, actor="bench", reason="attempt 1", attempts=1
            )
        t2 = time.process_time()
        await _commit(engine, op_id, f"ref{i}", False)
        t3 = time.process_time()
        async with engine.begin() as conn:
            await conn.execute(_SELECT_1)
        t4 = time.process_time()
        if _HAS_ALONE:
            async with engine.begin() as conn:
                op2 = await _admit(conn, i, "cpu-alone-")
                await ledger.transition(
                    conn, op2, S.ADMITTED, S.RUNNING, actor="bench", reason="a", attempts=1
                )
            t5 = time.process_time()
            await _commit(engine, op2, f"ref{i}", True)
            t6 = time.process_time()
            if warm:
                spent["  the same, alone"] += t6 - t5
        if warm:
            spent["admission"] += t1 - t0
            spent["admitted -> running"] += t2 - t1
            spent["running -> committed"] += t3 - t2
            floor += t4 - t3
    print(f"\nCPU ms per transaction, this process, mean over {n} operations")
    print(f"{'transaction':<22} {'CPU ms':>7} {'over baseline':>14}")
    print(f"{'-' * 22} {'-' * 7} {'-' * 14}")
    base = floor / n * 1000
    for name, total in spent.items():
        ms = total / n * 1000
        print(f"{name:<22} {ms:>7.3f} {ms - base:>14.3f}")
    print(f"{'baseline: SELECT 1':<22} {base:>7.3f}")
    whole = sum(v for k, v in spent.items() if not k.startswith(" ")) / n * 1000
    print(f"{'an operation (all 3)':<22} {whole:>7.3f} {whole - 3 * base:>14.3f}")


_SELECT_1 = sa.text("SELECT 1")


async def _jobs(engine: Any) -> int:
    """Jobs deferred so far."""
    async with engine.connect() as conn:
        return int(await conn.scalar(sa.text("SELECT count(*) FROM procrastinate_jobs")) or 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--subscriptions", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--cpu", type=int, default=300, help="operations for the CPU table")
    args = parser.parse_args()
    asyncio.run(main(args.subscriptions, args.repeat, args.cpu))
