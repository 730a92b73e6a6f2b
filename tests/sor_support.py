"""Shared helpers for tests that need the demo system of record (a real HTTP service)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from sqlalchemy.ext.asyncio import AsyncEngine

from tools import ledger
from tools.registry import Registry, RetryPolicy, ToolKind, ToolSpec
from tools.restaurant.catalog import BookingRefArgs, BookTableArgs
from tools.restaurant.sor import Faults, SystemOfRecord
from tools.states import OperationStatus

CALLBACK_SECRET = "test-callback-secret"

T = TypeVar("T")


async def start_sor(database_url: str, faults: Faults | None = None) -> SystemOfRecord:
    """A started SOR on an ephemeral port, storing into the test database's `sor` schema."""
    sor = SystemOfRecord(database_url, faults=faults, callback_secret=CALLBACK_SECRET)
    await sor.start()
    return sor


async def wait_for(
    probe: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    *,
    timeout_s: float = 20.0,
    interval_s: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll `probe` until `done(value)`; fail with the last value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    value = await probe()
    while not done(value):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last value: {value!r}")
        await asyncio.sleep(interval_s)
        value = await probe()
    return value


class AppServer:
    """Serve an ASGI app on an ephemeral local port for the duration of a test."""

    def __init__(self, app: object) -> None:
        import uvicorn

        self._server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)  # type: ignore[arg-type]
        )
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> AppServer:
        import socket

        # IPPROTO_TCP so asyncio sets TCP_NODELAY on accepted sockets (no 40 ms stalls).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        server = self._server
        await wait_for(lambda: asyncio.sleep(0, server.started), bool, what="server start")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task


# --- operations on the ledger, run by real executors --------------------------------------

TENANT = "t-test"
BOOKING_ARGS = {"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada"}


def exec_registry(
    *,
    deadline_s: float = 2.0,
    max_attempts: int = 5,
    base_backoff_s: float = 0.05,
    max_backoff_s: float = 0.2,
    total_deadline_s: float = 30.0,
) -> Registry:
    """Booking tools with test-sized deadlines and retries, plus a non-idempotent twin."""
    retry = RetryPolicy(
        max_attempts=max_attempts,
        base_backoff_s=base_backoff_s,
        max_backoff_s=max_backoff_s,
        jitter=0.2,
        total_deadline_s=total_deadline_s,
    )
    book = ToolSpec(
        name="book_table",
        description="Book a table.",
        args_model=BookTableArgs,
        kind=ToolKind.MUTATION,
        provider_action="sor.book_table",
        needs_confirmation=False,
        provider_idempotent=True,
        deadline_s=deadline_s,
        retry=retry,
        reconcile="sor.lookup_by_key",
        compensated_by="cancel_booking",
    )
    return Registry(
        [
            book,
            dataclasses.replace(book, name="book_table_once", provider_idempotent=False),
            ToolSpec(
                name="cancel_booking",
                description="Cancel a booking.",
                args_model=BookingRefArgs,
                kind=ToolKind.MUTATION,
                provider_action="sor.cancel_booking",
                needs_confirmation=False,
                provider_idempotent=True,
                deadline_s=deadline_s,
                retry=retry,
                reconcile="sor.lookup_by_key",
                reference_arg="booking_id",
            ),
        ]
    )


async def admit(
    engine: AsyncEngine,
    enqueue: ledger.Enqueue,
    *,
    tool: str = "book_table",
    args: dict[str, Any] | None = None,
    key: str | None = None,
) -> uuid.UUID:
    """Admit an operation and enqueue it in one transaction, as the gateway does."""
    async with engine.begin() as conn:
        admission = await ledger.admit_operation(
            conn,
            tenant_id=TENANT,
            tool=tool,
            args=args or BOOKING_ARGS,
            idempotency_key=key or f"k-{uuid.uuid4().hex}",
            call_id="call-1",
            caller="+15550001111",
            enqueue=enqueue,
        )
    return admission.operation.operation_id


async def get_op(engine: AsyncEngine, operation_id: uuid.UUID) -> ledger.OperationRecord:
    async with engine.connect() as conn:
        op = await ledger.get_operation(conn, operation_id)
    assert op is not None
    return op


async def events_of(engine: AsyncEngine, operation_id: uuid.UUID) -> list[ledger.EventRecord]:
    async with engine.connect() as conn:
        return await ledger.get_events(conn, operation_id)


async def wait_status(
    engine: AsyncEngine,
    operation_id: uuid.UUID,
    *statuses: OperationStatus,
    timeout_s: float = 20.0,
) -> ledger.OperationRecord:
    """Until the operation reaches one of `statuses`."""
    return await wait_for(
        lambda: get_op(engine, operation_id),
        lambda op: op.status in statuses,
        timeout_s=timeout_s,
        what=f"operation {operation_id} to reach {[s.value for s in statuses]}",
    )


def transitions(events: list[ledger.EventRecord]) -> list[tuple[str | None, str | None]]:
    """(from, to) of each transition event, in order."""
    return [
        (e.from_status.value if e.from_status else None, e.to_status.value if e.to_status else None)
        for e in events
        if e.kind == "transition"
    ]


async def count_jobs(database_url: str) -> int:
    """Operation jobs (deliveries and webhooks have their own queue)."""
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE queue_name = 'operations'"
        )
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])
