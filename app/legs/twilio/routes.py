"""Twilio ingress: the voice webhook, the media stream socket and the status callback."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response
from sqlalchemy.exc import DataError, DBAPIError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from app.calls import store as call_store
from app.calls import takeover
from app.calls.control import publish_end
from app.calls.store import CallStatus, EndSource, call_ended_data
from app.deps import RuntimeDep, runtime_of
from app.errors import (
    WS_POLICY_VIOLATION,
    BadRequest,
    Conflict,
    DatabaseUnavailable,
    TokenRejected,
    ws_close_code,
)
from app.http.signatures import signed_form
from app.http.slots import Slot
from app.legs.session import Admission, Caller, CallSession, start_stream
from app.legs.twilio import outbound, resume, transfer, twiml, warm
from app.legs.twilio.media_session import run_media_session
from app.legs.twilio.media_ws import LANE_EXTENSION, MediaWebSocketProtocol
from app.logging import RateLimitedLog
from app.models import LegKind
from app.ops.outbound import bind_sid
from app.runtime import Runtime
from telephony.call_events import CallEvent, CallEventKind
from telephony.errors import MalformedFrame
from telephony.legs.twilio.budget import StreamBudget
from telephony.legs.twilio.events import Connected, Start, StartInfo, parse_inbound
from telephony.tool_gateway import TransferOutcome
from tools.transfers import TARGET_NAME, record_transfer_outcome

log = logging.getLogger(__name__)
router = APIRouter()

# Twilio sends `connected` and `start` right after the socket opens.
START_TIMEOUT_S = 10.0
# Frames tolerated before `start` that are neither `connected` nor `start`.
MAX_FRAMES_BEFORE_START = 5
_CLEAR_PREFIX = '{"event":"clear"'


def _xml(body: str) -> Response:
    return Response(content=body, media_type="application/xml")


ENDED_WEBHOOKS = RateLimitedLog(log)


def _ended(status: str) -> Response:
    ENDED_WEBHOOKS.warning("voice webhook for a call that has ended (%s) refused", status)
    if status == CallStatus.BUSY:
        return _xml(twiml.busy())  # Twilio retrying a call we refused: the same answer
    raise Conflict("this call has ended")


@router.post("/twilio/voice")
async def voice(request: Request, runtime: RuntimeDep) -> Response:
    """Answer an incoming call: connect its audio to our media socket, or say we are busy."""
    settings = runtime.settings
    params = await signed_form(request, settings)
    call_sid = params.get("CallSid", "")
    if not call_sid:
        raise BadRequest("no CallSid")
    session = CallSession(
        runtime,
        LegKind.TWILIO,
        Caller(call_sid, params.get("From") or None, params.get("To") or None),
    )
    # A call that has ended stays ended: a replayed webhook gets no stream (and no capacity).
    # The row's insert finds it (one statement where a lookup first took two): a row there
    # and over is `ENDED` (a busy one does not ring again), and without a slot the row found
    # is `session.existing`.
    try:
        admission = await session.admit(
            {"direction": params.get("Direction", "inbound")}, reopen_busy=False
        )
    except DataError as exc:
        # Fields the columns cannot hold (over-long, NUL): the request is bad, not the database.
        raise BadRequest("unstorable call fields") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("calls insert failed") from exc
    known = session.existing
    if known is not None and known.status in call_store.TERMINAL:
        return _ended(known.status)
    if admission is Admission.DRAINING:
        log.warning("stopping: call %s hears busy", call_sid)
        return _xml(twiml.busy())
    if admission is Admission.BUSY:
        if session.refusal == "overloaded":
            log.warning("overloaded (BUSY_LOOP_LAG_MS): call %s hears busy", call_sid)
        else:
            log.warning("at capacity (%d): call %s hears busy", settings.max_live_calls, call_sid)
        return _xml(twiml.busy())
    row = session.row
    assert row is not None
    if admission is Admission.ENDED:
        return _ended(row.status)
    # ADMITTED, or EXISTING: Twilio retrying the webhook of a call not over gets its stream.
    token = runtime.tokens.issue(call_sid, row.id)
    return _xml(resume.stream_twiml(runtime, row, token))


async def _voice_lane(request: Request) -> Response:
    return await voice(request, runtime_of(request))


async def _media_lane(ws: WebSocket) -> None:
    await media(ws, runtime_of(ws))


# The two requests every call makes, for app.http.route_lane: the same endpoints, their one
# dependency resolved as `get_runtime` resolves it.
LANE_ROUTES: dict[tuple[str, str], Callable[..., Any]] = {
    ("POST", "/twilio/voice"): _voice_lane,
    ("WEBSOCKET", "/twilio/media"): _media_lane,
}


@router.post("/twilio/stream-ended")
async def stream_ended(request: Request, runtime: RuntimeDep) -> Response:
    """Twilio's `<Connect action>`: the stream ended, the call is up. Hang up a call that is
    over; resume one whose stream was lost (app/legs/twilio/resume.py)."""
    params = await signed_form(request, runtime.settings)
    call_sid = params.get("CallSid", "")
    if not call_sid:
        raise BadRequest("no CallSid")
    if params.get("CallStatus") in call_store.TWILIO_TERMINAL:
        return _xml(twiml.hangup())
    try:
        return _xml(await resume.decide(runtime, call_sid))
    except DataError as exc:
        raise BadRequest("unstorable CallSid") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("calls lookup failed") from exc


async def _transfer_params(
    request: Request, runtime: Runtime
) -> tuple[dict[str, str], str, str, str]:
    """A transfer webhook's signed form and its query (call, target, function call), checked:
    the call must be ours and the signed form name its CallSid (or ParentCallSid)."""
    params = await signed_form(request, runtime.settings)
    q = request.query_params
    call_id, target, fc = q.get("call_id", ""), q.get("target", ""), q.get("fc", "")
    try:
        uuid.UUID(call_id)
    except ValueError:
        raise BadRequest("no call_id") from None
    if not TARGET_NAME.match(target) or not fc or len(fc) > 128:
        raise BadRequest("no transfer target")
    try:
        row = await call_store.get_call(runtime.engine, call_id)
    except DBAPIError as exc:
        raise DatabaseUnavailable("calls lookup failed") from exc
    sids = {params.get("CallSid"), params.get("ParentCallSid")}
    if row is None or row.call_sid not in sids:
        raise BadRequest("not a call of ours")
    return params, call_id, target, fc


@router.post("/twilio/transfer-answered")
async def transfer_answered(request: Request, runtime: RuntimeDep) -> Response:
    """The transfer's `<Number statusCallback>`: the person answered (see transfer.py)."""
    params, call_id, target, fc = await _transfer_params(request, runtime)
    if params.get("CallStatus") in ("in-progress", "answered"):
        try:
            await transfer.answered(runtime, call_id, target, fc)
        except DBAPIError as exc:
            raise DatabaseUnavailable("transfer update failed") from exc
    return Response(status_code=204)


