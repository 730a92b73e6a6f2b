"""The calls list: filters (phone, time range, status, leg, unsettled operations) and keyset
pages, newest first.

A page ends with a cursor naming its last call (`created_at`, `id`); the next page is every
call strictly before it in that order, so a page costs the same however deep it is and calls
arriving meanwhile never shift what the next page shows.

Phone searches are where masking could leak: a viewer sees `+•••••••••76`, and suffix searches
(`?phone=176`, `?phone=2176`…) would rebuild the number digit by digit. So a viewer's search is
an exact match on a full number (`viewer_phone`), and every principal's searches are
rate-limited by distinct numbers (`SearchLimiter`).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.store import CallRow, calls
from tools.ledger_models import operations_table as ops_t
from tools.states import TERMINAL, OperationStatus

# Operations not settled yet: anything not terminal (awaiting the caller, queued, running,
# retrying, unknown).
OPEN_STATUSES = [s.value for s in OperationStatus if s not in TERMINAL]


class CursorError(ValueError):
    """A page cursor that this service did not make."""


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a page ended: the last call's creation time and id."""

    created_at: datetime
    id: uuid.UUID

    def encode(self) -> str:
        raw = f"{self.created_at.isoformat()}|{self.id}".encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor:
        try:
            padded = text + "=" * (-len(text) % 4)
            raw = base64.urlsafe_b64decode(padded.encode("ascii")).decode("utf-8")
            stamp, _, ident = raw.partition("|")
            created_at = datetime.fromisoformat(stamp)
            if created_at.tzinfo is None:
                raise ValueError("naive time")
            return cls(created_at, uuid.UUID(ident))
        except (ValueError, UnicodeError, binascii.Error) as exc:
            raise CursorError("not a cursor of this list") from exc


_NOT_DIGIT = re.compile(r"\D")


def phone_digits(text: str) -> str:
    """The digits staff typed (`+1 (555) 123-0000` -> `15551230000`)."""
    return _NOT_DIGIT.sub("", text)


# E.164: a country code and a subscriber number, 15 digits at most; fewer than 8 is no full
# number anywhere (it is a suffix).
E164_MIN_DIGITS = 8
E164_MAX_DIGITS = 15


class SearchRefused(ValueError):
    """A phone search this principal may not make (the message says why)."""


def viewer_phone(digits: str) -> str:
    """A viewer's phone search: the digits of a full E.164 number, else SearchRefused."""
    if not E164_MIN_DIGITS <= len(digits) <= E164_MAX_DIGITS:
        raise SearchRefused(
            "viewers search by a full phone number with its country code (+15551230000); "
            "numbers are masked for this role, so part of one is not searched"
        )
    return digits


class SearchLimiter:
    """Distinct phone numbers each principal searched within `window_s`, at most `max_numbers`.

    Repeating a search costs nothing (the live page refreshes its filtered list on every
    change); a new number past the limit is refused until the oldest leaves the window. Per
    process: each replica counts its own (at most replicas x the limit).
    """

    def __init__(self, max_numbers: int, window_s: float, *, max_principals: int = 10_000) -> None:
        self.max_numbers = max_numbers
        self.window_s = window_s
        self._max_principals = max_principals
        self._seen: OrderedDict[str, OrderedDict[str, float]] = OrderedDict()

    def admit(self, who: str, number: str) -> int | None:
        """None if `who` may search `number` now, else the seconds until it may."""
        now = time.monotonic()
        numbers = self._seen.pop(who, None) or OrderedDict()
        self._seen[who] = numbers  # most recently active last
        while numbers and next(iter(numbers.values())) <= now - self.window_s:
            numbers.popitem(last=False)
        if number in numbers:
            numbers.move_to_end(number)
            numbers[number] = now
            return None
        if len(numbers) >= self.max_numbers:
            return max(1, math.ceil(next(iter(numbers.values())) + self.window_s - now))
        numbers[number] = now
        while len(self._seen) > self._max_principals:
            self._seen.popitem(last=False)  # the longest idle: its window has long passed
        return None


