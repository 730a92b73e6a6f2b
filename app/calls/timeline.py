"""A call as one timeline: what was said, what the model asked for, what policy decided,
what the workers and the system of record did, and what the caller was told.

Four sources are merged by time into one ordered list of entries, each tagged with its
`source`:
- `call`: the call's events (`call_events`, in `seq` order), as before;
- `tool_call`: every function call the model made (`tool_calls`) and the policy decision;
- `operation`: every row of the trail of the call's operations (`operation_events`):
  transitions (`op_transition`), decisions (`op_decision`) and notes (`op_note`);
- `delivery`: how each outcome reached the caller (`delivery_events`): moves
  (`delivery_transition`), relevance-gate decisions with their reasons
  (`delivery_decision`), notes such as "held: the caller is speaking" (`delivery_note`), and
  every SMS status (`delivery_sms`: pending, queued, sent, delivered, undelivered, failed).

Every entry has `source, seq, kind, at, t_ms, data`; `seq` is the call event's sequence
number (None for the other sources). One clock orders them all: `t_ms` is milliseconds since
the call's first entry, never negative. Agent speech (`agent_transcript`, recorded once its
audio has played or was cut) is placed from the moment the caller began hearing it (`t_ms`) to
the moment they stopped (`until_ms`, `t_ms` plus what was heard); the page draws it there.
"""

from __future__ import annotations

import json
import shutil
import textwrap
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import store as call_store
from app.calls.store import call_events
from tools.delivery_models import deliveries_table as deliveries
from tools.delivery_models import delivery_events_table as delivery_events
from tools.delivery_models import sms_messages_table as sms_messages
from tools.ledger_models import operation_events_table as op_events
from tools.ledger_models import operations_table as operations
from tools.ledger_models import tool_calls_table as tool_calls

# When both clocks disagree by more than this, the events came from different processes
# (monotonic clocks are per process) and wall-clock differences are used instead.
_CLOCK_SKEW_NS = 1_000_000_000

# Which source comes first when two entries share a timestamp (a tool call and the
# admission it caused are written in one transaction, so they share `now()`).
_RANK = {"call": 0, "tool_call": 1, "operation": 2, "delivery": 3}


def _t_ms(mono_ns: int, at: datetime, origin_mono: int, origin_at: datetime) -> float:
    wall_ns = (at - origin_at).total_seconds() * 1e9
    mono = mono_ns - origin_mono
    best = mono if abs(mono - wall_ns) < _CLOCK_SKEW_NS else wall_ns
    return round(best / 1e6, 1)


def _wall_ms(at: datetime, origin_at: datetime) -> float:
    return round((at - origin_at).total_seconds() * 1000, 1)


