"""Console sessions: a random token in an HttpOnly cookie, its sha256 in the database.

Each session has its own CSRF token (the synchronizer-token pattern): every form and every
state-changing fetch of the console carries it, and a request whose token does not match the
session's is refused. A session ends on logout, after `idle_s` without use, after `max_s` in any
case, and when its account is disabled or its password changed.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from app.console_models import console_sessions_table as sessions_t
from app.console_models import staff_accounts_table as staff_t

COOKIE = "va_session"
# Touch `last_seen_at` at most this often (one write per minute per session, not per request).
TOUCH_EVERY_S = 60.0


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    """A valid session and who it belongs to."""

    id: str  # the token's hash
    staff_id: int
    username: str
    role: Role
    csrf_token: str
    expires_at: datetime


async def create_session(
    engine: AsyncEngine,
    staff_id: int,
    *,
    max_s: float,
    source: str | None = None,
    user_agent: str | None = None,
) -> tuple[str, str]:
    """A new session for `staff_id`; returns (cookie token, CSRF token)."""
    token = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(32)
    async with engine.begin() as conn:
        await conn.execute(
            sessions_t.insert().values(
                id=token_hash(token),
                staff_id=staff_id,
                csrf_token=csrf,
                source=(source or "")[:64] or None,
                user_agent=(user_agent or "")[:200] or None,
                expires_at=datetime.now(UTC) + timedelta(seconds=max_s),
            )
        )
        # Old sessions are swept here rather than by a timer of their own.
        await conn.execute(sessions_t.delete().where(sessions_t.c.expires_at < sa.func.now()))
    return token, csrf


async def load_session(engine: AsyncEngine, token: str, *, idle_s: float) -> ConsoleSession | None:
    """The live session of `token` (its account active), touching its last use; else None."""
    if not token or len(token) > 128:
        return None
    key = token_hash(token)
    now = datetime.now(UTC)
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                sa.select(
                    sessions_t.c.id,
                    sessions_t.c.staff_id,
                    sessions_t.c.csrf_token,
                    sessions_t.c.expires_at,
                    sessions_t.c.last_seen_at,
                    staff_t.c.username,
                    staff_t.c.role,
                    staff_t.c.disabled_at,
                )
                .join(staff_t, staff_t.c.id == sessions_t.c.staff_id)
                .where(sessions_t.c.id == key)
            )
        ).first()
    if row is None or row.disabled_at is not None:
        return None
    if row.expires_at <= now or row.last_seen_at + timedelta(seconds=idle_s) <= now:
        await end_session(engine, token)
        return None
    if (now - row.last_seen_at).total_seconds() >= TOUCH_EVERY_S:
        async with engine.begin() as conn:
            await conn.execute(
                sessions_t.update().where(sessions_t.c.id == key).values(last_seen_at=now)
            )
    return ConsoleSession(
        id=row.id,
        staff_id=row.staff_id,
        username=row.username,
        role=Role(row.role),
        csrf_token=row.csrf_token,
        expires_at=row.expires_at,
    )


async def end_session(engine: AsyncEngine, token: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(sessions_t.delete().where(sessions_t.c.id == token_hash(token)))


def csrf_matches(expected: str, given: str | None) -> bool:
    """Constant-time comparison of a submitted CSRF token with the session's."""
    if not given:
        return False
    return secrets.compare_digest(expected.encode(), given.encode())
