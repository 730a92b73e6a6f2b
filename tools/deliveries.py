"""The deliveries ledger: durable work that tells each finished outcome to its caller.

A delivery row is opened by `open_for` inside the transaction that makes an operation
terminal (see `tools.ledger.transition`), together with a NOTIFY to the replica holding the
call and a Procrastinate job, so a restart, a lost notification or a dead replica delays a
delivery and never drops it. Every function runs inside a transaction the caller owns.
`move` is the only code that changes a delivery's state; `record_sms` the only code that
changes an SMS message's status (forward only, see `tools.delivery_states`), with
`report_sms`, its one-statement form for a status callback (the same rows).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import functions

from tools import driver_sql, jobs, tracing
from tools.delivery_models import deliveries_table as dl_t
from tools.delivery_models import delivery_events_table as dev_t
from tools.delivery_models import sms_messages_table as sms_t
from tools.delivery_models import sms_opt_outs_table as opt_t
from tools.delivery_states import (
    SETTLED,
    SMS_FAILURES,
    SMS_FINAL,
    DeliveryState,
    SmsStatus,
    check_delivery_move,
    sms_advances,
)
from tools.ledger_models import OperationRecord
from tools.ledger_models import operation_events_table as ev_t
from tools.ledger_models import operations_table as ops_t
from tools.ledger_models import tool_calls_table as calls_t
from tools.states import IN_FLIGHT, OperationStatus

D = DeliveryState
M = SmsStatus
S = OperationStatus

NOTIFY_CHANNEL = "delivery_ready"

SETTABLE = frozenset(
    {
        "channel",
        "offers",
        "cuts",
        "holder",
        "response_id",
        "message_id",
        "reason",
        "agent",
        "next_attempt_at",
        "offered_at",
        "heard_at",
    }
)


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    """One row of `deliveries`."""

    id: uuid.UUID
    operation_id: uuid.UUID
    tenant_id: str
    call_id: str | None
    caller: str | None
    outcome: OperationStatus
    channel: str
    state: DeliveryState
    offers: int
    cuts: int
    holder: str | None
    response_id: str | None
    message_id: uuid.UUID | None
    reason: str | None
    next_attempt_at: datetime | None
    created_at: datetime
    updated_at: datetime
    offered_at: datetime | None
    heard_at: datetime | None
    finished_at: datetime | None
    agent: str | None = None  # the agent active when it was offered (or kept from it)

    @classmethod
    def from_row(cls, row: Any, prefix: str = "") -> DeliveryRecord:
        return cls.from_mapping(row._mapping, prefix)

    @classmethod
    def from_mapping(cls, m: Any, prefix: str = "") -> DeliveryRecord:
        """From a mapping of column names (a row's, or a dict of `tools.driver_sql`'s)."""
        values = {f.name: m[prefix + f.name] for f in fields(cls)}
        values["state"] = DeliveryState(values["state"])
        values["outcome"] = OperationStatus(values["outcome"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class SmsRecord:
    """One row of `sms_messages`."""

    id: uuid.UUID
    delivery_id: uuid.UUID
    tenant_id: str
    to_number: str
    from_number: str | None
    messaging_service_sid: str | None
    body: str
    reference: str | None
    status: SmsStatus
    message_sid: str | None
    error_code: int | None
    error: str | None
    attempts: int
    requested_by: str
    created_at: datetime
    updated_at: datetime
    attempted_at: datetime | None
    accepted_at: datetime | None
    status_at: datetime | None
    next_check_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> SmsRecord:
        return cls.from_mapping(row._mapping)

    @classmethod
    def from_mapping(cls, m: Any) -> SmsRecord:
        """From a mapping of column names (a row's, or a dict of `tools.driver_sql`'s)."""
        values = {f.name: m[f.name] for f in fields(cls)}
        values["status"] = SmsStatus(values["status"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class DeliveryEvent:
    """One row of `delivery_events`."""

    id: int
    delivery_id: uuid.UUID
    at: datetime
    from_state: str | None
    to_state: str | None
    kind: str
    actor: str
    reason: str | None
    data: dict[str, Any]

    @classmethod
    def from_row(cls, row: Any) -> DeliveryEvent:
        m = row._mapping
        return cls(**{f.name: m[f.name] for f in fields(cls)})


# --- events, notifications, jobs ------------------------------------------------------------


async def record_event(
    conn: AsyncConnection,
    delivery_id: uuid.UUID,
    *,
    kind: str,
    actor: str,
    reason: str | None,
    data: Mapping[str, Any] | None = None,
    from_state: DeliveryState | None = None,
    to_state: DeliveryState | None = None,
) -> None:
    """Append to a delivery's trail (a decision, a note, an SMS status, or a move)."""
    row = {
        "delivery_id": delivery_id,
        "from_state": from_state.value if from_state else None,
        "to_state": to_state.value if to_state else None,
        "kind": kind,
        "actor": actor[:128],
        "reason": reason,
        "data": dict(data or {}),
    }
    kept = conn.info.get(_KEPT_EVENTS)
    if kept is not None:
        kept.append(row)
        return
    await conn.execute(_INSERT_EVENT, row)


# Statements built once, their values passed as parameters: SQLAlchemy then finds the
# compiled form from the statement's memoized cache key, where a statement built per call
# was built, keyed and coerced anew each time.
_INSERT_EVENT = dev_t.insert()

# conn.info key: the trail events `events_together` keeps for one statement at its end.
_KEPT_EVENTS = "voice_agent.delivery_events_kept"


@asynccontextmanager
async def events_together(conn: AsyncConnection) -> AsyncIterator[None]:
    """Inside, the trail events this transaction appends are kept and written in one
    statement when the block ends (in the order they were appended), before the transaction
    can commit; a read of the trail writes them first. Same transaction, same rows: only
    fewer round trips for a batch of decisions. An error inside drops them with the
    transaction it must roll back."""
    if _KEPT_EVENTS in conn.info:
        yield  # already inside one: the outer block writes them
        return
    conn.info[_KEPT_EVENTS] = []
    try:
        yield
        await _write_kept_events(conn)
    finally:
        conn.info.pop(_KEPT_EVENTS, None)


# The kept events in one statement, on the driver connection (tools.driver_sql), their rows one
# JSON document typed by the table itself (`jsonb_populate_recordset`), inserted in the order
# they were appended (their ids, which order a trail, follow it). SQLAlchemy's executemany of
# `_INSERT_EVENT` built a VALUES list for every batch, and psycopg dumped each value in Python:
# ~5% of the delivery worker's busy CPU with 50 SMS at once (bench/delivery.py, py-spy).
_INSERT_EVENTS = sa.text(
    "INSERT INTO delivery_events (delivery_id, from_state, to_state, kind, actor, reason, data)"
    " SELECT r.delivery_id, r.from_state, r.to_state, r.kind, r.actor, r.reason, r.data"
    " FROM jsonb_populate_recordset(CAST(NULL AS delivery_events), CAST(:rows AS jsonb))"
    " WITH ORDINALITY AS r ORDER BY r.ordinality"
)


async def _write_kept_events(conn: AsyncConnection) -> None:
    kept = conn.info.get(_KEPT_EVENTS)
    if kept:
        rows = list(kept)
        kept.clear()
        await driver_sql.execute(conn, _INSERT_EVENTS, {"rows": driver_sql.json_rows(rows)})


async def notify_ready(conn: AsyncConnection, delivery: DeliveryRecord) -> None:
    """Tell every replica (the one holding the call acts) that a delivery wants deciding."""
    payload = json.dumps({"delivery_id": str(delivery.id), "call_id": delivery.call_id})
    await conn.execute(
        sa.select(sa.func.pg_notify(NOTIFY_CHANNEL, sa.bindparam("p", payload, sa.Text)))
    )


async def enqueue(conn: AsyncConnection, delivery_id: uuid.UUID, at: datetime | None = None) -> int:
    """Defer the delivery's job inside this transaction."""
    return await jobs.defer(conn, jobs.DELIVER_TASK, schedule_at=at, delivery_id=str(delivery_id))


async def drop_waiting_jobs(conn: AsyncConnection, delivery_ids: list[uuid.UUID]) -> int:
    """Delete the deliveries' jobs nobody has started, inside this transaction: whoever
    calls this has just decided those deliveries, so the jobs would only find them done.
    (A job already started finds that too; none is touched.)"""
    if not delivery_ids:
        return 0
    result = await conn.execute(
        sa.text(
            "DELETE FROM procrastinate_jobs WHERE status = 'todo' AND task_name = :task "
            "AND args->>'delivery_id' = ANY(:ids)"
        ),
        {"task": jobs.DELIVER_TASK, "ids": [str(i) for i in delivery_ids]},
    )
    return int(result.rowcount or 0)


