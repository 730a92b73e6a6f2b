"""Durable caller verification limits: PIN failures and lockouts across calls.

Per call, `tools.identity.CallerVerification` allows a few tries; that alone lets a caller
hang up and call again for fresh ones. Here every PIN check is a row per subject (the
account and the caller's number), and `max_failures` failures within a sliding `window_s`
lock the subject for `lockout_s`, whichever call they came from, across restarts and
replicas. Never the PIN itself, nor which digits were tried. Tables: migration 0007.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

_attempts = sa.table(
    "verification_attempts",
    sa.column("tenant_id"),
    sa.column("subject_kind"),
    sa.column("subject"),
    sa.column("call_id"),
    sa.column("succeeded"),
    sa.column("at"),
)
_locks = sa.table(
    "verification_locks",
    sa.column("id"),
    sa.column("tenant_id"),
    sa.column("subject_kind"),
    sa.column("subject"),
    sa.column("call_id"),
    sa.column("failures"),
    sa.column("locked_at"),
    sa.column("locked_until"),
    sa.column("cleared_at"),
)


@dataclass(frozen=True, slots=True)
class LockoutPolicy:
    """Default: 3 failures within 15 minutes lock verification for 15 minutes."""

    max_failures: int = 3
    window_s: float = 900.0
    lockout_s: float = 900.0


@dataclass(frozen=True, slots=True)
class Subject:
    """Who is being verified: an account, or a caller's number."""

    kind: str  # "account" | "phone"
    value: str


@dataclass(frozen=True, slots=True)
class Lock:
    """A lockout that has just tripped (or is in force)."""

    subject: Subject
    failures: int
    locked_until: datetime


def subjects_of(account_id: str | None, phone: str | None) -> list[Subject]:
    """The subjects one PIN check counts against (128 characters is the column)."""
    out = []
    if account_id:
        out.append(Subject("account", account_id[:128]))
    if phone:
        out.append(Subject("phone", phone[:128]))
    return out


async def _serialize(conn: AsyncConnection, tenant_id: str, subjects: list[Subject]) -> None:
    # Two calls guessing at once must not both see "two failures so far".
    for s in sorted(subjects, key=lambda s: (s.kind, s.value)):
        key = f"verification|{tenant_id}|{s.kind}|{s.value}"
        await conn.execute(
            sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtextextended(key, 0)))
        )


async def active_lock(
    conn: AsyncConnection, tenant_id: str, subjects: list[Subject], now: datetime
) -> Lock | None:
    """The lockout in force for any of `subjects`, if one is."""
    if not subjects:
        return None
    match = sa.or_(
        *(sa.and_(_locks.c.subject_kind == s.kind, _locks.c.subject == s.value) for s in subjects)
    )
    row = (
        await conn.execute(
            sa.select(
                _locks.c.subject_kind, _locks.c.subject, _locks.c.failures, _locks.c.locked_until
            )
            .where(
                _locks.c.tenant_id == tenant_id,
                match,
                _locks.c.cleared_at.is_(None),
                _locks.c.locked_until > now,
            )
            .order_by(_locks.c.locked_until.desc())
            .limit(1)
        )
    ).first()
    if row is None:
        return None
    return Lock(Subject(row.subject_kind, row.subject), row.failures, row.locked_until)


async def record_check(
    conn: AsyncConnection,
    tenant_id: str,
    subjects: list[Subject],
    call_id: str,
    *,
    succeeded: bool,
    policy: LockoutPolicy,
    now: datetime,
) -> Lock | None:
    """Record one PIN check against every subject; the lock it trips, if it trips one.

    Failures count within the window since the subject's last success or last lock.
    """
    if not subjects:
        return None
    await _serialize(conn, tenant_id, subjects)
    await conn.execute(
        sa.insert(_attempts),
        [
            {
                "tenant_id": tenant_id,
                "subject_kind": s.kind,
                "subject": s.value,
                "call_id": call_id[:128],
                "succeeded": succeeded,
                "at": now,
            }
            for s in subjects
        ],
    )
    if succeeded:
        return None
    tripped: Lock | None = None
    window_start = now - timedelta(seconds=policy.window_s)
    for s in subjects:
        of_subject = sa.and_(
            _attempts.c.tenant_id == tenant_id,
            _attempts.c.subject_kind == s.kind,
            _attempts.c.subject == s.value,
        )
        last_success = (
            sa.select(sa.func.max(_attempts.c.at))
            .where(of_subject, _attempts.c.succeeded.is_(True))
            .scalar_subquery()
        )
        last_lock = (
            sa.select(sa.func.max(_locks.c.locked_at))
            .where(
                _locks.c.tenant_id == tenant_id,
                _locks.c.subject_kind == s.kind,
                _locks.c.subject == s.value,
            )
            .scalar_subquery()
        )
        since = sa.func.greatest(
            sa.literal(window_start, sa.DateTime(timezone=True)),
            sa.func.coalesce(last_success, sa.literal(window_start, sa.DateTime(timezone=True))),
            sa.func.coalesce(last_lock, sa.literal(window_start, sa.DateTime(timezone=True))),
        )
        failures = (
            await conn.execute(
                sa.select(sa.func.count()).where(
                    of_subject, _attempts.c.succeeded.is_(False), _attempts.c.at > since
                )
            )
        ).scalar_one()
        if failures >= policy.max_failures:
            until = now + timedelta(seconds=policy.lockout_s)
            await conn.execute(
                sa.insert(_locks).values(
                    id=uuid.uuid4(),
                    tenant_id=tenant_id,
                    subject_kind=s.kind,
                    subject=s.value,
                    call_id=call_id[:128],
                    failures=failures,
                    locked_at=now,
                    locked_until=until,
                )
            )
            if tripped is None:
                tripped = Lock(s, failures, until)
    return tripped
