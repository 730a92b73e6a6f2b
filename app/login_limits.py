"""Login rate limiting, per account and per source address, shared by every replica.

Failures are rows in `login_failures`; a login (form or HTTP Basic) is refused without even
checking the password while either its account or its source has had too many failures within
the window. A successful login clears the account's failures (not the source's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.console_models import login_failures_table as failures_t


@dataclass(frozen=True, slots=True)
class LoginLimits:
    """How many failures are tolerated within `window_s`."""

    per_account: int
    per_source: int
    window_s: float


@dataclass(frozen=True, slots=True)
class Throttle:
    """A refusal: which limit, and how many seconds until a login may be tried again."""

    reason: str
    retry_after_s: int


def _key(text: str) -> str:
    return text.strip().lower()[:64]


async def check(
    engine: AsyncEngine, limits: LoginLimits, username: str, source: str
) -> Throttle | None:
    """None if a login for `username` from `source` may be tried now."""
    since = datetime.now(UTC) - timedelta(seconds=limits.window_s)
    async with engine.connect() as conn:
        for column, value, limit, what in (
            (failures_t.c.username, _key(username), limits.per_account, "account"),
            (failures_t.c.source, _key(source), limits.per_source, "source"),
        ):
            row = (
                await conn.execute(
                    sa.select(sa.func.count(), sa.func.min(failures_t.c.at)).where(
                        column == value, failures_t.c.at > since
                    )
                )
            ).one()
            count, oldest = row
            if count >= limit:
                wait = limits.window_s - (datetime.now(UTC) - oldest).total_seconds()
                return Throttle(f"too many failed logins for this {what}", max(1, math.ceil(wait)))
    return None


async def record_failure(
    engine: AsyncEngine, limits: LoginLimits, username: str, source: str
) -> None:
    async with engine.begin() as conn:
        await conn.execute(failures_t.insert().values(username=_key(username), source=_key(source)))
        # Rows older than two windows count for nothing any more.
        await conn.execute(
            failures_t.delete().where(
                failures_t.c.at < sa.func.now() - timedelta(seconds=2 * limits.window_s)
            )
        )


async def record_success(engine: AsyncEngine, username: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(failures_t.delete().where(failures_t.c.username == _key(username)))
