"""Tables of the staff console: accounts, sessions, API tokens, login failures, recordings.

The migration (app/migrations/versions/0005_staff_console.py) is the source of truth for the
schema; these models mirror it for typed access.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, DateTime, ForeignKey, Text
from sqlmodel import Field, SQLModel


def _ts(nullable: bool = True, default_now: bool = False) -> Any:
    return Field(
        default=None,
        sa_column=Column(
            DateTime(timezone=True),
            nullable=nullable,
            server_default=sa.func.now() if default_now else None,
        ),
    )


class StaffAccountRow(SQLModel, table=True):
    """A person who may use the console, with one role."""

    __tablename__ = "staff_accounts"

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True))
    username: str = Field(max_length=64, unique=True)
    password_hash: str = Field(sa_column=Column(Text, nullable=False))
    role: str = Field(max_length=16)
    created_at: datetime | None = _ts(nullable=False, default_now=True)
    password_changed_at: datetime | None = _ts(nullable=False, default_now=True)
    last_login_at: datetime | None = _ts()
    disabled_at: datetime | None = _ts()


class ConsoleSessionRow(SQLModel, table=True):
    """A logged-in browser: the cookie's token (hashed), its CSRF token, its lifetime."""

    __tablename__ = "console_sessions"

    id: str = Field(primary_key=True, max_length=64)
    staff_id: int = Field(
        sa_column=Column(
            BigInteger, ForeignKey("staff_accounts.id", ondelete="CASCADE"), nullable=False
        )
    )
    csrf_token: str = Field(max_length=64)
    source: str | None = Field(default=None, max_length=64)
    user_agent: str | None = Field(default=None, max_length=200)
    created_at: datetime | None = _ts(nullable=False, default_now=True)
    last_seen_at: datetime | None = _ts(nullable=False, default_now=True)
    expires_at: datetime | None = _ts(nullable=False)


class ApiTokenRow(SQLModel, table=True):
    """A bearer token for an integration (only its hash is kept)."""

    __tablename__ = "api_tokens"

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True))
    name: str = Field(max_length=64)
    token_hash: str = Field(max_length=64, unique=True)
    prefix: str = Field(max_length=16)
    role: str = Field(max_length=16)
    created_by: str | None = Field(default=None, max_length=64)
    created_at: datetime | None = _ts(nullable=False, default_now=True)
    last_used_at: datetime | None = _ts()
    revoked_at: datetime | None = _ts()


class LoginFailureRow(SQLModel, table=True):
    """One failed login, counted per account and per source address."""

    __tablename__ = "login_failures"

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True))
    username: str = Field(max_length=64)
    source: str = Field(max_length=64)
    at: datetime | None = _ts(nullable=False, default_now=True)


class CallRecordingRow(SQLModel, table=True):
    """Where a call's recording is and what it holds."""

    __tablename__ = "call_recordings"

    call_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("calls.id", ondelete="CASCADE"), primary_key=True)
    )
    store: str = Field(max_length=16)  # postgres | file
    locator: str = Field(sa_column=Column(Text, nullable=False))  # large object oid, file name
    content_type: str = Field(max_length=64)
    bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    duration_ms: int
    sample_rate: int
    channels: int
    started_at: datetime | None = _ts(nullable=False)
    truncated: bool = False
    created_at: datetime | None = _ts(nullable=False, default_now=True)


staff_accounts_table: sa.Table = SQLModel.metadata.tables["staff_accounts"]
console_sessions_table: sa.Table = SQLModel.metadata.tables["console_sessions"]
api_tokens_table: sa.Table = SQLModel.metadata.tables["api_tokens"]
login_failures_table: sa.Table = SQLModel.metadata.tables["login_failures"]
call_recordings_table: sa.Table = SQLModel.metadata.tables["call_recordings"]
