"""A call and its events, shaped for the staff console (and the demo's table)."""

from __future__ import annotations

import json
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


# What the table shows per kind (everything else, ids included, stays in the JSON).
_DETAILS: dict[str, tuple[str, ...]] = {
    "call_started": ("from", "to"),
    "stream_started": ("stream_sid",),
    "call_rejected": ("reason",),
    "caller_transcript": ("text",),
    "agent_transcript": ("text", "cut", "heard_ms", "audio_ms"),
    "speech_started": ("audio_start_ms",),
    "speech_stopped": ("audio_end_ms",),
    "barge_in": ("played_ms", "audio_end_ms", "truncated", "cancelled", "clear_latency_ms"),
    "response_created": ("reason",),
    "response_done": ("status",),
    "function_call": ("name", "arguments"),
    "function_output": ("sent", "response", "output"),
    "call_ended": ("reason",),
}
_IDS = {"call_id", "call_sid", "item_id", "response_id", "stream_sid", "turn_id"}


def format_table(timeline: dict[str, Any], width: int = 120) -> str:
    """The timeline as a plain-text table: t ms, kind, details."""
    lines = [f"{'t ms':>9}  {'kind':<20}  details", f"{'-' * 9}  {'-' * 20}  {'-' * 50}"]
    for event in timeline["events"]:
        data: dict[str, Any] = event["data"]
        keys = _DETAILS.get(event["kind"]) or tuple(k for k in data if k not in _IDS)
        details = ", ".join(f"{k}={_short(data[k])}" for k in keys if k in data)
        line = f"{event['t_ms']:>9.1f}  {event['kind']:<20}  {details}"
        lines.append(line if len(line) <= width else line[: width - 1] + "…")
    return "\n".join(lines)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = f'"{text}"' if isinstance(value, str) and " " in value else text
    return text if len(text) <= 72 else text[:71] + "…"
