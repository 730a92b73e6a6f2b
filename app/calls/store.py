"""The `calls` rows: creation, lookups and the status state machine (one transition function)."""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlmodel import SQLModel

import app.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from tools import deliveries, driver_sql
from tools.autocommit import autocommit
from tools.delivery_models import deliveries_table as dl_t
from tools.delivery_states import DeliveryState

calls = SQLModel.metadata.tables["calls"]
call_events = SQLModel.metadata.tables["call_events"]


class CallStatus(StrEnum):
    """Where a call is in its life."""

    RINGING = "ringing"  # webhook answered, media stream not started yet
    IN_PROGRESS = "in_progress"  # media stream running
    COMPLETED = "completed"
    BUSY = "busy"  # refused at capacity
    FAILED = "failed"
    NO_ANSWER = "no_answer"
    CANCELED = "canceled"
    REJECTED = "rejected"  # the media stream failed verification


TERMINAL = frozenset(
    {
        CallStatus.COMPLETED,
        CallStatus.BUSY,
        CallStatus.FAILED,
        CallStatus.NO_ANSWER,
        CallStatus.CANCELED,
        CallStatus.REJECTED,
    }
)

# Legal transitions: source -> targets.
_TRANSITIONS: dict[CallStatus, frozenset[CallStatus]] = {
    CallStatus.RINGING: frozenset({CallStatus.IN_PROGRESS} | TERMINAL),
    CallStatus.IN_PROGRESS: frozenset(TERMINAL - {CallStatus.REJECTED, CallStatus.BUSY}),
    # Refused before it began (this replica was full or stopping) and offered again with the
    # same Call-ID: a SIP dispatcher's failover to another replica, which takes it.
    CallStatus.BUSY: frozenset({CallStatus.RINGING}),
}

# Twilio CallStatus values that mean the call is over, and what we record for them.
TWILIO_TERMINAL: dict[str, CallStatus] = {
    "completed": CallStatus.COMPLETED,
    "busy": CallStatus.BUSY,
    "failed": CallStatus.FAILED,
    "no-answer": CallStatus.NO_ANSWER,
    "canceled": CallStatus.CANCELED,
}


class EndSource(StrEnum):
    """Who wrote a call's `call_ended` event (one writer per end, see app.legs.session)."""

    CALL = "call"  # the process holding the call, as its session ends (app.legs.session)
    STATUS = "status"  # Twilio's status callback, for a call no process here runs
    LIVENESS = "call-liveness"  # the sweep, for a call whose holder is gone


def call_ended_data(reason: str, source: str, duration_ms: int | None = None) -> dict[str, Any]:
    """The one shape of a `call_ended` event's data, whoever writes it: why, who, and how
    long the call ran here (None when the writer did not hold the call)."""
    return {"reason": reason, "source": source, "duration_ms": duration_ms}


def sources_of(target: CallStatus) -> list[str]:
    """The statuses a call may move to `target` from."""
    return [str(s) for s, targets in _TRANSITIONS.items() if target in targets]


@dataclass(frozen=True, slots=True)
class CallRow:
    """A read-only view of one `calls` row."""

    id: str
    call_sid: str
    tenant_id: str
    leg: str
    direction: str
    from_number: str | None
    to_number: str | None
    status: str
    stream_sid: str | None
    end_reason: str | None
    holder: str | None
    heartbeat_at: datetime | None
    created_at: datetime
    answered_at: datetime | None
    ended_at: datetime | None
    released_at: datetime | None = None  # its stream was lost: released for a resume

    @classmethod
    def from_mapping(cls, row: Any) -> CallRow:
        return cls(
            id=str(row["id"]),
            call_sid=row["call_sid"],
            tenant_id=row["tenant_id"],
            leg=row["leg"],
            direction=row["direction"],
            from_number=row["from_number"],
            to_number=row["to_number"],
            status=row["status"],
            stream_sid=row["stream_sid"],
            end_reason=row["end_reason"],
            holder=row["holder"],
            heartbeat_at=row["heartbeat_at"],
            created_at=row["created_at"],
            answered_at=row["answered_at"],
            ended_at=row["ended_at"],
            released_at=row.get("released_at"),
        )

    def as_json(self) -> dict[str, Any]:
        def iso(t: datetime | None) -> str | None:
            return t.isoformat() if t else None

        return {
            "id": self.id,
            "call_sid": self.call_sid,
            "tenant_id": self.tenant_id,
            "leg": self.leg,
            "direction": self.direction,
            "from": self.from_number,
            "to": self.to_number,
            "status": self.status,
            "stream_sid": self.stream_sid,
            "end_reason": self.end_reason,
            "created_at": iso(self.created_at),
            "answered_at": iso(self.answered_at),
            "ended_at": iso(self.ended_at),
        }


