"""The operations ledger: async functions over a SQLAlchemy `AsyncConnection`.

Every function runs inside a transaction the caller owns (`async with engine.begin() as
conn`), so admission + enqueue, or a transition + its event + its notification + its
webhook outbox rows + (when terminal) its delivery, commit or roll back together.
`transition` is the only code that changes an operation's status. The records of a row
(`OperationRecord`, ...) live in `tools.ledger_models`, where deliveries and webhooks take them
from without importing this module; they are named here too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from tools import deliveries, driver_sql, jobs, measures, webhooks
from tools.errors import IdempotencyConflict, OperationNotFound
from tools.ledger_models import EventRecord as EventRecord
from tools.ledger_models import OperationRecord as OperationRecord
from tools.ledger_models import ToolCallRecord as ToolCallRecord  # (as callers know them)
from tools.ledger_models import operation_events_table as events_t
from tools.ledger_models import operations_table as ops_t
from tools.ledger_models import tool_calls_table as calls_t
from tools.states import IN_FLIGHT, TERMINAL, OperationStatus, check_transition

S = OperationStatus

NOTIFY_CHANNEL = "operation_status"

log = logging.getLogger(__name__)

# Enqueue the execution of an operation on the admitting transaction's connection. The
# Procrastinate implementation defers on `(await conn.get_raw_connection()).driver_connection`.
Enqueue = Callable[[AsyncConnection, uuid.UUID], Awaitable[None]]

# Columns a transition may set besides the status (timestamps are set by `transition`).
SETTABLE_FIELDS = frozenset(
    {
        "result",
        "error",
        "provider_ref",
        "attempts",
        "deadline",
        "expires_at",
        "next_attempt_at",
        "cancel_requested",
        "overflow",
        "confirmed_by",
        "confirmation",
    }
)


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Admission:
    """The operation an admission maps to, and whether this admission created it."""

    operation: OperationRecord
    created: bool


# --- idempotency -------------------------------------------------------------------------


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def args_hash(args: Mapping[str, Any]) -> str:
    """Stable hash of normalized arguments."""
    return hashlib.sha256(canonical_json(dict(args)).encode()).hexdigest()


def derive_idempotency_key(
    tenant_id: str, scope: str, tool: str, args: Mapping[str, Any], generation: int = 1
) -> str:
    """Key for one human intent: same tenant, same call (or caller), same tool and args.

    `generation` > 1 starts a fresh intent after an earlier one with the same arguments was
    declined, expired or failed for good (a re-ask must not map onto a dead operation).
    """
    digest = hashlib.sha256(
        canonical_json([tenant_id, scope, tool, dict(args), generation]).encode()
    ).hexdigest()
    return f"d:{tool}:{digest[:40]}"


# --- operations --------------------------------------------------------------------------


async def _insert_event(
    conn: AsyncConnection,
    operation_id: uuid.UUID,
    *,
    kind: str,
    actor: str,
    reason: str | None,
    from_status: OperationStatus | None = None,
    to_status: OperationStatus | None = None,
    data: Mapping[str, Any] | None = None,
) -> tuple[int, datetime]:
    params = {
        "operation_id": operation_id,
        "from_status": from_status.value if from_status else None,
        "to_status": to_status.value if to_status else None,
        "kind": kind,
        "actor": actor,
        "reason": reason,
        "data": dict(data or {}),
    }
    row = (await conn.execute(_INSERT_EVENT, params)).first()
    assert row is not None
    return int(row.id), row.at


# Statements built once: the values of a call go in its parameters dict, so SQLAlchemy finds
# the compiled form from the statement's memoized cache key instead of building, keying and
# coercing the statement again on every call (a quarter of a commit's CPU went there).
_INSERT_EVENT = events_t.insert().returning(events_t.c.id, events_t.c.at)
_ADMIT = (
    pg_insert(ops_t)
    .on_conflict_do_nothing(index_elements=["tenant_id", "idempotency_key"])
    .returning(*ops_t.c)
)


def _notice(op: OperationRecord) -> tuple[str, str]:
    """The change's `pg_notify` (channel, payload), sent with its webhook outbox rows."""
    payload = canonical_json(
        {
            "operation_id": str(op.operation_id),
            "status": op.status.value,
            "call_id": op.call_id,
            "tenant_id": op.tenant_id,
        }
    )
    return NOTIFY_CHANNEL, payload


