"""Login rate limiting, shared by every replica: per (account, source), per source, and a
slow-down per account.

Every attempt (form or HTTP Basic) is a row in `login_failures` *before* its password is
checked: `begin` takes a transaction-scoped advisory lock on the account and one on the source,
counts, and inserts the attempt in the same transaction, so concurrent attempts queue on the
locks and the limit cannot be overrun (checking and counting in separate statements let 30
concurrent guesses all through). A wrong password leaves its row as a failure; the right one
removes the rows of its (account, source).

The limits are keyed on the real client, which is what uvicorn puts in `request.client` after
applying `X-Forwarded-For` from the proxies FORWARDED_ALLOW_IPS trusts:
- per (account, source): guessing one account from one place locks that pair only, so the
  right password from another source still works;
- per source, over all accounts: one place spraying many names;
- per account, over all sources: past that many failures the account is not locked but slowed:
  its password is checked at most once per `account_slowdown_s` (a distributed guesser gets a
  few hundred tries per window; staff are never locked out by strangers).
An admin sees the locked pairs on the console's staff page and clears them there or with
`voice-agent staff unlock NAME`; `voice-agent staff unlock --source ADDRESS` clears a source
(behind a shared address, such as a proxy FORWARDED_ALLOW_IPS does not trust or an office's
NAT, 20 failures lock every login through it).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.console_models import login_failures_table as failures_t

if TYPE_CHECKING:
    from app.settings import Settings

# Advisory lock classes (the first key of pg_advisory_xact_lock(int, int)); the second key is
# hashtext() of the name. Accounts are always locked before sources, one of each per
# transaction, so two attempts can never wait for each other in a circle.
_ACCOUNT_LOCK = 0x6C676E61  # "lgna"
_SOURCE_LOCK = 0x6C676E73  # "lgns"


@dataclass(frozen=True, slots=True)
class LoginLimits:
    """How many failures are tolerated within `window_s`, and the per-account slow-down."""

    per_account_source: int
    per_source: int
    per_account: int
    account_slowdown_s: float
    window_s: float

    @classmethod
    def from_settings(cls, s: Settings) -> LoginLimits:
        return cls(
            per_account_source=s.login_max_failures_per_account_source,
            per_source=s.login_max_failures_per_source,
            per_account=s.login_max_failures_per_account,
            account_slowdown_s=s.login_account_slowdown_s,
            window_s=s.login_failure_window_s,
        )


@dataclass(frozen=True, slots=True)
class Throttle:
    """A refusal: which limit, and how many seconds until a login may be tried again."""

    reason: str
    retry_after_s: int


@dataclass(frozen=True, slots=True)
class Attempt:
    """An attempt counted (as a failure until `succeeded` says otherwise)."""

    id: int
    username: str
    source: str


@dataclass(frozen=True, slots=True)
class Lockout:
    """An (account, source) pair at its limit: no login for it until `until`."""

    username: str
    source: str
    failures: int
    until: datetime


def key(text: str) -> str:
    """How names and sources are stored (the column holds 64 characters)."""
    return text.strip().lower()[:64]


def _wait(window_s: float, oldest: datetime, now: datetime) -> int:
    return max(1, math.ceil(window_s - (now - oldest).total_seconds()))


class _KeyedLocks:
    """One asyncio lock per key while anyone holds or waits for it. Attempts for one key queue
    here, in this process, before they take a database connection: a burst of guesses waits
    without holding the pool's connections (the advisory lock then orders the replicas)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


_accounts = _KeyedLocks()
_sources = _KeyedLocks()


async def _lock(conn: AsyncConnection, lock_class: int, name: str) -> None:
    await conn.execute(
        sa.select(sa.func.pg_advisory_xact_lock(sa.literal(lock_class), sa.func.hashtext(name)))
    )


async def begin(
    engine: AsyncEngine, limits: LoginLimits, username: str, source: str
) -> Attempt | Throttle:
    """Count an attempt for `username` from `source`, or refuse it without a password check."""
    user, src = key(username), key(source)
    window = timedelta(seconds=limits.window_s)
    async with _accounts.hold(user), _sources.hold(src):
        return await _count_and_insert(engine, limits, user, src, window)


