"""CPU and time of the job queue's own queries (what a worker runs for every job: fetch it,
finish it; and its heartbeat) through Procrastinate's connector as it comes (the baseline: a
pool that checks every connection it hands out, with a round trip, and commits after every
query, another) against ours (`tools.queue_connector.OutageTolerantConnector`: autocommit,
checked only once idle 5 s). The same one-statement query (`SELECT 1`, as Procrastinate's are
each one function call), alternated round by round in one process; per query. No
assertions.

    .venv/bin/python bench/queue_queries.py [--queries 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import procrastinate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _scratch import scratch_database  # bench/ is on sys.path when run as a script

from app.db import plain_url
from tools.queue_connector import OutageTolerantConnector


async def main(queries: int, rounds: int) -> None:
    results: dict[str, list[tuple[float, float]]] = {}
    with scratch_database("va_bench_queue") as url:
        conninfo = plain_url(url)
        ways = {
            "procrastinate PsycopgConnector (baseline)": procrastinate.PsycopgConnector(
                conninfo=conninfo, min_size=1, max_size=2
            ),
            "OutageTolerantConnector": OutageTolerantConnector(
                conninfo=conninfo, min_size=1, max_size=2
            ),
        }
        for connector in ways.values():
            await connector.open_async()
        try:
            for _ in range(rounds):
                for name, connector in ways.items():
                    for _ in range(20):  # warm
                        await connector.execute_query_one_async("SELECT 1 AS x")
                    cpu, wall = time.process_time(), time.perf_counter()
                    for _ in range(queries):
                        await connector.execute_query_one_async("SELECT 1 AS x")
                    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                    results.setdefault(name, []).append((cpu * 1e6 / queries, wall * 1e6 / queries))
        finally:
            for connector in ways.values():
                await connector.close_async()
    print(f"a one-statement query through the job queue's connector ({queries} a round)")
    print(f"{'connector':44}  {'us CPU a query, each round':30}  us a query (wall), each round")
    for name, rows in results.items():
        cpu = " ".join(f"{c:7.0f}" for c, _ in rows)
        wall = " ".join(f"{w:7.0f}" for _, w in rows)
        print(f"{name:44}  {cpu:30}  {wall}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.queries, args.rounds))
