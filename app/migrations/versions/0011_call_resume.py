"""call resume: a Twilio call whose stream was lost is released, then taken over once

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # When its holder let the stream go without Twilio's `stop` (NULL: held, or never lost).
    op.add_column("calls", sa.Column("released_at", sa.DateTime(timezone=True)))
    # The nonce of the one resume token that may take the call over (NULL: none issued).
    op.add_column("calls", sa.Column("resume_nonce", sa.String(64)))


def downgrade() -> None:
    op.drop_column("calls", "resume_nonce")
    op.drop_column("calls", "released_at")