async def admit_operation(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    tool: str,
    args: Mapping[str, Any],
    idempotency_key: str,
    key_source: str = "derived",
    call_id: str | None = None,
    caller: str | None = None,
    turn_id: int | None = None,
    resource: str | None = None,
    status: OperationStatus = S.ADMITTED,
    readback: str | None = None,
    confirm_by: datetime | None = None,
    expires_at: datetime | None = None,
    compensates_operation_id: uuid.UUID | None = None,
    overflow: str | None = None,
    conflict_key: str | None = None,
    held_by_operation_id: uuid.UUID | None = None,
    agent: str | None = None,
    actor: str = "policy",
    reason: str = "admitted by policy",
    data: Mapping[str, Any] | None = None,
    enqueue: Enqueue | None = None,
) -> Admission:
    """Create the operation for an intent (or find the existing one for the same key).

    A new `admitted` operation is enqueued through `enqueue` on this same connection, so the
    row and the job commit together. An existing key with different arguments raises
    `IdempotencyConflict`; with the same arguments it returns that operation unchanged.
    """
    if status not in (S.ADMITTED, S.AWAITING_CONFIRMATION):
        raise ValueError(f"an operation starts as admitted or awaiting_confirmation, not {status}")
    if status is S.ADMITTED and enqueue is None:
        raise ValueError("an admitted operation needs an enqueue hook, or nobody runs it")
    norm = dict(args)
    h = args_hash(norm)
    params = {
        "operation_id": uuid.uuid4(),
        "tenant_id": tenant_id,
        "idempotency_key": idempotency_key,
        "key_source": key_source,
        "call_id": call_id,
        "caller": caller,
        "turn_id": turn_id,
        "tool": tool,
        "args": norm,
        "args_hash": h,
        "resource": resource,
        "status": status.value,
        "readback": readback,
        "confirm_by": confirm_by,
        "expires_at": expires_at,
        "compensates_operation_id": compensates_operation_id,
        "overflow": overflow,
        "conflict_key": conflict_key,
        "held_by_operation_id": held_by_operation_id,
        "agent": agent,
    }
    row = (await conn.execute(_ADMIT, params)).first()
    if row is None:
        # A concurrent insert of the same key waited for the other transaction; the row
        # is committed now and visible to this statement.
        existing = await find_by_idempotency_key(conn, tenant_id, idempotency_key)
        if existing is None:  # pragma: no cover - deleted in between
            raise OperationNotFound(f"operation for key {idempotency_key} vanished")
        if existing.args_hash != h or existing.tool != tool:
            raise IdempotencyConflict(
                f"idempotency key {idempotency_key!r} was used for different arguments"
            )
        return Admission(existing, created=False)
    op = OperationRecord.from_row(row)
    event_id, at = await _insert_event(
        conn,
        op.operation_id,
        kind="transition",
        actor=actor,
        reason=reason,
        to_status=status,
        data=data,
    )
    await webhooks.record_change(conn, op, None, event_id, at, notify=_notice(op))
    if status is S.ADMITTED:
        assert enqueue is not None
        await enqueue(conn, op.operation_id)
    return Admission(op, created=True)