async def load_timeline(engine: AsyncEngine, call_id: str) -> dict[str, Any] | None:
    """{"call", "events", "operations", "deliveries"}: `events` is every entry of the call
    in time order; None if the call is unknown."""
    call = await call_store.get_call(engine, call_id)
    if call is None:
        return None
    call_uuid = uuid.UUID(call.id)
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.select(
                    call_events.c.seq,
                    call_events.c.kind,
                    call_events.c.at,
                    call_events.c.mono_ns,
                    call_events.c.data,
                )
                .where(call_events.c.call_id == call_uuid)
                .order_by(call_events.c.seq)
            )
        ).all()
        tc_rows = (
            await conn.execute(
                sa.select(tool_calls)
                .where(tool_calls.c.call_id == call.id)
                .order_by(tool_calls.c.id)
            )
        ).all()
        op_rows = (
            await conn.execute(
                sa.select(operations)
                .where(operations.c.call_id == call.id)
                .order_by(operations.c.created_at, operations.c.operation_id)
            )
        ).all()
        ev_rows = (
            await conn.execute(
                sa.select(op_events, operations.c.tool, operations.c.provider_ref)
                .join(operations, operations.c.operation_id == op_events.c.operation_id)
                .where(operations.c.call_id == call.id)
                .order_by(op_events.c.id)
            )
        ).all()
        dl_rows = (
            await conn.execute(
                sa.select(deliveries, operations.c.tool)
                .join(operations, operations.c.operation_id == deliveries.c.operation_id)
                .where(deliveries.c.call_id == call.id)
                .order_by(deliveries.c.created_at)
            )
        ).all()
        dev_rows = (
            await conn.execute(
                sa.select(delivery_events, deliveries.c.operation_id, operations.c.tool)
                .join(deliveries, deliveries.c.id == delivery_events.c.delivery_id)
                .join(operations, operations.c.operation_id == deliveries.c.operation_id)
                .where(deliveries.c.call_id == call.id)
                .order_by(delivery_events.c.id)
            )
        ).all()
        sms_rows = (
            await conn.execute(
                sa.select(sms_messages)
                .join(deliveries, deliveries.c.id == sms_messages.c.delivery_id)
                .where(deliveries.c.call_id == call.id)
                .order_by(sms_messages.c.created_at)
            )
        ).all()

    origin_at = rows[0].at if rows else _earliest(tc_rows, ev_rows)
    keyed: list[tuple[float, int, int, dict[str, Any]]] = []
    if rows:
        origin_mono = rows[0].mono_ns
        for row in rows:
            mono_ns, at = _stamp(row)
            entry = {
                "source": "call",
                "seq": row.seq,
                "kind": row.kind,
                "at": at.isoformat(),
                "t_ms": _t_ms(mono_ns, at, origin_mono, origin_at),
                "data": row.data,
            }
            if row.kind == "agent_transcript":
                entry["until_ms"] = round(entry["t_ms"] + _heard_ms(row.data), 1)
            keyed.append((entry["t_ms"], _RANK["call"], row.seq, entry))
    for tc in tc_rows:
        entry = _tool_call_entry(tc, origin_at)
        keyed.append((entry["t_ms"], _RANK["tool_call"], tc.id, entry))
    for ev in ev_rows:
        entry = _operation_entry(ev, origin_at)
        keyed.append((entry["t_ms"], _RANK["operation"], ev.id, entry))
    for dev in dev_rows:
        entry = _delivery_entry(dev, origin_at)
        keyed.append((entry["t_ms"], _RANK["delivery"], dev.id, entry))
    keyed.sort(key=lambda k: k[:3])
    events = [k[3] for k in keyed]
    _from_zero(events)
    call_json = call.as_json()
    # The call's trace (when traces are exported): its stream said which.
    call_json["trace_id"] = next(
        (
            str(e["data"]["trace_id"])
            for e in events
            if e["kind"] == "stream_started"
            and isinstance(e.get("data"), dict)
            and e["data"].get("trace_id")
        ),
        None,
    )
    return {
        "call": call_json,
        "events": events,
        "operations": [_operation_summary(op) for op in op_rows],
        "deliveries": [_delivery_summary(d, sms_rows) for d in dl_rows],
    }


# A start stamp further back than this is not this event's (another clock, a bad value).
_MAX_SPEECH_NS = 3600 * 1_000_000_000


def _heard_ms(data: Any) -> float:
    heard = data.get("heard_ms") if isinstance(data, dict) else None
    return float(heard) if isinstance(heard, int | float) and heard > 0 else 0.0


def _stamp(row: Any) -> tuple[int, datetime]:
    """(monotonic ns, wall time) an event is placed at: agent speech at its start."""
    if row.kind != "agent_transcript":
        return row.mono_ns, row.at
    started = row.data.get("started_mono_ns") if isinstance(row.data, dict) else None
    back_ns: float = -1
    if isinstance(started, int):
        back_ns = row.mono_ns - started
    if not 0 <= back_ns <= _MAX_SPEECH_NS:
        # No playout stamp (an older row, a leg that cannot tell): it was recorded when the
        # caller stopped hearing it, so it began what they heard before that.
        back_ns = _heard_ms(row.data) * 1_000_000
    return round(row.mono_ns - back_ns), row.at - timedelta(microseconds=back_ns / 1000)


def _from_zero(events: list[dict[str, Any]]) -> None:
    """Shift the axis so its first entry is at 0: speech heard before the call's first event
    (a greeting started as the stream opened) never shows at a negative offset."""
    first = min((e["t_ms"] for e in events), default=0.0)
    if first >= 0:
        return
    for e in events:
        e["t_ms"] = round(e["t_ms"] - first, 1)
        if "until_ms" in e:
            e["until_ms"] = round(e["until_ms"] - first, 1)


