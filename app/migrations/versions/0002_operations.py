"""operations ledger: operations, operation_events, tool_calls

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_STATUSES = (
    "awaiting_confirmation",
    "admitted",
    "running",
    "committed",
    "failed_retryable",
    "failed_final",
    "unknown",
    "cancelled",
)


def _ts(name: str, *, now: bool = False) -> sa.Column:
    if now:
        return sa.Column(
            name, sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        )
    return sa.Column(name, sa.DateTime(timezone=True))


def upgrade() -> None:
    statuses = ", ".join(f"'{s}'" for s in _STATUSES)
    op.create_table(
        "operations",
        sa.Column("operation_id", sa.Uuid(), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=False),
        sa.Column("key_source", sa.String(16), nullable=False, server_default="derived"),
        sa.Column("call_id", sa.String(128)),
        sa.Column("caller", sa.String(64)),
        sa.Column("turn_id", sa.Integer()),
        sa.Column("tool", sa.String(64), nullable=False),
        sa.Column("args", postgresql.JSONB(), nullable=False, server_default="{}"),
        sa.Column("args_hash", sa.String(64), nullable=False),
        sa.Column("resource", sa.String(200)),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False, server_default="false"),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        _ts("deadline"),
        _ts("expires_at"),
        _ts("next_attempt_at"),
        sa.Column("result", postgresql.JSONB()),
        sa.Column("error", sa.Text()),
        sa.Column("provider_ref", sa.String(200)),
        sa.Column(
            "compensates_operation_id",
            sa.Uuid(),
            sa.ForeignKey("operations.operation_id"),
        ),
        sa.Column("readback", sa.Text()),
        _ts("confirm_by"),
        sa.Column("overflow", sa.String(16)),
        _ts("created_at", now=True),
        _ts("updated_at", now=True),
        _ts("committed_at"),
        _ts("finished_at"),
        sa.UniqueConstraint("tenant_id", "idempotency_key", name="uq_operations_tenant_key"),
        sa.CheckConstraint(f"status IN ({statuses})", name="ck_operations_status"),
    )
    # The sweeper: running past its deadline; retries due; expired confirmations.
    op.create_index("ix_operations_status_deadline", "operations", ["status", "deadline"])
    op.create_index(
        "ix_operations_status_next_attempt", "operations", ["status", "next_attempt_at"]
    )
    op.create_index("ix_operations_call_id", "operations", ["call_id"])
    # Policy facts: in flight per resource, recent mutations per caller.
    op.create_index("ix_operations_resource", "operations", ["tenant_id", "resource", "status"])
    op.create_index(
        "ix_operations_caller_created", "operations", ["tenant_id", "caller", "created_at"]
    )
    op.create_index(
        "ix_operations_provider_ref", "operations", ["tenant_id", "tool", "provider_ref"]
    )

    op.create_table(
        "operation_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "operation_id",
            sa.Uuid(),
            sa.ForeignKey("operations.operation_id", ondelete="CASCADE"),
            nullable=False,
        ),
        # clock_timestamp, not now(): several events of one transaction stay distinct.
        sa.Column(
            "at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("clock_timestamp()"),
        ),
        sa.Column("from_status", sa.String(32)),
        sa.Column("to_status", sa.String(32)),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text()),
        sa.Column("data", postgresql.JSONB(), nullable=False, server_default="{}"),
    )
    op.create_index("ix_operation_events_operation", "operation_events", ["operation_id", "id"])

    op.create_table(
        "tool_calls",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("call_id", sa.String(128), nullable=False),
        sa.Column("provider_call_id", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("turn_id", sa.Integer()),
        sa.Column("response_id", sa.String(128)),
        sa.Column("item_id", sa.String(128)),
        sa.Column("tool", sa.String(64), nullable=False),
        sa.Column("raw_arguments", sa.Text(), nullable=False),
        sa.Column("arguments", postgresql.JSONB()),
        sa.Column("decision", sa.String(32), nullable=False, server_default="pending"),
        sa.Column("decision_reason", sa.Text()),
        sa.Column(
            "operation_id",
            sa.Uuid(),
            sa.ForeignKey("operations.operation_id", ondelete="SET NULL"),
        ),
        sa.Column("output", postgresql.JSONB()),
        _ts("created_at", now=True),
        _ts("completed_at"),
        sa.UniqueConstraint("call_id", "provider_call_id", name="uq_tool_calls_call_provider"),
    )
    op.create_index("ix_tool_calls_operation_id", "tool_calls", ["operation_id"])


def downgrade() -> None:
    op.drop_table("tool_calls")
    op.drop_table("operation_events")
    op.drop_table("operations")
