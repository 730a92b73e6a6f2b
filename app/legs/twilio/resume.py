"""A Twilio call whose stream ended while the call is up: hang up, or resume it here.

Twilio asks our `<Connect action>` URL (`POST /twilio/stream-ended`) when a media stream ends
and the call has not. `decide` answers from the call's row: a call we ended on purpose (a
goodbye, staff, a REST hang-up, the caller gone) gets `<Hangup/>`; a stream that was lost (its
holder process is dead, or it released the row because its socket dropped without `stop`) gets
a new `<Connect action><Stream>` with a resume token, claimed on the row
(app/calls/takeover.py). The new stream, on whichever replica it lands, takes the row over and
starts a Realtime session from `resume_context`: a summary of the conversation and the
operations still open, and a first line that says sorry and where those stand.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from app.calls import store as call_store
from app.calls import takeover
from app.calls.holders import holder_alive
from app.calls.store import CallRow, CallStatus, call_events
from app.legs.twilio import twiml
from app.runtime import Runtime
from telephony.call_events import CallEventKind
from tools import ledger
from tools.results import describe_operation
from tools.states import IN_FLIGHT, OperationStatus
from tools.transfers import dial_outcome_said

log = logging.getLogger(__name__)

# How long the webhook waits for the old holder to settle the row (its end or its release are
# a moment behind the socket's close, which is what made Twilio ask).
SETTLE_S = 5.0
POLL_S = 0.1
SUMMARY_LINES = 20
OPEN = [OperationStatus.AWAITING_CONFIRMATION, *IN_FLIGHT]


def action_url(runtime: Runtime) -> str:
    """Where Twilio asks what next when a stream ends (our `<Connect action>`)."""
    return runtime.settings.public_base_url.rstrip("/") + "/twilio/stream-ended"


def stream_twiml(runtime: Runtime, row: CallRow, token: str) -> str:
    """`<Connect action><Stream>` for the call's next stream, carrying `token`."""
    stream_url = runtime.settings.public_ws_base() + "/twilio/media"
    return twiml.connect_stream(
        stream_url, {"token": token, "call_id": row.id}, action_url=action_url(runtime)
    )


async def decide(runtime: Runtime, call_sid: str) -> str:
    """The TwiML for a call whose stream just ended (see the module docstring)."""
    deadline = time.monotonic() + SETTLE_S
    s = runtime.settings
    # Past CALL_DEAD_AFTER_S the sweep (or the delivery path) ends a released call anyway.
    window = timedelta(seconds=min(s.call_resume_window_s, s.call_dead_after_s))
    while True:
        row = await call_store.find_by_sid(runtime.engine, call_sid)
        if row is None or row.status != CallStatus.IN_PROGRESS:
            return twiml.hangup()  # over (on purpose, or never streamed)
        if row.released_at is not None:
            if row.released_at < datetime.now(UTC) - window:
                log.warning("call %s: released too long ago to resume", row.id)
                return twiml.hangup()
            break
        if row.holder is None or not await holder_alive(runtime.engine, row.holder):
            break
        if time.monotonic() >= deadline:
            # Its holder lives and still holds it: not a stream we know to be lost.
            log.warning("call %s: stream ended but its holder %s keeps it", row.id, row.holder)
            return twiml.hangup()
        await asyncio.sleep(POLL_S)
    token, nonce = runtime.tokens.issue_resume(call_sid, row.id)
    if not await takeover.claim(runtime.engine, row.id, holder=row.holder, nonce=nonce):
        return twiml.hangup()  # ended (or taken) meanwhile
    log.warning("call %s: its stream was lost (holder %s); resuming it", row.id, row.holder)
    return stream_twiml(runtime, row, token)


@dataclass(frozen=True, slots=True)
class ResumeContext:
    """What the new Realtime session of a resumed call starts from."""

    note: str  # added to the session's instructions
    first_line: str  # what the caller hears first
    agent: str | None = None  # the agent that was talking (agents declared), else None