async def create_call(
    engine: AsyncEngine,
    *,
    call_sid: str,
    tenant_id: str,
    from_number: str | None,
    to_number: str | None,
    status: CallStatus = CallStatus.RINGING,
    leg: str = "twilio",
) -> tuple[CallRow, bool]:
    """Insert the call unless its CallSid exists (Twilio retries); returns (row, created)."""
    values = {
        "id": uuid.uuid4(),
        "call_sid": call_sid,
        "tenant_id": tenant_id,
        "leg": leg,
        "from_number": from_number,
        "to_number": to_number,
        "status": str(status),
        "ended_at": datetime.now(UTC) if status in TERMINAL else None,
        "end_reason": str(status) if status in TERMINAL else None,
    }
    params = {f"set_{name}": value for name, value in values.items()}
    # One statement: it commits alone (a conflict means the row was there, committed).
    async with autocommit(engine) as conn:
        inserted = await driver_sql.fetch(conn, _INSERT_CALL, params)
        if inserted:
            return CallRow.from_mapping(inserted[0]), True
        existing = (await conn.execute(_BY_SID, {"b_sid": call_sid})).mappings().one()
        return CallRow.from_mapping(existing), False


def _param(name: str) -> Any:
    """The value of column `name` as parameter `set_<name>`, of the column's type (never the
    column's own name: SQLAlchemy would take it for the column in an UPDATE's WHERE)."""
    return sa.bindparam(f"set_{name}", type_=calls.c[name].type)


# The call's row statements, built once: a statement built per call is built, keyed and its
# result adapted again on every execution (about 0.1-0.2 ms, three times a call). The values
# are parameters; the SQL is the same.
_INSERTED: tuple[str, ...] = ("id", "call_sid", "tenant_id", "leg", "from_number", "to_number")
_INSERTED += ("status", "ended_at", "end_reason")
_INSERT_CALL = (
    pg_insert(calls)
    .values({name: _param(name) for name in _INSERTED})
    .on_conflict_do_nothing(index_elements=["call_sid"])
    .returning(*calls.c)
)
_BY_SID = sa.select(calls).where(
    calls.c.call_sid == sa.bindparam("b_sid", type_=calls.c.call_sid.type)
)


async def get_call(engine: AsyncEngine, call_id: str) -> CallRow | None:
    """The call with our id `call_id`, if any."""
    try:
        key = uuid.UUID(call_id)
    except ValueError:
        return None
    async with engine.connect() as conn:
        row = (await conn.execute(sa.select(calls).where(calls.c.id == key))).mappings().first()
    return CallRow.from_mapping(row) if row else None


async def find_by_sid(engine: AsyncEngine, call_sid: str) -> CallRow | None:
    """The call with provider id `call_sid`, if any."""
    async with engine.connect() as conn:
        row = (
            (await conn.execute(sa.select(calls).where(calls.c.call_sid == call_sid)))
            .mappings()
            .first()
        )
    return CallRow.from_mapping(row) if row else None


async def list_calls(engine: AsyncEngine, limit: int = 50, offset: int = 0) -> list[CallRow]:
    """Newest calls first."""
    stmt = sa.select(calls).order_by(calls.c.created_at.desc()).limit(limit).offset(offset)
    async with engine.connect() as conn:
        rows = (await conn.execute(stmt)).mappings().all()
    return [CallRow.from_mapping(r) for r in rows]


