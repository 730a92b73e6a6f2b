"""Warm transfer of a call on our own SIP leg (`transfer_call` with mode warm).

The caller never leaves the agent until the person has heard who is calling and why. Called by
the bridge once the agent's sentence ("I'm calling them, stay on the line") was heard, it does
not return until the transfer's outcome is known:

1. The person is called: an INVITE out of the SIP listener as an outbound call's
   (app/legs/sip_outbound.py: SIP_OUTBOUND_PROXY, SIP_OUTBOUND_USER/_PASSWORD digest), ringing
   at most TRANSFER_RING_TIMEOUT_S (then CANCEL). `transfer_briefing` on the timeline, with the
   person's Call-ID. Busy, no answer, declined or failed: the caller is still with the agent,
   who is told in the words of a dial's outcome (tools.transfers).
2. Answered: the person hears the engine's briefing (who calls, masked unless PIN-verified;
   why; operations still open; what the caller was told is done) in the agent's voice, from a
   model session of its own on the person's leg, as an outbound SIP call's agent opens its line
   (`Bridge.open_line`, deaf to the person), heard to its end. A person who hangs up first is
   "they hung up before the caller could be joined".
3. The agent tells the caller, in one sentence heard to its end, that it is connecting them.
4. REFER to the caller's side whose Refer-To is the person's Contact with `?Replaces=` naming
   our dialog with the person (RFC 3515, RFC 3891): the caller's phone or trunk calls the person
   and takes our place. The REFER's answer and its NOTIFYs are judged as a cold transfer's
   (app/legs/sip_transfer.py): only a final sipfrag 200 ends our side of both dialogs (BYE to
   the caller's; to the person's unless their UA already ended it with its BYE); a refused
   REFER or a failed sipfrag leaves the caller with the agent, who is told.

Whatever goes wrong, the person's leg is hung up (CANCEL while it rings, BYE once up) and its
RTP port given back; a caller who hangs up meanwhile leaves the row "caller-gone".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from app.legs.session import CallSession
from app.legs.sip_outbound import BareLeg, SipOutbound, who_answered
from app.legs.sip_transfer import sipfrag_outcome
from app.legs.twilio.outbound import quoted
from app.legs.twilio.warm import (
    BRIEFED,
    FAILED,
    JOINED,
    RINGING,
    advance,
    said_of,
    say_connecting,
)
from app.runtime import Runtime
from telephony.amd import HUMAN, Verdict
from telephony.bridge import Bridge
from telephony.call_events import CallEvent, CallEventKind
from telephony.legs.sip.dialog import CallKey
from telephony.legs.sip.errors import RtpPortsExhausted
from telephony.tool_gateway import (
    CallContext,
    FunctionCallRequest,
    KeypadEntry,
    ToolReply,
    TransferOutcome,
    TransferRequest,
)
from tools.transfers import TransferTarget, dial_outcome_said, record_transfer_outcome

log = logging.getLogger(__name__)

# Beyond the ring timeout (the core CANCELs then): only a lost event could need it.
RING_MARGIN_S = 10.0
# How long the briefing may take to be heard to its end (it is a few sentences).
BRIEFING_WAIT_S = 60.0

# Runs the REFER of the caller's call that replaces the given dialog (ours with the person),
# and returns its outcome as a cold transfer's (app/legs/sip_transfer.put_through); the
# callable is awaited once it was answered, before our side ends the call.
ReferReplacing = Callable[[CallKey, Callable[[], Awaitable[None]]], Awaitable[TransferOutcome]]


class _NoTools:
    """The person's leg's tool layer: it has none (the person is briefed, not served)."""

    def definitions(self) -> list[dict[str, Any]]:
        return []

    async def handle(self, ctx: CallContext, request: FunctionCallRequest) -> ToolReply:
        return ToolReply({"error": "Nothing can be done on this line."}, wants_response=False)

    async def on_dtmf(self, ctx: CallContext, digit: str) -> KeypadEntry | None:
        return None

    def redacts_arguments(self, name: str) -> bool:
        return False

    async def on_call_end(self, ctx: CallContext) -> None:
        return None


class _Unrecorded:
    """The person's leg writes no timeline of its own: the caller's call tells the story."""

    def emit(self, event: CallEvent) -> None:
        return None


async def warm_through(
    runtime: Runtime,
    session: CallSession,
    request: TransferRequest,
    outbound: SipOutbound,
    refer: ReferReplacing,
) -> TransferOutcome:
    """Carry out the warm transfer `request` of this SIP call (see the module docstring)."""
    outcome = await _attempt(runtime, session, request, outbound, refer)
    call_id, fc = session.call_id, request.function_call_id
    if not outcome.accepted:
        await advance(
            runtime, call_id, fc, frozenset({"", RINGING, BRIEFED}), FAILED, status=outcome.status
        )
    return outcome


async def _attempt(
    runtime: Runtime,
    session: CallSession,
    request: TransferRequest,
    outbound: SipOutbound,
    refer: ReferReplacing,
) -> TransferOutcome:
    call_id, fc = session.call_id, request.function_call_id
    target = TransferTarget(request.target, request.destination)
    ring_s = float(runtime.settings.transfer_ring_timeout_s)
    try:
        person = await outbound.dial_leg(f"{call_id}:warm", request.destination, ring_s)
    except (ValueError, RtpPortsExhausted) as exc:
        log.warning("call %s: warm transfer to %s not placed: %r", call_id, target.masked(), exc)
        return TransferOutcome(False, "refused", "the phone system did not place the call")
    # The transfer's state on its tool call row (`output.warm`), as on Twilio.
    await advance(
        runtime, call_id, fc, frozenset({""}), RINGING, person_call_sid=person.key.call_id
    )
    session.sink.emit(
        CallEvent(
            call_id,
            CallEventKind.TRANSFER_BRIEFING,
            {"target": request.target, "mode": "warm", "person_call_sid": person.key.call_id},
        )
    )
    log.info("call %s: calling %s (%s) to brief them", call_id, request.target, target.masked())
    briefing: Bridge | None = None
    run: asyncio.Task[None] | None = None
    why = "warm transfer over"
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ring_s + RING_MARGIN_S):
                await person.settled.wait()
        answered = person.answered
        if answered is None or person.ended.is_set():
            status = person.failed.status if person.failed is not None else 408
            name = sipfrag_outcome(status)
            why = f"not answered ({status})"
            return TransferOutcome(False, name, f"{dial_outcome_said(name)} (SIP {status})")
        person.leg.answered(answered.remote, answered.direction)
        if runtime.settings.sip_amd:
            # Never brief a voicemail, never put the caller through to one.
            verdict = await _answered_by(person)
            if verdict is None:
                why = "hung up before the briefing"
                return TransferOutcome(False, "person-hung-up", said_of("person-hung-up"))
            session.sink.emit(
                CallEvent(
                    call_id,
                    CallEventKind.AMD_RESULT,
                    {"answered_by": verdict.answered_by, "at_ms": verdict.at_ms,
                     "reason": verdict.reason, "target": request.target},
                )
            )  # fmt: skip
            if verdict.answered_by != HUMAN:
                why = f"answered by {verdict.answered_by}"
                return TransferOutcome(False, "voicemail", dial_outcome_said("voicemail"))
        briefing, run = _briefing_bridge(runtime, session, person)
        heard = await _first_done(
            briefing.open_line(
                f"You have called {request.target.replace('_', ' ')} for a caller who is "
                f'waiting. Say exactly: "{quoted(request.briefing or request.reason)}" '
                "Say nothing else.",
                listen=False,
                wait_s=BRIEFING_WAIT_S,
            ),
            person.ended.wait(),
        )
        if person.ended.is_set() or not heard:
            why = "hung up during the briefing"
            return TransferOutcome(False, "person-hung-up", said_of("person-hung-up"))
        log.info("call %s: %s was briefed", call_id, request.target)
        await advance(runtime, call_id, fc, frozenset({RINGING}), BRIEFED)
        said = await say_connecting(session.bridge, request.target)
        if not said:
            why = "the caller left"
            return await _caller_gone(runtime, call_id, request)
        if person.ended.is_set():
            why = "hung up before the join"
            return TransferOutcome(False, "person-hung-up", said_of("person-hung-up"))

        async def joined() -> None:
            await advance(runtime, call_id, fc, frozenset({BRIEFED}), JOINED)

        outcome = await refer(person.key, joined)
        why = f"transferred to {request.target} (warm)" if outcome.accepted else "not joined"
        return outcome
    except asyncio.CancelledError:
        # The caller's call ended under the transfer (its bridge's tasks are cancelled).
        why = "the caller left"
        await _caller_gone(runtime, call_id, request)
        raise
    finally:
        # At once, before any wait: a join ends the caller's call, which cancels this task.
        outbound.release_leg(person, why)  # CANCEL or BYE, unless their BYE came first
        if run is not None:
            person.leg.remote_ended(why)  # the briefing's bridge stops with its leg
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(run)


async def _answered_by(person: BareLeg) -> Verdict | None:
    ended = asyncio.ensure_future(person.ended.wait())
    try:
        return await who_answered(person.leg, ended, message_end=False)
    finally:
        ended.cancel()


def _briefing_bridge(
    runtime: Runtime, session: CallSession, person: BareLeg
) -> tuple[Bridge, asyncio.Task[None]]:
    """The agent's voice on the person's leg: a model session of its own, silent and deaf
    until it is told what to say (as an outbound SIP call's agent), with no tools."""
    row = session.row
    ctx = CallContext(
        call_id=session.call_id,
        call_sid=person.key.call_id,
        tenant_id=row.tenant_id if row is not None else "",
        from_number=None,
        to_number=None,
    )
    config = dataclasses.replace(runtime.bridge_config, greeting=False, listen_at_start=False)
    bridge = Bridge(person.leg, ctx, _NoTools(), _Unrecorded(), config, runtime.openai)
    run = asyncio.create_task(bridge.run(), name=f"sip-warm-briefing-{session.call_id}")
    return bridge, run


async def _caller_gone(runtime: Runtime, call_id: str, request: TransferRequest) -> TransferOutcome:
    """The caller left before the join: said on the row (nobody is left to tell)."""
    outcome = TransferOutcome(False, "caller-gone", "the caller left before the join")
    await advance(
        runtime, call_id, request.function_call_id, frozenset({"", RINGING, BRIEFED}), FAILED,
        status="caller-gone",
    )  # fmt: skip
    await record_transfer_outcome(runtime.engine, call_id, request.function_call_id, outcome)
    return outcome


async def _first_done(main: Awaitable[bool], stop: Awaitable[Any]) -> bool:
    """`main`'s result, or False when `stop` finishes first."""
    work = asyncio.ensure_future(main)
    halt = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({work, halt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, halt):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, halt, return_exceptions=True)
    if work.done() and not work.cancelled() and work.exception() is None:
        return bool(work.result())
    return False