async def _count_and_insert(
    engine: AsyncEngine, limits: LoginLimits, user: str, src: str, window: timedelta
) -> Attempt | Throttle:
    pair = sa.and_(failures_t.c.username == user, failures_t.c.source == src)
    mine = failures_t.c.username == user
    from_src = failures_t.c.source == src
    async with engine.begin() as conn:
        await _lock(conn, _ACCOUNT_LOCK, user)
        await _lock(conn, _SOURCE_LOCK, src)
        # clock_timestamp(), not now(): the transaction may have waited for the locks, and the
        # attempt it waited for was stamped after this transaction began.
        row = (
            await conn.execute(
                sa.select(
                    sa.func.clock_timestamp(),
                    sa.func.count().filter(pair),
                    sa.func.min(failures_t.c.at).filter(pair),
                    sa.func.count().filter(from_src),
                    sa.func.min(failures_t.c.at).filter(from_src),
                    sa.func.count().filter(mine),
                    sa.func.max(failures_t.c.at).filter(mine),
                ).where(
                    failures_t.c.at > sa.func.clock_timestamp() - window,
                    sa.or_(mine, from_src),
                )
            )
        ).one()
        now, n_pair, pair_oldest, n_src, src_oldest, n_account, account_latest = row
        if n_pair >= limits.per_account_source:
            return Throttle(
                "too many failed logins for this account from this address",
                _wait(limits.window_s, pair_oldest, now),
            )
        if n_src >= limits.per_source:
            return Throttle(
                "too many failed logins from this address", _wait(limits.window_s, src_oldest, now)
            )
        if n_account >= limits.per_account:
            since_last = (now - account_latest).total_seconds()
            if since_last < limits.account_slowdown_s:
                return Throttle(
                    "too many failed logins for this account; it is tried slowly now",
                    max(1, math.ceil(limits.account_slowdown_s - since_last)),
                )
        attempt_id = (
            await conn.execute(
                failures_t.insert()
                .values(username=user, source=src, at=sa.func.clock_timestamp())
                .returning(failures_t.c.id)
            )
        ).scalar_one()
    return Attempt(attempt_id, user, src)


async def failed(engine: AsyncEngine, limits: LoginLimits, attempt: Attempt) -> None:
    """The password was wrong: the attempt's row stays a failure; old rows go."""
    async with engine.begin() as conn:
        # Rows older than two windows count for nothing any more.
        await conn.execute(
            failures_t.delete().where(
                failures_t.c.at < sa.func.now() - timedelta(seconds=2 * limits.window_s)
            )
        )


async def succeeded(engine: AsyncEngine, attempt: Attempt) -> None:
    """The password was right: this (account, source) starts clean again. Failures from other
    sources stay (they are someone else's guesses, and still count toward the slow-down)."""
    async with engine.begin() as conn:
        await conn.execute(
            failures_t.delete().where(
                sa.or_(
                    failures_t.c.id == attempt.id,
                    sa.and_(
                        failures_t.c.username == attempt.username,
                        failures_t.c.source == attempt.source,
                    ),
                )
            )
        )


async def lockouts(engine: AsyncEngine, limits: LoginLimits) -> list[Lockout]:
    """Every (account, source) pair at its limit now, most recent first."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.select(
                    failures_t.c.username,
                    failures_t.c.source,
                    sa.func.count(),
                    sa.func.min(failures_t.c.at),
                    sa.func.now(),
                )
                .where(failures_t.c.at > sa.func.now() - timedelta(seconds=limits.window_s))
                .group_by(failures_t.c.username, failures_t.c.source)
                .having(sa.func.count() >= limits.per_account_source)
                .order_by(sa.func.max(failures_t.c.at).desc())
                .limit(500)
            )
        ).all()
    return [
        Lockout(user, src, count, now + timedelta(seconds=_wait(limits.window_s, oldest, now)))
        for user, src, count, oldest, now in rows
    ]


async def clear(engine: AsyncEngine, username: str | None = None, source: str | None = None) -> int:
    """Forget the failures of `username` (from every source), of `source` (for every account),
    or of the pair when both are given; how many there were."""
    if username is None and source is None:
        raise ValueError("clear needs a username, a source or both")
    where = [failures_t.c.username == key(username)] if username is not None else []
    if source is not None:
        where.append(failures_t.c.source == key(source))
    async with engine.begin() as conn:
        result = await conn.execute(failures_t.delete().where(*where))
    return int(result.rowcount or 0)
