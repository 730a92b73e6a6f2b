"""Tables of integrator webhooks: subscriptions, the outbox of deliveries, the attempt log.

The migration (app/migrations/versions/0006_deliveries.py) is the source of truth.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, DateTime, ForeignKey, Index, Text, UniqueConstraint
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel


def _ts(nullable: bool = True, default_now: bool = False) -> Any:
    return Field(
        default=None,
        sa_column=Column(
            DateTime(timezone=True),
            nullable=nullable,
            server_default=sa.func.now() if default_now else None,
        ),
    )


class WebhookSubscription(SQLModel, table=True):
    """An integrator's endpoint for operation status changes, and the secret that signs."""

    __tablename__ = "webhook_subscriptions"
    __table_args__ = (Index("ix_webhook_subscriptions_active", "tenant_id", "active"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: str = Field(max_length=64)
    url: str = Field(sa_column=Column(Text, nullable=False))
    secret: str = Field(sa_column=Column(Text, nullable=False))  # whsec_<base64>; never logged
    source: str = Field(max_length=16)  # config | api
    description: str | None = Field(default=None, sa_column=Column(Text))
    active: bool = True
    created_at: datetime | None = _ts(nullable=False, default_now=True)
    disabled_at: datetime | None = _ts()


class WebhookDelivery(SQLModel, table=True):
    """One status change for one subscription: the outbox row, written with the change."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint(
            "subscription_id", "operation_event_id", name="uq_webhook_deliveries_event"
        ),
        Index("ix_webhook_deliveries_state_next", "state", "next_attempt_at"),
        Index("ix_webhook_deliveries_subscription", "subscription_id", "created_at"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)  # the webhook-id
    subscription_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("webhook_subscriptions.id", ondelete="CASCADE"), nullable=False)
    )
    operation_id: uuid.UUID
    operation_event_id: int = Field(sa_column=Column(BigInteger, nullable=False))
    event_type: str = Field(max_length=64)
    payload: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))
    state: str = Field(max_length=16)  # pending | sending | delivered | failed
    attempts: int = 0
    last_status_code: int | None = None
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    next_attempt_at: datetime | None = _ts()
    created_at: datetime | None = _ts(nullable=False, default_now=True)
    updated_at: datetime | None = _ts(nullable=False, default_now=True)
    delivered_at: datetime | None = _ts()


class WebhookAttempt(SQLModel, table=True):
    """The delivery log: every POST made for a webhook delivery and how it ended."""

    __tablename__ = "webhook_attempts"
    __table_args__ = (Index("ix_webhook_attempts_delivery", "webhook_delivery_id", "id"),)

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True))
    webhook_delivery_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), nullable=False)
    )
    at: datetime | None = _ts(nullable=False, default_now=True)
    attempt: int
    status_code: int | None = None
    error: str | None = Field(default=None, sa_column=Column(Text))
    duration_ms: float | None = None


webhook_subscriptions_table: sa.Table = SQLModel.metadata.tables["webhook_subscriptions"]
webhook_deliveries_table: sa.Table = SQLModel.metadata.tables["webhook_deliveries"]
webhook_attempts_table: sa.Table = SQLModel.metadata.tables["webhook_attempts"]