@router.post("/twilio/transfer-ended")
async def transfer_ended(request: Request, runtime: RuntimeDep) -> Response:
    """The transfer's `<Dial action>`: hang up after a call the person answered, else bring
    the caller back to an agent (see transfer.py)."""
    params, call_id, target, fc = await _transfer_params(request, runtime)
    if params.get("CallStatus") in call_store.TWILIO_TERMINAL:
        # The caller hung up while it rang: the status callback ends the row.
        gone = TransferOutcome(False, "caller-hung-up", "the caller hung up while it rang")
        await record_transfer_outcome(runtime.engine, call_id, fc, gone)
        return _xml(twiml.hangup())
    status = params.get("DialCallStatus", "failed")
    try:
        return _xml(await transfer.dial_ended(runtime, call_id, target, fc, status))
    except DBAPIError as exc:
        raise DatabaseUnavailable("transfer update failed") from exc


async def _warm_params(request: Request, runtime: Runtime) -> tuple[dict[str, str], str, str]:
    """A warm transfer webhook's signed form and its query (call, function call, key), checked:
    only we make these URLs, and the form names the person's CallSid."""
    params = await signed_form(request, runtime.settings)
    q = request.query_params
    call_id, fc = q.get("call_id", ""), q.get("fc", "")
    if not warm.checked(runtime.settings, call_id, fc, q.get("k", "")):
        raise BadRequest("not a transfer of ours")
    if not params.get("CallSid"):
        raise BadRequest("no CallSid")
    return params, call_id, fc


