"""One admitted Twilio media stream: the Twilio leg under the call's session, run to its end.

The call's life (bridge, live, end) is `app.legs.session.CallSession`'s; what is Twilio's here
is the leg over the media socket, its frame budget, and the REST hang-up after a fatal
Realtime failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from app.calls.store import CallRow
from app.legs.session import CallSession
from app.legs.twilio import outbound, resume, transfer, warm
from app.runtime import Runtime
from telephony.call_events import CallEvent, CallEventKind
from telephony.legs.twilio.budget import BudgetLimits, StreamBudget
from telephony.legs.twilio.events import StartInfo
from telephony.legs.twilio.leg import TextWebSocket, TwilioLeg
from telephony.tool_gateway import TransferOutcome, TransferRequest
from tools import deliveries
from tools.delivery_states import DeliveryState

log = logging.getLogger(__name__)

# The REST hang-up after a fatal Realtime failure; the bridge bounds its hook at 10 s too.
HANGUP_TIMEOUT_S = 8.0


async def run_media_session(
    runtime: Runtime, ws: TextWebSocket, start: StartInfo, call: CallRow, *, resumed: bool = False
) -> None:
    """Bridge the call (its row went in_progress, or was taken over with a resume token, when
    the stream's token was spent in routes._admit); afterwards end it (row, events,
    recording), or release it for a resume when its socket dropped without `stop` or this
    process handed it over while stopping (app/server.py)."""
    session = CallSession.of_row(runtime, call)
    leg: TwilioLeg | None = None
    try:
        s = runtime.settings
        budget = StreamBudget(
            session.sink,
            call.id,
            BudgetLimits(max_malformed=s.media_max_malformed_frames, max_dtmf=s.media_max_dtmf),
        )
        if hasattr(ws, "budget"):
            ws.budget = budget  # the frame guard's drops count against the same budget
        leg = TwilioLeg(
            ws,
            start,
            session.sink,
            call.id,
            chunk_ms=s.twilio_media_chunk_ms,
            idle_timeout_s=s.media_idle_timeout_s,
            budget=budget,
        )

        async def hang_up(reason: str) -> None:
            await _hang_up_via_rest(runtime, session, reason)

        async def put_through(request: TransferRequest) -> TransferOutcome:
            if request.mode == "warm":
                return await warm.WarmTransfer(runtime, session, request).dial()
            return await transfer.put_through(runtime, session, request)

        config = None
        if resumed:
            # The new session starts from the call so far and says sorry first.
            context = await resume.resume_context(runtime, call.id)
            config = dataclasses.replace(
                runtime.bridge_config,
                context_note=context.note,
                start_agent=context.agent,
                greeting=True,
                greeting_instructions=(
                    "The caller's line dropped for a moment and is back. Say exactly: "
                    f'"{context.first_line}" Then carry on from where you were.'
                ),
            )
        elif call.direction == "outbound":
            # Silent and deaf until it is known who answered (app/legs/twilio/outbound.py).
            config = dataclasses.replace(
                runtime.bridge_config, greeting=False, listen_at_start=False
            )
        bridge = session.build_bridge(
            leg,
            on_fatal=hang_up,
            socket=ws,
            config=config,
            transfer=put_through,
            warm_transfer=True,
        )
        line: outbound.OutboundLine | None = None
        if session.entry is not None:
            session.entry.movable = True  # a stopping process hands it over (`<Connect action>`)
            if call.direction == "outbound" and not resumed:
                # Before the row is read: a result told meanwhile reaches it either way.
                line = session.entry.outbound = outbound.OutboundLine(runtime, session, bridge)
        await session.go_live(
            {
                "stream_sid": start.stream_sid,
                "encoding": start.media_format.encoding,
                "sample_rate": start.media_format.sample_rate,
                "tracks": start.tracks,
                **({"resumed": True} if resumed else {}),
            },
            moved=True,
        )
        if resumed:
            session.sink.emit(
                CallEvent(call.id, CallEventKind.STREAM_RESUMED, {"holder": runtime.holder})
            )
            await _offer_pending(runtime, call.id)
        if line is not None:
            picked = asyncio.create_task(line.pick_up_stored(), name=f"amd-{call.id}")
            try:
                await bridge.run()
            finally:
                picked.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await picked
        else:
            await bridge.run()
    finally:
        entry = session.entry
        released = False
        if entry is not None and isinstance(entry.warm, warm.WarmTransfer):
            # Joined: the row ends "transferred (warm)"; else the person is let go.
            await entry.warm.settle()
        if entry is not None and entry.transferring is not None:
            # Twilio took the caller to dial a person: the row waits for the outcome.
            released = await session.release(
                f"transferring to {entry.transferring.target}",
                kind=CallEventKind.TRANSFER_STARTED,
                hold_for_s=transfer.hold_for_s(runtime),
            )
        elif entry is not None and entry.handed_over:
            # This process is stopping: its stream was closed on purpose, for the call to
            # resume on another replica; anything not ours to release is ended as before.
            released = await session.release(
                f"this replica stopped: {entry.end_reason}",
                kind=CallEventKind.RELEASED_FOR_DRAIN,
            )
        elif leg is not None and leg.stream_lost and entry is not None and not entry.end_reason:
            released = await session.release("the media socket dropped without stop")
        if not released:
            await session.end()


async def _offer_pending(runtime: Runtime, call_id: str) -> None:
    """Results waiting for this call (the old holder's, or landed while it was away) are
    offered here now: the replica holding the call hears their NOTIFY and acts."""
    try:
        async with runtime.engine.begin() as conn:
            for delivery in await deliveries.for_call(conn, call_id):
                if delivery.state is DeliveryState.PENDING:
                    await deliveries.notify_ready(conn, delivery)
    except Exception:
        log.exception("call %s: could not offer its pending results", call_id)


async def _hang_up_via_rest(runtime: Runtime, session: CallSession, reason: str) -> None:
    """Realtime is gone for good: ask Twilio to end the call (the caller heard the apology)."""
    from app.ops.twilio_rest import end_call

    call_id = session.call_id
    log.warning("call %s: realtime failed (%s); hanging up through Twilio", call_id, reason)
    try:
        async with asyncio.timeout(HANGUP_TIMEOUT_S):
            await end_call(runtime.twilio, session.call_sid)
    except Exception as exc:
        log.error("call %s: REST hang-up failed: %r", call_id, exc)
        session.sink.emit(
            CallEvent(
                call_id, CallEventKind.ERROR, {"where": "twilio_rest", "error": repr(exc)[:200]}
            )
        )
    else:
        session.ended_by(f"realtime failed, hung up via Twilio: {reason}")
