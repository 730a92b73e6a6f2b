"""calls and call_events

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "calls",
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column("call_sid", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False, server_default="default"),
        sa.Column("leg", sa.String(16), nullable=False, server_default="twilio"),
        sa.Column("direction", sa.String(16), nullable=False, server_default="inbound"),
        sa.Column("from_number", sa.String(64)),
        sa.Column("to_number", sa.String(64)),
        sa.Column("status", sa.String(32), nullable=False, server_default="ringing"),
        sa.Column("stream_sid", sa.String(64)),
        sa.Column("end_reason", sa.String(128)),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("answered_at", sa.DateTime(timezone=True)),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_calls_call_sid", "calls", ["call_sid"], unique=True)
    op.create_index("ix_calls_created_at", "calls", ["created_at"])
    op.create_table(
        "call_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "call_id", sa.Uuid(), sa.ForeignKey("calls.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("data", postgresql.JSONB(), nullable=False, server_default="{}"),
        sa.Column("mono_ns", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_call_events_call_seq", "call_events", ["call_id", "seq"], unique=True)


def downgrade() -> None:
    op.drop_table("call_events")
    op.drop_table("calls")
