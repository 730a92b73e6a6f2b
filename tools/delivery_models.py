"""Tables of outcome delivery: deliveries, delivery_events, sms_messages, sms_opt_outs.

The migration (app/migrations/versions/0006_deliveries.py) is the source of truth for the
schema; these models mirror it for typed access.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, DateTime, ForeignKey, Index, Text, UniqueConstraint
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

import tools.ledger_models  # noqa: F401  (operations must be known for the foreign key)


def _ts(nullable: bool = True, default_now: bool = False) -> Any:
    return Field(
        default=None,
        sa_column=Column(
            DateTime(timezone=True),
            nullable=nullable,
            server_default=sa.func.now() if default_now else None,
        ),
    )


class Delivery(SQLModel, table=True):
    """How one finished operation's outcome reaches the caller (see tools.delivery_states)."""

    __tablename__ = "deliveries"
    __table_args__ = (
        UniqueConstraint("operation_id", name="uq_deliveries_operation"),
        Index("ix_deliveries_state_updated", "state", "updated_at"),
        Index("ix_deliveries_call", "call_id"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    operation_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("operations.operation_id", ondelete="CASCADE"), nullable=False)
    )
    tenant_id: str = Field(max_length=64)
    call_id: str | None = Field(default=None, max_length=128)
    caller: str | None = Field(default=None, max_length=64)
    outcome: str = Field(max_length=32)  # the operation status it tells
    channel: str = Field(default="none", max_length=16)  # none | call | sms
    state: str = Field(max_length=32)
    offers: int = 0  # times handed to a live call
    cuts: int = 0  # announcements cut by a barge-in (or not played out)
    holder: str | None = Field(default=None, max_length=128)  # process the offer went to
    response_id: str | None = Field(default=None, max_length=128)  # response that carried it
    message_id: uuid.UUID | None = None  # the SMS that carries it (last one)
    reason: str | None = Field(default=None, sa_column=Column(Text))  # the last decision's
    # The agent active in the call when the outcome was offered there, or kept from it.
    agent: str | None = Field(default=None, max_length=40)
    next_attempt_at: datetime | None = _ts()
    created_at: datetime | None = _ts(nullable=False, default_now=True)
    updated_at: datetime | None = _ts(nullable=False, default_now=True)
    offered_at: datetime | None = _ts()
    heard_at: datetime | None = _ts()
    finished_at: datetime | None = _ts()


class DeliveryEventRow(SQLModel, table=True):
    """Append-only trail of a delivery: moves, gate decisions, notes, SMS statuses."""

    __tablename__ = "delivery_events"
    __table_args__ = (Index("ix_delivery_events_delivery", "delivery_id", "id"),)

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True))
    delivery_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("deliveries.id", ondelete="CASCADE"), nullable=False)
    )
    at: datetime | None = _ts(nullable=False, default_now=True)
    from_state: str | None = Field(default=None, max_length=32)
    to_state: str | None = Field(default=None, max_length=32)
    kind: str = Field(max_length=16)  # transition | decision | note | sms
    actor: str = Field(max_length=128)
    reason: str | None = Field(default=None, sa_column=Column(Text))
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSONB, nullable=False))


class SmsMessage(SQLModel, table=True):
    """One SMS carrying a delivery, persisted before it is sent."""

    __tablename__ = "sms_messages"
    __table_args__ = (
        UniqueConstraint("message_sid", name="uq_sms_messages_sid"),
        Index("ix_sms_messages_delivery", "delivery_id"),
        Index("ix_sms_messages_status_check", "status", "next_check_at"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    delivery_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("deliveries.id", ondelete="CASCADE"), nullable=False)
    )
    tenant_id: str = Field(max_length=64)
    to_number: str = Field(max_length=64)
    from_number: str | None = Field(default=None, max_length=64)
    messaging_service_sid: str | None = Field(default=None, max_length=64)
    body: str = Field(sa_column=Column(Text, nullable=False))
    reference: str | None = Field(default=None, max_length=200)  # what the body carries
    status: str = Field(max_length=16)
    message_sid: str | None = Field(default=None, max_length=64)
    error_code: int | None = None
    error: str | None = Field(default=None, sa_column=Column(Text))
    attempts: int = 0  # create requests sent
    requested_by: str = Field(max_length=128)  # delivery | staff:<user>
    created_at: datetime | None = _ts(nullable=False, default_now=True)
    updated_at: datetime | None = _ts(nullable=False, default_now=True)
    attempted_at: datetime | None = _ts()  # the last create request
    accepted_at: datetime | None = _ts()  # Twilio gave it a MessageSid
    status_at: datetime | None = _ts()
    next_check_at: datetime | None = _ts()  # when the sweeper looks at it again
    finished_at: datetime | None = _ts()


class SmsOptOut(SQLModel, table=True):
    """Numbers that sent STOP (or that Twilio refused as unsubscribed, error 21610)."""

    __tablename__ = "sms_opt_outs"

    phone: str = Field(primary_key=True, max_length=64)
    opted_out: bool
    source: str = Field(max_length=64)
    updated_at: datetime | None = _ts(nullable=False, default_now=True)


deliveries_table: sa.Table = SQLModel.metadata.tables["deliveries"]
delivery_events_table: sa.Table = SQLModel.metadata.tables["delivery_events"]
sms_messages_table: sa.Table = SQLModel.metadata.tables["sms_messages"]
sms_opt_outs_table: sa.Table = SQLModel.metadata.tables["sms_opt_outs"]