@router.post("/twilio/warm-answered")
async def warm_answered(request: Request, runtime: RuntimeDep) -> Response:
    """A warm transfer's person's call was answered, and Twilio's answering-machine detection
    says by whom (`AnsweredBy`): the briefing for a person, a hang-up for a machine (see
    warm.py)."""
    params, call_id, fc = await _warm_params(request, runtime)
    if params.get("CallStatus") in call_store.TWILIO_TERMINAL:
        return _xml(twiml.hangup())
    target = request.query_params.get("target", "")
    try:
        return _xml(
            await warm.answered(
                runtime, call_id, fc, target, params["CallSid"], params.get("AnsweredBy", "")
            )
        )
    except DataError as exc:
        raise BadRequest("unstorable CallSid") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("transfer update failed") from exc


@router.post("/twilio/warm-briefed")
async def warm_briefed(request: Request, runtime: RuntimeDep) -> Response:
    """A warm transfer's person heard the briefing (the `<Redirect>` after its `<Say>`): into
    the conference, and the caller's replica joins the caller (see warm.py)."""
    params, call_id, fc = await _warm_params(request, runtime)
    if params.get("CallStatus") in call_store.TWILIO_TERMINAL:
        return _xml(twiml.hangup())
    try:
        return _xml(await warm.briefed(runtime, call_id, fc, params["CallSid"]))
    except DataError as exc:
        raise BadRequest("unstorable CallSid") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("transfer update failed") from exc


@router.post("/twilio/warm-status")
async def warm_status(request: Request, runtime: RuntimeDep) -> Response:
    """A warm transfer's person's call status: never joined (busy, no answer, hung up) tells the
    caller's agent (see warm.py). Idempotent."""
    params, call_id, fc = await _warm_params(request, runtime)
    try:
        await warm.person_status(
            runtime, call_id, fc, params["CallSid"], params.get("CallStatus", "")
        )
    except DataError as exc:
        raise BadRequest("unstorable CallSid") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("transfer update failed") from exc
    return Response(status_code=204)


@router.post("/twilio/outbound-answer")
async def outbound_answer(request: Request, runtime: RuntimeDep) -> Response:
    """An outbound call was picked up (Calls.create's `url`): its stream, with the agent silent
    until it is known who answered (see outbound.py)."""
    params = await signed_form(request, runtime.settings)
    q = request.query_params
    call_id = outbound.checked_call_id(runtime, q.get("call_id", ""), q.get("k", ""))
    call_sid = params.get("CallSid", "")
    if not call_sid:
        raise BadRequest("no CallSid")
    if params.get("CallStatus") in call_store.TWILIO_TERMINAL:
        return _xml(twiml.hangup())
    try:
        return _xml(await outbound.answer(runtime, call_id, call_sid))
    except DataError as exc:
        raise BadRequest("unstorable CallSid") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("calls update failed") from exc


@router.post("/twilio/amd")
async def amd_callback(request: Request, runtime: RuntimeDep) -> Response:
    """Twilio's AsyncAmdStatusCallback: who answered an outbound call (see outbound.py)."""
    params = await signed_form(request, runtime.settings)
    q = request.query_params
    call_id = outbound.checked_call_id(runtime, q.get("call_id", ""), q.get("k", ""))
    call_sid = params.get("CallSid", "")
    if not call_sid:
        raise BadRequest("no CallSid")
    try:
        await outbound.amd_result(runtime, call_id, call_sid, params.get("AnsweredBy", ""))
    except DataError as exc:
        raise BadRequest("unstorable CallSid") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("calls update failed") from exc
    return Response(status_code=204)