def _earliest(*groups: Sequence[Any]) -> datetime:
    stamps = [
        getattr(row, "created_at", None) or getattr(row, "at", None)
        for group in groups
        for row in group
    ]
    found = [s for s in stamps if s is not None]
    return min(found) if found else datetime.fromtimestamp(0, UTC)


def _tool_call_entry(tc: Any, origin_at: datetime) -> dict[str, Any]:
    output = tc.output or {}
    return {
        "source": "tool_call",
        "seq": None,
        "kind": "tool_call",
        "at": tc.created_at.isoformat(),
        "t_ms": _wall_ms(tc.created_at, origin_at),
        "data": {
            "tool": tc.tool,
            "provider_call_id": tc.provider_call_id,
            "turn_id": tc.turn_id,
            "response_id": tc.response_id,
            "decision": tc.decision,
            "reason": tc.decision_reason,
            "operation_id": str(tc.operation_id) if tc.operation_id else None,
            "arguments": tc.arguments if tc.arguments is not None else tc.raw_arguments,
            "status": output.get("status"),
            "message": output.get("message"),
            "completed_at": tc.completed_at.isoformat() if tc.completed_at else None,
        },
    }


def _operation_entry(ev: Any, origin_at: datetime) -> dict[str, Any]:
    data: dict[str, Any] = {
        "operation_id": str(ev.operation_id),
        "tool": ev.tool,
        "from": ev.from_status,
        "to": ev.to_status,
        "actor": ev.actor,
        "reason": ev.reason,
    }
    if ev.to_status == "committed" and ev.provider_ref:
        data["reference"] = ev.provider_ref
    if ev.data:
        data["details"] = ev.data
    return {
        "source": "operation",
        "seq": None,
        "kind": f"op_{ev.kind}",
        "at": ev.at.isoformat(),
        "t_ms": _wall_ms(ev.at, origin_at),
        "data": data,
    }


def _delivery_entry(ev: Any, origin_at: datetime) -> dict[str, Any]:
    data: dict[str, Any] = {
        "delivery_id": str(ev.delivery_id),
        "operation_id": str(ev.operation_id),
        "tool": ev.tool,
        "from": ev.from_state,
        "to": ev.to_state,
        "actor": ev.actor,
        "reason": ev.reason,
    }
    if ev.data:
        data["details"] = ev.data
    return {
        "source": "delivery",
        "seq": None,
        "kind": f"delivery_{ev.kind}",
        "at": ev.at.isoformat(),
        "t_ms": _wall_ms(ev.at, origin_at),
        "data": data,
    }


def _delivery_summary(d: Any, sms_rows: Sequence[Any]) -> dict[str, Any]:
    def iso(value: datetime | None) -> str | None:
        return value.isoformat() if value else None

    return {
        "id": str(d.id),
        "operation_id": str(d.operation_id),
        "tool": d.tool,
        "outcome": d.outcome,
        "state": d.state,
        "channel": d.channel,
        "offers": d.offers,
        "cuts": d.cuts,
        "response_id": d.response_id,
        "reason": d.reason,
        "heard_at": iso(d.heard_at),
        "finished_at": iso(d.finished_at),
        "sms": [
            {
                "id": str(m.id),
                "to": m.to_number,
                "status": m.status,
                "message_sid": m.message_sid,
                "error_code": m.error_code,
                "body": m.body,
                "requested_by": m.requested_by,
                "created_at": iso(m.created_at),
                "status_at": iso(m.status_at),
            }
            for m in sms_rows
            if m.delivery_id == d.id
        ],
    }


def _operation_summary(op: Any) -> dict[str, Any]:
    def iso(value: datetime | None) -> str | None:
        return value.isoformat() if value else None

    return {
        "operation_id": str(op.operation_id),
        "tool": op.tool,
        "status": op.status,
        "arguments": op.args,
        "attempts": op.attempts,
        "reference": op.provider_ref,
        "error": op.error,
        "compensates_operation_id": (
            str(op.compensates_operation_id) if op.compensates_operation_id else None
        ),
        "created_at": iso(op.created_at),
        "committed_at": iso(op.committed_at),
        "finished_at": iso(op.finished_at),
    }


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
    "result_announced": ("operation_ids",),
    "result_held": ("reason",),
    "result_heard": ("heard_ms", "audio_ms"),
    "result_cut": ("heard_ms", "audio_ms", "reason"),
    "result_not_spoken": ("reason",),
    "call_ended": ("reason",),
    "pin_entered": ("digits", "outcome"),
    "verification_locked": ("subject", "failures", "locked_until"),
    "agent_handoff": ("from_agent", "to_agent", "reason"),
    "stream_abusive": ("budget", "reason"),
    "foreign_media_dropped": ("source",),
}
_IDS = {"call_id", "call_sid", "item_id", "response_id", "stream_sid", "turn_id"}


