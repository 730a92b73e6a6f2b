"""callback deliveries: a late result told by calling the caller back

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_BEFORE = (
    "pending",
    "offered",
    "heard",
    "texting",
    "texted",
    "failed",
    "not_deliverable",
    "not_needed",
)
_AFTER = (*_BEFORE, "calling", "called", "voicemail")


def _check(states: tuple[str, ...]) -> None:
    op.drop_constraint("ck_deliveries_state", "deliveries", type_="check")
    listed = ", ".join(f"'{s}'" for s in states)
    op.create_check_constraint("ck_deliveries_state", "deliveries", f"state IN ({listed})")


def upgrade() -> None:
    _check(_AFTER)
    # The callback calls of a delivery (app/ops/callback.py) are found by this.
    op.execute("CREATE INDEX ix_calls_outbound_delivery ON calls ((outbound->>'delivery_id'))")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_calls_outbound_delivery")
    op.execute(
        "UPDATE deliveries SET state = 'not_deliverable', finished_at = coalesce(finished_at, "
        "now()) WHERE state IN ('calling', 'called', 'voicemail')"
    )
    _check(_BEFORE)
