"""Receipts of provider callbacks (`POST /operations/{id}/callback`).

One row per report received with a valid signature: its `webhook-id` (replays are refused
by it) and its `sequence` (a report older than the newest one taken for the operation is
ignored). The migration (0007) is the source of truth for the schema.
"""

from __future__ import annotations

import uuid
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, DateTime, ForeignKey, Index
from sqlmodel import Field, SQLModel

import tools.ledger_models  # noqa: F401  (operations must be known for the foreign key)


class CallbackReceipt(SQLModel, table=True):
    """A provider's report as received: which message, which sequence, what it did."""

    __tablename__ = "callback_receipts"
    __table_args__ = (Index("ix_callback_receipts_operation", "operation_id", "sequence"),)

    webhook_id: str = Field(primary_key=True, max_length=255)
    operation_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("operations.operation_id", ondelete="CASCADE"), nullable=False)
    )
    sequence: int = Field(sa_column=Column(BigInteger, nullable=False))
    status: str = Field(max_length=16)
    outcome: str = Field(max_length=32)  # applied | stale | ignored | pending
    received_at: datetime | None = Field(
        default=None,
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )


callback_receipts_table: sa.Table = SQLModel.metadata.tables["callback_receipts"]
