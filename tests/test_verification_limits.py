"""Durable PIN limits (tools.verification) on real Postgres, with an explicit clock: the
window slides, a lock expires, a success starts the count again, and the lock is per subject."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from tools.verification import LockoutPolicy, active_lock, record_check, subjects_of

POLICY = LockoutPolicy(max_failures=3, window_s=900, lockout_s=900)
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


async def _check(engine: AsyncEngine, at: datetime, ok: bool, phone: str = "+15550001111") -> bool:
    """One PIN check at `at`; whether it tripped a lock."""
    subjects = subjects_of("acc-1", phone)
    async with engine.begin() as conn:
        lock = await record_check(
            conn, "t", subjects, "call-x", succeeded=ok, policy=POLICY, now=at
        )
    return lock is not None


async def _locked(engine: AsyncEngine, at: datetime, phone: str = "+15550001111") -> bool:
    async with engine.connect() as conn:
        return await active_lock(conn, "t", subjects_of(None, phone), at) is not None


async def test_three_failures_in_the_window_lock_for_the_lockout_then_it_expires(
    engine: AsyncEngine,
) -> None:
    assert not await _check(engine, T0, False)
    assert not await _check(engine, T0 + timedelta(minutes=5), False)
    assert await _check(engine, T0 + timedelta(minutes=10), False)
    assert await _locked(engine, T0 + timedelta(minutes=24))
    assert not await _locked(engine, T0 + timedelta(minutes=26))  # 15 minutes after the lock
    # The failures that locked do not count again: one more failure does not re-lock.
    assert not await _check(engine, T0 + timedelta(minutes=26), False)


async def test_failures_outside_the_window_do_not_count(engine: AsyncEngine) -> None:
    assert not await _check(engine, T0, False)
    assert not await _check(engine, T0 + timedelta(minutes=10), False)
    # The first failure has slid out of the 15-minute window.
    assert not await _check(engine, T0 + timedelta(minutes=16), False)
    assert await _check(engine, T0 + timedelta(minutes=17), False)


async def test_a_success_starts_the_count_again(engine: AsyncEngine) -> None:
    assert not await _check(engine, T0, False)
    assert not await _check(engine, T0 + timedelta(minutes=1), False)
    assert not await _check(engine, T0 + timedelta(minutes=2), True)
    assert not await _check(engine, T0 + timedelta(minutes=3), False)
    assert not await _check(engine, T0 + timedelta(minutes=4), False)
    assert await _check(engine, T0 + timedelta(minutes=5), False)


async def test_the_account_locks_whichever_number_the_guesses_come_from(
    engine: AsyncEngine,
) -> None:
    for i, phone in enumerate(["+15550000001", "+15550000002", "+15550000003"]):
        tripped = await _check(engine, T0 + timedelta(minutes=i), False, phone)
    assert tripped  # three numbers, one account: the account is locked
    async with engine.connect() as conn:
        by_account = await active_lock(
            conn, "t", subjects_of("acc-1", None), T0 + timedelta(minutes=3)
        )
    assert by_account is not None and by_account.subject.kind == "account"
    assert not await _locked(engine, T0 + timedelta(minutes=3), "+15550000001")  # numbers: 1 each