@router.post("/twilio/status")
async def status_callback(request: Request, runtime: RuntimeDep) -> Response:
    """Twilio's call-status callback; a final status ends the call everywhere. Idempotent.
    An outbound call's carries its call id (and key) in the query: the first word Twilio
    gives of a call whose create answer was lost, or that nobody picked up."""
    params = await signed_form(request, runtime.settings)
    call_sid = params.get("CallSid", "")
    call_status = params.get("CallStatus", "")
    if not call_sid:
        raise BadRequest("no CallSid")
    if "call_id" in request.query_params:
        q = request.query_params
        call_id = outbound.checked_call_id(runtime, q.get("call_id", ""), q.get("k", ""))
        try:
            await bind_sid(runtime.engine, call_id, call_sid)
        except DataError as exc:
            raise BadRequest("unstorable CallSid") from exc
        except DBAPIError as exc:
            raise DatabaseUnavailable("calls update failed") from exc
    target = call_store.TWILIO_TERMINAL.get(call_status)
    if target is None:
        return Response(status_code=204)
    reason = f"twilio status {call_status}"
    entry = await runtime.registry.end(call_sid, reason)
    if entry is not None:
        # The media session of this call runs here; it persists the end once it has wound down.
        return Response(status_code=204)
    try:
        row = await call_store.find_by_sid(runtime.engine, call_sid)
        if row is not None:
            # Released (its stream lost, or dialling a transfer): nobody holds it, so the end
            # is written here.
            streaming = row.status == CallStatus.IN_PROGRESS and row.released_at is None
            ended = await call_store.transition(runtime.engine, row.id, target, end_reason=reason)
            if streaming:
                # The stream runs on another replica: that one ends it and records the end
                # on the timeline (one writer per call keeps its events in order).
                await publish_end(runtime.engine, call_sid, reason)
            elif ended is not None:
                await outbound.unanswered(runtime, row, call_status)
                data = call_ended_data(reason, EndSource.STATUS)
                runtime.events.emit(CallEvent(row.id, CallEventKind.CALL_ENDED, data))
    except DataError as exc:
        # A CallSid no column can hold (NUL, over-long) names no call of ours.
        raise BadRequest("unstorable CallSid") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("status update failed") from exc
    return Response(status_code=204)


@router.websocket("/twilio/media")
async def media(ws: WebSocket, runtime: RuntimeDep) -> None:
    """One Twilio Media Stream: verify its token, then bridge it until the call ends."""
    # Until its `start` carries a valid token a socket is anonymous: it holds a slot per
    # source address (and of the pool), or is refused at the handshake (403).
    source = ws.client.host if ws.client else "unknown"
    slot = runtime.pending_streams.take(source)
    if slot is None:
        PENDING_REFUSED.warning(
            "media socket from %s refused: %d waiting for start from there, %d in all "
            "(MEDIA_MAX_PENDING_PER_SOURCE, MEDIA_MAX_PENDING_STREAMS)",
            source,
            runtime.pending_streams.held(source),
            runtime.pending_streams.held(),
        )
        await _close(ws, WS_POLICY_VIOLATION, "too many streams waiting to start")
        return
    try:
        call = await _accept_and_admit(ws, runtime, slot)
    finally:
        slot.release()  # no-op once admitted; a socket that closes gives it back here
    if call is not None:
        guard, start, row = call
        await run_media_session(runtime, guard, start, row, resumed=guard.resumed)


