"""CPU of deferring a batch of Procrastinate jobs inside a transaction: Procrastinate's own
`batch_defer_async` (the baseline) against `tools.jobs.defer_many`, which runs Procrastinate's
SQL function (`procrastinate_defer_jobs_v1`) in one statement with the arguments as one jsonb
array. A delivery worker defers one `drive_sms` job for each SMS of a batch it persists.

Same connection and transaction (rolled back), alternated round by round in one process;
`time.process_time` over `--batches` batches of `--jobs` jobs. No assertions.

    .venv/bin/python bench/defer_jobs.py [--jobs 50] [--batches 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import procrastinate
from sqlalchemy.ext.asyncio import AsyncConnection

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _scratch import scratch_database  # bench/ is on sys.path when run as a script

from app.db import make_engine
from tools import jobs

Defer = Callable[[AsyncConnection, list[dict[str, Any]]], Awaitable[list[int]]]


async def main(n_jobs: int, batches: int, rounds: int) -> None:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector())

    async def procrastinates(conn: AsyncConnection, kwargs: list[dict[str, Any]]) -> list[int]:
        raw = await conn.get_raw_connection()
        deferrer = app.configure_task(
            jobs.SMS_TASK, queue=jobs.DELIVERY_QUEUE, connection=raw.driver_connection
        )
        return await deferrer.batch_defer_async(*kwargs)

    async def ours(conn: AsyncConnection, kwargs: list[dict[str, Any]]) -> list[int]:
        return await jobs.defer_many(conn, jobs.SMS_TASK, kwargs)

    ways: list[tuple[str, Defer]] = [
        ("procrastinate batch_defer_async (baseline)", procrastinates),
        ("tools.jobs.defer_many", ours),
    ]
    kwargs = [{"message_id": f"00000000-0000-0000-0000-{i:012d}"} for i in range(n_jobs)]
    results: dict[str, list[float]] = {name: [] for name, _ in ways}
    with scratch_database("va_bench_defer") as url:
        engine = make_engine(url)
        try:
            for _ in range(rounds):
                for name, defer in ways:
                    async with engine.connect() as conn:
                        tx = await conn.begin()
                        for _ in range(3):  # warm: statements prepared, caches filled
                            await defer(conn, kwargs)
                        started = time.process_time()
                        for _ in range(batches):
                            await defer(conn, kwargs)
                        spent = time.process_time() - started
                        await tx.rollback()
                    results[name].append(spent * 1000 / batches)
        finally:
            await engine.dispose()
    print(f"defer {n_jobs} jobs in a transaction: ms CPU a batch ({batches} batches a round)")
    print(f"{'way':44}  " + "  ".join(f"round {r + 1:<3}" for r in range(rounds)) + "  per job")
    for name, per_batch in results.items():
        cells = "  ".join(f"{v:9.2f}" for v in per_batch)
        print(f"{name:44}  {cells}  {min(per_batch) / n_jobs:7.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.jobs, args.batches, args.rounds))
