"""outbound calls: what an outbound call is for and where it stands

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL for an inbound call; an outbound one: purpose, operation ids, the AMD result.
    op.add_column("calls", sa.Column("outbound", JSONB))


def downgrade() -> None:
    op.drop_column("calls", "outbound")