async def transition(
    conn: AsyncConnection,
    operation_id: uuid.UUID,
    from_status: OperationStatus | Iterable[OperationStatus],
    to_status: OperationStatus,
    *,
    actor: str,
    reason: str,
    data: Mapping[str, Any] | None = None,
    attempt: int | None = None,
    alone: bool = False,
    **values: Any,
) -> OperationRecord | None:
    """Move an operation `from_status -> to_status` if it is still in `from_status` (and,
    with `attempt`, still on that attempt: a worker's outcome applies to its own attempt only).

    Illegal edges raise `IllegalTransition` (before touching the database). A lost race
    (the status is no longer one of `from_status`, or a newer attempt began) returns None
    and changes nothing; the row stays locked to the end of the transaction either way. On
    success the row, an `operation_events` row, a `pg_notify`, the integrator webhook
    outbox rows and, for a terminal status, the outcome's delivery (with its job) go out in
    this transaction, and the updated record is returned. `values` may set
    `SETTABLE_FIELDS`.

    `alone`: the whole change is this one statement, so it may run without a transaction
    around it (`tools.autocommit`); an operation whose change would need more (it compensates
    another, whose delivery is then looked at again) or that its caller must follow with more
    (a cancel was requested: the caller compensates it) is left as it is, and None returned as
    for a lost race, for the caller's transaction to do it.
    """
    froms = check_transition(from_status, to_status)
    to = OperationStatus(to_status)
    unknown = set(values) - SETTABLE_FIELDS
    if unknown:
        raise TypeError(f"transition cannot set {sorted(unknown)}")
    # Inside `events_together` the delivery's trail event waits for that block's statement
    # (trail order), so the delivery opens after the statement, as its own statements.
    fused = not deliveries.keeps_events(conn)
    if alone and not fused:
        raise ValueError("a change alone in its statement cannot wait for events_together")
    stmt = _transition_statement(
        tuple(f.value for f in froms), to, attempt is not None, tuple(sorted(values)), fused, alone
    )
    params: dict[str, Any] = {f"set_{k}": v for k, v in values.items()}
    params.update(
        b_operation_id=operation_id, b_actor=actor, b_reason=reason, b_data=dict(data or {})
    )
    if attempt is not None:
        params["b_attempt"] = attempt
    row = (await conn.execute(stmt, params)).first()
    if row is None:
        exists = await conn.scalar(
            sa.select(sa.literal(1)).where(ops_t.c.operation_id == operation_id)
        )
        if exists is None:
            raise OperationNotFound(f"no operation {operation_id}")
        return None  # a lost race: the status is no longer one of `from_status`
    op = OperationRecord.from_row(row)
    if fused:
        # The statement wrote the outbox rows, the delivery and its trail event, sent the
        # notifications and deferred the jobs.
        job_ids = list(row.job_ids or [])
        if to in TERMINAL:
            job_ids += row.delivery_job_ids or []
            if row.delivery_id is not None:
                await deliveries.release_original(conn, op)
        if job_ids:
            log.info("Deferred %d job(s) %s with %s", len(job_ids), job_ids, to.value)
    else:
        prev = OperationStatus(row.prev_status)
        event_id, at = int(row.event_id), row.event_at
        await webhooks.record_change(conn, op, prev, event_id, at, notify=_notice(op))
        if to in TERMINAL:
            # The outcome's delivery is durable work from the moment the outcome exists.
            await deliveries.open_for(conn, op)
    _measure(op, to, row.admitted_at if to is S.COMMITTED else None)
    return op


