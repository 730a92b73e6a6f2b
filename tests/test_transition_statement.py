"""A transition in one statement (`ledger.transition`: the update, its event, the webhook outbox
rows, the notifications, the delivery with its first trail event, and every job) writes what
the separate statements wrote (the path `transition` still takes inside
`deliveries.events_together`): the same rows and values, the same jobs in the same order, the
same notifications with the same payloads in the same order, for every kind of transition, with
and without a call, with webhook subscriptions, for a compensation, and for a lost race
(nothing). The executor's commit without a transaction (`alone`) writes the same again."""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tests.delivery_support import make_call
from tools import deliveries, ledger, webhooks
from tools.autocommit import autocommit
from tools.states import OperationStatus

S = OperationStatus
# A quote and a non-ASCII letter: the payloads built by Postgres must escape as Python does.
TENANT = 'caf\u00e9 "q"'
CHANNELS = (ledger.NOTIFY_CHANNEL, deliveries.NOTIFY_CHANNEL, "procrastinate_any_queue_v1")


async def _noop_enqueue(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
    """Admission's job is not what this file compares."""


class Case:
    """A start (`steps` from admission, each `(to, values)`) and the transition compared."""

    def __init__(
        self,
        name: str,
        steps: list[tuple[OperationStatus, dict[str, Any]]],
        froms: tuple[OperationStatus, ...],
        to: OperationStatus,
        *,
        call: bool = True,
        start: OperationStatus = S.ADMITTED,
        attempt: int | None = None,
        compensation: bool = False,
        values: dict[str, Any] | None = None,
        moves: bool = True,
    ) -> None:
        self.name, self.steps, self.froms, self.to = name, steps, froms, to
        self.call, self.start, self.attempt = call, start, attempt
        self.compensation, self.values, self.moves = compensation, values or {}, moves


RUNNING = [(S.RUNNING, {"attempts": 1})]
CASES = [
    Case(
        "commit",
        RUNNING,
        (S.RUNNING, S.UNKNOWN),
        S.COMMITTED,
        attempt=1,
        values={"result": {"ok": True, "note": 't\u00e9 "x"\n'}, "provider_ref": "r1"},
    ),
    Case("commit without a call", RUNNING, (S.RUNNING,), S.COMMITTED, call=False),
    Case(
        "commit from unknown",
        [*RUNNING, (S.UNKNOWN, {"error": "lost"})],
        (S.RUNNING, S.UNKNOWN),
        S.COMMITTED,
        attempt=1,
        values={"result": {"n": 1.5}, "error": None},
    ),
    Case("fail", RUNNING, (S.RUNNING,), S.FAILED_FINAL, values={"error": "refused"}),
    Case("fail before running", [], (S.ADMITTED,), S.FAILED_FINAL, values={"error": "late"}),
    Case(
        "cancel before any attempt",
        [],
        (S.AWAITING_CONFIRMATION,),
        S.CANCELLED,
        start=S.AWAITING_CONFIRMATION,
    ),
    Case("cancel after an attempt", RUNNING, (S.RUNNING,), S.CANCELLED),
    Case("lost answer", RUNNING, (S.RUNNING,), S.UNKNOWN, values={"error": "timeout"}),
    Case(
        "retry later",
        RUNNING,
        (S.RUNNING, S.UNKNOWN),
        S.FAILED_RETRYABLE,
        values={"next_attempt_at": datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)},
    ),
    Case("claim", [], (S.ADMITTED, S.FAILED_RETRYABLE), S.RUNNING, values={"attempts": 1}),
    Case(
        "compensation commits",
        RUNNING,
        (S.RUNNING,),
        S.COMMITTED,
        compensation=True,
        values={"result": {}},
    ),
    Case("lost race: another attempt", RUNNING, (S.RUNNING,), S.COMMITTED, attempt=2, moves=False),
    Case("lost race: another status", [], (S.RUNNING,), S.COMMITTED, moves=False),
]


async def _admit(conn: AsyncConnection, status: OperationStatus, **kw: Any) -> uuid.UUID:
    adm = await ledger.admit_operation(
        conn,
        tenant_id=TENANT,
        tool="book_table",
        args={"party": 2, "name": "Z\u00f6e"},
        idempotency_key=f"k-{uuid.uuid4()}",
        caller="+15550001",
        status=status,
        enqueue=_noop_enqueue,
        **kw,
    )
    return adm.operation.operation_id


