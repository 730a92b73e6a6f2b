"""One call's life, the same on every leg: admit, build the bridge, go live, end exactly once.

A leg keeps only what is its own (webhooks, SIP dialogs, the sideband accept) and calls these
steps, in this order, for every call:

1. `CallSession.admit`: a slot of this process (MAX_LIVE_CALLS; `Admission.BUSY` or
   `DRAINING` when there is none: the call row is written `busy` with `call_rejected`, and
   the leg answers busy its own way), the `calls` row, `call_started`.
2. `CallSession.build_bridge`: the call's context and sink, the recording tap where the leg
   carries audio, the `Bridge`, and the registry entry (in set-up for the heartbeat).
3. `CallSession.go_live`: the row's conditional move to `in_progress` (held here), the entry
   live for the heartbeat, then `stream_started`. False when the row was ended meanwhile.
4. `CallSession.end`, once, whatever happened before (a second call does nothing): what the
   caller heard of an announcement made durable, the row's end, the one `call_ended` (the
   bridge's own is held back and written here with the reason the row gets), the events
   flushed, the recording finished, the entry detached, the slot released.

Where a call begins and ends, per leg:

- Twilio (app/legs/twilio/routes.py, app/legs/twilio/media_session.py): it begins at `POST
  /twilio/voice` (`routes.voice` -> `admit`, answered with TwiML: busy or
  `<Connect><Stream>`). Its stream begins at `WS /twilio/media`: the stream token is spent
  by moving the row to in_progress (`routes._admit` -> `start_stream`, before anything is
  attached, so a replayed token displaces nothing), then `media_session.run_media_session`
  builds the bridge and goes live. It ends when the bridge stops (`stop`, a dead socket,
  `/twilio/status`, staff, shutdown) -> `end` in `run_media_session`, or, when its socket
  dropped without `stop`, `release` there: Twilio then asks `POST /twilio/stream-ended`
  (`resume.decide`) and a new stream takes the call over (`routes._admit` -> `take_over`). A
  status callback for a call no process runs ends the row in `routes.status_callback`.
- SIP, our user agent (app/legs/sip.py): it begins at an INVITE (`SipService._on_event` ->
  `_call` -> `admit`), the bridge is built at once, and it goes live at the 200
  (`SipService._bridge` -> `go_live`). It ends at a BYE, a CANCEL, our hang-up or a failed
  set-up -> `end` in `SipService._run_call` (before a bridge too: cancelled, no RTP port).
- OpenAI's SIP interconnect (app/legs/openai_sip/calls.py): it begins at the
  `realtime.call.incoming` webhook (`OpenAISipService._incoming` -> `admit`), goes live once
  accepted (`_accept_and_bridge` -> `go_live`), and ends when the sideband closes or the
  accept fails -> `end` in `OpenAISipService._run_call`.

Everywhere a call is `call_id` (our row id) and `call_sid` (the carrier's: the Twilio
CallSid, the SIP Call-ID, the OpenAI call id).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import store as call_store
from app.calls import takeover as call_takeover
from app.calls.recording import CallRecorder, RecordingLeg
from app.calls.registry import LiveCallEntry
from app.calls.store import CallRow, CallStatus, EndSource, call_ended_data
from app.models import LegKind
from app.runtime import Runtime
from telephony.bridge import Bridge, BridgeConfig
from telephony.bridge.tool_dispatch import TransferHook
from telephony.call_events import CallEvent, CallEventKind, CallEventSink
from telephony.legs.leg import CallLeg
from telephony.tool_gateway import CallContext
from tools import log_context, tracing

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0


class EndReason(StrEnum):
    """The reasons a call's end gets from the session and the legs (the bridge, the carrier
    and staff give their own, free text)."""

    ENDED = "ended"  # nobody said why
    ENDED_ELSEWHERE = "the call was ended by another process"
    SHUTDOWN = "server shutdown"
    INTERNAL_ERROR = "internal error"
    CANCELLED = "cancelled"
    NO_RTP_PORT = "no RTP port"
    ACCEPT_FAILED = "accept failed"
    REALTIME_FAILED = "realtime failed"
    REALTIME_TIMEOUT = "realtime did not open in time"
    REMOTE_HANGUP = "caller hung up (the call ended on OpenAI's side)"


class Admission(StrEnum):
    """What `CallSession.admit` made of a call."""

    ADMITTED = "admitted"  # a new row, a slot held: go on
    EXISTING = "existing"  # the row was there and is not over (a retried webhook, a fork)
    ENDED = "ended"  # the row was there and is over: a replay
    BUSY = "busy"  # no slot: recorded as busy
    DRAINING = "draining"  # this process is stopping: recorded as busy


def sip_refusal(admission: Admission) -> int:
    """The SIP status for a call without a slot (both SIP legs): 503 while stopping, which
    sends the caller's proxy elsewhere (RFC 3261 21.5.4), else 486 Busy Here."""
    return 503 if admission is Admission.DRAINING else 486


