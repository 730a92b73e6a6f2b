"""who confirmed an operation, and the caller's evidence (readback heard, answer after it)

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("operations", sa.Column("confirmed_by", sa.String(16)))
    op.add_column("operations", sa.Column("confirmation", JSONB))


def downgrade() -> None:
    op.drop_column("operations", "confirmation")
    op.drop_column("operations", "confirmed_by")