@lru_cache(maxsize=256)
def _transition_statement(
    froms: tuple[str, ...],
    to: OperationStatus,
    guard_attempt: bool,
    names: tuple[str, ...],
    fused: bool = True,
    alone: bool = False,
) -> sa.Select[Any]:
    """`transition`'s statement for one shape of call, its values left as parameters:
    `b_operation_id`, `b_attempt` (when guarded), `b_actor`, `b_reason`, `b_data` and
    `set_<name>` for each of `names`. (No parameter is named as a column: SQLAlchemy would
    take it for one more column the UPDATE sets.) `fused`: the whole change in this one
    statement, as `webhooks.record_change` and (terminal) `deliveries.open_for` would add it
    in theirs; a lost race matches no row, so none of it happens. `alone`: nor does the
    change of an operation with a cancel requested, or one that compensates another."""
    operation_id = sa.bindparam("b_operation_id", type_=ops_t.c.operation_id.type)
    now = sa.func.now()
    setv: dict[str, Any] = {"status": to.value, "updated_at": now}
    setv.update({n: sa.bindparam(f"set_{n}", type_=ops_t.c[n].type) for n in names})
    if to is S.COMMITTED:
        setv["committed_at"] = now
    if to in TERMINAL:
        setv["finished_at"] = now
    # One statement: lock the row and read its status (as the SELECT ... FOR UPDATE did),
    # update it only from an expected status, append the transition's event, and (for a
    # commit) read when it was admitted for the measure.
    old = (
        sa.select(ops_t.c.operation_id, ops_t.c.status, ops_t.c.attempts)
        .where(ops_t.c.operation_id == operation_id)
        .with_for_update()
        .cte("old")
    )
    guard: list[sa.ColumnElement[bool]] = [old.c.status.in_(list(froms))]
    if guard_attempt:
        guard.append(old.c.attempts == sa.bindparam("b_attempt", type_=ops_t.c.attempts.type))
    if alone:
        guard += [ops_t.c.cancel_requested.is_not(True), ops_t.c.compensates_operation_id.is_(None)]
    upd = (
        ops_t.update()
        .where(ops_t.c.operation_id == old.c.operation_id, *guard)
        .values(**setv)
        .returning(*ops_t.c, old.c.status.label("prev_status"))
        .cte("upd")
    )
    ev = (
        events_t.insert()
        .from_select(
            ["operation_id", "from_status", "to_status", "kind", "actor", "reason", "data"],
            sa.select(
                upd.c.operation_id,
                upd.c.prev_status,
                sa.literal(to.value, sa.String),
                sa.literal("transition", sa.String),
                sa.bindparam("b_actor", type_=sa.String),
                sa.bindparam("b_reason", type_=sa.Text),
                sa.bindparam("b_data", type_=events_t.c.data.type),
            ),
        )
        .returning(events_t.c.id, events_t.c.at)
        .cte("ev")
    )
    cols: list[Any] = [upd, ev.c.id.label("event_id"), ev.c.at.label("event_at")]
    if to is S.COMMITTED:
        # The event this statement appends is not visible here, nor is it an admission.
        cols.append(
            sa.select(sa.func.min(events_t.c.at))
            .where(
                events_t.c.operation_id == operation_id,
                events_t.c.to_status == S.ADMITTED.value,
            )
            .scalar_subquery()
            .label("admitted_at")
        )
    stmt = sa.select(*cols).select_from(upd.join(ev, sa.true()))
    if not fused:
        return stmt
    # Evaluated left to right, once (one row): the operation's notification before the
    # delivery's, the outbox rows' jobs before the delivery's, as the separate statements did.
    wh = webhooks.outbox_cte(upd, ev)
    stmt = stmt.add_columns(
        sa.literal_column(_NOTICE_SQL).label("notified"),
        sa.literal_column(jobs.defer_in_statement(webhooks.OUTBOX_JOBS_SQL)).label("job_ids"),
    ).add_cte(wh)
    if to in TERMINAL:
        dl, trail = deliveries.open_ctes(upd, to)
        stmt = stmt.add_columns(
            sa.select(dl.c.id).scalar_subquery().label("delivery_id"),
            sa.literal_column(deliveries.NOTIFY_SQL).label("delivery_notified"),
            sa.literal_column(jobs.defer_in_statement(deliveries.OPEN_JOBS_SQL)).label(
                "delivery_job_ids"
            ),
        ).add_cte(dl, trail)
    return stmt


# `_notice`'s payload built from CTE `upd`: `canonical_json` of the same four keys.
_NOTICE_SQL = (
    f"pg_notify('{NOTIFY_CHANNEL}', "
    "'{\"call_id\":' || COALESCE(to_json(upd.call_id)::text, 'null') || "
    '\',"operation_id":"\' || upd.operation_id::text || \'","status":\' || '
    "to_json(upd.status)::text || ',\"tenant_id\":' || to_json(upd.tenant_id)::text || '}')"
)


def _measure(op: OperationRecord, to: OperationStatus, admitted_at: datetime | None) -> None:
    """The engine's measures of one transition (tools.measures)."""
    if to is S.COMMITTED:
        measures.committed(admitted_at or op.created_at, op.committed_at)
    elif to is S.FAILED_RETRYABLE:
        measures.TOOL_RETRIES.labels(measures.MUTATION).inc()
    elif to is S.CANCELLED and op.cancel_requested:
        measures.CANCELLATIONS_CONFIRMED.inc()


