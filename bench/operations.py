"""Operations benchmark: admission latency, time to worker pickup, ledger throughput.

Prints tables (no assertions). Uses TEST_DATABASE_URL / DATABASE_URL (a scratch database
is created there and dropped afterwards) or an embedded PostgreSQL. Everything (load,
worker, SOR) runs in this one process, as `voice-agent serve` does by default.

    .venv/bin/python bench/operations.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _stats import pct  # bench/ is on sys.path when run as a script

from app.db import create_database, drop_database, make_engine, resolve_database_url, upgrade
from app.ops.worker import OperationWorker
from telephony.tool_gateway import CallContext, ConfirmationEvidence, FunctionCallRequest
from tools import ledger
from tools.executor import enqueue_operation, make_app
from tools.gateway import ToolPipeline
from tools.identity import StaticIdentityStore
from tools.policy import PolicyConfig
from tools.restaurant.catalog import restaurant_catalog
from tools.restaurant.client import SorClient
from tools.restaurant.protocol import BookingRequest
from tools.restaurant.provider import SorProvider
from tools.restaurant.sor import SystemOfRecord
from tools.states import OperationStatus

TENANT = "bench"


class _CallerAnswered:
    """The bench measures admission, not the call: every readback was heard and answered."""

    def confirmation_evidence(self, operation_id: str) -> ConfirmationEvidence:
        return ConfirmationEvidence(True, "bench: the caller answered", "bench-readback")


_CALLER_ANSWERED = _CallerAnswered()


def _args(i: int) -> dict[str, object]:
    # Spread over many slots so the SOR's seat limit never refuses a booking.
    day = 1 + (i // 400) % 28
    minute = (i % 400) % 60
    hour = 12 + ((i % 400) // 60)
    return {
        "date": f"2027-01-{day:02d}",
        "time": f"{hour:02d}:{minute:02d}",
        "party_size": 2,
        "name": f"Guest {i}",
    }


def fmt_ms(v: float) -> str:
    return f"{v * 1000:8.2f}"


async def run_concurrent(
    callers: int, per_caller: int, one: Callable[[int], Awaitable[None]]
) -> tuple[list[float], float]:
    """`callers` tasks each doing `per_caller` calls; (latencies, wall seconds)."""
    latencies: list[float] = []
    counter = iter(range(callers * per_caller))

    async def caller() -> None:
        for _ in range(per_caller):
            i = next(counter)
            t0 = time.perf_counter()
            await one(i)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return latencies, time.perf_counter() - t0


class Bench:
    def __init__(self, url: str, engine: AsyncEngine, quick: bool) -> None:
        self.url = url
        self.engine = engine
        self.quick = quick
        self.queue = make_app(url)
        self.n = 0

    async def enqueue(self, conn: sa.ext.asyncio.AsyncConnection, op_id: uuid.UUID) -> None:
        await enqueue_operation(self.queue, conn, op_id)

    async def admit_one(self, i: int) -> None:
        async with self.engine.begin() as conn:
            await ledger.admit_operation(
                conn,
                tenant_id=TENANT,
                tool="book_table",
                args=_args(i),
                idempotency_key=f"bench-{uuid.uuid4().hex}",
                call_id="bench-call",
                caller="+15550000000",
                enqueue=self.enqueue,
            )

    async def bare_insert(self, i: int) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                sa.text("INSERT INTO bench_scratch (id, payload) VALUES (:id, :p)"),
                {"id": uuid.uuid4(), "p": f"row {i}"},
            )

    async def reset(self) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "TRUNCATE operations, operation_events, tool_calls, bench_scratch, "
                    "procrastinate_jobs, procrastinate_events CASCADE"
                )
            )
            await conn.execute(sa.text("TRUNCATE sor.bookings, sor.idempotency, sor.effects"))


class PipelinePath:
    """The whole path of a model's function call through `ToolPipeline.handle`.

    Per operation: `book_table` (parse, validate, policy, tool_calls row, operation awaiting
    confirmation; not timed), then the timed part: the caller's `confirm_operation` call
    until the operation is admitted and its job enqueued in the same transaction.
    """

    def __init__(self, b: Bench) -> None:
        self.b = b
        self.pipeline = ToolPipeline(
            b.engine,
            restaurant_catalog(),
            enqueue=b.enqueue,
            read_executor=_no_reads,
            identities=StaticIdentityStore(),
            # The bench admits thousands of bookings an hour for one tenant.
            policy=PolicyConfig(max_mutations_per_tenant=10**9),
        )

    def _ctx(self, i: int) -> CallContext:
        return CallContext(
            call_id=f"bench-call-{i}",
            call_sid=f"CA{i:032d}",
            tenant_id=TENANT,
            from_number=f"+1555{i:07d}",
            to_number="+15550000000",
        )

    def _request(self, i: int, name: str, args: dict[str, object]) -> FunctionCallRequest:
        return FunctionCallRequest(
            call_id=f"fc-{name}-{i}-{uuid.uuid4().hex[:8]}",
            name=name,
            arguments=json.dumps(args),
            item_id=f"item-{i}",
            response_id=f"resp-{i}",
            turn_id=1,
            evidence=_CALLER_ANSWERED,
        )

    async def book_then_time_confirm(self, i: int) -> float:
        ctx = self._ctx(i)
        day = datetime.now(UTC).date() + timedelta(days=1 + i % 50)
        args = {**_args(i), "date": day.isoformat()}
        reply = await self.pipeline.handle(ctx, self._request(i, "book_table", args))
        op_id = reply.output.get("operation_id")
        if reply.output.get("status") != "awaiting_confirmation" or not op_id:
            raise RuntimeError(f"book_table was not held for confirmation: {reply.output}")
        t0 = time.perf_counter()
        reply = await self.pipeline.handle(
            ctx,
            self._request(i, "confirm_operation", {"operation_id": op_id, "confirmed": True}),
        )
        elapsed = time.perf_counter() - t0
        if reply.output.get("status") != "admitted":
            raise RuntimeError(f"confirm_operation did not admit: {reply.output}")
        return elapsed


async def _no_reads(spec: object, args: object) -> dict[str, object]:
    raise RuntimeError("the bench makes no reads")


async def pipeline_rows(b: Bench) -> list[tuple[str, ...]]:
    path = PipelinePath(b)
    rows = []
    counter = iter(range(10**9))
    for callers, per in ((1, 50 if b.quick else 200), (50, 2 if b.quick else 6)):
        await b.reset()
        latencies: list[float] = []

        async def caller(per: int = per, latencies: list[float] = latencies) -> None:
            for _ in range(per):
                latencies.append(await path.book_then_time_confirm(next(counter)))

        t0 = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        wall = time.perf_counter() - t0
        rows.append(
            (
                "confirm_operation call (pipeline)*",
                str(callers),
                str(len(latencies)),
                fmt_ms(pct(latencies, 50)),
                fmt_ms(pct(latencies, 99)),
                f"{len(latencies) / wall:9.0f}",
            )
        )
    return rows


async def admission_table(b: Bench) -> list[tuple[str, ...]]:
    rows = []
    for callers, per in ((1, 100 if b.quick else 300), (50, 4 if b.quick else 10)):
        for label, fn in (("bare INSERT+COMMIT", b.bare_insert), ("admit+enqueue", b.admit_one)):
            await b.reset()
            await run_concurrent(callers, 2, fn)  # warm the pool
            lat, wall = await run_concurrent(callers, per, fn)
            rows.append(
                (
                    label,
                    str(callers),
                    str(len(lat)),
                    fmt_ms(pct(lat, 50)),
                    fmt_ms(pct(lat, 99)),
                    f"{len(lat) / wall:9.0f}",
                )
            )
    return rows


async def _event_gap(engine: AsyncEngine, to_a: str, to_b: str) -> list[float]:
    """Per operation: seconds between its transition to `to_a` and to `to_b`."""
    async with engine.connect() as conn:
        result = await conn.execute(
            sa.text(
                "SELECT extract(epoch FROM b.at - a.at) FROM operation_events a "
                "JOIN operation_events b ON a.operation_id = b.operation_id "
                "WHERE a.to_status = :a AND b.to_status = :b AND a.kind = 'transition' "
                "AND b.kind = 'transition' AND a.from_status IS NULL"
                if to_a == "admitted"
                else "SELECT extract(epoch FROM b.at - a.at) FROM operation_events a "
                "JOIN operation_events b ON a.operation_id = b.operation_id "
                "WHERE a.to_status = :a AND b.to_status = :b"
            ),
            {"a": to_a, "b": to_b},
        )
        return [float(r[0]) for r in result]


async def _count(engine: AsyncEngine, status: OperationStatus) -> int:
    async with engine.connect() as conn:
        result = await conn.execute(
            sa.text("SELECT count(*) FROM operations WHERE status = :s"), {"s": status.value}
        )
        return int(result.scalar_one())


async def wait_all(engine: AsyncEngine, n: int, timeout_s: float = 120.0) -> float:
    t0 = time.perf_counter()
    while await _count(engine, OperationStatus.COMMITTED) < n:
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"only {await _count(engine, OperationStatus.COMMITTED)} of {n}")
        await asyncio.sleep(0.02)
    return time.perf_counter() - t0


async def pipeline_tables(b: Bench, sor: SystemOfRecord) -> tuple[list[tuple[str, ...]], ...]:
    async with SorClient(sor.url) as client:
        worker = OperationWorker(
            database_url=b.url,
            engine=b.engine,
            registry=restaurant_catalog(),
            provider=SorProvider(client),
            concurrency=8,
            poll_interval_s=1.0,
            sweep=False,
        )
        await worker.start()
        try:
            # Pickup: one operation at a time into an idle worker (LISTEN/NOTIFY path).
            await b.reset()
            n_pick = 30 if b.quick else 100
            for i in range(n_pick):
                await b.admit_one(i)
                await wait_all(b.engine, i + 1)
            pickup = await _event_gap(b.engine, "admitted", "running")
            run = await _event_gap(b.engine, "running", "committed")
            pick_rows = [
                (
                    "admitted -> running (pickup)",
                    str(len(pickup)),
                    fmt_ms(pct(pickup, 50)),
                    fmt_ms(pct(pickup, 99)),
                ),
                (
                    "running -> committed (SOR call)",
                    str(len(run)),
                    fmt_ms(pct(run, 50)),
                    fmt_ms(pct(run, 99)),
                ),
            ]

            # Throughput: a burst admitted by 20 callers, drained by the worker.
            await b.reset()
            n = 200 if b.quick else 600
            t0 = time.perf_counter()
            await run_concurrent(20, n // 20, b.admit_one)
            await wait_all(b.engine, n)
            ops_wall = time.perf_counter() - t0
        finally:
            await worker.stop()

        # Baselines in the same run, same concurrency: bare rows, and the SOR called
        # directly (what the ledger wraps).
        await b.reset()
        _, bare_wall = await run_concurrent(20, n // 20, b.bare_insert)

        async def direct(i: int) -> None:
            await client.book_table(f"direct-{i}", BookingRequest.model_validate(_args(i)))

        await b.reset()
        _, sor_wall = await run_concurrent(20, n // 20, direct)
    ops = n / ops_wall
    tp_rows = [
        ("bare INSERT+COMMIT (baseline)", str(n), f"{n / bare_wall:9.0f}", "1.00x"),
        (
            "SOR POST /bookings direct",
            str(n),
            f"{n / sor_wall:9.0f}",
            f"{(n / bare_wall) / (n / sor_wall):.2f}x",
        ),
        ("admit -> run -> commit (ledger)", str(n), f"{ops:9.0f}", f"{(n / bare_wall) / ops:.2f}x"),
    ]
    return pick_rows, tp_rows


def table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(r[i].strip()) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.strip().ljust(w) for c, w in zip(r, widths, strict=True)))


def _server_url() -> str:
    url = os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    return resolve_database_url(url, Path(tempfile.gettempdir()) / "voice-agent-bench-pg")


async def main(quick: bool) -> None:
    server = _server_url()
    name = f"va_bench_{os.getpid()}"
    url_str = create_database(server, name)
    try:
        await asyncio.to_thread(upgrade, url_str)
        engine = make_engine(url_str, pool_size=60, max_overflow=10)
        async with engine.begin() as conn:
            await conn.execute(
                sa.text("CREATE TABLE bench_scratch (id uuid PRIMARY KEY, payload text)")
            )
        sor = SystemOfRecord(url_str)
        await sor.start()
        b = Bench(url_str, engine, quick)
        try:
            t0 = time.perf_counter()
            adm = await admission_table(b)
            adm += await pipeline_rows(b)
            pick, tp = await pipeline_tables(b, sor)
            took = time.perf_counter() - t0
        finally:
            await sor.stop()
            await engine.dispose()
        print(
            f"operations benchmark ({'quick' if quick else 'full'}; {os.cpu_count()} CPUs; "
            f"took {took:.0f} s)"
        )
        table(
            "Admission latency: function call -> operation persisted and enqueued (ms)",
            ("path", "callers", "n", "p50", "p99", "per s"),
            adm,
        )
        print(
            "* the model's confirm_operation call through ToolPipeline.handle (arguments, "
            "policy, tool_calls row, transition, enqueue) until admitted and enqueued; its "
            "'per s' counts whole book_table + confirm_operation pairs."
        )
        table("Time to worker pickup and execution (ms)", ("interval", "n", "p50", "p99"), pick)
        table(
            "Throughput (ops/s; cost relative to bare INSERT+COMMIT, 20 callers)",
            ("path", "n", "per s", "cost"),
            tp,
        )
    finally:
        drop_database(server, name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    asyncio.run(main(parser.parse_args().quick))
