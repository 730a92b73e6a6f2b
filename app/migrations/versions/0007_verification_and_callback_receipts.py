"""durable caller verification (attempts, lockouts) and receipts of provider callbacks

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _ts(name: str, *, nullable: bool = True, now: bool = False) -> sa.Column:
    return sa.Column(
        name,
        sa.DateTime(timezone=True),
        nullable=nullable,
        server_default=sa.func.now() if now else None,
    )


def upgrade() -> None:
    # Every PIN check per subject (an account, a caller's number): never the PIN itself.
    op.create_table(
        "verification_attempts",
        sa.Column("id", sa.BigInteger(), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("subject_kind", sa.String(16), nullable=False),
        sa.Column("subject", sa.String(128), nullable=False),
        sa.Column("call_id", sa.String(128)),
        sa.Column("succeeded", sa.Boolean(), nullable=False),
        _ts("at", nullable=False, now=True),
        sa.CheckConstraint(
            "subject_kind IN ('account', 'phone')", name="ck_verification_attempts_kind"
        ),
    )
    op.create_index(
        "ix_verification_attempts_subject",
        "verification_attempts",
        ["tenant_id", "subject_kind", "subject", "at"],
    )
    # Lockouts: a subject with too many failures in the window may not try until locked_until.
    op.create_table(
        "verification_locks",
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("subject_kind", sa.String(16), nullable=False),
        sa.Column("subject", sa.String(128), nullable=False),
        sa.Column("call_id", sa.String(128)),
        sa.Column("failures", sa.Integer(), nullable=False),
        _ts("locked_at", nullable=False, now=True),
        _ts("locked_until", nullable=False),
        _ts("cleared_at"),
        sa.Column("cleared_by", sa.String(128)),
        sa.Column("cleared_reason", sa.Text()),
        sa.CheckConstraint(
            "subject_kind IN ('account', 'phone')", name="ck_verification_locks_kind"
        ),
    )
    op.create_index(
        "ix_verification_locks_subject",
        "verification_locks",
        ["tenant_id", "subject_kind", "subject"],
    )
    op.create_index("ix_verification_locks_call", "verification_locks", ["call_id"])
    # Provider callbacks received: replay protection by webhook-id, and the highest sequence
    # seen per operation (a report older than one applied is ignored).
    op.create_table(
        "callback_receipts",
        sa.Column("webhook_id", sa.String(255), primary_key=True),
        sa.Column(
            "operation_id",
            sa.Uuid(),
            sa.ForeignKey("operations.operation_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("sequence", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        _ts("received_at", nullable=False, now=True),
    )
    op.create_index(
        "ix_callback_receipts_operation", "callback_receipts", ["operation_id", "sequence"]
    )


def downgrade() -> None:
    op.drop_table("callback_receipts")
    op.drop_table("verification_locks")
    op.drop_table("verification_attempts")
