"""staff console: staff accounts, sessions, API tokens, login failures, call recordings,
and the indexes the calls and operations lists page by

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_ROLES = "'viewer', 'operator', 'admin'"


def _ts(name: str, *, now: bool = False) -> sa.Column:
    if now:
        return sa.Column(
            name, sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        )
    return sa.Column(name, sa.DateTime(timezone=True))


def upgrade() -> None:
    op.create_table(
        "staff_accounts",
        sa.Column("id", sa.BigInteger(), primary_key=True),
        sa.Column("username", sa.String(64), nullable=False, unique=True),
        sa.Column("password_hash", sa.Text(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        _ts("created_at", now=True),
        _ts("password_changed_at", now=True),
        _ts("last_login_at"),
        _ts("disabled_at"),
        sa.CheckConstraint(f"role IN ({_ROLES})", name="ck_staff_accounts_role"),
    )
    op.create_table(
        "console_sessions",
        # sha256 of the cookie's token: a database dump holds no usable session.
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "staff_id",
            sa.BigInteger(),
            sa.ForeignKey("staff_accounts.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("csrf_token", sa.String(64), nullable=False),
        sa.Column("source", sa.String(64)),
        sa.Column("user_agent", sa.String(200)),
        _ts("created_at", now=True),
        _ts("last_seen_at", now=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_console_sessions_staff", "console_sessions", ["staff_id"])
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.BigInteger(), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_by", sa.String(64)),
        _ts("created_at", now=True),
        _ts("last_used_at"),
        _ts("revoked_at"),
        sa.CheckConstraint(f"role IN ({_ROLES})", name="ck_api_tokens_role"),
    )
    op.create_table(
        "login_failures",
        sa.Column("id", sa.BigInteger(), primary_key=True),
        sa.Column("username", sa.String(64), nullable=False),
        sa.Column("source", sa.String(64), nullable=False),
        _ts("at", now=True),
    )
    op.create_index("ix_login_failures_username_at", "login_failures", ["username", "at"])
    op.create_index("ix_login_failures_source_at", "login_failures", ["source", "at"])
    op.create_table(
        "call_recordings",
        sa.Column(
            "call_id",
            sa.Uuid(),
            sa.ForeignKey("calls.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("store", sa.String(16), nullable=False),
        sa.Column("locator", sa.Text(), nullable=False),
        sa.Column("content_type", sa.String(64), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("duration_ms", sa.Integer(), nullable=False),
        sa.Column("sample_rate", sa.Integer(), nullable=False),
        sa.Column("channels", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("truncated", sa.Boolean(), nullable=False, server_default="false"),
        _ts("created_at", now=True),
    )
    # The calls list pages by (created_at, id), newest first.
    op.create_index("ix_calls_created_id", "calls", ["created_at", "id"])
    # Phone search matches the digits a staff member typed against the end of the number
    # ("0000", "5551230000" and "+1 555 123 0000" all find +15551230000): a suffix match is a
    # prefix match on the reversed digits, which a text_pattern_ops btree answers.
    for column in ("from_number", "to_number"):
        op.execute(
            f"CREATE INDEX ix_calls_{column}_digits ON calls "
            f"(reverse(regexp_replace({column}, '[^0-9]', '', 'g')) text_pattern_ops)"
        )
    # The operations list: open ones by last change.
    op.create_index("ix_operations_updated", "operations", ["updated_at", "operation_id"])


def downgrade() -> None:
    op.drop_index("ix_operations_updated", table_name="operations")
    for column in ("from_number", "to_number"):
        op.execute(f"DROP INDEX IF EXISTS ix_calls_{column}_digits")
    op.drop_index("ix_calls_created_id", table_name="calls")
    op.execute("SELECT lo_unlink(locator::oid) FROM call_recordings WHERE store = 'postgres'")
    op.drop_table("call_recordings")
    op.drop_table("login_failures")
    op.drop_table("api_tokens")
    op.drop_table("console_sessions")
    op.drop_table("staff_accounts")
