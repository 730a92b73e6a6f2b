"""The operations list, open ones first, and one operation with everything around it.

Every operation is in one console state, which decides where it is listed:

    awaiting_person  `unknown`, and its tool cannot be reconciled automatically
                     (`on_unknown: ask_staff`, or no reconcile strategy): a person must check
    unknown          `unknown`, reconciliation will ask the system of record
    stuck            in flight (admitted, running, retrying) with no change for
                     OPERATION_STUCK_AFTER_S, or running past its attempt deadline
    in_flight        admitted, running or waiting for its next attempt
    awaiting_caller  waiting for the caller's confirmation
    settled          committed, failed_final, cancelled

The list is ordered by that state (in this order), then by last change, newest first, and
paged by keyset over (state, updated_at, operation_id).
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tools import ledger
from tools.ledger import EventRecord, OperationRecord, ToolCallRecord
from tools.ledger_models import operations_table as ops_t
from tools.registry import OnUnknown, Registry, ToolSpec
from tools.states import OperationStatus

S = OperationStatus


class ConsoleState(StrEnum):
    """Where the console lists an operation (the order is the list's order)."""

    AWAITING_PERSON = "awaiting_person"
    UNKNOWN = "unknown"
    STUCK = "stuck"
    IN_FLIGHT = "in_flight"
    AWAITING_CALLER = "awaiting_caller"
    SETTLED = "settled"

    @property
    def rank(self) -> int:
        return list(ConsoleState).index(self)


ATTENTION = (ConsoleState.AWAITING_PERSON, ConsoleState.UNKNOWN, ConsoleState.STUCK)
OPEN = (*ATTENTION, ConsoleState.IN_FLIGHT, ConsoleState.AWAITING_CALLER)


def needs_a_person(spec: ToolSpec | None) -> bool:
    """Whether an `unknown` of this tool can only be settled by a person."""
    if spec is None:
        return True  # a tool this deployment no longer has: nobody else can reconcile it
    return spec.on_unknown is OnUnknown.ASK_STAFF or spec.reconcile is None


def person_tools(registry: Registry) -> list[str]:
    return [spec.name for spec in registry if needs_a_person(spec)]


def console_state(
    op: OperationRecord, registry: Registry, now: datetime, stuck_after_s: float
) -> ConsoleState:
    """The console state of one operation (the same rule as the list's SQL)."""
    spec = registry.get(op.tool) if op.tool in registry else None
    if op.status is S.UNKNOWN:
        return ConsoleState.AWAITING_PERSON if needs_a_person(spec) else ConsoleState.UNKNOWN
    if op.status in (S.ADMITTED, S.RUNNING, S.FAILED_RETRYABLE):
        stale = op.updated_at < now - timedelta(seconds=stuck_after_s)
        overdue = op.status is S.RUNNING and op.deadline is not None and op.deadline < now
        return ConsoleState.STUCK if stale or overdue else ConsoleState.IN_FLIGHT
    if op.status is S.AWAITING_CONFIRMATION:
        return ConsoleState.AWAITING_CALLER
    return ConsoleState.SETTLED


def _rank_expr(registry: Registry, now: datetime, stuck_after_s: float) -> Any:
    stale = ops_t.c.updated_at < now - timedelta(seconds=stuck_after_s)
    overdue = sa.and_(ops_t.c.status == S.RUNNING.value, ops_t.c.deadline < now)
    in_flight = ops_t.c.status.in_([S.ADMITTED.value, S.RUNNING.value, S.FAILED_RETRYABLE.value])
    person = person_tools(registry)
    # A tool this deployment no longer declares cannot be reconciled by anyone but a person.
    needs_person = sa.or_(ops_t.c.tool.in_(person), ops_t.c.tool.not_in(registry.names()))
    return sa.case(
        (
            sa.and_(ops_t.c.status == S.UNKNOWN.value, needs_person),
            ConsoleState.AWAITING_PERSON.rank,
        ),
        (ops_t.c.status == S.UNKNOWN.value, ConsoleState.UNKNOWN.rank),
        (sa.and_(in_flight, sa.or_(stale, overdue)), ConsoleState.STUCK.rank),
        (in_flight, ConsoleState.IN_FLIGHT.rank),
        (ops_t.c.status == S.AWAITING_CONFIRMATION.value, ConsoleState.AWAITING_CALLER.rank),
        else_=ConsoleState.SETTLED.rank,
    )


class CursorError(ValueError):
    """A page cursor that this service did not make."""


@dataclass(frozen=True, slots=True)
class OpCursor:
    rank: int
    updated_at: datetime
    operation_id: uuid.UUID

    def encode(self) -> str:
        raw = f"{self.rank}|{self.updated_at.isoformat()}|{self.operation_id}".encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> OpCursor:
        try:
            raw = base64.urlsafe_b64decode((text + "=" * (-len(text) % 4)).encode("ascii"))
            rank, stamp, ident = raw.decode("utf-8").split("|")
            at = datetime.fromisoformat(stamp)
            if at.tzinfo is None or not 0 <= int(rank) < len(ConsoleState):
                raise ValueError("bad cursor")
            return cls(int(rank), at, uuid.UUID(ident))
        except (ValueError, UnicodeError, binascii.Error) as exc:
            raise CursorError("not a cursor of this list") from exc


@dataclass(frozen=True, slots=True)
class OperationFilter:
    states: tuple[ConsoleState, ...] = ()  # empty: any
    statuses: tuple[str, ...] = ()
    tool: str | None = None
    call_id: str | None = None


@dataclass(frozen=True, slots=True)
class OperationItem:
    op: OperationRecord
    state: ConsoleState


@dataclass(frozen=True, slots=True)
class OperationPage:
    items: list[OperationItem] = field(default_factory=list)
    next_cursor: str | None = None


async def list_operations(
    engine: AsyncEngine,
    registry: Registry,
    f: OperationFilter,
    *,
    limit: int,
    cursor: OpCursor | None = None,
    stuck_after_s: float,
    now: datetime | None = None,
) -> OperationPage:
    """One page of operations, open ones first."""
    now = now or datetime.now(UTC)
    rank = _rank_expr(registry, now, stuck_after_s).label("rank")
    stmt = sa.select(ops_t, rank)
    where: list[Any] = []
    if f.states:
        where.append(rank.in_([s.rank for s in f.states]))
    if f.statuses:
        where.append(ops_t.c.status.in_(list(f.statuses)))
    if f.tool:
        where.append(ops_t.c.tool == f.tool)
    if f.call_id:
        where.append(ops_t.c.call_id == f.call_id)
    if cursor is not None:
        where.append(
            sa.or_(
                rank > cursor.rank,
                sa.and_(
                    rank == cursor.rank,
                    sa.tuple_(ops_t.c.updated_at, ops_t.c.operation_id)
                    < sa.tuple_(cursor.updated_at, cursor.operation_id),
                ),
            )
        )
    stmt = (
        stmt.where(*where)
        .order_by(rank, ops_t.c.updated_at.desc(), ops_t.c.operation_id.desc())
        .limit(limit + 1)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(stmt)).all()
    items = [
        OperationItem(OperationRecord.from_row(r), list(ConsoleState)[r.rank]) for r in rows[:limit]
    ]
    next_cursor = None
    if len(rows) > limit and items:
        last = items[-1]
        next_cursor = OpCursor(last.state.rank, last.op.updated_at, last.op.operation_id).encode()
    return OperationPage(items, next_cursor)


async def count_by_state(
    engine: AsyncEngine, registry: Registry, *, stuck_after_s: float
) -> dict[ConsoleState, int]:
    """How many operations are in each console state (the list's headline)."""
    rank = _rank_expr(registry, datetime.now(UTC), stuck_after_s)
    async with engine.connect() as conn:
        rows = (
            await conn.execute(sa.select(rank.label("rank"), sa.func.count()).group_by("rank"))
        ).all()
    counts = dict.fromkeys(ConsoleState, 0)
    for r, n in rows:
        counts[list(ConsoleState)[r]] = int(n)
    return counts


@dataclass(frozen=True, slots=True)
class OperationDetail:
    """One operation and everything the console shows about it."""

    op: OperationRecord
    state: ConsoleState
    events: list[EventRecord]
    tool_calls: list[ToolCallRecord]
    compensations: list[OperationRecord]  # operations that compensate this one
    compensates: OperationRecord | None  # the operation this one compensates


async def load_operation(
    conn: AsyncConnection,
    registry: Registry,
    operation_id: uuid.UUID,
    *,
    stuck_after_s: float,
) -> OperationDetail | None:
    op = await ledger.get_operation(conn, operation_id)
    if op is None:
        return None
    events = await ledger.get_events(conn, operation_id)
    tool_calls = await ledger.tool_calls_for_operation(conn, operation_id)
    rows = await conn.execute(
        sa.select(ops_t)
        .where(ops_t.c.compensates_operation_id == operation_id)
        .order_by(ops_t.c.created_at)
    )
    compensations = [OperationRecord.from_row(r) for r in rows]
    parent = (
        await ledger.get_operation(conn, op.compensates_operation_id)
        if op.compensates_operation_id
        else None
    )
    state = console_state(op, registry, datetime.now(UTC), stuck_after_s)
    return OperationDetail(op, state, events, tool_calls, compensations, parent)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def operation_json(op: OperationRecord, state: ConsoleState | None = None) -> dict[str, Any]:
    """An operation as the API shows it (before masking)."""
    out: dict[str, Any] = {
        "operation_id": str(op.operation_id),
        "tenant_id": op.tenant_id,
        "idempotency_key": op.idempotency_key,
        "call_id": op.call_id,
        "turn_id": op.turn_id,
        "caller": op.caller,
        "tool": op.tool,
        "args": op.args,
        "status": op.status.value,
        "cancel_requested": op.cancel_requested,
        "attempts": op.attempts,
        "deadline": _iso(op.deadline),
        "expires_at": _iso(op.expires_at),
        "next_attempt_at": _iso(op.next_attempt_at),
        "result": op.result,
        "error": op.error,
        "provider_ref": op.provider_ref,
        "compensates_operation_id": (
            str(op.compensates_operation_id) if op.compensates_operation_id else None
        ),
        "readback": op.readback,
        "created_at": _iso(op.created_at),
        "updated_at": _iso(op.updated_at),
        "committed_at": _iso(op.committed_at),
        "finished_at": _iso(op.finished_at),
    }
    if state is not None:
        out["console_state"] = state.value
    return out


def event_json(e: EventRecord) -> dict[str, Any]:
    return {
        "id": e.id,
        "at": _iso(e.at),
        "kind": e.kind,
        "from_status": e.from_status.value if e.from_status else None,
        "to_status": e.to_status.value if e.to_status else None,
        "actor": e.actor,
        "reason": e.reason,
        "data": e.data,
    }


def tool_call_json(tc: ToolCallRecord) -> dict[str, Any]:
    return {
        "id": tc.id,
        "call_id": tc.call_id,
        "provider_call_id": tc.provider_call_id,
        "turn_id": tc.turn_id,
        "response_id": tc.response_id,
        "tool": tc.tool,
        "decision": tc.decision,
        "reason": tc.decision_reason,
        "arguments": tc.arguments,
        "created_at": _iso(tc.created_at),
    }