async def enqueue_sms(
    conn: AsyncConnection, message_id: uuid.UUID, at: datetime | None = None
) -> int:
    """Defer the job that sends, reconciles or polls one SMS, inside this transaction."""
    return await jobs.defer(conn, jobs.SMS_TASK, schedule_at=at, message_id=str(message_id))


# --- deliveries -----------------------------------------------------------------------------


async def open_for(conn: AsyncConnection, op: OperationRecord) -> DeliveryRecord | None:
    """Open the delivery of a terminal operation (in its transition's transaction).

    A call-less operation has nobody to tell (integrators hear it through webhooks). One
    that never reached the provider (declined, expired, withdrawn) is settled at once as
    `not_needed`: the caller was answered in the call when it was withdrawn.
    """
    if op.call_id is None:
        return None
    nothing_done = op.status is S.CANCELLED and op.attempts == 0
    state = D.NOT_NEEDED if nothing_done else D.PENDING
    reason = (
        "never reached the provider: nothing to tell"
        if nothing_done
        else f"the operation ended {op.status.value}"
    )
    delivery_id = uuid.uuid4()
    params: dict[str, Any] = {
        "b_id": delivery_id,
        "b_operation_id": op.operation_id,
        "b_tenant_id": op.tenant_id,
        "b_call_id": op.call_id,
        "b_caller": op.caller,
        "b_outcome": op.status.value,
        "b_reason": reason,
    }
    if _KEPT_EVENTS in conn.info:  # the trail event waits for `events_together`'s statement
        row = (await conn.execute(_open_statement(state, together=False), params)).first()
        if row is None:
            return None
        delivery = DeliveryRecord.from_row(row)
        await record_event(
            conn, delivery.id, kind="transition", actor="ledger", reason=reason, to_state=state
        )
        if state is D.PENDING:
            await notify_ready(conn, delivery)
    else:
        # One statement: the row, its first trail event and (when it wants deciding) the
        # notification, all only when this insert made the row.
        if state is D.PENDING:
            notice = {"delivery_id": str(delivery_id), "call_id": op.call_id}
            params["b_notice"] = json.dumps(notice)
        row = (await conn.execute(_open_statement(state, together=True), params)).first()
        if row is None:
            return None
        delivery = DeliveryRecord.from_row(row)
    if state is D.PENDING:
        await enqueue(conn, delivery.id)
    # The original's delivery may be held until its compensation settles: look again.
    await release_original(conn, op)
    return delivery


@lru_cache(maxsize=8)
def _open_statement(state: DeliveryState, *, together: bool) -> Any:
    """`open_for`'s insert of a delivery in `state` (values as `b_<column>` parameters);
    `together`: with its first trail event and, for a pending one, the `pg_notify` of
    parameter `b_notice`, in one statement."""
    dl = (
        pg_insert(dl_t)
        .values(
            id=sa.bindparam("b_id", type_=dl_t.c.id.type),
            operation_id=sa.bindparam("b_operation_id", type_=dl_t.c.operation_id.type),
            tenant_id=sa.bindparam("b_tenant_id", type_=dl_t.c.tenant_id.type),
            call_id=sa.bindparam("b_call_id", type_=dl_t.c.call_id.type),
            caller=sa.bindparam("b_caller", type_=dl_t.c.caller.type),
            outcome=sa.bindparam("b_outcome", type_=dl_t.c.outcome.type),
            channel="none",
            state=state.value,
            reason=sa.bindparam("b_reason", type_=dl_t.c.reason.type),
            finished_at=sa.func.now() if state in SETTLED else None,
        )
        .on_conflict_do_nothing(index_elements=["operation_id"])
        .returning(*dl_t.c)
    )
    if not together:
        return dl
    opened = dl.cte("dl")
    trail = _first_trail(
        opened.c.id,
        sa.literal(state.value, sa.String),
        sa.bindparam("b_reason", type_=sa.Text),
        "trail",
    )
    cols: list[Any] = [opened]
    if state is D.PENDING:
        notice = sa.bindparam("b_notice", type_=sa.Text)
        cols.append(sa.func.pg_notify(NOTIFY_CHANNEL, notice).label("notified"))
    return sa.select(*cols).add_cte(trail)


def keeps_events(conn: AsyncConnection) -> bool:
    """Whether this transaction is inside `events_together` (its trail events wait)."""
    return _KEPT_EVENTS in conn.info


def open_ctes(upd: Any, to: OperationStatus) -> tuple[Any, Any]:
    """`open_for` inside the statement of the transition to terminal status `to`, which reads
    CTE `upd` (the updated operation): CTE `dl`, the delivery row (`id`, `call_id`, `state`;
    none without a call, or when the operation has one already), and its first trail event,
    the same rows `open_for` writes. The caller adds `NOTIFY_SQL` and `OPEN_JOBS_SQL` (the
    notification and job of a pending one) and, for a compensation, `release_original`."""
    if to is S.CANCELLED:
        # Withdrawn before an attempt (the statement's `upd.attempts`): nothing to tell.
        nothing = "upd.attempts = 0"
        state = f"CASE WHEN {nothing} THEN '{D.NOT_NEEDED.value}' ELSE '{D.PENDING.value}' END"
        reason = (
            f"CASE WHEN {nothing} THEN 'never reached the provider: nothing to tell' "
            f"ELSE 'the operation ended {to.value}' END"
        )
        finished = f"CASE WHEN {nothing} THEN now() END" if D.NOT_NEEDED in SETTLED else "NULL"
    else:
        state, reason = f"'{D.PENDING.value}'", f"'the operation ended {to.value}'"
        finished = "now()" if D.PENDING in SETTLED else "NULL"
    rows = sa.select(
        sa.func.gen_random_uuid(),
        upd.c.operation_id,
        upd.c.tenant_id,
        upd.c.call_id,
        upd.c.caller,
        upd.c.status,
        sa.literal_column("'none'"),
        sa.literal_column(state),
        sa.literal_column(reason),
        sa.literal_column(f"CAST({finished} AS timestamptz)"),
    ).where(upd.c.call_id.is_not(None))
    cols = [
        "id",
        "operation_id",
        "tenant_id",
        "call_id",
        "caller",
        "outcome",
        "channel",
        "state",
        "reason",
        "finished_at",
    ]
    dl = (
        pg_insert(dl_t)
        .from_select(cols, rows, include_defaults=False)  # offers, cuts: the server's 0
        .on_conflict_do_nothing(index_elements=["operation_id"])
        .returning(dl_t.c.id, dl_t.c.call_id, dl_t.c.state, dl_t.c.reason)
        .cte("dl")
    )
    return dl, _first_trail(dl.c.id, dl.c.state, dl.c.reason, "dl_trail")


def _first_trail(delivery_id: Any, state: Any, reason: Any, name: str) -> Any:
    """CTE `name`: a new delivery's first trail event (from nothing to `state`, by the
    ledger), inserted from the delivery row's CTE columns."""
    return (
        dev_t.insert()
        .from_select(
            ["delivery_id", "from_state", "to_state", "kind", "actor", "reason", "data"],
            sa.select(
                delivery_id,
                sa.null(),
                state,
                sa.literal("transition", sa.String),
                sa.literal("ledger", sa.String),
                reason,
                sa.literal({}, dev_t.c.data.type),
            ),
        )
        .cte(name)
    )


# `notify_ready`'s notification of the pending delivery in CTE `dl` (the same payload), and its
# job's row for `jobs.defer_in_statement`.
NOTIFY_SQL = (
    f"(SELECT pg_notify('{NOTIFY_CHANNEL}', '{{\"delivery_id\": \"' || dl.id::text || "
    "'\", \"call_id\": ' || to_json(dl.call_id)::text || '}') "
    f"FROM dl WHERE dl.state = '{D.PENDING.value}')"
)
OPEN_JOBS_SQL = (
    "SELECT jsonb_build_object('delivery_id', dl.id::text) AS args, "
    f"'{jobs.DELIVER_TASK}' AS task FROM dl WHERE dl.state = '{D.PENDING.value}'"
)


async def release_original(conn: AsyncConnection, op: OperationRecord) -> None:
    """A compensation settled (its delivery just opened): the original's delivery may be held
    until then, so look at it again."""
    if op.compensates_operation_id is None:
        return
    original = await for_operation(conn, op.compensates_operation_id)
    if original is not None and original.state is D.PENDING:
        await conn.execute(
            dl_t.update().where(dl_t.c.id == original.id).values(next_attempt_at=None)
        )
        await notify_ready(conn, original)
        await enqueue(conn, original.id)


async def get(
    conn: AsyncConnection,
    delivery_id: uuid.UUID,
    *,
    for_update: bool = False,
    skip_locked: bool = False,
) -> DeliveryRecord | None:
    """The delivery (None when missing, or locked by another transaction and `skip_locked`)."""
    stmt = _GET[(bool(for_update), bool(for_update and skip_locked))]
    # On the driver connection (tools.driver_sql): each delivery job reads its delivery.
    rows = await driver_sql.fetch(conn, stmt, {"b_id": delivery_id})
    return DeliveryRecord.from_mapping(rows[0]) if rows else None


