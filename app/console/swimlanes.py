"""A call's timeline laid out as swimlanes on one time axis (pure: view JSON in, layout out).

Lanes, top to bottom:
- caller: what the caller said (speech start to stop, with the transcript);
- agent: what the agent said; a barge-in shows the part the caller heard and, hatched, the
  part that was generated but never heard;
- tools: what the model asked for and what the policy decided;
- operations: every transition of the call's operations;
- system of record: what it confirmed or refused, callbacks, lookups, checks by hand;
- deliveries: how each outcome reached the caller (announced, heard or cut, deferred, SMS);
- call: the call's own life (start, stream, Realtime connection, keypad, errors, end).

Items that would overlap at the narrowest width the page draws are put on separate rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The axis is at least this wide (px), and at least this many px per second of call.
MIN_WIDTH_PX = 640
PX_PER_S = 20
LABEL_PX_PER_CHAR = 6.6
LABEL_MAX_CHARS = 36
GAP_PX = 6
# Points this far along the axis draw their label to their left (it would not fit after).
FLIP_AFTER = 0.8

_CALL_LANE_KINDS = {
    "call_started": "call started",
    "call_rejected": "rejected",
    "stream_started": "media stream",
    "stream_stopped": "stream stopped",
    "stream_lost": "stream lost",
    "released_for_drain": "handed over (drain)",
    "stream_resumed": "stream resumed",
    "realtime_connected": "Realtime connected",
    "realtime_dropped": "Realtime dropped",
    "realtime_reconnected": "Realtime back",
    "realtime_failed": "Realtime failed",
    "realtime_error": "Realtime error",
    "dtmf": "keypad",
    "pin_entered": "PIN entered",
    "verification_locked": "verification locked",
    "agent_handoff": "handoff",
    "stream_abusive": "ended as abusive",
    "foreign_media_dropped": "foreign RTP dropped",
    "malformed_frame": "bad frame",
    "apology_played": "apology",
    "call_transferred": "transferred",
    "dtmf_sent": "keys sent",
    "transfer_requested": "transfer asked",
    "transfer_started": "transferring",
    "transfer_failed": "transfer failed",
    "transfer_answered": "transfer answered",
    "transfer_briefing": "briefing the person",
    "call_hangup": "hung up",
    "outbound_requested": "call requested",
    "outbound_answered": "call answered",
    "amd_result": "answered by",
    "voicemail_left": "voicemail left",
    "outbound_unanswered": "not answered",
    "error": "error",
    "call_ended": "call ended",
}
_SOR_ACTORS = ("worker:", "reconciler", "provider-callback", "staff:", "token:", "sweeper")


@dataclass
class Item:
    """One thing on a lane: a point (`end_ms` None) or a span."""

    start_ms: float
    end_ms: float | None
    label: str
    title: str
    css: str
    href: str | None = None
    heard_end_ms: float | None = None  # agent speech: the heard part ends here
    row: int = 0


@dataclass
class Lane:
    key: str
    title: str
    items: list[Item] = field(default_factory=list)
    rows: int = 1


@dataclass(frozen=True)
class TranscriptLine:
    t_ms: float
    speaker: str  # caller | agent
    text: str
    unheard: str = ""  # agent text generated but never heard (cut by a barge-in)
    note: str = ""
    turn_id: int | None = None


@dataclass
class Swimlanes:
    duration_ms: float
    lanes: list[Lane]
    ticks: list[tuple[float, str]]
    transcript: list[TranscriptLine]
    width_px: int

    def pct(self, ms: float) -> float:
        """Position of `ms` on the axis, in percent."""
        return round(max(0.0, min(100.0, ms / self.duration_ms * 100)), 3)

    def flip(self, item: Item) -> bool:
        """A point near the right edge: its label goes to the left of it."""
        return item.end_ms is None and item.start_ms > self.duration_ms * FLIP_AFTER

    def span_pct(self, item: Item) -> float:
        if item.end_ms is None:
            return 0.0
        return round(max(0.15, (item.end_ms - item.start_ms) / self.duration_ms * 100), 3)


def seconds(ms: float) -> str:
    """`83500` -> `1:23.5`, `2500` -> `2.5 s`."""
    s = ms / 1000
    if s < 60:
        return f"{s:.1f} s"
    minutes, rest = divmod(s, 60)
    return f"{int(minutes)}:{rest:04.1f}"


def _short(text: str, limit: int = LABEL_MAX_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _caller_lane(events: list[dict[str, Any]], end_ms: float) -> tuple[Lane, list[TranscriptLine]]:
    lane = Lane("caller", "Caller")
    open_item: Item | None = None
    by_turn: dict[Any, Item] = {}
    lines: list[TranscriptLine] = []
    for e in events:
        kind, t, data = e["kind"], e["t_ms"], e["data"]
        if kind == "speech_started":
            open_item = Item(t, None, "speaking…", "caller speech", "speech caller")
            lane.items.append(open_item)
            by_turn[data.get("turn_id")] = open_item
        elif kind == "speech_stopped" and open_item is not None:
            open_item.end_ms = max(t, open_item.start_ms + 50)
            open_item = None
        elif kind == "caller_transcript":
            text = str(data.get("text") or "")
            turn = data.get("turn_id")
            target = by_turn.get(data.get("turn_id"))
            # The words are placed where the caller began saying them, as the lane draws them
            # (the transcription itself arrives later, often while the agent answers).
            said_at = target.start_ms if target is not None else t
            lines.append(
                TranscriptLine(
                    said_at, "caller", text, turn_id=turn if isinstance(turn, int) else None
                )
            )
            if target is None:
                target = Item(t, None, "", "", "speech caller point")
                lane.items.append(target)
            target.label = _short(text) or "(speech)"
            target.title = text
    if open_item is not None:
        open_item.end_ms = end_ms
    for item in lane.items:
        if item.end_ms is None and "point" not in item.css:
            item.end_ms = item.start_ms + 200
    return lane, lines


def _agent_lane(events: list[dict[str, Any]]) -> tuple[Lane, list[TranscriptLine]]:
    lane = Lane("agent", "Agent")
    lines: list[TranscriptLine] = []
    for e in events:
        if e["kind"] == "barge_in":
            d = e["data"]
            title = (
                f"barge-in: the caller had heard {d.get('played_ms')} ms; "
                f"truncated {d.get('truncated')}, cancelled {d.get('cancelled')}"
            )
            lane.items.append(Item(e["t_ms"], None, "barge-in", title, "barge"))
    for e in events:
        if e["kind"] != "agent_transcript":
            continue
        d = e["data"]
        heard = float(d.get("heard_ms") or 0)
        audio = float(d.get("audio_ms") or 0)
        text = str(d.get("text") or "")
        full = str(d.get("full_text") or text)
        cut = bool(d.get("cut"))
        if audio <= 0:
            lane.items.append(
                Item(
                    e["t_ms"],
                    None,
                    "(not heard)",
                    f"generated, never heard: {full}",
                    "speech agent point",
                )
            )
            lines.append(TranscriptLine(e["t_ms"], "agent", "", full, "never heard"))
            continue
        # The timeline places speech where the caller began hearing it and says when they
        # stopped; the rest of its audio (cut by a barge-in) was generated, never heard.
        start = float(e["t_ms"])
        heard_end = float(e.get("until_ms", start + heard))
        end = max(start + audio, heard_end)
        unheard = full[len(text) :].strip() if cut and full.startswith(text) else ""
        title = (
            full
            if not cut
            else f"heard {int(heard)} of {int(audio)} ms: “{text}” / never heard: “{unheard}”"
        )
        lane.items.append(
            Item(
                start,
                end,
                _short(text or full),
                title,
                "speech agent cut" if cut else "speech agent",
                heard_end_ms=heard_end if cut else None,
            )
        )
        note = f"cut by a barge-in after {int(heard)} of {int(audio)} ms" if cut else ""
        lines.append(TranscriptLine(start, "agent", text, unheard, note))
    lane.items.sort(key=lambda i: i.start_ms)
    return lane, lines


def _op_href(data: dict[str, Any]) -> str | None:
    op_id = data.get("operation_id")
    return f"/console/operations/{op_id}" if op_id else None


def _tools_lane(events: list[dict[str, Any]]) -> Lane:
    lane = Lane("tools", "Tools and policy")
    for e in events:
        if e["source"] != "tool_call":
            continue
        d = e["data"]
        decision = str(d.get("decision") or "pending")
        title = f"{d.get('tool')} → {decision}"
        if d.get("reason"):
            title += f": {d['reason']}"
        if d.get("arguments") is not None:
            title += f" · arguments {d['arguments']}"
        lane.items.append(
            Item(
                e["t_ms"],
                None,
                _short(f"{d.get('tool')} → {decision}"),
                title,
                f"tool decision-{decision}",
                href=_op_href(d),
            )
        )
    return lane


def _operations_lane(events: list[dict[str, Any]]) -> Lane:
    lane = Lane("operations", "Operations")
    for e in events:
        if e["source"] != "operation" or e["kind"] != "op_transition":
            continue
        d = e["data"]
        title = f"{d.get('tool')}: {d.get('from') or '·'} → {d.get('to')} by {d.get('actor')}"
        if d.get("reason"):
            title += f" ({d['reason']})"
        lane.items.append(
            Item(
                e["t_ms"],
                None,
                _short(f"{d.get('tool')}: {d.get('to')}"),
                title,
                f"op status-{d.get('to')}",
                href=_op_href(d),
            )
        )
    return lane


def _sor_label(d: dict[str, Any]) -> str | None:
    actor = str(d.get("actor") or "")
    if not actor.startswith(_SOR_ACTORS):
        return None
    to = d.get("to")
    what = {
        "committed": f"confirmed {d.get('reference') or ''}".strip(),
        "failed_final": "refused / not done",
        "failed_retryable": "temporary failure",
        "unknown": "no answer: unknown",
    }.get(str(to))
    if what is None:
        return None
    if actor == "provider-callback":
        return f"callback: {what}"
    if actor == "reconciler":
        return f"lookup: {what}"
    if actor.startswith(("staff:", "token:")):
        by_hand = "by hand" in str(d.get("reason") or "")
        return f"by hand: {what}" if by_hand else f"lookup: {what}"
    if actor == "sweeper":
        return f"sweeper: {what}"
    return what


def _sor_lane(events: list[dict[str, Any]]) -> Lane:
    lane = Lane("sor", "System of record")
    for e in events:
        if e["source"] != "operation" or e["kind"] != "op_transition":
            continue
        d = e["data"]
        label = _sor_label(d)
        if label is None:
            continue
        title = f"{d.get('tool')}: {label} ({d.get('actor')}: {d.get('reason') or ''})"
        lane.items.append(
            Item(
                e["t_ms"], None, _short(label), title, f"sor status-{d.get('to')}", href=_op_href(d)
            )
        )
    return lane


def _delivery_lane(events: list[dict[str, Any]]) -> Lane:
    lane = Lane("delivery", "Deliveries")
    transcripts = [e for e in events if e["kind"] == "agent_transcript"]
    for e in events:
        d = e["data"]
        if e["source"] == "operation" and e["kind"] in ("op_decision", "op_note"):
            actor = str(d.get("actor") or "")
            details = d.get("details") or {}
            sms = (
                actor.startswith("sms")
                or "sms" in str(d.get("reason") or "").lower()
                or (isinstance(details, dict) and any("sms" in str(k) for k in details))
            )
            if actor != "delivery" and not sms:
                continue
            reason = str(d.get("reason") or "")
            css = "delivery sms" if sms else "delivery"
            lane.items.append(
                Item(
                    e["t_ms"],
                    None,
                    _short(reason),
                    f"{d.get('tool')}: {reason} ({actor})",
                    css,
                    href=_op_href(d),
                )
            )
        elif e["source"] == "call" and e["kind"] == "result_announced":
            after = next((t for t in transcripts if t["t_ms"] >= e["t_ms"]), None)
            heard = "spoken"
            if after is not None:
                ad = after["data"]
                if ad.get("cut"):
                    heard = f"cut: heard {ad.get('heard_ms')} of {ad.get('audio_ms')} ms"
                elif ad.get("audio_ms"):
                    heard = "heard in full"
            ops = d.get("operation_ids") or []
            href = f"/console/operations/{ops[0]}" if ops else None
            lane.items.append(
                Item(
                    e["t_ms"],
                    None,
                    _short(f"announced · {heard}"),
                    f"result announced in the call; {heard}",
                    "delivery announced",
                    href=href,
                )
            )
        elif e["source"] == "delivery":
            item = _delivery_item(e)
            if item is not None:
                lane.items.append(item)
    return lane


# Delivery states worth a mark of their own; the rest (pending, offered) are steps on the way.
_DELIVERY_MARKS = {
    "heard": "heard",
    "texting": "SMS",
    "texted": "SMS sent",
    "failed": "not delivered",
    "not_deliverable": "not deliverable",
    "calling": "calling back",
    "called": "told by callback",
    "voicemail": "voicemail left",
}


def _delivery_item(e: dict[str, Any]) -> Item | None:
    """One entry of the delivery ledger (`delivery_events`) on the deliveries lane."""
    d = e["data"]
    href = _op_href(d)
    reason = str(d.get("reason") or "")
    if e["kind"] == "delivery_transition":
        to = str(d.get("to") or "")
        if to not in _DELIVERY_MARKS:
            return None
        css = "delivery sms" if to.startswith(("text", "not_")) else "delivery"
        title = f"{d.get('tool')}: {to}" + (f" ({reason})" if reason else "")
        return Item(e["t_ms"], None, _short(_DELIVERY_MARKS[to]), title, css, href=href)
    if e["kind"] == "delivery_decision":
        return Item(e["t_ms"], None, _short(reason), f"{d.get('tool')}: {reason}", "delivery",
                    href=href)  # fmt: skip
    if e["kind"] == "delivery_sms":
        status = str(d.get("to") or (d.get("details") or {}).get("status") or "sms")
        return Item(e["t_ms"], None, _short(f"SMS {status}"), f"SMS {status}", "delivery sms",
                    href=href)  # fmt: skip
    return None


def _call_lane(events: list[dict[str, Any]]) -> Lane:
    lane = Lane("call", "Call")
    for e in events:
        if e["source"] != "call" or e["kind"] not in _CALL_LANE_KINDS:
            continue
        d = e["data"]
        label = _CALL_LANE_KINDS[e["kind"]]
        if e["kind"] == "dtmf":
            label = f"keypad {d.get('digit', '')}".strip()
        if e["kind"] == "pin_entered":
            label = f"PIN entered ({d.get('digits')} digits)"  # never which digits
        if e["kind"] == "agent_handoff":
            label = f"handoff {d.get('from_agent')} → {d.get('to_agent')}"
        if e["kind"] in ("call_ended", "call_rejected") and d.get("reason"):
            label = f"{label}: {d['reason']}"
        detail = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("excerpt",))
        css = (
            "call error"
            if e["kind"]
            in (
                "error",
                "realtime_error",
                "realtime_failed",
                "malformed_frame",
                "verification_locked",
                "stream_abusive",
                "foreign_media_dropped",
            )
            else "call"
        )
        lane.items.append(Item(e["t_ms"], None, _short(label), f"{e['kind']}: {detail}", css))
    return lane


def _pack(lane: Lane, px_per_ms: float, duration_ms: float) -> None:
    """Rows so that no two items (with their labels) overlap at the narrowest width."""
    spans: list[tuple[float, float, Item]] = []
    for item in lane.items:
        label_ms = (len(item.label) * LABEL_PX_PER_CHAR + GAP_PX + 10) / px_per_ms
        if item.end_ms is None and item.start_ms > duration_ms * FLIP_AFTER:  # drawn flipped
            spans.append((item.start_ms - label_ms, item.start_ms, item))
        else:
            end = max(item.end_ms or item.start_ms, item.start_ms + label_ms)
            spans.append((item.start_ms, end, item))
    ends: list[float] = []
    for lo, hi, item in sorted(spans, key=lambda s: s[0]):
        for row, row_end in enumerate(ends):
            if row_end <= lo:
                item.row = row
                ends[row] = hi
                break
        else:
            item.row = len(ends)
            ends.append(hi)
    lane.rows = max(1, len(ends))


def _ticks(duration_ms: float, width_px: int) -> list[tuple[float, str]]:
    for step_s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600):
        if duration_ms / 1000 / step_s * 70 <= width_px:
            break
    count = int(duration_ms / 1000 // step_s)
    return [(i * step_s * 1000, seconds(i * step_s * 1000)) for i in range(count + 1)]


def layout(view: dict[str, Any]) -> Swimlanes:
    """The swimlanes of a call view (see `app.console.call_view`)."""
    events: list[dict[str, Any]] = view["events"]
    last = max([e["t_ms"] for e in events] + [0.0])
    recording = view.get("recording") or {}
    if recording.get("duration_ms"):
        last = max(last, (recording.get("offset_ms") or 0) + recording["duration_ms"])
    caller, caller_lines = _caller_lane(events, last)
    agent, agent_lines = _agent_lane(events)
    lanes = [
        caller,
        agent,
        _tools_lane(events),
        _operations_lane(events),
        _sor_lane(events),
        _delivery_lane(events),
        _call_lane(events),
    ]
    ends = [i.end_ms or i.start_ms for lane in lanes for i in lane.items]
    duration = max([last, 1000.0, *ends]) * 1.02
    width = max(MIN_WIDTH_PX, math.ceil(duration / 1000 * PX_PER_S))
    for lane in lanes:
        _pack(lane, width / duration, duration)
    transcript = sorted(caller_lines + agent_lines, key=lambda line: line.t_ms)
    return Swimlanes(duration, lanes, _ticks(duration, width), transcript, width)
