"""CPU of a call's hot statements: through SQLAlchemy's async engine vs on the driver.

The same statement objects, parameters and connections (a pooled connection in autocommit, as
the callers run them), each way in turn, alternated round by round in one process so the
machine's load falls on both: the call's row inserted, moved to in progress and ended, and a
batch of three call events with their notification. `time.process_time` over `--calls`
statements of each, per statement. No assertions.

    .venv/bin/python bench/driver_statements.py [--calls 300] [--rounds 3]
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

from app.calls import store
from app.calls.events import _INSERT_AND_NOTIFY, _insert_and_notify_params
from app.db import make_engine
from tools import driver_sql
from tools.autocommit import autocommit

Run = Callable[[AsyncConnection, Any, dict[str, Any]], Awaitable[Any]]


async def via_sqlalchemy(conn: AsyncConnection, stmt: Any, params: dict[str, Any]) -> Any:
    return (await conn.execute(stmt, params)).mappings().all()


async def via_driver(conn: AsyncConnection, stmt: Any, params: dict[str, Any]) -> Any:
    return await driver_sql.fetch(conn, stmt, params)


async def one_way(engine: AsyncEngine, run: Run, calls: int, tag: str) -> dict[str, float]:
    to_progress = store._transition_statement(
        store.CallStatus.IN_PROGRESS, ("answered_at", "status", "stream_sid")
    )
    to_end = store._transition_statement(
        store.CallStatus.COMPLETED, ("end_reason", "ended_at", "status")
    )
    spent = {"insert": 0.0, "in_progress": 0.0, "end": 0.0, "events": 0.0}
    for i in range(calls):
        call_id = uuid.uuid4()
        now = datetime.now(UTC)
        steps: list[tuple[str, Any, dict[str, Any]]] = [
            ("insert", store._INSERT_CALL, {
                "set_id": call_id, "set_call_sid": f"CA{tag}{i}", "set_tenant_id": "t1",
                "set_leg": "twilio", "set_from_number": "+15550001", "set_to_number": "+1555002",
                "set_status": "ringing", "set_ended_at": None, "set_end_reason": None}),
            ("in_progress", to_progress, {
                "b_id": call_id, "set_status": "in_progress", "set_answered_at": now,
                "set_stream_sid": f"MZ{i}"}),
            ("events", _INSERT_AND_NOTIFY, _insert_and_notify_params([
                {"call_id": call_id, "seq": n + 1, "kind": "abc"[n], "data": {"n": n},
                 "mono_ns": n + 1, "at": now} for n in range(3)])),
            ("end", to_end, {
                "b_id": call_id, "set_status": "completed", "set_end_reason": "stop",
                "set_ended_at": now}),
        ]  # fmt: skip
        for name, stmt, params in steps:
            async with autocommit(engine) as conn:
                t0 = time.process_time()
                await run(conn, stmt, params)
                spent[name] += time.process_time() - t0
    return {k: v * 1000 / calls for k, v in spent.items()}


async def main_async(url: str, calls: int, rounds: int) -> None:
    engine = make_engine(url)
    try:
        # Warm-up: connections, compiled caches, psycopg's prepared statements.
        await one_way(engine, via_sqlalchemy, 20, "w0")
        await one_way(engine, via_driver, 20, "w1")
        for r in range(rounds):
            for name, run in (("sqlalchemy", via_sqlalchemy), ("driver", via_driver)):
                ms = await one_way(engine, run, calls, f"{name[0]}{r}")
                cells = "  ".join(f"{k} {v:.3f}" for k, v in ms.items())
                print(f"round {r + 1} {name:10}  ms CPU a statement: {cells}", flush=True)
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with scratch_database("bench_driver") as url:
        asyncio.run(main_async(url, args.calls, args.rounds))
    _ = sa


if __name__ == "__main__":
    main()
