"""agents: the agent that admitted an operation, and the one active when its result was told

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("operations", sa.Column("agent", sa.String(40)))
    op.add_column("deliveries", sa.Column("agent", sa.String(40)))


def downgrade() -> None:
    op.drop_column("deliveries", "agent")
    op.drop_column("operations", "agent")