async def claim_for_execution(
    conn: AsyncConnection,
    operation_id: uuid.UUID,
    *,
    worker_id: str,
    attempt_deadline_s: float,
    now: datetime | None = None,
) -> OperationRecord | None:
    """A worker takes an operation: admitted|failed_retryable -> running, attempts + 1.

    Returns the running record, or None when another worker won, the operation is no
    longer runnable, a cancel was requested (-> cancelled), or its total deadline passed
    before this attempt could start (-> failed_final).
    """
    now = now or _now()
    op = await get_operation(conn, operation_id, for_update=True)
    if op is None:
        raise OperationNotFound(f"no operation {operation_id}")
    runnable = (S.ADMITTED, S.FAILED_RETRYABLE)
    if op.status not in runnable:
        return None
    actor = f"worker:{worker_id}"
    if op.cancel_requested:
        await transition(
            conn, operation_id, op.status, S.CANCELLED, actor=actor, reason="cancel requested"
        )
        return None
    if op.expires_at is not None and now >= op.expires_at:
        await transition(
            conn,
            operation_id,
            op.status,
            S.FAILED_FINAL,
            actor=actor,
            reason="deadline passed before the attempt started",
            error=op.error or "deadline passed",
        )
        return None
    return await transition(
        conn,
        operation_id,
        op.status,
        S.RUNNING,
        actor=actor,
        reason=f"attempt {op.attempts + 1}",
        attempts=op.attempts + 1,
        deadline=now + timedelta(seconds=attempt_deadline_s),
        next_attempt_at=None,
    )


async def request_cancel(
    conn: AsyncConnection, operation_id: uuid.UUID, *, actor: str, reason: str
) -> OperationRecord:
    """Mark a cancel request. Nothing sent yet -> cancelled now; else the provider decides.

    A finished operation is left as it is (undoing a committed one is compensation, a new
    operation); the request is still recorded in its trail.
    """
    op = await get_operation(conn, operation_id, for_update=True)
    if op is None:
        raise OperationNotFound(f"no operation {operation_id}")
    if op.status in TERMINAL:
        await _insert_event(
            conn,
            operation_id,
            kind="decision",
            actor=actor,
            reason=f"cancel requested after the outcome was final: {reason}",
            data={"cancel_requested": False},
        )
        return op
    if not op.cancel_requested:
        measures.CANCELLATIONS_REQUESTED.inc()
    row = (
        await conn.execute(
            ops_t.update()
            .where(ops_t.c.operation_id == operation_id)
            .values(cancel_requested=True, updated_at=sa.func.now())
            .returning(*ops_t.c)
        )
    ).first()
    assert row is not None
    op = OperationRecord.from_row(row)
    await _insert_event(
        conn,
        operation_id,
        kind="decision",
        actor=actor,
        reason=reason,
        data={"cancel_requested": True},
    )
    if op.status in (S.AWAITING_CONFIRMATION, S.ADMITTED, S.FAILED_RETRYABLE):
        done = await transition(
            conn, operation_id, op.status, S.CANCELLED, actor=actor, reason=reason
        )
        if done is not None:
            return done
    return op


async def record_event(
    conn: AsyncConnection,
    operation_id: uuid.UUID,
    *,
    kind: str,
    actor: str,
    reason: str,
    data: Mapping[str, Any] | None = None,
) -> None:
    """Append a decision or note (no status change) to an operation's trail."""
    if kind == "transition":
        raise ValueError("transitions are recorded by transition() only")
    await _insert_event(conn, operation_id, kind=kind, actor=actor, reason=reason, data=data)


async def get_operation(
    conn: AsyncConnection, operation_id: uuid.UUID, *, for_update: bool = False
) -> OperationRecord | None:
    stmt = sa.select(ops_t).where(ops_t.c.operation_id == operation_id)
    if for_update:
        stmt = stmt.with_for_update()
    row = (await conn.execute(stmt)).first()
    return OperationRecord.from_row(row) if row is not None else None