# `get`'s select by (for_update, skip_locked), the id as parameter `b_id`; built once.
_GET_ONE = sa.select(dl_t).where(dl_t.c.id == sa.bindparam("b_id", type_=dl_t.c.id.type))
_GET = {
    (False, False): _GET_ONE,
    (True, False): _GET_ONE.with_for_update(skip_locked=False),
    (True, True): _GET_ONE.with_for_update(skip_locked=True),
}


async def for_operation(conn: AsyncConnection, operation_id: uuid.UUID) -> DeliveryRecord | None:
    row = (await conn.execute(sa.select(dl_t).where(dl_t.c.operation_id == operation_id))).first()
    return DeliveryRecord.from_row(row) if row is not None else None


async def for_call(conn: AsyncConnection, call_id: str) -> list[DeliveryRecord]:
    rows = await conn.execute(
        sa.select(dl_t).where(dl_t.c.call_id == call_id).order_by(dl_t.c.created_at)
    )
    return [DeliveryRecord.from_row(r) for r in rows]


async def events(conn: AsyncConnection, delivery_id: uuid.UUID) -> list[DeliveryEvent]:
    await _write_kept_events(conn)
    rows = await conn.execute(
        sa.select(dev_t).where(dev_t.c.delivery_id == delivery_id).order_by(dev_t.c.id)
    )
    return [DeliveryEvent.from_row(r) for r in rows]


async def move(
    conn: AsyncConnection,
    delivery_id: uuid.UUID,
    from_state: DeliveryState | Iterable[DeliveryState],
    to_state: DeliveryState,
    *,
    actor: str,
    reason: str,
    data: Mapping[str, Any] | None = None,
    locked: DeliveryRecord | None = None,
    **values: Any,
) -> DeliveryRecord | None:
    """Move a delivery `from_state -> to_state` if it is still in `from_state`.

    Illegal edges raise `IllegalTransition`; a lost race returns None and changes nothing.
    The move and its event commit together. `values` may set `SETTABLE` columns. `locked`
    is the row as this transaction already read it FOR UPDATE (saves reading it again).
    """
    froms = check_delivery_move(from_state, to_state)
    to = DeliveryState(to_state)
    unknown = set(values) - SETTABLE
    if unknown:
        raise TypeError(f"move cannot set {sorted(unknown)}")
    current = locked if locked is not None else await get(conn, delivery_id, for_update=True)
    if current is None or current.state not in froms:
        return None
    setv: dict[str, Any] = {"state": to.value, "reason": reason}
    setv.update(values)
    # Plain values go in as parameters of a statement built once per shape; now() stays SQL.
    # Any other SQL expression (no caller passes one) gets a statement of its own.
    stamped = tuple(sorted(k for k, v in setv.items() if isinstance(v, functions.now)))
    if any(isinstance(v, sa.ClauseElement) for k, v in setv.items() if k not in stamped):
        setv.update(updated_at=sa.func.now(), finished_at=sa.func.now() if to in SETTLED else None)
        stmt: Any = dl_t.update().where(dl_t.c.id == delivery_id).values(**setv)
        stmt, params = stmt.returning(*dl_t.c), {}
    else:
        names = tuple(sorted(k for k in setv if k not in stamped))
        stmt = _move_statement(names, stamped, to in SETTLED)
        params = {f"set_{k}": setv[k] for k in names}
        params["b_id"] = delivery_id
    row = (await conn.execute(stmt, params)).first()
    assert row is not None  # the row is locked
    await record_event(
        conn,
        delivery_id,
        kind="transition",
        actor=actor,
        reason=reason,
        data=data,
        from_state=current.state,
        to_state=to,
    )
    moved = DeliveryRecord.from_row(row)
    if tracing.recording():
        await _trace_move(conn, moved, current.state, actor, reason, data)
    return moved


@lru_cache(maxsize=64)
def _move_statement(names: tuple[str, ...], stamped: tuple[str, ...], settled: bool) -> Any:
    """`move`'s update of a delivery (parameter `b_id`): `names` set to parameters
    `set_<name>`, `stamped` and `updated_at` to now(), `finished_at` to now() when `settled`
    or else NULL (parameter `set_finished_at`, passed as None or left out: NULL)."""
    setv: dict[str, Any] = {"updated_at": sa.func.now()}
    for name in names:
        setv[name] = sa.bindparam(f"set_{name}", type_=dl_t.c[name].type)
    for name in stamped:
        setv[name] = sa.func.now()
    setv["finished_at"] = (
        sa.func.now()
        if settled
        else sa.bindparam("set_finished_at", None, type_=dl_t.c.finished_at.type)
    )
    return (
        dl_t.update()
        .where(dl_t.c.id == sa.bindparam("b_id", type_=dl_t.c.id.type))
        .values(**setv)
        .returning(*dl_t.c)
    )


async def trace_carrier(conn: AsyncConnection, operation_id: uuid.UUID) -> dict[str, Any] | None:
    """The data of the operation's first event, where its admission stored the trace context
    (`tools.tracing.carrier`); None when it has no event."""
    row = (
        await conn.execute(
            sa.select(ev_t.c.data)
            .where(ev_t.c.operation_id == operation_id)
            .order_by(ev_t.c.id)
            .limit(1)
        )
    ).first()
    return dict(row[0]) if row is not None and isinstance(row[0], Mapping) else None


async def _trace_move(
    conn: AsyncConnection,
    delivery: DeliveryRecord,
    before: DeliveryState,
    actor: str,
    reason: str,
    data: Mapping[str, Any] | None,
) -> None:
    """A delivery's step as a span in its operation's trace (the call's): whichever process
    takes it (the call's replica announcing, a worker sending the SMS, the status webhook),
    it joins the trace the admission stored on the ledger."""
    parent = tracing.context_from(await trace_carrier(conn, delivery.operation_id))
    with tracing.tracer.start_as_current_span(
        f"delivery {delivery.state.value}",
        context=parent,
        attributes={
            tracing.DELIVERY_ID: str(delivery.id),
            tracing.OPERATION_ID: str(delivery.operation_id),
            tracing.CALL_ID: delivery.call_id or "",
            tracing.AGENT: delivery.agent or "",
            "voice_agent.delivery.channel": delivery.channel,
            "voice_agent.delivery.from_state": before.value,
            "voice_agent.delivery.actor": actor.split(":", 1)[0],
            "voice_agent.delivery.reason": reason[:200],
        },
    ) as span:
        # The spoken acknowledgement: the response and items that said it in the call.
        if delivery.response_id:
            span.set_attribute("gen_ai.response.id", delivery.response_id)
        items = (data or {}).get("item_ids")
        if isinstance(items, list) and items:
            span.set_attribute(tracing.ACK_ITEM_ID, str(items[0]))


async def update(
    conn: AsyncConnection,
    delivery_id: uuid.UUID,
    expected: DeliveryState,
    *,
    actor: str,
    reason: str,
    data: Mapping[str, Any] | None = None,
    **values: Any,
) -> DeliveryRecord | None:
    """Set columns of a delivery still in `expected` (no state change), with a note."""
    unknown = set(values) - SETTABLE
    if unknown:
        raise TypeError(f"update cannot set {sorted(unknown)}")
    row = (
        await conn.execute(
            dl_t.update()
            .where(dl_t.c.id == delivery_id, dl_t.c.state == expected.value)
            .values(updated_at=sa.func.now(), **values)
            .returning(*dl_t.c)
        )
    ).first()
    if row is None:
        return None
    await record_event(conn, delivery_id, kind="note", actor=actor, reason=reason, data=data)
    return DeliveryRecord.from_row(row)


async def defer_until(conn: AsyncConnection, delivery_id: uuid.UUID, at: datetime) -> None:
    """Leave a pending delivery alone until `at` (the sweeper does not re-queue it before)."""
    await conn.execute(
        dl_t.update()
        .where(dl_t.c.id == delivery_id, dl_t.c.state == D.PENDING.value)
        .values(next_attempt_at=at)
    )


async def redrive_for_call(
    conn: AsyncConnection, call_id: str, *, actor: str, reason: str
) -> list[uuid.UUID]:
    """The call is over: unheard offers go back to pending, and every pending delivery of
    the call gets a job (which now chooses SMS). Returns the deliveries re-driven."""
    # On the driver connection (tools.driver_sql): every call's end runs it, and it mostly
    # finds nothing.
    ids = []
    for delivery_id, state in await driver_sql.fetch_tuples(conn, _REDRIVE, {"b_call_id": call_id}):
        if state == D.OFFERED.value:
            await move(
                conn,
                delivery_id,
                D.OFFERED,
                D.PENDING,
                actor=actor,
                reason=f"not heard: {reason}",
                holder=None,
            )
        else:
            await record_event(conn, delivery_id, kind="note", actor=actor, reason=reason)
        await enqueue(conn, delivery_id)
        ids.append(delivery_id)
    return ids