async def resume_context(runtime: Runtime, call_id: str) -> ResumeContext:
    """The conversation so far (its transcript events) and the operations still open."""
    async with runtime.engine.connect() as conn:
        rows = await conn.execute(
            sa.select(call_events.c.kind, call_events.c.data)
            .where(
                call_events.c.call_id == uuid.UUID(call_id),
                call_events.c.kind.in_(
                    [
                        CallEventKind.CALLER_TRANSCRIPT.value,
                        CallEventKind.AGENT_TRANSCRIPT.value,
                        CallEventKind.AGENT_HANDOFF.value,
                        CallEventKind.TRANSFER_FAILED.value,
                        CallEventKind.STREAM_RESUMED.value,
                    ]
                ),
            )
            .order_by(call_events.c.seq)
        )
        said: list[str] = []
        agent: str | None = None
        # A transfer whose dial ended without the person (the caller is back from it).
        failed_transfer: dict[str, str] | None = None
        for kind, data in rows.all():
            if kind == CallEventKind.AGENT_HANDOFF.value:
                agent = str((data or {}).get("to_agent") or "") or agent
                continue
            if kind == CallEventKind.TRANSFER_FAILED.value:
                if (data or {}).get("status"):  # the dial's outcome, not the leg's refusal
                    failed_transfer = {k: str(v) for k, v in (data or {}).items()}
                continue
            if kind == CallEventKind.STREAM_RESUMED.value:
                failed_transfer = None  # told on an earlier stream already
                continue
            text = str((data or {}).get("text") or "").strip()
            if text:
                who = "Caller" if kind == CallEventKind.CALLER_TRANSCRIPT.value else "You"
                said.append(f"{who}: {text}")
        ops = await ledger.operations_for_call(conn, call_id, OPEN)
    registry = runtime.tools.registry if runtime.tools is not None else None
    open_lines: list[str] = []
    under_way: list[str] = []
    unconfirmed: list[str] = []
    for op in ops:
        what = (
            describe_operation(registry.get(op.tool), op)
            if registry is not None and op.tool in registry
            else op.tool.replace("_", " ")
        )
        open_lines.append(f"- {what}: {op.status.value.replace('_', ' ')}")
        awaiting = op.status is OperationStatus.AWAITING_CONFIRMATION
        (unconfirmed if awaiting else under_way).append(what)
    transcript = "\n".join(said[-SUMMARY_LINES:]) or "(nothing yet)"
    operations = "\n".join(open_lines) or "(none)"
    note = (
        "The line to this caller dropped for a moment and is back; you are continuing the "
        f"same call. The conversation so far (most recent last):\n{transcript}\n"
        "Requests of this call still open (their results will reach you; never say one is "
        f"done before you are told):\n{operations}\n"
        + (
            "One awaiting confirmation is neither done nor under way: nothing happens without "
            "the caller's yes, so read it back and ask again.\n"
            if unconfirmed
            else ""
        )
        + "Do not greet the caller again."
    )
    first = "Sorry, I lost you for a moment"
    if under_way:
        first += f" — your request for {under_way[0]} is still being confirmed."
    elif unconfirmed:
        # Not "being confirmed": the caller's yes is missing, and a caller told it is under way
        # may hang up believing so while it is cancelled with the call (the soak found this).
        first += f" — I have not done {unconfirmed[0]} yet: it needs your yes. Shall I go ahead?"
    else:
        first += ". Where were we?"
    if failed_transfer is not None:
        target = failed_transfer.get("target", "them").replace("_", " ")
        why = dial_outcome_said(failed_transfer.get("status", ""))
        note = note.replace(
            "The line to this caller dropped for a moment and is back",
            f"You tried to put this caller through to {target}, but {why}; they are back with you",
        )
        first = (
            f"I'm sorry, I couldn't put you through to {target}: {why}. I can arrange for us "
            "to call you back, if you like."
        )
    return ResumeContext(note, first, agent)