@dataclass(frozen=True, slots=True)
class CallFilter:
    """Which calls to list. Empty tuples and None mean "any"."""

    phone: str | None = None  # digits; matches the end of the from or to number
    phone_exact: bool = False  # match the whole number only (viewers)
    since: datetime | None = None
    until: datetime | None = None
    statuses: tuple[str, ...] = ()
    legs: tuple[str, ...] = ()
    unsettled: bool = False  # only calls with operations not settled yet


@dataclass(frozen=True, slots=True)
class CallSummary:
    """A call as the list shows it: the row plus its operations, counted."""

    call: CallRow
    operations: int
    unsettled: int

    def as_json(self) -> dict[str, Any]:
        return {**self.call.as_json(), "operations": self.operations, "unsettled": self.unsettled}


@dataclass(frozen=True, slots=True)
class CallPage:
    items: list[CallSummary] = field(default_factory=list)
    next_cursor: str | None = None


def _digits_expr(column: str) -> Any:
    # Must read exactly like the index expression in migration 0005 for the index to be used.
    return sa.literal_column(f"reverse(regexp_replace(calls.{column}, '[^0-9]', '', 'g'))")


def _where(f: CallFilter, cursor: Cursor | None) -> list[Any]:
    clauses: list[Any] = []
    if f.phone and f.phone_exact:
        # The same reversed-digits expression, compared whole: the index serves it too.
        whole = sa.literal(f.phone[::-1])
        clauses.append(
            sa.or_(_digits_expr("from_number") == whole, _digits_expr("to_number") == whole)
        )
    elif f.phone:
        pattern = f.phone[::-1] + "%"  # digits only: nothing LIKE would read as a pattern
        clauses.append(
            sa.or_(
                _digits_expr("from_number").op("LIKE")(sa.literal(pattern)),
                _digits_expr("to_number").op("LIKE")(sa.literal(pattern)),
            )
        )
    if f.since is not None:
        clauses.append(calls.c.created_at >= f.since)
    if f.until is not None:
        clauses.append(calls.c.created_at < f.until)
    if f.statuses:
        clauses.append(calls.c.status.in_(list(f.statuses)))
    if f.legs:
        clauses.append(calls.c.leg.in_(list(f.legs)))
    if f.unsettled:
        clauses.append(
            sa.exists().where(
                ops_t.c.call_id == sa.cast(calls.c.id, sa.String),
                ops_t.c.status.in_(OPEN_STATUSES),
            )
        )
    if cursor is not None:
        clauses.append(
            sa.tuple_(calls.c.created_at, calls.c.id) < sa.tuple_(cursor.created_at, cursor.id)
        )
    return clauses


async def search_calls(
    engine: AsyncEngine, f: CallFilter, *, limit: int, cursor: Cursor | None = None
) -> CallPage:
    """One page of calls matching `f`, newest first, after `cursor`."""
    call_key = sa.cast(calls.c.id, sa.String)
    total = (
        sa.select(sa.func.count())
        .where(ops_t.c.call_id == call_key)
        .correlate(calls)
        .scalar_subquery()
    )
    unsettled = (
        sa.select(sa.func.count())
        .where(ops_t.c.call_id == call_key, ops_t.c.status.in_(OPEN_STATUSES))
        .correlate(calls)
        .scalar_subquery()
    )
    stmt = (
        sa.select(calls, total.label("ops_total"), unsettled.label("ops_unsettled"))
        .where(*_where(f, cursor))
        .order_by(calls.c.created_at.desc(), calls.c.id.desc())
        .limit(limit + 1)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(stmt)).mappings().all()
    items = [
        CallSummary(CallRow.from_mapping(r), int(r["ops_total"]), int(r["ops_unsettled"]))
        for r in rows[:limit]
    ]
    next_cursor = None
    if len(rows) > limit and items:
        last = items[-1].call
        next_cursor = Cursor(last.created_at, uuid.UUID(last.id)).encode()
    return CallPage(items, next_cursor)
