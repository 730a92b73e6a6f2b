"""A call and its events, shaped for the staff console (and the demo's table)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app import call_store
from app.call_store import call_events

# When both clocks disagree by more than this, the events came from different processes
# (monotonic clocks are per process) and wall-clock differences are used instead.
_CLOCK_SKEW_NS = 1_000_000_000


def _t_ms(mono_ns: int, at: datetime, origin_mono: int, origin_at: datetime) -> float:
    wall_ns = (at - origin_at).total_seconds() * 1e9
    mono = mono_ns - origin_mono
    best = mono if abs(mono - wall_ns) < _CLOCK_SKEW_NS else wall_ns
    return round(best / 1e6, 1)


async def load_timeline(engine: AsyncEngine, call_id: str) -> dict[str, Any] | None:
    """{"call": {...}, "events": [{seq, kind, at, t_ms, data}]} in seq order; None if unknown."""
    call = await call_store.get_call(engine, call_id)
    if call is None:
        return None
    stmt = (
        sa.select(
            call_events.c.seq,
            call_events.c.kind,
            call_events.c.at,
            call_events.c.mono_ns,
            call_events.c.data,
        )
        .where(call_events.c.call_id == uuid.UUID(call.id))
        .order_by(call_events.c.seq)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(stmt)).all()
    events: list[dict[str, Any]] = []
    if rows:
        origin_mono, origin_at = rows[0].mono_ns, rows[0].at
        for row in rows:
            events.append(
                {
                    "seq": row.seq,
                    "kind": row.kind,
                    "at": row.at.isoformat(),
                    "t_ms": _t_ms(row.mono_ns, row.at, origin_mono, origin_at),
                    "data": row.data,
                }
            )
    return {"call": call.as_json(), "events": events}


def format_table(timeline: dict[str, Any], width: int = 100) -> str:
    """The timeline as a plain-text table: t ms, kind, details."""
    lines = [f"{'t ms':>9}  {'kind':<22}  details", f"{'-' * 9}  {'-' * 22}  {'-' * 40}"]
    for event in timeline["events"]:
        details = ", ".join(f"{k}={_short(v)}" for k, v in event["data"].items())
        line = f"{event['t_ms']:>9.1f}  {event['kind']:<22}  {details}"
        lines.append(line if len(line) <= width else line[: width - 1] + "…")
    return "\n".join(lines)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 48 else text[:47] + "…"
