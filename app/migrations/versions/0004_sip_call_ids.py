"""calls.call_sid holds a whole SIP Call-ID

Revision ID: 0004
Revises: 0003

SIP Call-IDs have no length limit and are often longer than a Twilio CallSid (34). The SIP
listener refuses Call-IDs over 1024 characters, so every call it answers fits whole.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.alter_column(
        "calls", "call_sid", type_=sa.String(1024), existing_type=sa.String(128), nullable=False
    )


def downgrade() -> None:
    op.alter_column(
        "calls", "call_sid", type_=sa.String(128), existing_type=sa.String(1024), nullable=False
    )