async def start_stream(
    engine: AsyncEngine, call_id: str, *, holder: str, stream_sid: str | None = None
) -> CallRow | None:
    """The row's one move to in_progress, held by `holder`; None unless it was ringing."""
    return await call_store.transition(
        engine,
        call_id,
        CallStatus.IN_PROGRESS,
        stream_sid=stream_sid,
        holder=holder,
        heartbeat_at=datetime.now(UTC),
    )


class CallSink:
    """The process's event writer as one call sees it.

    Notices when the Realtime session is up or gone for good (the SIP leg answers on it),
    and holds back the bridge's `call_ended`: the session writes the call's one `call_ended`
    at its end, with the reason its row gets, in the one shape (`call_ended_data`).
    """

    def __init__(self, inner: CallEventSink) -> None:
        self._inner = inner
        self.end_reason: str | None = None  # why the bridge ended the call
        self.media: dict[str, Any] | None = None  # what the leg measured of its media (SIP)
        self.connected = asyncio.Event()
        self.failed = asyncio.Event()

    def emit(self, event: CallEvent) -> None:
        kind = event.kind
        if kind is CallEventKind.CALL_ENDED:
            if self.end_reason is None:
                self.end_reason = str(event.data.get("reason") or EndReason.ENDED)
            media = event.data.get("media")
            if isinstance(media, dict):
                self.media = media
            self.failed.set()
            return
        if kind is CallEventKind.REALTIME_CONNECTED:
            self.connected.set()
        elif kind is CallEventKind.REALTIME_FAILED:
            self.failed.set()
        self._inner.emit(event)

    def emit_now(self, event: CallEvent) -> None:
        """Past the hold: the session's own `call_ended`."""
        self._inner.emit(event)


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    """Who a call is from and to, as the carrier said."""

    call_sid: str
    from_number: str | None
    to_number: str | None


