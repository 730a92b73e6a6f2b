"""deliveries of OpenAI webhooks, by webhook-id (OpenAI retries; the SDK does not deduplicate)

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "openai_webhook_deliveries",
        sa.Column("webhook_id", sa.String(128), primary_key=True),
        sa.Column("event_type", sa.String(64), nullable=False),
        sa.Column("call_id", sa.String(128)),
        sa.Column(
            "received_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.create_index(
        "ix_openai_webhook_deliveries_received_at", "openai_webhook_deliveries", ["received_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_openai_webhook_deliveries_received_at", "openai_webhook_deliveries")
    op.drop_table("openai_webhook_deliveries")