# `redrive_for_call`'s select, the call as `b_call_id`; built once (every call's end runs it).
_REDRIVE = (
    sa.select(dl_t.c.id, dl_t.c.state)
    .where(
        dl_t.c.call_id == sa.bindparam("b_call_id", type_=dl_t.c.call_id.type),
        dl_t.c.state.in_([D.PENDING.value, D.OFFERED.value]),
    )
    .with_for_update()
)


# --- what the relevance gate looks at, from the ledger ---------------------------------------


@dataclass(frozen=True, slots=True)
class Related:
    """Another operation that bears on how an outcome is told."""

    operation_id: uuid.UUID
    tool: str
    status: OperationStatus
    args: dict[str, Any]
    held_by_this: bool
    created_at: datetime


@dataclass(frozen=True, slots=True)
class LedgerContext:
    """The ledger's side of a delivery decision."""

    op: OperationRecord
    # Newer operations of the same caller with the same conflict key (they contradict it).
    conflicts: tuple[Related, ...]
    # Operations compensating this one (a cancel of a booking that went through).
    compensations: tuple[Related, ...]
    # A tool reply in the call already carried this very outcome to the model.
    told_in_reply: bool
    opted_out: bool
    # This compensates an operation whose delivery waited for it: that one tells both.
    told_with_original: bool = False


async def ledger_context(conn: AsyncConnection, op: OperationRecord) -> LedgerContext:
    """Gather what the gate needs to know from the ledger about `op`."""
    conflicts: list[Related] = []
    if op.conflict_key is not None:
        rows = await conn.execute(
            sa.select(ops_t)
            .where(
                ops_t.c.tenant_id == op.tenant_id,
                ops_t.c.caller.is_not_distinct_from(op.caller),
                ops_t.c.conflict_key == op.conflict_key,
                ops_t.c.operation_id != op.operation_id,
                ops_t.c.compensates_operation_id.is_(None),
                ops_t.c.created_at >= op.created_at,
                sa.or_(
                    ops_t.c.status.in_(
                        [S.AWAITING_CONFIRMATION.value, S.COMMITTED.value]
                        + [s.value for s in IN_FLIGHT]
                    ),
                    # Held back by this one and dropped with the call: still worth a word.
                    sa.and_(
                        ops_t.c.status == S.CANCELLED.value,
                        ops_t.c.held_by_operation_id == op.operation_id,
                    ),
                ),
            )
            .order_by(ops_t.c.created_at)
        )
        conflicts = [_related(r, op.operation_id) for r in rows]
    # One round trip for the rest: told already, opted out, waited on by the original.
    told_q = (
        sa.select(sa.literal(1))
        .select_from(calls_t)
        .where(
            calls_t.c.operation_id == op.operation_id,
            calls_t.c.call_id == op.call_id,
            calls_t.c.output["status"].astext == op.status.value,
        )
        .exists()
    )
    opted_q = (
        sa.select(sa.literal(1))
        .select_from(opt_t)
        .where(opt_t.c.phone == op.caller, opt_t.c.opted_out.is_(True))
        .exists()
    )
    held_q = (
        sa.select(sa.literal(1))
        .select_from(dev_t.join(dl_t, dl_t.c.id == dev_t.c.delivery_id))
        .where(
            dl_t.c.operation_id == op.compensates_operation_id,
            dev_t.c.kind == "decision",
            dev_t.c.data["action"].astext == "hold",
        )
        .exists()
    )
    if op.compensates_operation_id is not None:
        await _write_kept_events(conn)  # held_q reads the trail
    comp_q = (
        sa.select(sa.literal(1))
        .select_from(ops_t)
        .where(ops_t.c.compensates_operation_id == op.operation_id)
        .exists()
    )
    flags = (
        await conn.execute(
            sa.select(
                told_q.label("told"),
                opted_q.label("opted_out"),
                (held_q if op.compensates_operation_id is not None else sa.false()).label("held"),
                comp_q.label("compensated"),
            )
        )
    ).one()
    compensations: list[Related] = []
    if flags.compensated:
        comp_rows = await conn.execute(
            sa.select(ops_t)
            .where(ops_t.c.compensates_operation_id == op.operation_id)
            .order_by(ops_t.c.created_at)
        )
        compensations = [_related(r, op.operation_id) for r in comp_rows]
    told, opted_out, with_original = bool(flags.told), bool(flags.opted_out), bool(flags.held)
    return LedgerContext(op, tuple(conflicts), tuple(compensations), told, opted_out, with_original)


async def ledger_contexts(
    conn: AsyncConnection, ops: list[OperationRecord]
) -> dict[uuid.UUID, LedgerContext]:
    """`ledger_context` for many operations (a batch of decisions), in four statements for
    the lot rather than one or two each; the same answers, by operation id. One that
    compensates another (rare) is asked alone: it also reads the original's trail."""
    found: dict[uuid.UUID, LedgerContext] = {}
    for op in ops:
        if op.compensates_operation_id is not None:
            found[op.operation_id] = await ledger_context(conn, op)
    ops = [op for op in ops if op.operation_id not in found]
    if not ops:
        return found
    ids = [op.operation_id for op in ops]
    # Conflicts: the single query's conditions on the ones that depend on each operation
    # (tenant, caller, created since, not itself, held by it) are applied below.
    keys = {op.conflict_key for op in ops if op.conflict_key is not None}
    candidates: list[Any] = []
    if keys:
        candidates = list(
            await driver_sql.fetch_rows(
                conn, _CONFLICT_CANDIDATES, {"keys": list(keys), "ids": ids}
            )
        )
    told = {
        (r.operation_id, r.call_id, r.status)
        for r in await driver_sql.fetch_rows(conn, _TOLD, {"ids": ids})
    }
    callers = {op.caller for op in ops if op.caller is not None}
    opted = (
        {r.phone for r in await driver_sql.fetch_rows(conn, _OPTED_OUT, {"phones": list(callers)})}
        if callers
        else set()
    )
    compensations: dict[uuid.UUID, list[Related]] = {}
    for r in await driver_sql.fetch_rows(conn, _COMPENSATIONS, {"ids": ids}):
        origin = r.compensates_operation_id
        compensations.setdefault(origin, []).append(_related(r, origin))
    for op in ops:
        conflicts = [
            _related(r, op.operation_id)
            for r in candidates
            if op.conflict_key is not None
            and r.conflict_key == op.conflict_key
            and r.tenant_id == op.tenant_id
            and r.caller == op.caller
            and r.operation_id != op.operation_id
            and r.created_at >= op.created_at
            and (r.status != S.CANCELLED.value or r.held_by_operation_id == op.operation_id)
        ]
        found[op.operation_id] = LedgerContext(
            op,
            tuple(conflicts),
            tuple(compensations.get(op.operation_id, ())),
            op.call_id is not None and (op.operation_id, op.call_id, op.status.value) in told,
            op.caller is not None and op.caller in opted,
            False,
        )
    return found


# `ledger_contexts`' statements, built once: the ids, keys and phones are array parameters
# (`= ANY`), so each is one statement text whatever the batch (compiled and prepared once),
# where built per batch with `IN` lists they were half of the function's CPU in a worker.
_IDS = sa.bindparam("ids", type_=ARRAY(ops_t.c.operation_id.type))
_CONFLICT_CANDIDATES = (
    sa.select(ops_t)
    .where(
        ops_t.c.conflict_key
        == sa.any_(sa.bindparam("keys", type_=ARRAY(ops_t.c.conflict_key.type))),
        ops_t.c.compensates_operation_id.is_(None),
        sa.or_(
            ops_t.c.status
            == sa.any_(
                sa.bindparam(
                    "open_statuses",
                    value=[S.AWAITING_CONFIRMATION.value, S.COMMITTED.value]
                    + [s.value for s in IN_FLIGHT],
                    type_=ARRAY(ops_t.c.status.type),
                )
            ),
            sa.and_(
                ops_t.c.status == S.CANCELLED.value,
                ops_t.c.held_by_operation_id == sa.any_(_IDS),
            ),
        ),
    )
    .order_by(ops_t.c.created_at)
)
_TOLD = sa.select(
    calls_t.c.operation_id,
    calls_t.c.call_id,
    calls_t.c.output["status"].astext.label("status"),
).where(calls_t.c.operation_id == sa.any_(_IDS))
_OPTED_OUT = sa.select(opt_t.c.phone).where(
    opt_t.c.phone == sa.any_(sa.bindparam("phones", type_=ARRAY(opt_t.c.phone.type))),
    opt_t.c.opted_out.is_(True),
)
_COMPENSATIONS = (
    sa.select(ops_t)
    .where(ops_t.c.compensates_operation_id == sa.any_(_IDS))
    .order_by(ops_t.c.created_at)
)