class CallSession:
    """One call on one leg, from its admission to its end (see the module docstring)."""

    def __init__(self, runtime: Runtime, leg: LegKind, caller: Caller) -> None:
        self.runtime = runtime
        self.leg = leg
        self.caller = caller
        self.call_sid = caller.call_sid
        self.row: CallRow | None = None
        self.sink = CallSink(runtime.events)
        self.bridge: Bridge | None = None
        self.entry: LiveCallEntry | None = None
        self.admitted = False  # this session holds the call's row (admit, of_row)
        self.existing: CallRow | None = None  # refused, and its row was there already
        self.refusal = ""  # refused: why ("draining", "capacity", "overloaded")
        self.live = False
        self.ended = False
        self._recorder: CallRecorder | None = None
        self._started = time.monotonic()
        self._span: trace.Span | None = None

    @classmethod
    def of_row(cls, runtime: Runtime, row: CallRow) -> CallSession:
        """The session of a call admitted earlier (Twilio: the webhook admitted it, its
        stream comes later, maybe to another process)."""
        session = cls(
            runtime, LegKind(row.leg), Caller(row.call_sid, row.from_number, row.to_number)
        )
        session.row = row
        session.admitted = True
        return session

    @property
    def call_id(self) -> str:
        assert self.row is not None, "the call has no row yet (admit it first)"
        return self.row.id

    # ---- 1. admit -----------------------------------------------------------------------

    async def admit(
        self,
        started: dict[str, Any],
        *,
        rejected: dict[str, Any] | None = None,
        reopen_busy: bool = True,
    ) -> Admission:
        """A slot, the row and `call_started` (with `started`, after the common fields);
        `rejected`: what the leg adds to a busy call's `call_rejected`; `reopen_busy`: a row
        refused busy earlier rings again here (a SIP dispatcher's failover), else it is
        `ENDED` (Twilio retrying a webhook we refused). Without a slot, `existing` is the
        row found there, if any. Database errors propagate (the slot given back): the leg
        answers them its own way."""
        runtime = self.runtime
        registry = runtime.registry
        fields: dict[str, Any] = {
            "call_sid": self.call_sid,
            "tenant_id": runtime.settings.tenant_id,
            "from_number": self.caller.from_number,
            "to_number": self.caller.to_number,
            "leg": str(self.leg),
        }
        if not registry.try_reserve(self.call_sid, load_guard=True):
            admission = Admission.DRAINING if registry.draining else Admission.BUSY
            self.refusal = registry.refusal
            why: dict[str, Any] = {"reason": registry.refusal}
            if registry.refusal == "capacity":
                why["max_live_calls"] = runtime.settings.max_live_calls
            elif registry.refusal == "overloaded":
                lag = registry.overloaded()
                why["loop_lag_ms"] = round(lag * 1000) if lag is not None else None
            await self.refuse(CallStatus.BUSY, {**why, **(rejected or {})})
            return admission
        try:
            row, created = await call_store.create_call(runtime.engine, **fields)
        except Exception:
            registry.release_reservation(self.call_sid)
            raise
        if created:
            runtime.events.new_call(row.id)  # a new row: its first event is seq 1
        if not created and row.status == CallStatus.BUSY and reopen_busy:
            # Refused elsewhere (a replica full or stopping) and offered here by the
            # caller's proxy: it rings again, here; its timeline keeps the refusal.
            reopened = await call_store.transition(
                runtime.engine, row.id, CallStatus.RINGING, ended_at=None, end_reason=None
            )
            if reopened is not None:
                row, created = reopened, True
        self.row = row
        if not created:
            if row.status in call_store.TERMINAL:
                registry.release_reservation(self.call_sid)
                return Admission.ENDED
            return Admission.EXISTING
        self.admitted = True
        data = {
            "call_sid": self.call_sid,
            "from": self.caller.from_number,
            "to": self.caller.to_number,
            "direction": "inbound",
            "leg": str(self.leg),
            **started,
        }
        runtime.events.emit(CallEvent(row.id, CallEventKind.CALL_STARTED, data))
        return Admission.ADMITTED

    async def refuse(self, status: CallStatus, data: dict[str, Any]) -> None:
        """The call is refused before it began (no slot, not our number): its row in
        `status` with `call_rejected` (`data`), best effort (the caller is answered anyway)."""
        runtime = self.runtime
        try:
            row, created = await call_store.create_call(
                runtime.engine,
                status=status,
                call_sid=self.call_sid,
                tenant_id=runtime.settings.tenant_id,
                from_number=self.caller.from_number,
                to_number=self.caller.to_number,
                leg=str(self.leg),
            )
        except Exception:
            log.exception("could not record the refused call %s", self.call_sid[:64])
            return
        if created:
            runtime.events.emit(CallEvent(row.id, CallEventKind.CALL_REJECTED, data))
            # Written before the refusal is answered: a proxy then tries the next replica with
            # the same call, whose events must come after this one on the timeline.
            await runtime.events.flush(FLUSH_TIMEOUT_S)
        else:
            self.existing = row

    # ---- 2. the bridge ------------------------------------------------------------------

    def build_bridge(
        self,
        leg: CallLeg,
        *,
        carries_audio: bool = True,
        caller_id: str | None = None,
        config: BridgeConfig | None = None,
        on_fatal: Callable[[str], Awaitable[None]] | None = None,
        socket: Any = None,
        transfer: TransferHook | None = None,
        warm_transfer: bool = False,
    ) -> Bridge:
        """The call's bridge, attached to the registry (in set-up). Recorded only where the
        leg carries audio (the recording taps the leg between it and the bridge; neither
        knows). `caller_id`: who the tools take the caller to be (default: From)."""
        runtime = self.runtime
        row = self.row
        assert row is not None and self.bridge is None
        # Every line logged by this call's task, and the tasks it spawns, names the call; and
        # the call's span is their parent (tool calls, and through the ledger the operations).
        log_context.call_id.set(row.id)
        self._span = tracing.tracer.start_span(
            "call",
            attributes={
                tracing.CALL_ID: row.id,
                "voice_agent.leg": str(self.leg),
                "gen_ai.conversation.id": row.id,
            },
        )
        otel_context.attach(trace.set_span_in_context(self._span))
        ctx = CallContext(
            call_id=row.id,
            call_sid=self.call_sid,
            tenant_id=row.tenant_id,
            from_number=caller_id if caller_id is not None else self.caller.from_number,
            to_number=self.caller.to_number,
            warm_transfer=warm_transfer,
        )
        recordings = runtime.console.recordings if runtime.console is not None else None
        if carries_audio and recordings is not None:
            self._recorder = recordings.start(leg.audio_format)  # None: recording is off
            if self._recorder is not None:
                leg = RecordingLeg(leg, self._recorder)
        bridge = Bridge(
            leg,
            ctx,
            runtime.gateway,
            self.sink,
            config or runtime.bridge_config,
            runtime.openai,
            on_fatal=on_fatal,
            announcements=runtime.delivery,
            transfer=transfer,
        )
        self.bridge = bridge
        self.entry = runtime.registry.attach(
            self.call_sid, row.id, bridge, self.caller.from_number, leg=str(self.leg)
        )
        self.entry.socket = socket
        return bridge

    # ---- 3. live ------------------------------------------------------------------------

    async def go_live(
        self, stream: dict[str, Any], *, stream_sid: str | None = None, moved: bool = False
    ) -> bool:
        """The row to in_progress (unless the leg `moved` it already: Twilio spends its
        stream token that way), the entry live for the heartbeat, then `stream_started`
        (`stream`: the leg's media facts). False when the row was ended meanwhile (staff, a
        sweep): the entry stays in set-up and the caller ends the call."""
        runtime = self.runtime
        entry = self.entry
        assert entry is not None and not self.live
        if not moved:
            row = await start_stream(
                runtime.engine, entry.call_id, holder=runtime.holder, stream_sid=stream_sid
            )
            if row is None:
                return False
            self.row = row
        runtime.registry.went_live(entry)
        self.live = True
        data = {"leg": str(self.leg), "call_sid": self.call_sid, **stream}
        if self._span is not None and (span_context := self._span.get_span_context()).is_valid:
            data["trace_id"] = f"{span_context.trace_id:032x}"  # the console links the trace
        self.sink.emit(CallEvent(entry.call_id, CallEventKind.STREAM_STARTED, data))
        return True

    def ended_by(self, reason: str) -> None:
        """Who ended the call first, for its row (later enders do not overwrite)."""
        entry = self.entry
        if entry is not None and entry.end_reason is None:
            entry.end_reason = reason[:128]

    # ---- 4. end (or, Twilio, release) --------------------------------------------------

    async def release(
        self,
        reason: str,
        *,
        kind: CallEventKind = CallEventKind.STREAM_LOST,
        hold_for_s: float = 0.0,
    ) -> bool:
        """The stream was lost without the carrier's `stop` while the call may be up, or
        this process let it go on purpose (stopping: `kind` is then `released_for_drain`);
        Twilio asks its `<Connect action>` URL next: the row stays in progress, released for
        a resume on any replica (app/calls/takeover.py), and `kind` goes on the timeline in
        place of `call_ended`. False, with nothing done, when the row was not ours to
        release (ended or taken meanwhile): end the call then."""
        if self.ended or self.row is None or not self.admitted or not self.live:
            return False
        runtime = self.runtime
        entry = self.entry
        call_id = self.row.id
        if runtime.delivery is not None and self.bridge is not None:
            # What the caller heard of an announcement is durable before another stream
            # (maybe another replica) takes the call.
            await runtime.delivery.flush(call_id)
        try:
            released = await call_takeover.release(
                runtime.engine, call_id, runtime.holder, hold_for_s
            )
        except Exception:
            log.exception("could not release call %s for a resume", call_id)
            released = False
        if not released:
            return False
        self.ended = True
        try:
            self.sink.emit_now(
                CallEvent(call_id, kind, {"reason": reason[:200], "holder": runtime.holder})
            )
            await runtime.events.flush(FLUSH_TIMEOUT_S)
        finally:
            if entry is not None:
                runtime.registry.detach(entry)
            runtime.registry.release_reservation(self.call_sid)
        return True

    async def end(
        self,
        status: CallStatus = CallStatus.COMPLETED,
        reason: str = EndReason.ENDED,
        *,
        override: str | None = None,
    ) -> None:
        """End the call here, once. `reason` is the default: whoever ended it first (the
        registry entry), else the bridge, says why; `override` wins over both (the leg
        knows better: the caller hung up on OpenAI's side). The slot goes last."""
        if self.ended:
            return
        self.ended = True
        runtime = self.runtime
        entry = self.entry
        try:
            if self.row is None or not self.admitted:
                return  # not this session's row: nothing to end, only the slot to give back
            call_id = self.row.id
            if entry is not None:
                entry.ending_here = True
            try:
                if runtime.delivery is not None and self.bridge is not None:
                    # What the caller heard of an announcement is durable before the call's
                    # end hands whatever was not heard to SMS.
                    await runtime.delivery.flush(call_id)
                why = override or (entry.end_reason if entry else None) or self.sink.end_reason
                why = why or str(reason)
                try:
                    await call_store.transition(
                        runtime.engine, call_id, status, end_reason=why[:128]
                    )
                except Exception:
                    log.exception("could not persist the end of call %s", call_id)
                duration_ms = round((time.monotonic() - self._started) * 1000)
                ended = call_ended_data(why, EndSource.CALL, duration_ms)
                if self.sink.media is not None:
                    ended["media"] = self.sink.media  # RTP loss and jitter (SIP)
                self.sink.emit_now(CallEvent(call_id, CallEventKind.CALL_ENDED, ended))
                await runtime.events.flush(FLUSH_TIMEOUT_S)
                recordings = runtime.console.recordings if runtime.console is not None else None
                if self._recorder is not None and recordings is not None and self.live:
                    await recordings.finish(call_id, self._recorder)
            finally:
                # The entry goes only once the end is persisted: whoever waits for a call to
                # be over (shutdown, the drain, a test) then finds its row and events final.
                if entry is not None:
                    runtime.registry.detach(entry)
        finally:
            runtime.registry.release_reservation(self.call_sid)
            if self._recorder is not None:
                self._recorder.discard()  # saved by now or never to be: its spool file goes
            if self._span is not None:
                self._span.end()
