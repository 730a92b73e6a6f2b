"""deliveries of outcomes (in call, SMS), call liveness, conflicts, integrator webhooks

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_DELIVERY_STATES = (
    "pending",
    "offered",
    "heard",
    "texting",
    "texted",
    "failed",
    "not_deliverable",
    "not_needed",
)
_SMS_STATUSES = (
    "pending",
    "requesting",
    "unknown",
    "queued",
    "sent",
    "delivered",
    "undelivered",
    "failed",
)
_WEBHOOK_STATES = ("pending", "sending", "delivered", "failed")


def _in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def _ts(name: str, *, now: bool = False) -> sa.Column:
    if now:
        return sa.Column(
            name, sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        )
    return sa.Column(name, sa.DateTime(timezone=True))


def upgrade() -> None:
    # Conflicts: the tool's declared key, and which earlier operation holds this one back.
    op.add_column("operations", sa.Column("conflict_key", sa.String(200)))
    op.add_column(
        "operations",
        sa.Column("held_by_operation_id", sa.Uuid(), sa.ForeignKey("operations.operation_id")),
    )
    op.create_index("ix_operations_conflict", "operations", ["tenant_id", "caller", "conflict_key"])

    # Call liveness: which process holds the stream, and when it last said so.
    op.add_column("calls", sa.Column("holder", sa.String(128)))
    op.add_column("calls", sa.Column("heartbeat_at", sa.DateTime(timezone=True)))
    op.create_index("ix_calls_status_heartbeat", "calls", ["status", "heartbeat_at"])

    op.create_table(
        "deliveries",
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column(
            "operation_id",
            sa.Uuid(),
            sa.ForeignKey("operations.operation_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("call_id", sa.String(128)),
        sa.Column("caller", sa.String(64)),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("channel", sa.String(16), nullable=False, server_default="none"),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("offers", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("cuts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("holder", sa.String(128)),
        sa.Column("response_id", sa.String(128)),
        sa.Column("message_id", sa.Uuid()),
        sa.Column("reason", sa.Text()),
        _ts("next_attempt_at"),
        _ts("created_at", now=True),
        _ts("updated_at", now=True),
        _ts("offered_at"),
        _ts("heard_at"),
        _ts("finished_at"),
        sa.UniqueConstraint("operation_id", name="uq_deliveries_operation"),
        sa.CheckConstraint(f"state IN ({_in(_DELIVERY_STATES)})", name="ck_deliveries_state"),
    )
    op.create_index("ix_deliveries_state_updated", "deliveries", ["state", "updated_at"])
    op.create_index("ix_deliveries_call", "deliveries", ["call_id"])

    op.create_table(
        "delivery_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "delivery_id",
            sa.Uuid(),
            sa.ForeignKey("deliveries.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("clock_timestamp()"),
        ),
        sa.Column("from_state", sa.String(32)),
        sa.Column("to_state", sa.String(32)),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text()),
        sa.Column("data", postgresql.JSONB(), nullable=False, server_default="{}"),
    )
    op.create_index("ix_delivery_events_delivery", "delivery_events", ["delivery_id", "id"])

    op.create_table(
        "sms_messages",
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column(
            "delivery_id",
            sa.Uuid(),
            sa.ForeignKey("deliveries.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("to_number", sa.String(64), nullable=False),
        sa.Column("from_number", sa.String(64)),
        sa.Column("messaging_service_sid", sa.String(64)),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("reference", sa.String(200)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("message_sid", sa.String(64)),
        sa.Column("error_code", sa.Integer()),
        sa.Column("error", sa.Text()),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("requested_by", sa.String(128), nullable=False),
        _ts("created_at", now=True),
        _ts("updated_at", now=True),
        _ts("attempted_at"),
        _ts("accepted_at"),
        _ts("status_at"),
        _ts("next_check_at"),
        _ts("finished_at"),
        sa.UniqueConstraint("message_sid", name="uq_sms_messages_sid"),
        sa.CheckConstraint(f"status IN ({_in(_SMS_STATUSES)})", name="ck_sms_messages_status"),
    )
    op.create_index("ix_sms_messages_delivery", "sms_messages", ["delivery_id"])
    op.create_index("ix_sms_messages_status_check", "sms_messages", ["status", "next_check_at"])

    op.create_table(
        "sms_opt_outs",
        sa.Column("phone", sa.String(64), primary_key=True),
        sa.Column("opted_out", sa.Boolean(), nullable=False),
        sa.Column("source", sa.String(64), nullable=False),
        _ts("updated_at", now=True),
    )

    op.create_table(
        "webhook_subscriptions",
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),  # config | api
        sa.Column("description", sa.Text()),
        sa.Column("active", sa.Boolean(), nullable=False, server_default="true"),
        _ts("created_at", now=True),
        _ts("disabled_at"),
    )
    op.create_index(
        "ix_webhook_subscriptions_active", "webhook_subscriptions", ["tenant_id", "active"]
    )

    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column(
            "subscription_id",
            sa.Uuid(),
            sa.ForeignKey("webhook_subscriptions.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("operation_id", sa.Uuid(), nullable=False),
        sa.Column("operation_event_id", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.String(64), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("last_status_code", sa.Integer()),
        sa.Column("last_error", sa.Text()),
        _ts("next_attempt_at"),
        _ts("created_at", now=True),
        _ts("updated_at", now=True),
        _ts("delivered_at"),
        sa.UniqueConstraint(
            "subscription_id", "operation_event_id", name="uq_webhook_deliveries_event"
        ),
        sa.CheckConstraint(
            f"state IN ({_in(_WEBHOOK_STATES)})", name="ck_webhook_deliveries_state"
        ),
    )
    op.create_index(
        "ix_webhook_deliveries_state_next", "webhook_deliveries", ["state", "next_attempt_at"]
    )
    op.create_index(
        "ix_webhook_deliveries_subscription",
        "webhook_deliveries",
        ["subscription_id", "created_at"],
    )

    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "webhook_delivery_id",
            sa.Uuid(),
            sa.ForeignKey("webhook_deliveries.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("clock_timestamp()"),
        ),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer()),
        sa.Column("error", sa.Text()),
        sa.Column("duration_ms", sa.Float()),
    )
    op.create_index(
        "ix_webhook_attempts_delivery", "webhook_attempts", ["webhook_delivery_id", "id"]
    )


def downgrade() -> None:
    op.drop_table("webhook_attempts")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_subscriptions")
    op.drop_table("sms_opt_outs")
    op.drop_table("sms_messages")
    op.drop_table("delivery_events")
    op.drop_table("deliveries")
    op.drop_index("ix_calls_status_heartbeat", table_name="calls")
    op.drop_column("calls", "heartbeat_at")
    op.drop_column("calls", "holder")
    op.drop_index("ix_operations_conflict", table_name="operations")
    op.drop_column("operations", "held_by_operation_id")
    op.drop_column("operations", "conflict_key")