async def _setup(engine: AsyncEngine, case: Case) -> uuid.UUID:
    call_id = await make_call(engine) if case.call else None
    compensates = None
    if case.compensation:
        # The original, committed, its delivery held until the compensation settles.
        async with engine.begin() as conn:
            compensates = await _admit(conn, S.ADMITTED, call_id=call_id)
            await ledger.transition(
                conn, compensates, S.ADMITTED, S.RUNNING, actor="t", reason="go"
            )
            await ledger.transition(
                conn, compensates, S.RUNNING, S.COMMITTED, actor="t", reason="ok"
            )
            await conn.execute(
                sa.text(
                    "UPDATE deliveries SET next_attempt_at = now() + interval '1 hour' "
                    "WHERE operation_id = :op"
                ),
                {"op": compensates},
            )
    async with engine.begin() as conn:
        op_id = await _admit(
            conn, case.start, call_id=call_id, compensates_operation_id=compensates
        )
        prev = case.start
        for to, values in case.steps:
            moved = await ledger.transition(
                conn, op_id, prev, to, actor="t", reason="step", **values
            )
            assert moved is not None
            prev = to
    return op_id


Run = Callable[[AsyncEngine, Case, uuid.UUID], Awaitable[Any]]


async def _separate(engine: AsyncEngine, case: Case, op_id: uuid.UUID) -> Any:
    async with engine.begin() as conn, deliveries.events_together(conn):
        return await _move(conn, case, op_id)


async def _together(engine: AsyncEngine, case: Case, op_id: uuid.UUID) -> Any:
    async with engine.begin() as conn:
        return await _move(conn, case, op_id)


async def _alone(engine: AsyncEngine, case: Case, op_id: uuid.UUID) -> Any:
    async with autocommit(engine) as conn:
        return await _move(conn, case, op_id, alone=True)


async def _move(conn: AsyncConnection, case: Case, op_id: uuid.UUID, **kw: Any) -> Any:
    return await ledger.transition(
        conn,
        op_id,
        case.froms,
        case.to,
        actor="worker-1",
        reason="the provider answered",
        data={"attempt": 1, "why": "\u00e9"},
        attempt=case.attempt,
        **kw,
        **case.values,
    )


async def _listen(url: str) -> psycopg.AsyncConnection[Any]:
    listener = await psycopg.AsyncConnection.connect(url, autocommit=True)
    for channel in CHANNELS:
        await listener.execute(f'LISTEN "{channel}"')
    return listener


async def _heard(listener: psycopg.AsyncConnection[Any]) -> list[tuple[str, str]]:
    heard = []
    async for n in listener.notifies(timeout=0.3):
        heard.append((n.channel, n.payload))
    return heard


async def _world(engine: AsyncEngine, url: str, case: Case, run: Run) -> dict[str, Any]:
    """Set the case up in this database, run its transition one way, and read what it left."""
    async with engine.begin() as conn:
        for t in (TENANT, TENANT, "another tenant"):
            await webhooks.subscribe(conn, tenant_id=t, url="https://example.com/hook")
    op_id = await _setup(engine, case)
    async with engine.connect() as conn:
        jobs_before = await conn.scalar(
            sa.text("SELECT coalesce(max(id), 0) FROM procrastinate_jobs")
        )
        events_before = await conn.scalar(
            sa.text("SELECT coalesce(max(id), 0) FROM operation_events")
        )
        hooks_before = await conn.scalar(sa.text("SELECT count(*) FROM webhook_deliveries"))
        trails_before = await conn.scalar(
            sa.text("SELECT coalesce(max(id), 0) FROM delivery_events")
        )
    async with AsyncExitStack() as stack:
        listener = await _listen(url)
        stack.push_async_callback(listener.close)
        moved = await run(engine, case, op_id)
        heard = await _heard(listener)
    assert (moved is not None) is case.moves, case.name

    async def rows(sql: str, **params: Any) -> list[dict[str, Any]]:
        async with engine.connect() as conn:
            return [dict(r._mapping) for r in await conn.execute(sa.text(sql), params)]

    events = await rows("SELECT * FROM operation_events WHERE id > :b ORDER BY id", b=events_before)
    seq = {e["id"]: f"event{i}" for i, e in enumerate(events)}
    hooks = await rows(
        "SELECT * FROM webhook_deliveries ORDER BY created_at, id OFFSET :b", b=hooks_before
    )
    for h in hooks:
        h["id"] = "hook"  # random, and random order among one change's rows
        h["operation_event_id"] = seq.get(h["operation_event_id"], h["operation_event_id"])
        data = h["payload"]["data"]
        data["sequence"] = seq.get(data["sequence"], data["sequence"])
    hooks.sort(key=lambda h: str(h["subscription_id"]))
    for e in events:
        e["id"] = seq[e["id"]]
    jobs = await rows(
        "SELECT queue_name, task_name, priority, lock, queueing_lock, args, status, "
        "scheduled_at, attempts FROM procrastinate_jobs WHERE id > :b ORDER BY id",
        b=jobs_before,
    )
    world = {
        "returned": None if moved is None else dataclasses.asdict(moved),
        "operations": await rows("SELECT * FROM operations ORDER BY created_at"),
        "events": events,
        "webhook_deliveries": hooks,
        "deliveries": await rows("SELECT * FROM deliveries ORDER BY created_at, operation_id"),
        "delivery_events": await rows(
            "SELECT * FROM delivery_events WHERE id > :b ORDER BY id", b=trails_before
        ),
        "jobs": jobs,
        "notifications": heard,
    }
    for e in world["delivery_events"]:
        e.pop("id")
    return world