async def get_events(conn: AsyncConnection, operation_id: uuid.UUID) -> list[EventRecord]:
    rows = await conn.execute(
        sa.select(events_t).where(events_t.c.operation_id == operation_id).order_by(events_t.c.id)
    )
    return [EventRecord.from_row(r) for r in rows]


async def find_by_idempotency_key(
    conn: AsyncConnection, tenant_id: str, idempotency_key: str
) -> OperationRecord | None:
    row = (
        await conn.execute(
            sa.select(ops_t).where(
                ops_t.c.tenant_id == tenant_id, ops_t.c.idempotency_key == idempotency_key
            )
        )
    ).first()
    return OperationRecord.from_row(row) if row is not None else None


async def operations_for_call(
    conn: AsyncConnection,
    call_id: str,
    statuses: Iterable[OperationStatus] | None = None,
) -> list[OperationRecord]:
    stmt = _operations_for_call(None if statuses is None else tuple(s.value for s in statuses))
    # On the driver connection (tools.driver_sql): every call's end runs it.
    rows = await driver_sql.fetch(conn, stmt, {"b_call_id": call_id})
    return [OperationRecord.from_mapping(r) for r in rows]


@lru_cache(maxsize=32)
def _operations_for_call(statuses: tuple[str, ...] | None) -> Any:
    """`operations_for_call`'s select, the call as `b_call_id`: built once per set of statuses
    (every call's end runs it)."""
    call_id = sa.bindparam("b_call_id", type_=ops_t.c.call_id.type)
    stmt = sa.select(ops_t).where(ops_t.c.call_id == call_id).order_by(ops_t.c.created_at)
    if statuses is not None:
        stmt = stmt.where(ops_t.c.status.in_(list(statuses)))
    return stmt


async def find_by_provider_ref(
    conn: AsyncConnection, tenant_id: str, tool: str, provider_ref: str
) -> OperationRecord | None:
    """The committed operation of `tool` that produced `provider_ref` (e.g. a booking id)."""
    row = (
        await conn.execute(
            sa.select(ops_t)
            .where(
                ops_t.c.tenant_id == tenant_id,
                ops_t.c.tool == tool,
                ops_t.c.provider_ref == provider_ref,
                ops_t.c.status == S.COMMITTED.value,
            )
            .order_by(ops_t.c.created_at.desc())
            .limit(1)
        )
    ).first()
    return OperationRecord.from_row(row) if row is not None else None


async def count_recent_mutations(
    conn: AsyncConnection, tenant_id: str, *, window: timedelta, caller: str | None = None
) -> int:
    """Operations admitted within `window` of the database clock (a caller, or the tenant)."""
    since = sa.func.now() - window
    stmt = (
        sa.select(sa.func.count())
        .select_from(ops_t)
        .where(
            ops_t.c.tenant_id == tenant_id,
            ops_t.c.created_at >= since,
            # Requests never confirmed are not actions taken.
            ops_t.c.status != S.AWAITING_CONFIRMATION.value,
            sa.not_(sa.and_(ops_t.c.status == S.CANCELLED.value, ops_t.c.attempts == 0)),
        )
    )
    if caller is not None:
        stmt = stmt.where(ops_t.c.caller == caller)
    return int((await conn.execute(stmt)).scalar_one())


async def count_in_flight(conn: AsyncConnection, tenant_id: str, resource: str) -> int:
    """Operations on `resource` that are admitted, running, retrying or unresolved."""
    stmt = (
        sa.select(sa.func.count())
        .select_from(ops_t)
        .where(
            ops_t.c.tenant_id == tenant_id,
            ops_t.c.resource == resource,
            ops_t.c.status.in_([s.value for s in IN_FLIGHT]),
        )
    )
    return int((await conn.execute(stmt)).scalar_one())


async def lock_scope(conn: AsyncConnection, *parts: str) -> None:
    """Serialize admissions that count against the same limits (transaction-scoped)."""
    await conn.execute(
        sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtextextended("|".join(parts), 0)))
    )


