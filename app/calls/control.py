"""Ending a call from whichever replica hears about it.

Twilio's status callback (or a staff action) can land on any replica; the media stream (and
so the bridge) runs on one. The replica that got it publishes `call_control` and the one
holding the call acts: `end`, `transfer` (OpenAI SIP interconnect calls: `refer`), `amd`
(who answered an outbound call, from Twilio's answering-machine detection), or `warm` (a warm
transfer's person was briefed: join them; or was never reached: tell the caller).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.registry import CallRegistry
from app.owned_tasks import OwnedTasks
from app.pg_listener import PgListener

log = logging.getLogger(__name__)

CHANNEL = "call_control"


async def publish_end(engine: AsyncEngine, call_sid: str, reason: str) -> None:
    """Ask every replica to end `call_sid` (the one holding it does)."""
    payload = json.dumps({"action": "end", "call_sid": call_sid, "reason": reason})
    async with engine.begin() as conn:
        await conn.execute(sa.select(sa.func.pg_notify(CHANNEL, payload)))


async def publish_transfer(engine: AsyncEngine, call_sid: str, target: str, by: str) -> None:
    """Ask every replica to transfer `call_sid` to `target` (the one holding it does)."""
    payload = json.dumps(
        {"action": "transfer", "call_sid": call_sid, "target": target, "by": by[:128]}
    )
    async with engine.begin() as conn:
        await conn.execute(sa.select(sa.func.pg_notify(CHANNEL, payload)))


async def publish_amd(engine: AsyncEngine, call_sid: str, answered_by: str) -> None:
    """Tell the replica holding the outbound call `call_sid` who answered it (Twilio's
    answering-machine detection)."""
    payload = json.dumps({"action": "amd", "call_sid": call_sid, "answered_by": answered_by})
    async with engine.begin() as conn:
        await conn.execute(sa.select(sa.func.pg_notify(CHANNEL, payload)))


async def publish_warm(
    engine: AsyncEngine, call_sid: str, step: str, function_call_id: str, status: str = ""
) -> None:
    """Tell the replica holding `call_sid` what became of its warm transfer: `join` (the person
    heard the briefing) or `failed` (`status`: busy, no-answer, person-hung-up...)."""
    payload = json.dumps(
        {"action": "warm", "call_sid": call_sid, "step": step,
         "fc": function_call_id[:128], "status": status[:40]}
    )  # fmt: skip
    async with engine.begin() as conn:
        await conn.execute(sa.select(sa.func.pg_notify(CHANNEL, payload)))


# (call_sid, target, by): transfers a call of this process; set where a leg can transfer.
Transfer = Callable[[str, str, str], Awaitable[None]]
# (call_sid, answered_by): an outbound call of this process learns who answered it.
Amd = Callable[[str, str], Awaitable[None]]
# (call_sid, step, function_call_id, status): a warm transfer of this process moves on.
Warm = Callable[[str, str, str, str], Awaitable[None]]


class CallControl:
    """Ends (or transfers) live calls of this process when another replica asks."""

    def __init__(self, registry: CallRegistry) -> None:
        self._registry = registry
        self._work = OwnedTasks()
        self.transfer: Transfer | None = None
        self.amd: Amd | None = None
        self.warm: Warm | None = None

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
        if self._registry.get(call_sid) is None:
            return
        if action == "end":
            self._work.spawn(self._registry.end(call_sid, reason), f"end-{call_sid}")
        elif action == "transfer" and self.transfer is not None:
            target, by = str(data.get("target") or ""), str(data.get("by") or "")
            self._work.spawn(self._transfer(call_sid, target, by), f"transfer-{call_sid}")
        elif action == "amd" and self.amd is not None:
            answered_by = str(data.get("answered_by") or "unknown")
            self._work.spawn(self._amd(call_sid, answered_by), f"amd-{call_sid}")
        elif action == "warm" and self.warm is not None:
            step, fc = str(data.get("step") or ""), str(data.get("fc") or "")
            status = str(data.get("status") or "")
            self._work.spawn(self._warm(call_sid, step, fc, status), f"warm-{call_sid}")

    async def _transfer(self, call_sid: str, target: str, by: str) -> None:
        assert self.transfer is not None
        try:
            await self.transfer(call_sid, target, by)
        except Exception as exc:  # recorded on the call's timeline by the leg
            log.warning("transfer of a call failed: %s", type(exc).__name__)

    async def _amd(self, call_sid: str, answered_by: str) -> None:
        assert self.amd is not None
        try:
            await self.amd(call_sid, answered_by)
        except Exception:
            log.exception("acting on who answered an outbound call failed")

    async def _warm(self, call_sid: str, step: str, fc: str, status: str) -> None:
        assert self.warm is not None
        try:
            await self.warm(call_sid, step, fc, status)
        except Exception:
            log.exception("acting on a warm transfer failed")

    async def stop(self) -> None:
        await self._work.cancel_all()