async def _accept_and_admit(
    ws: WebSocket, runtime: Runtime, slot: Slot
) -> tuple[FrameGuard, StartInfo, call_store.CallRow] | None:
    """Accept the socket, read its `start` and admit its token; None if it was refused."""
    await ws.accept()
    guard = FrameGuard(ws, runtime)
    try:
        start = await _read_start(guard)
    except (TimeoutError, MalformedFrame) as exc:
        log.info("media stream closed before start: %s", exc)
        await _close(ws, WS_POLICY_VIOLATION, "no valid start")
        return None
    except WebSocketDisconnect:
        return None
    try:
        call = await _admit(runtime, start, guard)
    except TokenRejected as exc:
        await _record_rejection(runtime, start, exc.reason)
        await _close(ws, ws_close_code(exc), f"stream token {exc.reason}")
        return None
    except DataError:
        # Start fields no column can hold (an over-long streamSid): a bad stream, not a retry.
        log.warning("media stream for call %s refused: unstorable start", start.call_sid)
        await _close(ws, WS_POLICY_VIOLATION, "bad start")
        return None
    except DBAPIError:
        log.exception("media stream admission failed")
        await _close(ws, ws_close_code(DatabaseUnavailable()), "try again")
        return None
    # A valid token: the stream is a call now, bounded by MAX_LIVE_CALLS, not by this pool.
    slot.release()
    guard.call_id = call.id
    return guard, start, call


async def _close(ws: WebSocket, code: int, reason: str) -> None:
    try:
        async with asyncio.timeout(5.0):
            await ws.close(code, reason)
    except (TimeoutError, RuntimeError):
        pass


async def _read_start(guard: FrameGuard) -> StartInfo:
    """Skip `connected`, return the `start` info; anything else before it is a bad stream."""
    async with asyncio.timeout(START_TIMEOUT_S):
        for _ in range(MAX_FRAMES_BEFORE_START):
            message = parse_inbound(await guard.receive_text())
            if isinstance(message, Connected):
                continue
            if isinstance(message, Start):
                return message.start
            raise MalformedFrame(f"{message.event!r} before start")
    raise MalformedFrame("no start frame")


async def _admit(runtime: Runtime, start: StartInfo, guard: FrameGuard) -> call_store.CallRow:
    """Verify and spend the stream token; move the call to in_progress exactly once."""
    claims = runtime.tokens.verify(start.custom_parameters.get("token"), start.call_sid)
    if claims.resume:
        # A lost stream's call, claimed for this token by the action webhook: the row
        # becomes ours and the nonce is spent, so a replayed token fails here.
        row = await takeover.take_over(
            runtime.engine,
            claims.call_id,
            nonce=claims.nonce,
            holder=runtime.holder,
            stream_sid=start.stream_sid,
        )
    else:
        # Across processes: only a ringing call can start its stream, so a replayed token
        # fails here.
        row = await start_stream(
            runtime.engine, claims.call_id, holder=runtime.holder, stream_sid=start.stream_sid
        )
    if row is None:
        raise TokenRejected("reused")
    # Spent in memory only once the database took the stream: a start the update refused
    # (an over-long streamSid, a database hiccup) must not burn the genuine stream's token.
    runtime.tokens.consume(claims)
    guard.resumed = claims.resume
    return row


# Sockets refused because too many wait for `start`: logged at most every 10 s.
PENDING_REFUSED = RateLimitedLog(log)

# Streams refused for their token: counted (on /metrics) and logged at most every 10 s.
# Never written to the named call's timeline: anyone can name a CallSid, so a row per
# attempt would let an unauthenticated client write into a known call's timeline.
STREAMS_REJECTED = RateLimitedLog(log)


async def _record_rejection(runtime: Runtime, start: StartInfo, reason: str) -> None:
    runtime.streams_rejected += 1
    STREAMS_REJECTED.warning("media stream for call %s rejected: %s", start.call_sid, reason)


