"""Statements one terminal transition costs: the worker's commit of one operation.

Counts what the ledger sends to Postgres (SQLAlchemy's `before_cursor_execute`, plus the
driver-level statements Procrastinate's defer runs on the same connection) for
`transition(running -> committed)` of an operation with a call (so its delivery opens) and
`--subscriptions` active webhook subscriptions (so its outbox rows go out). Prints the
statements and their count; no assertions.

    .venv/bin/python bench/commit_statements.py [--subscriptions 1] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
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
from tools import ledger, webhooks
from tools.states import OperationStatus

S = OperationStatus


async def _enqueue(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
    """The bench measures the commit, not admission's queue."""


async def main(subscriptions: int, repeat: int) -> None:
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
        counts: list[int] = []
        elapsed: list[float] = []
        for i in range(repeat):
            async with engine.begin() as conn:
                adm = await ledger.admit_operation(
                    conn,
                    tenant_id="bench",
                    tool="book_table",
                    args={"i": i},
                    idempotency_key=f"k{i}",
                    call_id=f"call-{i}",
                    caller="+15550001",
                    enqueue=_enqueue,
                )
                op_id = adm.operation.operation_id
                await ledger.transition(
                    conn, op_id, S.ADMITTED, S.RUNNING, actor="bench", reason="attempt 1"
                )
            raw_before = await _driver_statements(engine)
            seen.clear()
            t0 = time.perf_counter()
            async with engine.begin() as conn:
                done = await ledger.transition(
                    conn,
                    op_id,
                    (S.RUNNING, S.UNKNOWN),
                    S.COMMITTED,
                    actor="bench",
                    reason="the provider confirmed it",
                    data={"attempt": 1},
                    result={"ok": True},
                    provider_ref="ref",
                    error=None,
                )
            elapsed.append((time.perf_counter() - t0) * 1000)
            assert done is not None
            statements = list(seen)
            jobs = await _driver_statements(engine) - raw_before
            # BEGIN and COMMIT are round trips too (the driver's, not in `seen`).
            counts.append(len(statements) + jobs + 2)
            if i == 0:
                for s in statements:
                    print("  ", " ".join(s.split())[:110])
                print(f"   + {jobs} Procrastinate defer(s) on the driver connection, BEGIN, COMMIT")
        print(
            f"commit of one operation ({subscriptions} webhook subscription(s)): "
            f"{counts[0]} round trips; wall ms over {repeat}: "
            f"min {min(elapsed):.2f} median {sorted(elapsed)[len(elapsed) // 2]:.2f}"
        )
        await engine.dispose()
    finally:
        drop_database(server, name)


async def _driver_statements(engine: Any) -> int:
    """Jobs deferred so far (Procrastinate's defer is one statement each)."""
    async with engine.connect() as conn:
        return int(await conn.scalar(sa.text("SELECT count(*) FROM procrastinate_jobs")) or 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--subscriptions", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(main(args.subscriptions, args.repeat))
