"""CPU of writing a batch of call events: the event writer's statement, as it was and as it is.

Every call's timeline goes through one statement a batch (app/calls/events.py): its rows
inserted and one notification per call. Three ways of writing the same batches, on the same
pooled connection in autocommit as the writer runs them, alternated round by round in one
process so the machine's load falls on all:

- `arrays`: the statement as it was, six arrays unnested (one parameter a column; psycopg dumps
  each element in Python and escapes each event's JSON text);
- `json`: the statement as it is, the batch one JSON document (`jsonb_to_recordset`);
- `executemany` (baseline, not ours): psycopg's own `executemany` of a bare INSERT of the same
  rows (no notification), in one pipeline.

Each batch's events are a call's usual ones (transcripts with quotes and non-ASCII text, marks,
the model's usage). `time.process_time` over `--batches` batches of each size, per batch. No
assertions; the rows each way writes are compared once (the same values back).

    .venv/bin/python bench/event_batch.py [--batches 300] [--rounds 3] [--sizes 1,5,50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

# The writer's statement before the batch became one JSON document.
ARRAYS = sa.text(
    "WITH written AS ("
    " INSERT INTO call_events (call_id, seq, kind, data, mono_ns, at)"
    " SELECT * FROM unnest(CAST(:call_ids AS uuid[]), CAST(:seqs AS bigint[]),"
    " CAST(:kinds AS text[]), CAST(:datas AS jsonb[]), CAST(:monos AS bigint[]),"
    " CAST(:ats AS timestamptz[]))"
    " RETURNING call_id)"
    " SELECT pg_notify('call_events', ids.c)"
    " FROM (SELECT DISTINCT CAST(call_id AS text) AS c FROM written) AS ids"
)

BARE = (
    "INSERT INTO call_events (call_id, seq, kind, data, mono_ns, at)"
    " VALUES (%s, %s, %s, %s::jsonb, %s, %s)"
)

EVENTS: list[tuple[str, dict[str, Any]]] = [
    ("agent_transcript", {
        "text": 'Your table for four is booked for 7 pm, under "Zoë".', "item_id": "item_1",
        "response_id": "resp_1", "audio_ms": 3420, "heard_ms": 3420, "started_mono_ns": 1}),
    ("caller_transcript", {"text": "Can I book a table for four at seven?", "item_id": "i2"}),
    ("mark", {"name": "m17", "audio_ms": 640}),
    ("model_usage", {"input_tokens": 412, "output_tokens": 88, "cached_tokens": 256}),
    ("speech_started", {"audio_start_ms": 10240}),
]  # fmt: skip


def rows_for(call_ids: list[uuid.UUID], size: int, seq0: int) -> list[dict[str, Any]]:
    now = datetime.now(UTC)
    rows = []
    for n in range(size):
        kind, data = EVENTS[n % len(EVENTS)]
        rows.append({
            "call_id": call_ids[n % len(call_ids)], "seq": seq0 + n, "kind": kind, "data": data,
            "mono_ns": time.monotonic_ns(), "at": now,
        })  # fmt: skip
    return rows


def arrays_params(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {
        "call_ids": [r["call_id"] for r in rows],
        "seqs": [r["seq"] for r in rows],
        "kinds": [r["kind"] for r in rows],
        "datas": [json.dumps(r["data"]) for r in rows],
        "monos": [r["mono_ns"] for r in rows],
        "ats": [r["at"] for r in rows],
    }


async def via_arrays(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    await driver_sql.execute(conn, ARRAYS, arrays_params(rows))


async def via_json(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    await driver_sql.execute(conn, _INSERT_AND_NOTIFY, _insert_and_notify_params(rows))


async def via_executemany(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    driver = (await conn.get_raw_connection()).driver_connection
    assert driver is not None
    async with driver.cursor() as cursor:
        await cursor.executemany(
            BARE,
            [
                (r["call_id"], r["seq"], r["kind"], json.dumps(r["data"]), r["mono_ns"], r["at"])
                for r in rows
            ],
        )


Way = Callable[[AsyncConnection, list[dict[str, Any]]], Awaitable[None]]
WAYS: dict[str, Way] = {"arrays": via_arrays, "json": via_json, "executemany": via_executemany}


class Seqs:
    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> int:
        first, self.next = self.next, self.next + n
        return first


async def one_way(
    engine: AsyncEngine, way: Way, call_ids: list[uuid.UUID], size: int, batches: int, seqs: Seqs
) -> float:
    spent = 0.0
    for _ in range(batches):
        rows = rows_for(call_ids, size, seqs.take(size))
        async with autocommit(engine) as conn:
            t0 = time.process_time()
            await way(conn, rows)
            spent += time.process_time() - t0
    return spent * 1000 / batches


async def same_rows(engine: AsyncEngine) -> None:
    """Each way writes the same rows (their seq, kind and data)."""
    seen = []
    for name, way in WAYS.items():
        call_id = uuid.UUID(
            (
                await store.create_call(
                    engine, call_sid=f"CAcheck{name}", tenant_id="t", from_number=None,
                    to_number=None,
                )
            )[0].id
        )  # fmt: skip
        rows = rows_for([call_id], 7, 1)
        async with autocommit(engine) as conn:
            await way(conn, rows)
            got = await conn.execute(
                sa.text(
                    "SELECT seq, kind, data, mono_ns, at FROM call_events WHERE call_id = :c "
                    "ORDER BY seq"
                ),
                {"c": call_id},
            )
            seen.append([tuple(r)[:3] for r in got])
    if any(s != seen[0] for s in seen):
        raise SystemExit(f"the ways wrote different rows: {seen}")


async def main_async(url: str, batches: int, rounds: int, sizes: list[int]) -> None:
    engine = make_engine(url)
    try:
        await same_rows(engine)
        call_ids = []
        for i in range(4):
            row, _ = await store.create_call(
                engine, call_sid=f"CAbench{i}", tenant_id="t", from_number=None, to_number=None
            )
            call_ids.append(uuid.UUID(row.id))
        seqs = Seqs()
        for way in WAYS.values():  # warm-up: connections, prepared statements
            await one_way(engine, way, call_ids, 5, 20, seqs)
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(rounds):
            for size in sizes:
                for name, way in WAYS.items():
                    ms = await one_way(engine, way, call_ids, size, batches, seqs)
                    results.setdefault((name, size), []).append(ms)
        print(f"\nms of CPU a batch ({batches} batches a round, {rounds} rounds: min-max)")
        print(f"{'events a batch':>15}" + "".join(f"{name:>20}" for name in WAYS))
        for size in sizes:
            cells = "".join(
                f"{min(results[(n, size)]):>13.3f}-{max(results[(n, size)]):<6.3f}" for n in WAYS
            )
            print(f"{size:>15}{cells}")
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="1,5,50")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with scratch_database("bench_events") as url:
        asyncio.run(main_async(url, args.batches, args.rounds, sizes))


if __name__ == "__main__":
    main()
