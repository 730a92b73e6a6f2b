"""Staff actions on calls, shared by the JSON API and the console's forms: place an outbound
call; end a live call, or transfer it to a person. A live call's actions are checked here (the
call is live, the target is one the call's leg can reach) and then asked of the process holding
the call (`app.calls.control`), which carries them out and writes the outcome on the call's
timeline."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.control import publish_end, publish_transfer
from app.calls.store import calls
from app.errors import BadRequest, Conflict, InvalidRequest, NotFound
from app.runtime import Runtime
from telephony.call_events import CallEvent

LIVE = ("ringing", "in_progress")


async def place_outbound_call(
    runtime: Runtime,
    by: str,
    to: str,
    purpose: str,
    about_operation_id: str | None,
    idempotency_key: str | None,
) -> tuple[str, str]:
    """Ask for an outbound call (the `place_call` operation; a worker places it): its call id
    and operation id. InvalidRequest names a field that cannot be used; the same idempotency
    key again answers the same call."""
    from app.ops.outbound import OutboundRefused, request_call, requested_events

    if runtime.tools is None:
        raise Conflict("this process has no operation ledger to place calls with")
    try:
        placed = await request_call(
            runtime.engine,
            runtime.settings,
            runtime.tools.enqueue,
            to=to,
            purpose=purpose,
            about_operation_id=about_operation_id,
            by=by,
            idempotency_key=idempotency_key,
        )
    except OutboundRefused as exc:
        raise InvalidRequest(str(exc)) from exc
    if placed.created:
        number = to.strip().removeprefix("tel:")
        said = " ".join(purpose.split())
        for kind, data in requested_events(placed, number, said, by):
            runtime.events.emit(CallEvent(placed.call_id, kind, data))
    return placed.call_id, placed.operation_id


async def live_call(engine: AsyncEngine, call_id: uuid.UUID) -> Any:
    """The call's row (sid, leg, status); NotFound, or Conflict when it is not live."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                sa.select(calls.c.call_sid, calls.c.leg, calls.c.status, calls.c.ended_at).where(
                    calls.c.id == call_id
                )
            )
        ).one_or_none()
    if row is None:
        raise NotFound(f"no call {call_id}")
    if row.ended_at is not None or row.status not in LIVE:
        raise Conflict(f"the call is not live (status {row.status})")
    return row


async def end_live_call(engine: AsyncEngine, call_id: uuid.UUID, by: str, why: str) -> str:
    """Ask the process holding the call to end it; the reason names who and why."""
    row = await live_call(engine, call_id)
    await publish_end(engine, row.call_sid, f"ended by staff ({by}): {why}"[:128])
    return "asked the process holding the call to end it"


async def transfer_live_call(
    runtime: Runtime, call_id: uuid.UUID, by: str, target: str, why: str
) -> str:
    """Ask the process holding the call to transfer it to `target` (a TRANSFER_TARGETS name, a
    number or a SIP URI); BadRequest names what is wrong with a target, before anything moves."""
    from app.legs.openai_sip.calls import transfer_target
    from app.legs.staff_transfer import staff_target

    row = await live_call(runtime.engine, call_id)
    try:
        if row.leg == "openai_sip":
            target = transfer_target(target)
        else:
            staff_target(runtime, target)  # refused here, before any replica acts
            target = target.strip()
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    await publish_transfer(runtime.engine, row.call_sid, target, f"{by}: {why}")
    return f"asked the process holding the call to transfer it to {target}"