def _related(row: Any, origin: uuid.UUID) -> Related:
    return Related(
        operation_id=row.operation_id,
        tool=row.tool,
        status=OperationStatus(row.status),
        args=dict(row.args or {}),
        held_by_this=row.held_by_operation_id == origin,
        created_at=row.created_at,
    )


# --- SMS messages ----------------------------------------------------------------------------


async def create_sms(
    conn: AsyncConnection,
    delivery: DeliveryRecord,
    *,
    to_number: str,
    from_number: str | None,
    messaging_service_sid: str | None,
    body: str,
    reference: str | None,
    requested_by: str,
    check_at: datetime | None = None,
) -> SmsRecord:
    """Persist an SMS for `delivery` (before anything is sent) and defer its job, to run at
    `check_at` (None: at once). A caller that sends right away passes a later time: the job
    is then only the safety net for a crash before the send."""
    params = {
        "id": uuid.uuid4(),
        "delivery_id": delivery.id,
        "tenant_id": delivery.tenant_id,
        "to_number": to_number,
        "from_number": from_number,
        "messaging_service_sid": messaging_service_sid,
        "body": body,
        "reference": reference,
        "status": M.PENDING.value,
        "requested_by": requested_by[:128],
        "next_check_at": check_at,
    }
    row = (await conn.execute(_CREATE_SMS, params)).first()
    assert row is not None
    message = SmsRecord.from_row(row)
    await conn.execute(_TEXT_DELIVERY, {"b_id": delivery.id, "b_message_id": message.id})
    await record_event(
        conn,
        delivery.id,
        kind="sms",
        actor=requested_by,
        reason="SMS persisted, not sent yet",
        data={"message_id": str(message.id), "status": message.status.value},
    )
    await enqueue_sms(conn, message.id, at=check_at)
    return message


# `create_sms`'s statements, built once (the values are parameters; same SQL and rows).
_CREATE_SMS = sms_t.insert().returning(*sms_t.c)
_TEXT_DELIVERY = (
    dl_t.update()
    .where(dl_t.c.id == sa.bindparam("b_id", type_=dl_t.c.id.type))
    .values(
        message_id=sa.bindparam("b_message_id", type_=dl_t.c.message_id.type),
        channel="sms",
        updated_at=sa.func.now(),
    )
)


# `text_many`'s move, one statement text whatever the batch: the rows come as arrays
# (unnested), so SQLAlchemy compiles it once and psycopg prepares it once. A VALUES list of
# the rows instead (`sa.values(...).data(...)`) has no cache key: it was compiled again for
# every batch, most of the SQL compilation a delivery worker did (bench/delivery.py,
# BENCH_PROFILE_WORKER).
_TEXT_MANY_ROWS = (
    sa.func.unnest(
        sa.bindparam("v_ids", type_=ARRAY(dl_t.c.id.type)),
        sa.bindparam("v_reasons", type_=ARRAY(sa.Text())),
        sa.bindparam("v_message_ids", type_=ARRAY(dl_t.c.message_id.type)),
    )
    .table_valued(
        sa.column("id", dl_t.c.id.type),
        sa.column("reason", sa.Text()),
        sa.column("message_id", dl_t.c.message_id.type),
    )
    .render_derived(name="v")
)
_TEXT_MANY_MOVE = (
    dl_t.update()
    .where(dl_t.c.id == _TEXT_MANY_ROWS.c.id, dl_t.c.state == D.PENDING.value)
    .values(
        state=D.TEXTING.value,
        updated_at=sa.func.now(),
        reason=_TEXT_MANY_ROWS.c.reason,
        channel="sms",
        message_id=_TEXT_MANY_ROWS.c.message_id,
        finished_at=None,
    )
    .returning(*dl_t.c)
)


@dataclass(frozen=True, slots=True)
class NewSms:
    """An SMS for `text_many` to persist: the delivery (locked, pending) and what to send."""

    delivery: DeliveryRecord
    reason: str  # why it goes by SMS (the move's reason)
    to_number: str
    body: str
    reference: str | None


# `text_many`'s SMS rows in one statement on the driver connection, one JSON document typed by
# the table (as `_INSERT_EVENTS`); their created and updated times the database's.
_INSERT_SMS_MANY = sa.text(
    "INSERT INTO sms_messages (id, delivery_id, tenant_id, to_number, from_number,"
    " messaging_service_sid, body, reference, status, attempts, requested_by, next_check_at)"
    " SELECT r.id, r.delivery_id, r.tenant_id, r.to_number, r.from_number,"
    " r.messaging_service_sid, r.body, r.reference, r.status, r.attempts, r.requested_by,"
    " r.next_check_at"
    " FROM jsonb_populate_recordset(CAST(NULL AS sms_messages), CAST(:rows AS jsonb)) AS r"
    " RETURNING *"
)


async def text_many(
    conn: AsyncConnection,
    items: list[NewSms],
    *,
    from_number: str | None,
    messaging_service_sid: str | None,
    requested_by: str,
    check_at: datetime | None = None,
) -> list[SmsRecord]:
    """`move` pending -> texting and `create_sms`, for deliveries this transaction read FOR
    UPDATE and has not moved since (a batch of decisions): the same rows, trail events and
    jobs as one by one, in four statements for the lot. A delivery that is no longer
    pending (it cannot be: it is locked) gets nothing."""
    if not items:
        return []
    check_delivery_move(D.PENDING, D.TEXTING)
    ids = {i.delivery.id: uuid.uuid4() for i in items}
    moved_rows = await driver_sql.fetch(
        conn,
        _TEXT_MANY_MOVE,
        {
            "v_ids": [i.delivery.id for i in items],
            "v_reasons": [i.reason for i in items],
            "v_message_ids": [ids[i.delivery.id] for i in items],
        },
    )
    moved = {r["id"]: DeliveryRecord.from_mapping(r) for r in moved_rows}
    items = [i for i in items if i.delivery.id in moved]
    if not items:
        return []
    new_rows = [
        {
            "id": ids[i.delivery.id],
            "delivery_id": i.delivery.id,
            "tenant_id": i.delivery.tenant_id,
            "to_number": i.to_number,
            "from_number": from_number,
            "messaging_service_sid": messaging_service_sid,
            "body": i.body,
            "reference": i.reference,
            "status": M.PENDING.value,
            "attempts": 0,
            "requested_by": requested_by[:128],
            "next_check_at": check_at,
        }
        for i in items
    ]
    inserted = await driver_sql.fetch(
        conn, _INSERT_SMS_MANY, {"rows": driver_sql.json_rows(new_rows)}
    )
    by_id = {r["id"]: SmsRecord.from_mapping(r) for r in inserted}
    messages = [by_id[ids[i.delivery.id]] for i in items]
    for i, message in zip(items, messages, strict=True):
        await record_event(
            conn,
            i.delivery.id,
            kind="transition",
            actor=requested_by,
            reason=i.reason,
            from_state=i.delivery.state,
            to_state=D.TEXTING,
        )
        await record_event(
            conn,
            i.delivery.id,
            kind="sms",
            actor=requested_by,
            reason="SMS persisted, not sent yet",
            data={"message_id": str(message.id), "status": message.status.value},
        )
        if tracing.recording():
            await _trace_move(
                conn, moved[i.delivery.id], i.delivery.state, requested_by, i.reason, None
            )
    await jobs.defer_many(
        conn, jobs.SMS_TASK, [{"message_id": str(m.id)} for m in messages], schedule_at=check_at
    )
    return messages


async def get_sms(
    conn: AsyncConnection, message_id: uuid.UUID, *, for_update: bool = False
) -> SmsRecord | None:
    stmt = _GET_SMS_FOR_UPDATE if for_update else _GET_SMS
    row = (await conn.execute(stmt, {"message_id": message_id})).first()
    return SmsRecord.from_row(row) if row is not None else None


_GET_SMS = sa.select(sms_t).where(sms_t.c.id == sa.bindparam("message_id", type_=sms_t.c.id.type))
_GET_SMS_FOR_UPDATE = _GET_SMS.with_for_update()


async def sms_for_delivery(conn: AsyncConnection, delivery_id: uuid.UUID) -> list[SmsRecord]:
    rows = await conn.execute(
        sa.select(sms_t).where(sms_t.c.delivery_id == delivery_id).order_by(sms_t.c.created_at)
    )
    return [SmsRecord.from_row(r) for r in rows]


async def claim_send(
    conn: AsyncConnection, message_id: uuid.UUID, *, check_after: timedelta
) -> SmsRecord | None:
    """pending -> requesting, attempts + 1: of any number of workers, one sends. None when
    the message is not pending any more (sent, being sent, or settled)."""
    rows = await driver_sql.fetch(
        conn, _CLAIM_SEND, {"message_id": message_id, "check_after": check_after}
    )
    return SmsRecord.from_mapping(rows[0]) if rows else None


