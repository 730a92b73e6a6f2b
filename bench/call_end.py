"""CPU and round trips of a call's end: `store.transition` to `completed` as it runs now (one
statement when the call has no delivery to re-drive), beside the transaction it took before
(BEGIN, the end's UPDATE, `redrive_for_call`'s locked select, COMMIT), which it still takes
when a delivery waits. The same calls' rows (inserted and moved to in progress first, not
counted), alternated round by round in one process so the machine's load falls on both;
`time.process_time` per end and the statements and transactions the engine saw. No
assertions.

    .venv/bin/python bench/call_end.py [--calls 300] [--rounds 3]
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
from sqlalchemy.ext.asyncio import AsyncEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _scratch import scratch_database  # bench/ is on sys.path when run as a script

from app.calls import store
from app.calls.store import CallStatus
from app.db import make_engine
from tools import deliveries

End = Callable[[AsyncEngine, str], Awaitable[Any]]


async def now(engine: AsyncEngine, call_id: str) -> Any:
    return await store.transition(engine, call_id, CallStatus.COMPLETED, end_reason="stop")


async def before(engine: AsyncEngine, call_id: str) -> Any:
    """The end as it ran before: the UPDATE and the re-drive's select in a transaction."""
    stmt = store._transition_statement(CallStatus.COMPLETED, ("end_reason", "ended_at", "status"))
    params = {
        "b_id": uuid.UUID(call_id),
        "set_status": "completed",
        "set_end_reason": "stop",
        "set_ended_at": datetime.now(UTC),
    }
    async with engine.begin() as conn:
        row = await store._first(conn, stmt, params)
        if row is not None:
            await deliveries.redrive_for_call(
                conn, call_id, actor="call-end", reason="the call ended (stop)"
            )
    return row


async def started_calls(engine: AsyncEngine, n: int, tag: str) -> list[str]:
    ids = []
    for i in range(n):
        row, _ = await store.create_call(
            engine, call_sid=f"CA{tag}{i}", tenant_id="t1", from_number="+15550001",
            to_number="+15550002",
        )  # fmt: skip
        await store.transition(engine, row.id, CallStatus.IN_PROGRESS, stream_sid=f"MZ{tag}{i}")
        ids.append(row.id)
    return ids


class Seen:
    """Statements and transactions on the engine."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.statements = self.transactions = 0
        sa.event.listen(engine.sync_engine, "before_cursor_execute", self._statement)
        sa.event.listen(engine.sync_engine, "begin", self._begin)

    def _statement(self, *_: object) -> None:
        self.statements += 1

    def _begin(self, *_: object) -> None:
        self.transactions += 1


async def one_way(engine: AsyncEngine, seen: Seen, end: End, calls: int, tag: str) -> str:
    ids = await started_calls(engine, calls, tag)
    statements, transactions = seen.statements, seen.transactions
    t0 = time.process_time()
    for call_id in ids:
        assert await end(engine, call_id) is not None
    cpu = (time.process_time() - t0) * 1000 / calls
    return (
        f"CPU {cpu:.3f} ms  statements {(seen.statements - statements) / calls:.1f}  "
        f"transactions {(seen.transactions - transactions) / calls:.1f}"
    )


async def main_async(url: str, calls: int, rounds: int) -> None:
    engine = make_engine(url)
    seen = Seen(engine)
    try:
        # Warm-up: connections, compiled caches, psycopg's prepared statements.
        await one_way(engine, seen, before, 20, "w0")
        await one_way(engine, seen, now, 20, "w1")
        for r in range(rounds):
            for name, end in (("before", before), ("now", now)):
                cells = await one_way(engine, seen, end, calls, f"{name}{r}")
                print(f"round {r + 1} {name:7} a call's end: {cells}", flush=True)
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with scratch_database("bench_call_end") as url:
        asyncio.run(main_async(url, args.calls, args.rounds))


if __name__ == "__main__":
    main()
