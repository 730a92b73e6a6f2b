"""Tables of the operations ledger (tool_calls, operations, operation_events) and the
records one row of each reads as (`OperationRecord`, `ToolCallRecord`, `EventRecord`).

The records live here, beside their tables, because the ledger, deliveries and webhooks all
pass them: the ledger imports deliveries and webhooks (a terminal transition writes their
rows), so they take the records from here and no import runs back to the ledger.

The migration (app/migrations/versions/0002_operations.py) is the source of truth for the
schema; these models mirror it for typed access and for Alembic's metadata.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, DateTime, ForeignKey, Index, Text, UniqueConstraint
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

from tools.states import OperationStatus


def _ts(nullable: bool = True, default_now: bool = False) -> Any:
    return Field(
        default=None,
        sa_column=Column(
            DateTime(timezone=True),
            nullable=nullable,
            server_default=sa.func.now() if default_now else None,
        ),
    )


class ToolCallRow(SQLModel, table=True):
    """Every function call the model made (its `function_call_id`, the column
    `provider_call_id`) in our call `call_id`, and what became of it."""

    __tablename__ = "tool_calls"
    __table_args__ = (
        UniqueConstraint("call_id", "provider_call_id", name="uq_tool_calls_call_provider"),
        Index("ix_tool_calls_operation_id", "operation_id"),
    )

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True))
    call_id: str = Field(max_length=128)  # our call (CallContext.call_id)
    provider_call_id: str = Field(max_length=128)  # the model's function_call_id
    tenant_id: str = Field(max_length=64)
    turn_id: int | None = None
    response_id: str | None = Field(default=None, max_length=128)
    item_id: str | None = Field(default=None, max_length=128)
    tool: str = Field(max_length=64)
    raw_arguments: str = Field(sa_column=Column(Text, nullable=False))
    arguments: dict[str, Any] | None = Field(default=None, sa_column=Column(JSONB))
    decision: str = Field(default="pending", max_length=32)
    decision_reason: str | None = Field(default=None, sa_column=Column(Text))
    operation_id: uuid.UUID | None = Field(
        default=None,
        sa_column=Column(ForeignKey("operations.operation_id", ondelete="SET NULL")),
    )
    output: dict[str, Any] | None = Field(default=None, sa_column=Column(JSONB))
    created_at: datetime | None = _ts(nullable=False, default_now=True)
    completed_at: datetime | None = _ts()


class Operation(SQLModel, table=True):
    """One business intent and its status: the durable owner of an action."""

    __tablename__ = "operations"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_operations_tenant_key"),
        Index("ix_operations_status_deadline", "status", "deadline"),
        Index("ix_operations_status_next_attempt", "status", "next_attempt_at"),
        Index("ix_operations_call_id", "call_id"),
        Index("ix_operations_resource", "tenant_id", "resource", "status"),
        Index("ix_operations_caller_created", "tenant_id", "caller", "created_at"),
        Index("ix_operations_provider_ref", "tenant_id", "tool", "provider_ref"),
        Index("ix_operations_conflict", "tenant_id", "caller", "conflict_key"),
    )

    operation_id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: str = Field(max_length=64)
    idempotency_key: str = Field(max_length=200)
    key_source: str = Field(default="derived", max_length=16)  # derived | client
    call_id: str | None = Field(default=None, max_length=128)
    caller: str | None = Field(default=None, max_length=64)
    turn_id: int | None = None
    tool: str = Field(max_length=64)
    args: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSONB, nullable=False))
    args_hash: str = Field(max_length=64)
    resource: str | None = Field(default=None, max_length=200)
    status: str = Field(max_length=32)
    cancel_requested: bool = False
    attempts: int = 0
    deadline: datetime | None = _ts()  # the current attempt's deadline (the sweeper's)
    expires_at: datetime | None = _ts()  # total deadline: no attempt starts after it
    next_attempt_at: datetime | None = _ts()
    result: dict[str, Any] | None = Field(default=None, sa_column=Column(JSONB))
    error: str | None = Field(default=None, sa_column=Column(Text))
    provider_ref: str | None = Field(default=None, max_length=200)
    compensates_operation_id: uuid.UUID | None = Field(
        default=None, sa_column=Column(ForeignKey("operations.operation_id"))
    )
    readback: str | None = Field(default=None, sa_column=Column(Text))
    confirm_by: datetime | None = _ts()
    overflow: str | None = Field(default=None, max_length=16)  # queued | degraded
    # The tool's conflict key (e.g. the booking's date): same caller + same key conflict.
    conflict_key: str | None = Field(default=None, max_length=200)
    # An earlier conflicting operation still in flight: this one waits until it is settled.
    held_by_operation_id: uuid.UUID | None = Field(
        default=None, sa_column=Column(ForeignKey("operations.operation_id"))
    )
    # Who confirmed it ("caller": the readback heard, the caller's answer observed after
    # it) and that evidence (the readback item, heard ms, the caller's item or digit).
    confirmed_by: str | None = Field(default=None, max_length=16)
    confirmation: dict[str, Any] | None = Field(default=None, sa_column=Column(JSONB))
    # The agent that asked for it (AGENTS_FILE; None: one agent). The call owns it, not them.
    agent: str | None = Field(default=None, max_length=40)
    created_at: datetime | None = _ts(nullable=False, default_now=True)
    updated_at: datetime | None = _ts(nullable=False, default_now=True)
    committed_at: datetime | None = _ts()
    finished_at: datetime | None = _ts()


class OperationEventRow(SQLModel, table=True):
    """Append-only audit trail: one row per transition and per decision."""

    __tablename__ = "operation_events"
    __table_args__ = (Index("ix_operation_events_operation", "operation_id", "id"),)

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True))
    operation_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("operations.operation_id", ondelete="CASCADE"), nullable=False)
    )
    at: datetime | None = _ts(nullable=False, default_now=True)
    from_status: str | None = Field(default=None, max_length=32)
    to_status: str | None = Field(default=None, max_length=32)
    kind: str = Field(max_length=16)  # transition | decision | note
    actor: str = Field(max_length=64)  # model | policy | worker:<id> | sweeper | ...
    reason: str | None = Field(default=None, sa_column=Column(Text))
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSONB, nullable=False))


tool_calls_table: sa.Table = SQLModel.metadata.tables["tool_calls"]
operations_table: sa.Table = SQLModel.metadata.tables["operations"]
operation_events_table: sa.Table = SQLModel.metadata.tables["operation_events"]


# --- the records a row reads as ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OperationRecord:
    """One row of `operations`."""

    operation_id: uuid.UUID
    tenant_id: str
    idempotency_key: str
    key_source: str
    call_id: str | None
    caller: str | None
    turn_id: int | None
    tool: str
    args: dict[str, Any]
    args_hash: str
    resource: str | None
    status: OperationStatus
    cancel_requested: bool
    attempts: int
    deadline: datetime | None
    expires_at: datetime | None
    next_attempt_at: datetime | None
    result: dict[str, Any] | None
    error: str | None
    provider_ref: str | None
    compensates_operation_id: uuid.UUID | None
    readback: str | None
    confirm_by: datetime | None
    overflow: str | None
    created_at: datetime
    updated_at: datetime
    committed_at: datetime | None
    finished_at: datetime | None
    conflict_key: str | None = None
    held_by_operation_id: uuid.UUID | None = None
    # Who confirmed it ("caller": the call observed their answer) and that evidence.
    confirmed_by: str | None = None
    confirmation: dict[str, Any] | None = None
    agent: str | None = None  # the agent that asked for it

    @classmethod
    def from_row(cls, row: Any) -> OperationRecord:
        return cls.from_mapping(row._mapping)

    @classmethod
    def from_mapping(cls, m: Any) -> OperationRecord:
        values = {f.name: m[f.name] for f in fields(cls)}
        values["status"] = OperationStatus(values["status"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One row of `operation_events`."""

    id: int
    operation_id: uuid.UUID
    at: datetime
    from_status: OperationStatus | None
    to_status: OperationStatus | None
    kind: str
    actor: str
    reason: str | None
    data: dict[str, Any]

    @classmethod
    def from_row(cls, row: Any) -> EventRecord:
        m = row._mapping
        values = {f.name: m[f.name] for f in fields(cls)}
        for k in ("from_status", "to_status"):
            if values[k] is not None:
                values[k] = OperationStatus(values[k])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class ToolCallRecord:
    """One row of `tool_calls`."""

    id: int
    call_id: str
    provider_call_id: str
    tenant_id: str
    turn_id: int | None
    response_id: str | None
    item_id: str | None
    tool: str
    raw_arguments: str
    arguments: dict[str, Any] | None
    decision: str
    decision_reason: str | None
    operation_id: uuid.UUID | None
    output: dict[str, Any] | None
    created_at: datetime
    completed_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> ToolCallRecord:
        m = row._mapping
        return cls(**{f.name: m[f.name] for f in fields(cls)})