# What a claim writes: pending -> requesting, one more attempt, checked after `check_after`.
_CLAIMED = {
    "status": M.REQUESTING.value,
    "attempts": sms_t.c.attempts + 1,
    "attempted_at": sa.func.now(),
    "updated_at": sa.func.now(),
    "next_check_at": sa.func.now() + sa.bindparam("check_after", type_=sa.Interval()),
}
# The claims' statements, built once and run on the driver connection (tools.driver_sql): the
# message ids an array parameter, so one statement text whatever the batch.
_CLAIM_SEND = (
    sms_t.update()
    .where(
        sms_t.c.id == sa.bindparam("message_id", type_=sms_t.c.id.type),
        sms_t.c.status == M.PENDING.value,
    )
    .values(**_CLAIMED)
    .returning(*sms_t.c)
)
_NOT_OPTED_OUT = ~(
    sa.select(sa.literal(1))
    .select_from(opt_t)
    .where(opt_t.c.phone == sms_t.c.to_number, opt_t.c.opted_out.is_(True))
    .exists()
)
_CLAIM_SENDS = (
    sms_t.update()
    .where(
        sms_t.c.id == sa.any_(sa.bindparam("message_ids", type_=ARRAY(sms_t.c.id.type))),
        sms_t.c.status == M.PENDING.value,
        _NOT_OPTED_OUT,
    )
    .values(**_CLAIMED)
    .returning(*sms_t.c)
)


async def claim_sends(
    conn: AsyncConnection, message_ids: list[uuid.UUID], *, check_after: timedelta
) -> list[SmsRecord]:
    """`claim_send` for many messages in one statement, leaving out any whose number opted
    out (their sender records why, one by one). Returns the messages claimed."""
    if not message_ids:
        return []
    rows = await driver_sql.fetch(
        conn, _CLAIM_SENDS, {"message_ids": message_ids, "check_after": check_after}
    )
    return [SmsRecord.from_mapping(r) for r in rows]


async def release_send(
    conn: AsyncConnection, message_id: uuid.UUID, *, at: datetime, error: str
) -> SmsRecord | None:
    """requesting -> pending: the send provably never reached the provider (refused to
    connect, rate limited); it may be tried again from `at`."""
    row = (
        await conn.execute(
            sms_t.update()
            .where(sms_t.c.id == message_id, sms_t.c.status == M.REQUESTING.value)
            .values(
                status=M.PENDING.value,
                next_check_at=at,
                error=error[:500],
                updated_at=sa.func.now(),
            )
            .returning(*sms_t.c)
        )
    ).first()
    if row is None:
        return None
    message = SmsRecord.from_row(row)
    await record_event(
        conn,
        message.delivery_id,
        kind="sms",
        actor="sms",
        reason="SMS not sent; trying again",
        data={"message_id": str(message.id), "status": M.PENDING.value, "error": error[:200]},
    )
    return message


async def sms_by_sid(conn: AsyncConnection, message_sid: str) -> SmsRecord | None:
    row = (await conn.execute(sa.select(sms_t).where(sms_t.c.message_sid == message_sid))).first()
    return SmsRecord.from_row(row) if row is not None else None


async def schedule_sms_check(
    conn: AsyncConnection, message_id: uuid.UUID, at: datetime | None
) -> None:
    """When the sweeper should look at a message again (no status change)."""
    await conn.execute(sms_t.update().where(sms_t.c.id == message_id).values(next_check_at=at))


@dataclass(frozen=True, slots=True)
class SmsUpdate:
    """What recording an SMS status did."""

    message: SmsRecord
    changed: bool
    delivery: DeliveryRecord | None


async def record_sms(
    conn: AsyncConnection,
    message_id: uuid.UUID,
    status: SmsStatus,
    *,
    actor: str,
    source: str,
    message_sid: str | None = None,
    error_code: int | None = None,
    error: str | None = None,
    next_check_at: datetime | None = None,
    not_deliverable: bool = False,
    locked: SmsRecord | None = None,
) -> SmsUpdate | None:
    """Apply a status to a message if it moves it forward; out-of-order and duplicate
    reports change nothing (but a MessageSid learnt from any of them is kept).

    A final status settles the delivery the message carries: delivered -> `texted`;
    undelivered/failed -> `failed`, or `not_deliverable` when the number cannot take SMS.
    `locked` is the message as this transaction already read it FOR UPDATE (saves reading
    it again).
    """
    current = locked if locked is not None else await get_sms(conn, message_id, for_update=True)
    if current is None:
        return None
    values: dict[str, Any] = {}  # set to a parameter
    stamped: list[str] = []  # set to now()
    if message_sid and current.message_sid is None:
        values["message_sid"] = message_sid
        stamped.append("accepted_at")
    changed = sms_advances(current.status, status)
    if changed:
        values.update(status=status.value, next_check_at=next_check_at)
        stamped.append("status_at")
        if error_code is not None:
            values["error_code"] = error_code
        if error is not None:
            values["error"] = error[:500]
        if status in SMS_FINAL:
            stamped.append("finished_at")
    if not values:
        return SmsUpdate(current, False, None)
    params = {f"b_{k}": v for k, v in values.items()}
    params["b_id"] = message_id
    stmt = _record_sms_statement(tuple(values), tuple(stamped))
    row = (await conn.execute(stmt, params)).first()
    assert row is not None
    message = SmsRecord.from_row(row)
    delivery: DeliveryRecord | None = None
    if changed:
        data: dict[str, Any] = {
            "message_id": str(message.id),
            "status": status.value,
            "message_sid": message.message_sid,
            "source": source,
        }
        if error_code is not None:
            data["error_code"] = error_code
        # The status's trail event and the settling move's go in one statement (same rows,
        # same order, same transaction): one round trip fewer for a final status.
        async with events_together(conn):
            await record_event(
                conn,
                message.delivery_id,
                kind="sms",
                actor=actor,
                reason=f"SMS {status.value}",
                data=data,
            )
            delivery = await _settle_by_sms(conn, message, status, actor, not_deliverable)
    return SmsUpdate(message, changed, delivery)


@lru_cache(maxsize=64)
def _record_sms_statement(names: tuple[str, ...], stamped: tuple[str, ...]) -> Any:
    """`record_sms`'s update of a message (parameter `b_id`): `names` set to parameters
    `b_<name>`, `stamped` and `updated_at` to now(), in this order."""
    setv: dict[str, Any] = {"updated_at": sa.func.now()}
    for name in names:
        setv[name] = sa.bindparam(f"b_{name}", type_=sms_t.c[name].type)
    for name in stamped:
        setv[name] = sa.func.now()
    return (
        sms_t.update()
        .where(sms_t.c.id == sa.bindparam("b_id", type_=sms_t.c.id.type))
        .values(**setv)
        .returning(*sms_t.c)
    )


async def _settle_by_sms(
    conn: AsyncConnection,
    message: SmsRecord,
    status: SmsStatus,
    actor: str,
    not_deliverable: bool,
) -> DeliveryRecord | None:
    if status is not M.DELIVERED and status not in SMS_FAILURES:
        return None  # queued, sent...: the delivery stays texting, nothing to settle
    delivery = await get(conn, message.delivery_id, for_update=True)
    if delivery is None or delivery.message_id != message.id:
        return delivery  # an older message of a resent delivery: history only
    if status is M.DELIVERED:
        return await move(
            conn,
            delivery.id,
            D.TEXTING,
            D.TEXTED,
            locked=delivery,
            actor=actor,
            reason="the SMS was delivered",
        )
    if status in SMS_FAILURES:
        target = D.NOT_DELIVERABLE if not_deliverable else D.FAILED
        why = f"the SMS was {status.value}"
        if message.error_code is not None:
            why += f" (Twilio error {message.error_code})"
        moved = await move(
            conn, delivery.id, D.TEXTING, target, locked=delivery, actor=actor, reason=why
        )
        if moved is not None and target is D.NOT_DELIVERABLE:
            # Another channel may take it (a callback, LATE_RESULT_CHANNEL=auto): its job looks.
            await enqueue(conn, delivery.id)
        return moved
    return delivery


@dataclass(frozen=True, slots=True)
class SmsReport:
    """What `report_sms` did: the update (None when the message is missing or the report
    names another MessageSid), or that the report must go through `record_sms`."""

    update: SmsUpdate | None
    foreign_sid: bool = False  # the message has another MessageSid: nothing recorded
    under_lock: bool = False  # it only teaches the MessageSid: `record_sms` does that


