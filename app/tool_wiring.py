"""Which tool layer the bridge talks to.

Until the durable pipeline (tools/gateway.py) is wired, calls get a small read-only gateway
with one tool, `check_availability`, answered from a deterministic in-memory table. The
switch is the one line in `build_gateway`.
"""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any

from pydantic import BaseModel, Field, ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.settings import Settings
from telephony.tool_gateway import CallContext, FunctionCallRequest, ToolGateway, ToolReply

log = logging.getLogger(__name__)


def build_gateway(settings: Settings, engine: AsyncEngine) -> ToolGateway:
    """The ToolGateway every call of this process uses."""
    return ReadOnlyDemoGateway()


class CheckAvailabilityArgs(BaseModel):
    date: str = Field(description="The date, YYYY-MM-DD.")
    time: str = Field(description="The time, HH:MM, 24-hour clock.")
    party_size: int = Field(ge=1, le=20, description="How many people.")


_SLOTS = ("18:00", "18:30", "19:00", "19:30", "20:00", "20:30", "21:00", "21:30")


def availability(date: str, time: str, party_size: int) -> dict[str, Any]:
    """Deterministic: whether a table is free, and nearby free times, from a hash of the date."""
    seed = zlib.crc32(f"{date}|{party_size}".encode())
    free = [slot for i, slot in enumerate(_SLOTS) if (seed >> i) & 1 or party_size <= 2]
    if time in free:
        return {"available": True, "date": date, "time": time, "party_size": party_size}
    return {
        "available": False,
        "date": date,
        "time": time,
        "party_size": party_size,
        "alternatives": free[:3],
    }


class ReadOnlyDemoGateway:
    """One read-only tool, enough to prove the function-call loop end to end."""

    def definitions(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "name": "check_availability",
                "description": (
                    "Check whether the restaurant has a free table for a date, time and party "
                    "size. Call it when the caller asks about availability or wants to book."
                ),
                "parameters": CheckAvailabilityArgs.model_json_schema(),
            }
        ]

    async def handle(self, ctx: CallContext, request: FunctionCallRequest) -> ToolReply:
        if request.name != "check_availability":
            return ToolReply(output={"error": "That action is not available on this line."})
        try:
            args = CheckAvailabilityArgs.model_validate(json.loads(request.arguments or "{}"))
        except (ValueError, ValidationError):
            return ToolReply(output={"error": "I need a date, a time and the party size."})
        return ToolReply(output=availability(args.date, args.time, args.party_size))

    async def on_dtmf(self, ctx: CallContext, digit: str) -> None:
        return None

    async def on_call_end(self, ctx: CallContext) -> None:
        return None