_DETAILS_AT = 9 + 2 + 20 + 2  # where the details column starts


def terminal_width(default: int = 120) -> int:
    """Columns of the terminal (COLUMNS, else the tty's, else `default`); at least 60."""
    return max(60, shutil.get_terminal_size((default, 24)).columns)


def format_table(timeline: dict[str, Any], width: int | None = 120) -> str:
    """The timeline as a plain-text table: t ms, kind, details. Details longer than `width`
    wrap onto indented lines (nothing is cut); `width=None` keeps one line per entry."""
    rule = 50 if width is None else max(7, min(50, width - _DETAILS_AT))
    lines = [f"{'t ms':>9}  {'kind':<20}  details", f"{'-' * 9}  {'-' * 20}  {'-' * rule}"]
    indent = " " * _DETAILS_AT
    for event in timeline["events"]:
        kind, details = _row(event)
        head = f"{event['t_ms']:>9.1f}  {kind:<20}  "
        if width is None or len(head) + len(details) <= width:
            lines.append(head + details)
            continue
        wrapped = textwrap.wrap(
            details,
            width=max(20, width - _DETAILS_AT),
            break_long_words=True,
            break_on_hyphens=False,
        )
        lines.append(head + wrapped[0])
        lines.extend(indent + more for more in wrapped[1:])
    return "\n".join(lines)


def _row(event: dict[str, Any]) -> tuple[str, str]:
    data: dict[str, Any] = event["data"]
    source = event.get("source", "call")
    if source == "tool_call":
        # e.g. `book_table -> needs_confirmation (awaiting the caller's confirmation) op 1a2b3c4d`
        text = f"{data['tool']} -> {data['decision']}"
        if data.get("reason"):
            text += f" ({data['reason']})"
        if data.get("operation_id"):
            text += f" op {data['operation_id'][:8]}"
        return "tool_call", text
    if source == "operation":
        # e.g. `op book_table: admitted (policy)`, `op: committed (worker:…) ref BK…`
        who = data["actor"]
        if event["kind"] == "op_transition":
            text = f"{data['tool']}: {data['to']} ({who})"
            if data.get("reference"):
                text += f" ref {data['reference']}"
            elif data.get("reason"):
                text += f": {data['reason']}"
            return "op", text
        label = "decision" if event["kind"] == "op_decision" else "note"
        return label, f"{data['tool']}: {data.get('reason') or ''} ({who})"
    if source == "delivery":
        # e.g. `delivery: offered (replica:…): handed to the live call`, `sms: delivered`
        kind = event["kind"].removeprefix("delivery_")
        details = data.get("details") or {}
        if kind == "sms":
            return "sms", f"{data['tool']}: {details.get('status')} ({data['actor']})"
        if kind == "transition":
            return "delivery", f"{data['tool']}: {data['to']}: {data.get('reason') or ''}"
        return f"delivery {kind}", f"{data['tool']}: {data.get('reason') or ''}"
    kind = event["kind"]
    keys = _DETAILS.get(kind)
    if keys is None:
        keys = tuple(k for k in data if k not in _IDS)
    return kind, ", ".join(f"{k}={_shown(data[k])}" for k in keys if k in data)


def _shown(value: Any) -> str:
    """A value as the table shows it: whole (the table wraps; a readback is never cut)."""
    if isinstance(value, str) and value.startswith(("{", "[")):
        # Arguments arrive as the model's compact JSON: a space after each field lets the
        # table wrap between fields, never inside one.
        try:
            value = json.loads(value)
        except ValueError:
            pass
    text = (
        value if isinstance(value, str) else json.dumps(value, default=str, separators=(", ", ":"))
    )
    return f'"{text}"' if isinstance(value, str) and " " in value else text