async def report_sms(
    conn: AsyncConnection,
    message_id: uuid.UUID,
    status: SmsStatus,
    *,
    actor: str,
    source: str,
    message_sid: str | None = None,
    error_code: int | None = None,
    next_check_at: datetime | None = None,
) -> SmsReport:
    """`record_sms` of a provider's report (a status callback) in one statement, which may
    run without a transaction around it: the message locked and moved forward only from a
    status the report advances (a duplicate or late report changes nothing), its trail
    event, and for a final status the settling move of its delivery (still texting this
    message) with that move's event. The same rows, values and trail order as `record_sms`.

    Not for a report whose delivery would end `not_deliverable` (its job is deferred: use
    `record_sms`). A report that moves nothing but would teach the message its MessageSid
    comes back `under_lock`, unrecorded, for `record_sms`. `update.delivery` is the
    delivery this report settled, if any.
    """
    sid = message_sid or None
    stmt = _report_sms_statement(status, sid is not None, error_code is not None)
    data: dict[str, Any] = {"message_id": str(message_id), "status": status.value}
    data["source"] = source
    params: dict[str, Any] = {
        "b_id": message_id,
        "b_next_check_at": next_check_at,
        "b_actor": actor[:128],
        "b_reason": f"SMS {status.value}",
    }
    if sid is not None:
        params["b_message_sid"] = sid
    if error_code is not None:
        params["b_error_code"] = error_code
        data["error_code"] = error_code
    params["b_data"] = data
    if status in _SETTLES:
        params["b_why"] = f"the SMS was {status.value}"
    # On the driver connection (tools.driver_sql): every status callback runs it.
    rows = await driver_sql.fetch_rows(conn, stmt, params)
    if not rows:
        return SmsReport(None)
    row = rows[0]
    message = SmsRecord.from_mapping(row)
    if not row.changed:
        if message.message_sid and sid and sid != message.message_sid:
            return SmsReport(None, foreign_sid=True)
        if sid and message.message_sid is None:
            return SmsReport(None, under_lock=True)
        return SmsReport(SmsUpdate(message, False, None))
    delivery: DeliveryRecord | None = None
    if status in _SETTLES and row.d_id is not None:
        delivery = DeliveryRecord.from_mapping(row, prefix="d_")
        if tracing.recording():
            await _trace_move(conn, delivery, D.TEXTING, actor, delivery.reason or "", None)
    return SmsReport(SmsUpdate(message, True, delivery))


# The delivery move a final status makes in `report_sms` (the not_deliverable one aside).
_SETTLES: dict[SmsStatus, DeliveryState] = {
    M.DELIVERED: D.TEXTED,
    M.UNDELIVERED: D.FAILED,
    M.FAILED: D.FAILED,
}


@lru_cache(maxsize=32)
def _report_sms_statement(status: SmsStatus, with_sid: bool, with_code: bool) -> Any:
    """`report_sms`'s statement for one shape of report, its values as parameters: `b_id`,
    `b_next_check_at`, `b_actor`, `b_reason`, `b_data` (the trail event's data but its
    `message_sid`), `b_message_sid` and `b_error_code` when given, `b_why` for a final
    status. One row when the message exists: the message (as moved, or as it stood when
    nothing moved), `changed`, and for a final status the settled delivery's columns as
    `d_<name>` (NULL when none moved)."""
    now = sa.func.now()
    message_id = sa.bindparam("b_id", type_=sms_t.c.id.type)
    actor = sa.bindparam("b_actor", type_=dev_t.c.actor.type)
    # Lock the row and read it, as record_sms's SELECT ... FOR UPDATE did.
    old = sa.select(sms_t).where(sms_t.c.id == message_id).with_for_update().cte("old")
    behind = [s.value for s in SmsStatus if sms_advances(s, status)]
    guard: list[sa.ColumnElement[bool]] = [sms_t.c.id == old.c.id, old.c.status.in_(behind)]
    setv: dict[str, Any] = {
        "updated_at": now,
        "status": status.value,
        "next_check_at": sa.bindparam("b_next_check_at", type_=sms_t.c.next_check_at.type),
        "status_at": now,
    }
    if with_sid:
        sid = sa.bindparam("b_message_sid", type_=sms_t.c.message_sid.type)
        # A report naming another MessageSid than the message's changes nothing; one that
        # names it first teaches it (record_sms: only a message without one learns it).
        guard.append(
            sa.or_(old.c.message_sid.is_(None), old.c.message_sid == "", old.c.message_sid == sid)
        )
        setv["message_sid"] = sa.func.coalesce(old.c.message_sid, sid)
        setv["accepted_at"] = sa.case((old.c.message_sid.is_(None), now), else_=old.c.accepted_at)
    if with_code:
        setv["error_code"] = sa.bindparam("b_error_code", type_=sms_t.c.error_code.type)
    if status in SMS_FINAL:
        setv["finished_at"] = now
    upd = sms_t.update().where(*guard).values(**setv).returning(*sms_t.c).cte("upd")
    data = sa.bindparam("b_data", type_=dev_t.c.data.type).op("||", return_type=JSONB)(
        sa.func.jsonb_build_object(sa.literal_column("'message_sid'"), upd.c.message_sid)
    )
    trail: list[Any] = [
        sa.select(
            sa.literal(1).label("n"),
            upd.c.delivery_id.label("delivery_id"),
            sa.cast(sa.null(), sa.String).label("from_state"),
            sa.cast(sa.null(), sa.String).label("to_state"),
            sa.literal("sms", sa.String).label("kind"),
            actor.label("actor"),
            sa.bindparam("b_reason", type_=sa.Text).label("reason"),
            data.label("data"),
        )
    ]
    d = None
    target = _SETTLES.get(status)
    if target is not None:
        check_delivery_move(D.TEXTING, target)
        why: Any = sa.bindparam("b_why", type_=sa.Text)
        if status in SMS_FAILURES:
            why = why + sa.func.coalesce(
                " (Twilio error " + sa.cast(upd.c.error_code, sa.Text) + ")", ""
            )
        # The delivery still texting this message settles (an older message of a resent
        # delivery is history only), as record_sms's move did.
        d = (
            dl_t.update()
            .where(
                dl_t.c.id == upd.c.delivery_id,
                dl_t.c.message_id == upd.c.id,
                dl_t.c.state == D.TEXTING.value,
            )
            .values(state=target.value, reason=why, updated_at=now, finished_at=now)
            .returning(*dl_t.c)
            .cte("d")
        )
        trail.append(
            sa.select(
                sa.literal(2),
                d.c.id,
                sa.literal(D.TEXTING.value, sa.String),
                sa.literal(target.value, sa.String),
                sa.literal("transition", sa.String),
                actor,
                d.c.reason,
                sa.literal({}, dev_t.c.data.type),
            )
        )
    # One insert, in trail order: the status's event, then the move's.
    events = sa.union_all(*trail).subquery("e") if len(trail) > 1 else trail[0].subquery("e")
    names = ["delivery_id", "from_state", "to_state", "kind", "actor", "reason", "data"]
    ev = (
        dev_t.insert()
        .from_select(names, sa.select(*(events.c[n] for n in names)).order_by(events.c.n))
        .cte("ev")
    )
    cols: list[Any] = [
        sa.case((upd.c.id.is_(None), old.c[c.name]), else_=upd.c[c.name]).label(c.name)
        for c in sms_t.c
    ]
    cols.append(upd.c.id.is_not(None).label("changed"))
    joined = old.outerjoin(upd, sa.true())
    if d is not None:
        cols.extend(d.c[c.name].label(f"d_{c.name}") for c in dl_t.c)
        joined = joined.outerjoin(d, sa.true())
    return sa.select(*cols).select_from(joined).add_cte(ev)


@dataclass(frozen=True, slots=True)
class SmsAnswer:
    """A create's answer for `report_answers`: the message, the MessageSid Twilio gave it,
    and when to poll it if no callback moves it on."""

    message_id: uuid.UUID
    message_sid: str
    next_check_at: datetime | None


async def report_answers(
    conn: AsyncConnection,
    status: SmsStatus,
    answers: list[SmsAnswer],
    *,
    actor: str,
    source: str,
) -> list[SmsReport]:
    """`report_sms` of many create answers of one status that settles nothing (queued,
    sent), in one statement that may run without a transaction around it: each message
    locked (in id order) and moved forward only from a status the answer advances, and its
    trail event; the same rows and values as `report_sms` one by one, in the answers' order.
    One report for each answer, in the same order, read as `report_sms`'s: `under_lock` and
    `foreign_sid` ones are unrecorded, for `record_sms`."""
    if status in SMS_FINAL:
        raise ValueError(f"a {status.value} answer settles its delivery: use report_sms")
    if len({a.message_id for a in answers}) != len(answers):
        raise ValueError("one answer per message in a statement")
    if not answers:
        return []
    rows = await driver_sql.fetch_rows(
        conn,
        _report_answers_statement(status),
        {
            "b_ids": [a.message_id for a in answers],
            "b_sids": [a.message_sid for a in answers],
            "b_checks": [a.next_check_at for a in answers],
            "b_actor": actor[:128],
            "b_reason": f"SMS {status.value}",
            "b_status": status.value,
            "b_source": source,
        },
    )
    by_id = {row.id: row for row in rows}
    reports = []
    for answer in answers:
        row = by_id.get(answer.message_id)
        if row is None:
            reports.append(SmsReport(None))
            continue
        message = SmsRecord.from_mapping(row)
        sid = answer.message_sid
        if row.changed:
            reports.append(SmsReport(SmsUpdate(message, True, None)))
        elif message.message_sid and sid != message.message_sid:
            reports.append(SmsReport(None, foreign_sid=True))
        elif message.message_sid is None:
            reports.append(SmsReport(None, under_lock=True))
        else:
            reports.append(SmsReport(SmsUpdate(message, False, None)))
    return reports