class FrameGuard:
    """The media socket as the Twilio leg sees it, minus frames no media stream sends.

    Oversized and binary frames are dropped here and recorded on the call; they never reach
    the parser and never end the call.
    """

    def __init__(self, ws: WebSocket, runtime: Runtime) -> None:
        self._ws = ws
        # Per frame the guard talks ASGI to the server directly: Starlette's WebSocket adds
        # only state checks that hold for an accepted stream (and is used for the close).
        self._asgi_receive = ws._receive
        self._asgi_send = ws._send
        # The server's media lane (app/legs/twilio/media_ws.py), when the server is ours.
        self._lane_protocol: MediaWebSocketProtocol | None = ws.scope.get("extensions", {}).get(
            LANE_EXTENSION
        )
        self._events = runtime.events
        self._max = runtime.settings.max_ws_frame_bytes
        self.call_id: str | None = None
        self.resumed = False  # admitted with a resume token: a lost stream's call, taken over
        self.dropped = 0
        self.max_dropped_before_start = runtime.settings.media_max_frames_before_start
        self.budget: StreamBudget | None = None  # set once the stream is admitted
        # When each `clear` left (monotonic): barge-in ordering is observable from outside.
        self.clears_sent_at: list[float] = []

    async def receive_text(self) -> str:
        if self._ws.client_state is not WebSocketState.CONNECTED:
            await self._ws.receive()  # Starlette says why this stream cannot be read
        while True:
            message = await self._asgi_receive()
            kind = message["type"]
            if kind != "websocket.receive":
                self._ws.client_state = WebSocketState.DISCONNECTED
                if kind == "websocket.disconnect":
                    raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
                raise WebSocketDisconnect(1011, f"unexpected ASGI message {kind!r}")
            text = message.get("text")
            if text is None:
                self._drop("binary frame", len(message.get("bytes") or b""))
                self._check_budget()
                continue
            if len(text) > self._max or (
                len(text) * 4 > self._max and len(text.encode()) > self._max
            ):
                self._drop("oversized frame", len(text))
                self._check_budget()
                continue
            return str(text)

    def _check_budget(self) -> None:
        if self.call_id is None and self.dropped > self.max_dropped_before_start:
            # Before `start` nothing is admitted yet: a client sending only junk goes.
            raise MalformedFrame(f"{self.dropped} unusable frames before start")
        if self.budget is not None:
            self.budget.malformed()
            if self.budget.tripped is not None:
                raise MalformedFrame(self.budget.tripped)  # the leg ends the call on it

    def _drop(self, reason: str, length: int) -> None:
        self.dropped += 1
        if self.dropped <= 3:  # the first few; a flood is counted, not logged line by line
            log.info("dropped %s (%d) on media stream of call %s", reason, length, self.call_id)
        if self.call_id is not None and (self.budget is None or self.budget.may_record()):
            self._events.emit(
                CallEvent(
                    self.call_id,
                    CallEventKind.MALFORMED_FRAME,
                    {"reason": reason, "length": length, "limit": self._max},
                )
            )

    def set_lane(self, lane: Callable[[bytes], bool] | None) -> None:
        """Offer frames to `lane` as they arrive (TwilioLeg); the ones this guard drops
        (oversized) are never offered: they take `receive_text`, which drops and records
        them."""
        protocol = self._lane_protocol
        if protocol is None:
            return
        protocol.set_lane(lane, self._max)

    def send_nowait(self, frames: Iterable[str]) -> bool:
        """Write `frames` now, in one write, if the socket takes them without waiting (never
        a `clear`: those are timed); False (nothing written) to use `send_text`. TwilioLeg
        takes `nowait_sender()` instead, which skips this layer."""
        protocol = self._lane_protocol
        if protocol is None or self._ws.application_state is not WebSocketState.CONNECTED:
            return False
        return protocol.send_text_nowait(frames)

    def nowait_sender(self) -> Callable[[Iterable[str]], bool] | None:
        """`send_nowait` without this layer per frame: the server protocol's own, which
        refuses once a close is sent (the only way this guard's state changes mid-stream)."""
        protocol = self._lane_protocol
        return protocol.send_text_nowait if protocol is not None else None

    async def send_text(self, data: str) -> None:
        if self._ws.application_state is WebSocketState.CONNECTED:
            try:
                await self._asgi_send({"type": "websocket.send", "text": data})
            except OSError as exc:
                self._ws.application_state = WebSocketState.DISCONNECTED
                raise WebSocketDisconnect(code=1006) from exc
        else:
            await self._ws.send_text(data)  # Starlette refuses it with the reason
        if data.startswith(_CLEAR_PREFIX):
            self.clears_sent_at.append(time.monotonic())

    async def close(self, code: int, reason: str) -> None:
        await _close(self._ws, code, reason)
