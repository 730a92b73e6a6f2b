"""Cold transfer of a Twilio call to a person (`transfer_call`).

1. `put_through` (the call's replica, once the agent's sentence was heard): the live call gets
   new TwiML through the REST API, `<Dial action timeout><Number statusCallback>` to the
   target. Twilio stops our media stream; the row is released (not ended) and kept from the
   sweeps while it rings. A refused REST request leaves the call with the agent, who is told.
2. `answered` (`POST /twilio/transfer-answered`, the Number's status callback): the person
   picked up: our part of the call is over, the row ends "transferred to <target>".
3. `dial_ended` (`POST /twilio/transfer-ended`, the Dial's action): answered and over:
   `<Hangup/>`; busy, no answer or failed: the caller comes back to an agent on a new stream
   (a resume token, as after a lost stream) whose first words say what happened.
Each outcome is written on the transfer's tool call row and the call's timeline.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from urllib.parse import urlencode

import sqlalchemy as sa

from app.calls import store as call_store
from app.calls import takeover
from app.calls.liveness import append_call_event, end_row
from app.calls.store import CallStatus, calls
from app.legs.session import CallSession
from app.legs.twilio import twiml
from app.legs.twilio.resume import stream_twiml
from app.ops.twilio_rest import redirect_call
from app.runtime import Runtime
from telephony.call_events import CallEventKind
from telephony.tool_gateway import TransferOutcome, TransferRequest
from tools.transfers import TransferTarget, dial_outcome_said, record_transfer_outcome

log = logging.getLogger(__name__)

REST_TIMEOUT_S = 8.0
# After the ring timeout, how long the row is kept for the dial's outcome to arrive.
OUTCOME_MARGIN_S = 30.0
# Twilio's DialCallStatus values for a dial the person answered.
ANSWERED = frozenset({"completed", "answered"})


def _url(runtime: Runtime, path: str, call_id: str, request: TransferRequest) -> str:
    query = urlencode(
        {"call_id": call_id, "target": request.target, "fc": request.function_call_id}
    )
    return f"{runtime.settings.public_base_url.rstrip('/')}{path}?{query}"


async def put_through(
    runtime: Runtime, session: CallSession, request: TransferRequest
) -> TransferOutcome:
    """Ask Twilio to dial the target on this live call (see the module docstring)."""
    entry = session.entry
    if entry is None or runtime.twilio is None:
        return TransferOutcome(False, "unsupported", "this service cannot reach Twilio's API")
    call_id = session.call_id
    dial = twiml.dial(
        request.destination,
        action_url=_url(runtime, "/twilio/transfer-ended", call_id, request),
        answered_url=_url(runtime, "/twilio/transfer-answered", call_id, request),
        timeout_s=runtime.settings.transfer_ring_timeout_s,
    )
    # Marked first: Twilio stops the stream as soon as it takes the new instructions.
    entry.transferring = request
    try:
        async with asyncio.timeout(REST_TIMEOUT_S):
            placed = await redirect_call(runtime.twilio, session.call_sid, dial)
    except Exception as exc:
        entry.transferring = None
        log.warning("call %s: transfer to %s refused by Twilio: %r", call_id, request.target, exc)
        return TransferOutcome(False, "refused", "the phone system did not take the transfer")
    if not placed:
        entry.transferring = None
        return TransferOutcome(False, "failed", "the call had already ended")
    target = TransferTarget(request.target, request.destination)
    log.info("call %s: transferring to %s (%s)", call_id, request.target, target.masked())
    return TransferOutcome(True, "dialing", f"ringing {request.target}")


def hold_for_s(runtime: Runtime) -> float:
    """How long a transferring call's released row is kept from the sweeps."""
    return runtime.settings.transfer_ring_timeout_s + OUTCOME_MARGIN_S


async def answered(runtime: Runtime, call_id: str, target: str, function_call_id: str) -> None:
    """The person picked up: the caller is theirs now; our part of the call ends."""
    reason = f"transferred to {target}"
    async with runtime.engine.begin() as conn:
        status = await conn.scalar(
            sa.select(calls.c.status).where(calls.c.id == uuid.UUID(call_id)).with_for_update()
        )
        if status != CallStatus.IN_PROGRESS.value:
            return
        await append_call_event(
            conn, uuid.UUID(call_id), CallEventKind.TRANSFER_ANSWERED, {"target": target}
        )
        await end_row(conn, call_id, CallStatus.COMPLETED, reason, expect=CallStatus.IN_PROGRESS)
    runtime.events.forget(call_id)  # its timeline went on without this process's writer
    await record_transfer_outcome(
        runtime.engine,
        call_id,
        function_call_id,
        TransferOutcome(True, "answered", f"{target} answered"),
    )
    log.info("call %s: %s", call_id, reason)


async def dial_ended(
    runtime: Runtime, call_id: str, target: str, function_call_id: str, status: str
) -> str:
    """The TwiML for a call whose transfer dial ended with `status` (DialCallStatus)."""
    if status in ANSWERED:
        await answered(runtime, call_id, target, function_call_id)  # if its callback was lost
        return twiml.hangup()
    said = dial_outcome_said(status)
    await record_transfer_outcome(
        runtime.engine, call_id, function_call_id, TransferOutcome(False, status[:40], said)
    )
    row = await call_store.get_call(runtime.engine, call_id)
    if row is None or row.status != CallStatus.IN_PROGRESS or row.released_at is None:
        return twiml.hangup()  # over, or not waiting on this transfer
    async with runtime.engine.begin() as conn:
        await append_call_event(
            conn,
            uuid.UUID(row.id),
            CallEventKind.TRANSFER_FAILED,
            {"target": target, "status": status[:40]},
        )
    runtime.events.forget(row.id)  # the caller's next stream numbers its events after this
    # The caller comes back to an agent: a new stream, as after a lost one.
    token, nonce = runtime.tokens.issue_resume(row.call_sid, row.id)
    if not await takeover.claim(runtime.engine, row.id, holder=row.holder, nonce=nonce):
        return twiml.hangup()
    log.info("call %s: transfer to %s ended (%s); back to the agent", call_id, target, status)
    return stream_twiml(runtime, row, token)