@lru_cache(maxsize=8)
def _report_answers_statement(status: SmsStatus) -> Any:
    """`report_answers`'s statement for one status, `report_sms`'s for a queued or sent
    report with a MessageSid, over arrays: `b_ids`, `b_sids`, `b_checks` (one element an
    answer), `b_actor`, `b_reason`, `b_status`, `b_source`. A row for each message that
    exists: as moved, or as it stood when nothing moved, and `changed`."""
    now = sa.func.now()
    answers = (
        sa.func.unnest(
            sa.bindparam("b_ids", type_=ARRAY(sms_t.c.id.type)),
            sa.bindparam("b_sids", type_=ARRAY(sms_t.c.message_sid.type)),
            sa.bindparam("b_checks", type_=ARRAY(sms_t.c.next_check_at.type)),
        )
        .table_valued(
            sa.column("a_id", sms_t.c.id.type),
            sa.column("a_sid", sms_t.c.message_sid.type),
            sa.column("a_check", sms_t.c.next_check_at.type),
            with_ordinality="a_n",
        )
        .render_derived(name="a")
    )
    # Lock the rows and read them, as report_sms does one by one; in id order, so two
    # statements over the same messages cannot each hold one the other waits for.
    old = (
        sa.select(sms_t, answers.c.a_sid, answers.c.a_check, answers.c.a_n)
        .join(answers, answers.c.a_id == sms_t.c.id)
        .order_by(sms_t.c.id)
        .with_for_update(of=sms_t)
        .cte("old")
    )
    behind = [s.value for s in SmsStatus if sms_advances(s, status)]
    upd = (
        sms_t.update()
        .where(
            sms_t.c.id == old.c.id,
            old.c.status.in_(behind),
            sa.or_(
                old.c.message_sid.is_(None),
                old.c.message_sid == "",
                old.c.message_sid == old.c.a_sid,
            ),
        )
        .values(
            updated_at=now,
            status=status.value,
            next_check_at=old.c.a_check,
            status_at=now,
            message_sid=sa.func.coalesce(old.c.message_sid, old.c.a_sid),
            accepted_at=sa.case((old.c.message_sid.is_(None), now), else_=old.c.accepted_at),
        )
        .returning(*sms_t.c)
        .cte("upd")
    )
    data = sa.func.jsonb_build_object(
        sa.literal_column("'message_id'"),
        sa.cast(upd.c.id, sa.Text),
        sa.literal_column("'status'"),
        sa.bindparam("b_status", type_=sa.Text),
        sa.literal_column("'source'"),
        sa.bindparam("b_source", type_=sa.Text),
        sa.literal_column("'message_sid'"),
        upd.c.message_sid,
    )
    names = ["delivery_id", "kind", "actor", "reason", "data"]
    ev = (
        dev_t.insert()
        .from_select(
            names,
            sa.select(
                upd.c.delivery_id,
                sa.literal("sms", sa.String),
                sa.bindparam("b_actor", type_=dev_t.c.actor.type),
                sa.bindparam("b_reason", type_=sa.Text),
                data,
            )
            .select_from(upd.join(old, old.c.id == upd.c.id))
            .order_by(old.c.a_n),
        )
        .cte("ev")
    )
    cols: list[Any] = [
        sa.case((upd.c.id.is_(None), old.c[c.name]), else_=upd.c[c.name]).label(c.name)
        for c in sms_t.c
    ]
    cols.append(upd.c.id.is_not(None).label("changed"))
    return sa.select(*cols).select_from(old.outerjoin(upd, upd.c.id == old.c.id)).add_cte(ev)


async def settle_sent(
    conn: AsyncConnection, message: SmsRecord, *, actor: str, reason: str
) -> DeliveryRecord | None:
    """A message that stays `sent` with no receipt for good: the delivery is done.

    The message is locked before its delivery, as a status callback locks them (the other
    order deadlocked against a receipt arriving at that moment); one that moved on from `sent`
    meanwhile (its receipt came) is left to what moved it."""
    locked = await get_sms(conn, message.id, for_update=True)
    if locked is None or locked.status is not SmsStatus.SENT:
        return None
    delivery = await get(conn, message.delivery_id, for_update=True)
    if delivery is None or delivery.message_id != message.id:
        return None
    await schedule_sms_check(conn, message.id, None)
    return await move(conn, delivery.id, D.TEXTING, D.TEXTED, actor=actor, reason=reason)


# --- opt-outs --------------------------------------------------------------------------------


async def is_opted_out(conn: AsyncConnection, phone: str) -> bool:
    # Built once, on the driver connection (tools.driver_sql): every SMS send asks.
    rows = await driver_sql.fetch_tuples(conn, _IS_OPTED_OUT, {"phone": phone})
    return bool(rows and rows[0][0])


_IS_OPTED_OUT = sa.select(opt_t.c.opted_out).where(
    opt_t.c.phone == sa.bindparam("phone", type_=opt_t.c.phone.type)
)


async def set_opt_out(conn: AsyncConnection, phone: str, *, opted_out: bool, source: str) -> None:
    """Record STOP (opted_out) or START (not) for a number."""
    await conn.execute(
        pg_insert(opt_t)
        .values(phone=phone, opted_out=opted_out, source=source[:64])
        .on_conflict_do_update(
            index_elements=["phone"],
            set_={"opted_out": opted_out, "source": source[:64], "updated_at": sa.func.now()},
        )
    )


# --- the sweeper's queries -------------------------------------------------------------------

_NO_LIVE_JOB = (
    "NOT EXISTS (SELECT 1 FROM procrastinate_jobs j WHERE j.status IN ('todo', 'doing') "
    "AND j.task_name = :task AND j.args->>:arg = {col}::text)"
)


async def pending_without_job(
    conn: AsyncConnection, before: datetime, limit: int = 100
) -> list[uuid.UUID]:
    """Pending deliveries no job will look at (lost with a worker, or nobody claimed)."""
    rows = await conn.execute(
        sa.text(
            "SELECT d.id FROM deliveries d WHERE d.state = 'pending' AND d.updated_at < :before "
            "AND coalesce(d.next_attempt_at, d.updated_at) <= now() AND "
            + _NO_LIVE_JOB.format(col="d.id")
            + " ORDER BY d.updated_at LIMIT :n FOR UPDATE OF d SKIP LOCKED"
        ),
        {"before": before, "n": limit, "task": jobs.DELIVER_TASK, "arg": "delivery_id"},
    )
    return [r.id for r in rows.all()]


async def offers_unreported(
    conn: AsyncConnection, before: datetime, limit: int = 100
) -> list[DeliveryRecord]:
    """Offers handed to a bridge before `before` that never came back heard or cut."""
    rows = await conn.execute(
        sa.select(dl_t)
        .where(dl_t.c.state == D.OFFERED.value, dl_t.c.offered_at < before)
        .order_by(dl_t.c.offered_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return [DeliveryRecord.from_row(r) for r in rows]


async def sms_due(conn: AsyncConnection, now: datetime, limit: int = 100) -> list[uuid.UUID]:
    """Messages whose check is due and that no job is looking at."""
    rows = await conn.execute(
        sa.text(
            "SELECT m.id FROM sms_messages m WHERE m.next_check_at IS NOT NULL "
            "AND m.next_check_at <= :now AND m.status NOT IN ('delivered', 'undelivered', "
            "'failed') AND "
            + _NO_LIVE_JOB.format(col="m.id")
            + " ORDER BY m.next_check_at LIMIT :n FOR UPDATE OF m SKIP LOCKED"
        ),
        {"now": now, "n": limit, "task": jobs.SMS_TASK, "arg": "message_id"},
    )
    return [r.id for r in rows.all()]


async def waiting(conn: AsyncConnection, now: datetime) -> tuple[int, float]:
    """Deliveries not yet at an end (the outcome not yet told, texted or given up), and how
    long the oldest of them has waited, in seconds (0 when none waits)."""
    row = (
        await conn.execute(
            sa.select(sa.func.count(), sa.func.min(dl_t.c.created_at)).where(
                dl_t.c.state.not_in([s.value for s in SETTLED])
            )
        )
    ).one()
    oldest = row[1]
    return int(row[0]), max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0