async def list_running_past_deadline(
    conn: AsyncConnection, now: datetime, limit: int = 100
) -> list[OperationRecord]:
    """For the sweeper: running operations whose attempt deadline has passed."""
    rows = await conn.execute(
        sa.select(ops_t)
        .where(ops_t.c.status == S.RUNNING.value, ops_t.c.deadline < now)
        .order_by(ops_t.c.deadline)
        .limit(limit)
    )
    return [OperationRecord.from_row(r) for r in rows]


async def list_expired_confirmations(
    conn: AsyncConnection, now: datetime, limit: int = 100
) -> list[OperationRecord]:
    rows = await conn.execute(
        sa.select(ops_t)
        .where(ops_t.c.status == S.AWAITING_CONFIRMATION.value, ops_t.c.confirm_by < now)
        .order_by(ops_t.c.confirm_by)
        .limit(limit)
    )
    return [OperationRecord.from_row(r) for r in rows]


async def expire_confirmations(
    conn: AsyncConnection, now: datetime, *, actor: str = "sweeper", limit: int = 100
) -> list[uuid.UUID]:
    """Cancel confirmations whose window has passed; returns the ids cancelled."""
    done = []
    for op in await list_expired_confirmations(conn, now, limit):
        moved = await transition(
            conn,
            op.operation_id,
            S.AWAITING_CONFIRMATION,
            S.CANCELLED,
            actor=actor,
            reason="confirmation expired",
        )
        if moved is not None:
            done.append(op.operation_id)
    return done


# --- tool calls --------------------------------------------------------------------------


async def record_tool_call(
    conn: AsyncConnection,
    *,
    call_id: str,
    function_call_id: str,
    tenant_id: str,
    tool: str,
    raw_arguments: str,
    turn_id: int | None = None,
    response_id: str | None = None,
    item_id: str | None = None,
) -> tuple[ToolCallRecord, bool]:
    """Record the model's function call `function_call_id` in our call `call_id` (the
    column `provider_call_id`); returns (row, created). A duplicate delivery of the same
    function call in the same call returns the first row and False."""
    stmt = (
        pg_insert(calls_t)
        .values(
            call_id=call_id,
            provider_call_id=function_call_id,
            tenant_id=tenant_id,
            turn_id=turn_id,
            response_id=response_id,
            item_id=item_id,
            tool=tool,
            raw_arguments=raw_arguments,
        )
        .on_conflict_do_nothing(index_elements=["call_id", "provider_call_id"])
        .returning(*calls_t.c)
    )
    row = (await conn.execute(stmt)).first()
    if row is not None:
        return ToolCallRecord.from_row(row), True
    existing = await get_tool_call(conn, call_id, function_call_id)
    assert existing is not None
    return existing, False


async def complete_tool_call(
    conn: AsyncConnection,
    tool_call_id: int,
    *,
    decision: str,
    reason: str | None = None,
    arguments: Mapping[str, Any] | None = None,
    operation_id: uuid.UUID | None = None,
    output: Mapping[str, Any] | None = None,
) -> None:
    """Store what became of a function call: the decision, its operation, what we answered."""
    await conn.execute(
        calls_t.update()
        .where(calls_t.c.id == tool_call_id)
        .values(
            decision=decision,
            decision_reason=reason,
            arguments=dict(arguments) if arguments is not None else None,
            operation_id=operation_id,
            output=dict(output) if output is not None else None,
            completed_at=sa.func.now(),
        )
    )


async def get_tool_call(
    conn: AsyncConnection, call_id: str, function_call_id: str
) -> ToolCallRecord | None:
    """The `tool_calls` row of the model's function call `function_call_id` in our call."""
    row = (
        await conn.execute(
            sa.select(calls_t).where(
                calls_t.c.call_id == call_id, calls_t.c.provider_call_id == function_call_id
            )
        )
    ).first()
    return ToolCallRecord.from_row(row) if row is not None else None


async def tool_calls_for_operation(
    conn: AsyncConnection, operation_id: uuid.UUID
) -> list[ToolCallRecord]:
    rows = await conn.execute(
        sa.select(calls_t).where(calls_t.c.operation_id == operation_id).order_by(calls_t.c.id)
    )
    return [ToolCallRecord.from_row(r) for r in rows]
