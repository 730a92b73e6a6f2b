"""The JSON API of the staff console: calls and their timelines (HTTP Basic)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query

from app import call_store
from app.deps import EngineDep, StaffDep
from app.errors import NotFound
from app.timeline import load_timeline

router = APIRouter(prefix="/api")


@router.get("/calls")
async def list_calls(
    engine: EngineDep,
    _staff: StaffDep,
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0),
) -> dict[str, Any]:
    """Newest calls first."""
    rows = await call_store.list_calls(engine, limit=limit, offset=offset)
    return {"calls": [row.as_json() for row in rows], "limit": limit, "offset": offset}


@router.get("/calls/{call_id}/timeline")
async def call_timeline(call_id: str, engine: EngineDep, _staff: StaffDep) -> dict[str, Any]:
    """The call, its operations, and its events, tool calls and operation trail in time order."""
    timeline = await load_timeline(engine, call_id)
    if timeline is None:
        raise NotFound(call_id)
    return timeline