def _plain(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_TIME = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d)?")
_JOB_ID = re.compile(r'job_id(\\?)" ?: ?\d+')


def _normalized(world: dict[str, Any]) -> str:
    """The world as text, each id and instant replaced by the order it first appears in (the
    form of a timestamp kept: 'T' or ' ', microseconds or not, its offset)."""
    text = json.dumps(world, default=_plain, sort_keys=True, ensure_ascii=False, indent=1)
    ids: dict[str, str] = {}
    text = _UUID.sub(lambda m: ids.setdefault(m.group(), f"<id{len(ids)}>"), text)
    text = _JOB_ID.sub(r'job_id\1": <job>', text)
    times: dict[datetime, str] = {}

    def instant(m: re.Match[str]) -> str:
        at = datetime.fromisoformat(m.group())
        if at.year > 2030:
            return m.group()  # a value the case set, not a clock
        token = times.setdefault(at, f"<t{len(times)}>")
        return f"{token}{m.group()[10]}{'us' if m.group(1) else ''}{m.group(2) or ''}"

    return _TIME.sub(instant, text)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_one_statement_writes_what_the_separate_statements_wrote(
    engine: AsyncEngine, case: Case
) -> None:
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    runs: list[tuple[str, Run]] = [("separate", _separate), ("together", _together)]
    if case.to is S.COMMITTED and not case.compensation:
        runs.append(("alone", _alone))
    worlds = {}
    for name, run in runs:
        async with engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "TRUNCATE operations, operation_events, webhook_subscriptions, "
                    "webhook_deliveries, deliveries, delivery_events, calls CASCADE"
                )
            )
        worlds[name] = _normalized(await _world(engine, url, case, run))
    reference = worlds.pop("separate")
    for name, text in worlds.items():
        diff = "\n".join(
            difflib.unified_diff(reference.splitlines(), text.splitlines(), lineterm="")
        )
        assert not diff, f"{case.name}: {name} differs:\n{diff}"
    if case.moves:
        assert "send_webhook" in reference  # the case did reach the outbox
    print(case.name, "same rows, jobs and notifications on", ", ".join(worlds))


async def test_alone_leaves_a_cancel_requested_commit_to_the_transaction(
    engine: AsyncEngine,
) -> None:
    op_id = await _setup(engine, RUNNING_CASE)
    async with engine.begin() as conn:
        await conn.execute(
            sa.text("UPDATE operations SET cancel_requested = true WHERE operation_id = :op"),
            {"op": op_id},
        )
    async with autocommit(engine) as conn:
        assert await _move(conn, RUNNING_CASE, op_id, alone=True) is None
        status = await conn.scalar(
            sa.text("SELECT status FROM operations WHERE operation_id = :op"), {"op": op_id}
        )
        opened = await conn.scalar(sa.text("SELECT count(*) FROM deliveries"))
    assert (status, opened) == ("running", 0)
    async with engine.begin() as conn:
        done = await _move(conn, RUNNING_CASE, op_id)
    assert done is not None and done.cancel_requested


RUNNING_CASE = CASES[0]


async def test_transitions_at_once_still_serialize(engine: AsyncEngine) -> None:
    """Two commits of one operation at once, one statement each: one wins, one delivery."""
    op_id = await _setup(engine, RUNNING_CASE)
    results = await asyncio.gather(
        _together(engine, RUNNING_CASE, op_id), _alone(engine, RUNNING_CASE, op_id)
    )
    assert sum(r is not None for r in results) == 1
    async with engine.connect() as conn:
        counts = (
            await conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM deliveries), "
                    "(SELECT count(*) FROM operation_events WHERE to_status = 'committed'), "
                    "(SELECT count(*) FROM procrastinate_jobs WHERE task_name = 'deliver_outcome')"
                )
            )
        ).one()
    assert tuple(counts) == (1, 1, 1)