async def transition(
    engine: AsyncEngine, call_id: str, target: CallStatus, **fields: Any
) -> CallRow | None:
    """Move the call to `target` if that is legal from its current status; else None.

    A conditional update, so two parties ending the same call (status callback, media
    socket, shutdown) never both win, and a stream can only start once. Ending a call
    hands its outcomes not yet heard to out-of-call delivery in the same transaction.
    """
    values: dict[str, Any] = {"status": str(target), **fields}
    if target in TERMINAL:
        values.setdefault("ended_at", datetime.now(UTC))
    if target is CallStatus.IN_PROGRESS:
        values.setdefault("answered_at", datetime.now(UTC))
    key = uuid.UUID(call_id)
    stmt: Any
    params: dict[str, Any] = {}
    if all(name in calls.c and not isinstance(v, sa.ClauseElement) for name, v in values.items()):
        # Plain values of columns (what every caller passes): the statement built once a shape.
        stmt = _transition_statement(target, tuple(sorted(values)))
        params = {f"set_{name}": value for name, value in values.items()}
        params["b_id"] = key
    else:
        stmt = (
            sa.update(calls)
            .where(calls.c.id == key, calls.c.status.in_(sources_of(target)))
            .values(**values)
            .returning(*calls.c)
        )
    if target not in TERMINAL:
        # One statement: no transaction around it (tools.autocommit).
        async with autocommit(engine) as conn:
            row = await _first(conn, stmt, params)
        return CallRow.from_mapping(row) if row else None
    if params:
        # Most calls end with no delivery to re-drive: their end is one statement, which
        # ends the call only if it has none (no transaction around it). One that has some
        # ends as below, the end and the re-drive in one transaction.
        async with autocommit(engine) as conn:
            ended = await _first(
                conn, _ending_statement(target, tuple(sorted(values))), params | {"b_call": call_id}
            )
        # One row, always: the call's columns are NULL when it did not move.
        if not ended["redrive"]:
            return CallRow.from_mapping(ended) if ended["id"] is not None else None
    async with engine.begin() as conn:
        row = await _first(conn, stmt, params)
        if row is not None:
            await deliveries.redrive_for_call(
                conn,
                call_id,
                actor="call-end",
                reason=f"the call ended ({fields.get('end_reason') or target.value})",
            )
    return CallRow.from_mapping(row) if row else None


@functools.lru_cache(maxsize=32)
def _ending_statement(target: CallStatus, names: tuple[str, ...]) -> Any:
    """`_transition_statement` to a terminal `target`, made only if the call (`b_call`, as
    deliveries name it) has no delivery to re-drive (`redrive_for_call`'s: pending or
    offered). One row: the call's columns (NULL when nothing moved) and `redrive`."""
    waiting = (
        sa.select(sa.literal(1))
        .select_from(dl_t)
        .where(
            dl_t.c.call_id == sa.bindparam("b_call", type_=dl_t.c.call_id.type),
            dl_t.c.state.in_([DeliveryState.PENDING.value, DeliveryState.OFFERED.value]),
        )
        .exists()
    )
    redrive = sa.select(waiting.label("redrive")).cte("redrive")
    upd = (
        _transition_statement(target, names)
        .where(~sa.select(redrive.c.redrive).scalar_subquery())
        .cte("upd")
    )
    return sa.select(*upd.c, redrive.c.redrive).select_from(redrive.outerjoin(upd, sa.true()))


async def _first(conn: AsyncConnection, stmt: Any, params: dict[str, Any]) -> Any:
    """The statement's first row as a mapping, or None: a statement built once runs on the
    driver connection (tools.driver_sql), one built for this call through SQLAlchemy."""
    if params:
        rows = await driver_sql.fetch(conn, stmt, params)
        return rows[0] if rows else None
    return (await conn.execute(stmt)).mappings().first()


@functools.lru_cache(maxsize=64)
def _transition_statement(target: CallStatus, names: tuple[str, ...]) -> Any:
    """`transition`'s UPDATE to `target` setting columns `names` (each `set_<name>`), the
    call's id as `b_id`; built once a shape."""
    return (
        sa.update(calls)
        .where(
            calls.c.id == sa.bindparam("b_id", type_=calls.c.id.type),
            calls.c.status.in_(sources_of(target)),
        )
        .values({name: _param(name) for name in names})
        .returning(*calls.c)
    )
