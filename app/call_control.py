"""Ending a call from whichever replica hears about it.

Twilio's status callback can land on any replica; the media stream (and so the bridge) runs
on one. The replica that got the callback publishes `call_control` and the one holding the
call ends it.
"""

from __future__ import annotations

import json
import logging

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import CallRegistry
from app.owned_tasks import OwnedTasks
from app.pg_listener import PgListener

log = logging.getLogger(__name__)

CHANNEL = "call_control"


async def publish_end(engine: AsyncEngine, call_sid: str, reason: str) -> None:
    """Ask every replica to end `call_sid` (the one holding it does)."""
    payload = json.dumps({"action": "end", "call_sid": call_sid, "reason": reason})
    async with engine.begin() as conn:
        await conn.execute(sa.select(sa.func.pg_notify(CHANNEL, payload)))


class CallControl:
    """Ends live calls of this process when another replica asks."""

    def __init__(self, registry: CallRegistry) -> None:
        self._registry = registry
        self._work = OwnedTasks()

    def subscribe(self, listener: PgListener) -> None:
        listener.subscribe(CHANNEL, self._on_notify)

    def _on_notify(self, payload: str) -> None:
        try:
            data = json.loads(payload)
            action, call_sid = data["action"], str(data["call_sid"])
            reason = str(data.get("reason") or "ended by another replica")
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed %s notification", CHANNEL)
            return
        if action != "end" or self._registry.get(call_sid) is None:
            return
        self._work.spawn(self._registry.end(call_sid, reason), f"end-{call_sid}")

    async def stop(self) -> None:
        await self._work.cancel_all()
