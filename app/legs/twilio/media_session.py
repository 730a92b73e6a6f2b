"""One admitted media stream: the Twilio leg and the bridge, run until the call ends."""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.exc import DBAPIError

from app.calls import store as call_store
from app.calls.recording import RecordingLeg
from app.calls.store import CallRow, CallStatus
from app.runtime import Runtime
from telephony.bridge import Bridge
from telephony.budget import BudgetLimits, StreamBudget
from telephony.call_events import CallEvent, CallEventKind, CallEventSink
from telephony.leg import CallLeg
from telephony.tool_gateway import CallContext
from telephony.twilio_events import StartInfo
from telephony.twilio_leg import TextWebSocket, TwilioLeg

log = logging.getLogger(__name__)

# The REST hang-up after a fatal Realtime failure; the bridge bounds its hook at 10 s too.
HANGUP_TIMEOUT_S = 8.0
FLUSH_TIMEOUT_S = 5.0


class CallSink:
    """The process's event writer, seen by one call; remembers why the bridge ended it."""

    def __init__(self, inner: CallEventSink) -> None:
        self._inner = inner
        self.end_reason: str | None = None

    def emit(self, event: CallEvent) -> None:
        if event.kind is CallEventKind.CALL_ENDED and self.end_reason is None:
            self.end_reason = str(event.data.get("reason") or "ended")
        self._inner.emit(event)


async def run_media_session(
    runtime: Runtime, ws: TextWebSocket, start: StartInfo, call: CallRow
) -> None:
    """Bridge the call; afterwards persist its end (row and flushed events)."""
    sink = CallSink(runtime.events)
    started = time.monotonic()
    sink.emit(
        CallEvent(
            call.id,
            CallEventKind.STREAM_STARTED,
            {
                "stream_sid": start.stream_sid,
                "call_sid": start.call_sid,
                "encoding": start.media_format.encoding,
                "sample_rate": start.media_format.sample_rate,
                "tracks": start.tracks,
            },
        )
    )
    ctx = CallContext(
        call_id=call.id,
        call_sid=call.call_sid,
        tenant_id=call.tenant_id,
        from_number=call.from_number,
        to_number=call.to_number,
    )

    async def hang_up(reason: str) -> None:
        await _hang_up_via_rest(runtime, sink, call, reason)

    s = runtime.settings
    budget = StreamBudget(
        sink,
        call.id,
        BudgetLimits(max_malformed=s.media_max_malformed_frames, max_dtmf=s.media_max_dtmf),
    )
    if hasattr(ws, "budget"):
        ws.budget = budget  # the frame guard's drops count against the same budget
    leg = TwilioLeg(
        ws,
        start,
        sink,
        call.id,
        chunk_ms=runtime.settings.twilio_media_chunk_ms,
        idle_timeout_s=runtime.settings.media_idle_timeout_s,
        budget=budget,
    )
    # Recording taps the leg here, between it and the bridge (app.calls.recording): neither knows.
    recordings = runtime.console.recordings if runtime.console is not None else None
    recorder = recordings.start(leg.audio_format) if recordings is not None else None
    bridge_leg: CallLeg = RecordingLeg(leg, recorder) if recorder is not None else leg
    bridge = Bridge(
        bridge_leg,
        ctx,
        runtime.gateway,
        sink,
        runtime.bridge_config,
        runtime.openai,
        on_fatal=hang_up,
        announcements=runtime.delivery,
    )
    entry = runtime.registry.attach(call.call_sid, call.id, bridge, call.from_number)
    entry.socket = ws
    # The row went in_progress when the stream token was spent (routes_twilio._admit): live
    # from the start. (The SIP legs reach in_progress later, through call_liveness.go_live.)
    runtime.registry.went_live(entry)
    try:
        await bridge.run()
    finally:
        # The entry goes only once the end is persisted: whoever waits for a call to be over
        # here (shutdown, the drain, a test) then finds its row and events final.
        try:
            if runtime.delivery is not None:
                # What the caller heard of an announcement is durable before the call's end
                # hands whatever was not heard to SMS.
                await runtime.delivery.flush(call.id)
            await _persist_end(runtime, sink, call, entry.end_reason, started)
            if recorder is not None and recordings is not None:
                await recordings.finish(call.id, recorder)
        finally:
            runtime.registry.detach(entry)


async def _persist_end(
    runtime: Runtime, sink: CallSink, call: CallRow, ended_by: str | None, started: float
) -> None:
    reason = ended_by or sink.end_reason or "stream ended"
    try:
        await call_store.transition(
            runtime.engine, call.id, CallStatus.COMPLETED, end_reason=reason[:128]
        )
    except DBAPIError:
        log.exception("could not persist the end of call %s", call.id)
    if sink.end_reason is None:
        # The bridge did not get to say it (cancelled): the timeline still needs its end.
        sink.emit(
            CallEvent(
                call.id,
                CallEventKind.CALL_ENDED,
                {"reason": reason, "duration_ms": round((time.monotonic() - started) * 1000)},
            )
        )
    await runtime.events.flush(FLUSH_TIMEOUT_S)


async def _hang_up_via_rest(runtime: Runtime, sink: CallSink, call: CallRow, reason: str) -> None:
    """Realtime is gone for good: ask Twilio to end the call (the caller heard the apology)."""
    from app.ops.twilio_rest import end_call

    log.warning("call %s: realtime failed (%s); hanging up through Twilio", call.id, reason)
    try:
        async with asyncio.timeout(HANGUP_TIMEOUT_S):
            await end_call(runtime.twilio, call.call_sid)
    except Exception as exc:
        log.error("call %s: REST hang-up failed: %r", call.id, exc)
        sink.emit(
            CallEvent(
                call.id, CallEventKind.ERROR, {"where": "twilio_rest", "error": repr(exc)[:200]}
            )
        )
    else:
        entry = runtime.registry.get(call.call_sid)
        if entry is not None and entry.end_reason is None:
            entry.end_reason = f"realtime failed, hung up via Twilio: {reason}"[:128]
