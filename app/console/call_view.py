"""One call as the console shows it: the timeline JSON, its recording, fit for a role.

The call page and `GET /api/calls/{id}/timeline` both come from `call_view`, so a page never
shows what the API would not (and the other way round).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.recording_store import RecordingInfo, get_recording
from app.calls.timeline import load_timeline
from app.console.masking import Masker
from tools.registry import Registry


def recording_json(info: RecordingInfo, call_id: str, offset_ms: float | None) -> dict[str, Any]:
    return {
        "url": f"/api/calls/{call_id}/recording",
        "content_type": info.content_type,
        "bytes": info.bytes,
        "duration_ms": info.duration_ms,
        "channels": info.channels,
        "sample_rate": info.sample_rate,
        "started_at": info.started_at.isoformat(),
        "truncated": info.truncated,
        # Where the recording starts on the timeline's axis (t_ms of its first sample).
        "offset_ms": offset_ms,
    }


def _origin(events: list[dict[str, Any]]) -> datetime | None:
    """The wall-clock time of t_ms = 0 on the timeline."""
    for e in events:
        if e["source"] == "call":
            return datetime.fromisoformat(e["at"]) - timedelta(milliseconds=e["t_ms"])
    return None


def _redact_arguments(events: list[dict[str, Any]], registry: Registry) -> None:
    """Function calls of tools whose arguments the ledger keeps redacted (PINs) show none."""
    secret = {spec.name for spec in registry if spec.redact_arguments}
    for e in events:
        data = e["data"]
        if e["kind"] == "function_call" and data.get("name") in secret:
            e["data"] = {**data, "arguments": {"redacted": True}}
        elif e["source"] == "tool_call" and data.get("tool") in secret:
            e["data"] = {**data, "arguments": {"redacted": True}}


async def call_view(
    engine: AsyncEngine, call_id: str, *, registry: Registry, masker: Masker
) -> dict[str, Any] | None:
    """{"call", "events", "operations", "recording"} for this role; None if no such call."""
    timeline = await load_timeline(engine, call_id)
    if timeline is None:
        return None
    _redact_arguments(timeline["events"], registry)
    info = await get_recording(engine, call_id)
    recording = None
    if info is not None:
        origin = _origin(timeline["events"])
        offset = (
            round((info.started_at - origin).total_seconds() * 1000, 1)
            if origin is not None
            else None
        )
        recording = recording_json(info, timeline["call"]["id"], offset)
    view: dict[str, Any] = masker.scrub(timeline)
    view["recording"] = recording
    return view
