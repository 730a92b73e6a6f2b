"""The per-call bridge between a phone leg and an OpenAI Realtime session.

Caller audio goes upstream as it arrives; agent audio goes to the leg as it arrives. On top of
the two audio paths sit barge-in (clear, truncate at what was heard, cancel), response
bookkeeping (never a response.create while one is active), function calls handed to the tool
gateway off the audio path, transcripts cut to what was heard, and reconnection within a budget
with an apology when it fails.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from openai import AsyncOpenAI
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from openai.types.realtime import (
    ConversationItemInputAudioTranscriptionCompletedEvent,
    InputAudioBufferCommittedEvent,
    InputAudioBufferSpeechStartedEvent,
    InputAudioBufferSpeechStoppedEvent,
    RealtimeConversationItemFunctionCall,
    RealtimeErrorEvent,
    RealtimeServerEvent,
    ResponseAudioDeltaEvent,
    ResponseAudioTranscriptDoneEvent,
    ResponseCreatedEvent,
    ResponseDoneEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
)
from openai.types.realtime.input_audio_buffer_dtmf_event_received_event import (
    InputAudioBufferDtmfEventReceivedEvent,
)
from websockets.exceptions import ConnectionClosed, InvalidStatus

from telephony import audio
from telephony.announcements import AnnouncementTracker, ItemAudio
from telephony.audio import base64_size
from telephony.call_events import CallEvent, CallEventKind, CallEventSink
from telephony.caller_evidence import READBACK_TOLERANCE_MS, EvidenceLog, SpokenItem
from telephony.errors import TelephonyError
from telephony.leg import AudioFormat, AudioIn, CallLeg, DtmfIn, LegClosed
from telephony.realtime_wire import (
    APPEND_HEAD,
    APPEND_TAIL,
    AudioDelta,
    LaneConnection,
    append_frame,
    audio_delta,
    audio_delta_fields,
    lane_of,
    nowait_sender,
    raw_sender,
)
from telephony.redaction import mask_spoken_pins
from telephony.session_config import BridgeConfig, instructions_text, session_update
from telephony.sideband_leg import OPEN_PLAYOUT_MS, SidebandLeg
from telephony.tool_gateway import (
    AnnouncementSink,
    CallContext,
    ConfirmationEvidence,
    FunctionCallRequest,
    LateResult,
    ToolGateway,
    ToolReply,
)
from telephony.watchdog import Watchdog

__all__ = ["Bridge", "BridgeConfig", "BridgeState", "IllegalTransition", "apology_clip"]

log = logging.getLogger(__name__)

BYTES_PER_MS = 8  # G.711 at 8 kHz, both directions (audio/pcmu and audio/pcma)
# Errors that races between the caller, the server's VAD and us make unavoidable.
EXPECTED_ERROR_CODES = frozenset(
    {"response_cancel_not_active", "conversation_already_has_active_response"}
)
# Errors after which the session cannot continue; treated like a dropped socket.
FATAL_ERROR_CODES = frozenset({"session_expired", "session_closed"})
HISTORY_LINES = 20
MAX_PLAYED_CHECKS = 20  # looks at an agent item's playout before its transcript is recorded
TOOL_GRACE_S = 2.0  # how long a running tool call may finish after the call ends
TIMEOUT_S = 10.0  # bound for housekeeping awaits (hooks, closes)
DTMF_QUEUE = 32  # keypad digits waiting for the tool layer; more are dropped
# Caller audio kept while the session is (re)connecting, sent once it is up (2 s of frames).
BACKLOG_FRAMES = 100
RECHECK_S = 0.25  # how often queued response work looks for a safe moment
AUTO_RESPONSE_WAIT_S = 2.0  # after speech stopped, how long the server's own response may take


SESSION_UPDATE_EVENT_ID = "bridge_session_update"


async def _close_quietly(conn: AsyncRealtimeConnection) -> None:
    """Close a Realtime socket we are giving up on, within a second, whatever state it is in."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await conn.close()


class _SessionRejected(TelephonyError):
    """The server refused the session configuration."""


class _SidebandRefused(TelephonyError):
    """OpenAI refused to (re-)attach the sideband: the call is over on its side."""


# The Realtime socket: base64 audio both ways, 50 frames a second, so compression costs CPU
# per frame and saves little (stated, so an SDK default cannot change it); and the lane for
# audio deltas (realtime_wire.LaneConnection), which the SDK passes on to websockets.
REALTIME_SOCKET_OPTIONS: Any = {"compression": None, "create_connection": LaneConnection}

# Speech runs at ~15 characters a second: the length of an item cut before its transcript's
# audio was known (sideband mode has no audio to measure).
MS_PER_CHAR = 65


class IllegalTransition(TelephonyError):
    """A bridge state change that the state machine does not allow."""


class BridgeState(StrEnum):
    """Where the bridge is in a call's life."""

    CONNECTING = "connecting"
    LIVE = "live"
    RECONNECTING = "reconnecting"
    FAILING = "failing"  # Realtime is gone for good: apologise, then end
    ENDED = "ended"


_TRANSITIONS: dict[BridgeState, frozenset[BridgeState]] = {
    BridgeState.CONNECTING: frozenset({BridgeState.LIVE, BridgeState.FAILING, BridgeState.ENDED}),
    BridgeState.LIVE: frozenset({BridgeState.RECONNECTING, BridgeState.ENDED}),
    BridgeState.RECONNECTING: frozenset({BridgeState.LIVE, BridgeState.FAILING, BridgeState.ENDED}),
    BridgeState.FAILING: frozenset({BridgeState.ENDED}),
    BridgeState.ENDED: frozenset(),
}


class ResponseState(StrEnum):
    """The model's response slot: at most one response may be active."""

    IDLE = "idle"
    REQUESTED = "requested"  # we sent response.create, response.created not yet seen
    ACTIVE = "active"


# We may only ask for a response from IDLE; the server's own facts (created, done) always apply.
_RESPONSE_TRANSITIONS: dict[ResponseState, frozenset[ResponseState]] = {
    ResponseState.IDLE: frozenset({ResponseState.REQUESTED, ResponseState.ACTIVE}),
    ResponseState.REQUESTED: frozenset({ResponseState.ACTIVE, ResponseState.IDLE}),
    ResponseState.ACTIVE: frozenset({ResponseState.ACTIVE, ResponseState.IDLE}),
}


@dataclass(slots=True)
class _CreateRequest:
    """A response.create waiting for a safe moment."""

    reason: str
    turn_id: int | None = None  # None: valid whatever the caller said since
    operation_ids: tuple[str, ...] = ()
    instructions: str | None = None
    late: tuple[LateResult, ...] = ()  # the late results this response announces


@dataclass(slots=True)
class _AgentItem:
    """Audio and transcript of one assistant item, as received from the model."""

    response_id: str
    received_ms: float = 0.0
    transcript: str | None = None
    cut_at_ms: int | None = None  # heard ms when a barge-in cut it
    recorded: bool = False
    timer: asyncio.TimerHandle | None = None
    checks: int = 0


@dataclass(slots=True)
class _Session:
    """Per-connection state; lost when the Realtime socket drops."""

    conn: AsyncRealtimeConnection
    generation: int
    items: set[str] = field(default_factory=set)
    response: ResponseState = ResponseState.IDLE
    active_response_id: str | None = None
    requested: _CreateRequest | None = None
    requested_event_id: str | None = None
    # How a preformatted audio frame goes out on `conn` (realtime_wire.raw_sender).
    send_frame: Callable[[str], Awaitable[None]] = field(init=False)
    # The same, synchronous, for the lanes: False when the socket cannot take it now.
    send_now: Callable[[str], bool] | None = field(init=False)

    def __post_init__(self) -> None:
        self.send_frame = raw_sender(self.conn)
        self.send_now = nowait_sender(self.conn)

    def move(self, new: ResponseState) -> None:
        """Apply a response-slot transition; asking while a response is active is refused."""
        if new not in _RESPONSE_TRANSITIONS[self.response]:
            raise IllegalTransition(f"response slot cannot go from {self.response} to {new}")
        self.response = new


def apology_clip(audio_format: AudioFormat, duration_ms: int = 1200) -> bytes:
    """A short, gentle two-note chime in the leg's codec, played before giving up a call."""
    half = duration_ms / 2
    pcm = audio.tone_pcm16(660.0, half, amplitude=0.25) + audio.tone_pcm16(
        440.0, half, amplitude=0.25
    )
    return audio.encode(pcm, "pcma" if audio_format == "audio/pcma" else "pcmu")


class Bridge:
    """One live call: a CallLeg bridged to a Realtime session. Implements LiveCall."""

    def __init__(
        self,
        leg: CallLeg,
        ctx: CallContext,
        gateway: ToolGateway,
        sink: CallEventSink,
        config: BridgeConfig,
        client: AsyncOpenAI,
        on_fatal: Callable[[str], Awaitable[None]] | None = None,
        announcements: AnnouncementSink | None = None,
    ) -> None:
        self.leg = leg
        self.ctx = ctx
        self._gateway = gateway
        self._sink = sink
        self.config = config
        self._client = client
        self._on_fatal = on_fatal
        # Sideband mode: OpenAI carries the audio; we attach to its call for control only.
        self._sideband = leg if isinstance(leg, SidebandLeg) else None
        self.ended_remotely = False  # the sideband was refused: the call ended on OpenAI's side
        self._state = BridgeState.CONNECTING
        self._session: _Session | None = None
        self._generation = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._tool_tasks: set[asyncio.Task[Any]] = set()
        self._dtmf_queue: asyncio.Queue[str] = asyncio.Queue(maxsize=DTMF_QUEUE)
        self._dtmf_task: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()
        self._closed = asyncio.Event()
        self._end_reason = ""
        self._running = False
        # Conversation state that survives reconnects.
        self.turn_id = 0
        self._turn_item_id: str | None = None
        self._caller_speaking = False
        self._speech_stopped_at: float | None = None  # awaiting the server's own response
        self._items: dict[str, _AgentItem] = {}
        self._muted_responses: set[str] = set()
        self._response_turn: dict[str, int] = {}
        self._seen_calls: set[str] = set()
        # Function calls per response, and those running now (bounded by the config).
        self._calls_per_response: dict[str, int] = {}
        self._tools_running = 0
        # What the caller's yes to a readback rests on (telephony.caller_evidence).
        self._evidence = EvidenceLog()
        self._creates: deque[_CreateRequest] = deque()
        self._late: deque[LateResult] = deque()
        # Follows each response that announces late results until it is heard or not.
        self._announcing = AnnouncementTracker(
            announcements,
            lambda kind, **data: self._emit(kind, **data),
            lambda: self.leg.playback,
            self._item_audio,
            lambda response_id: response_id in self._muted_responses,
            ctx.call_id,
        )
        self._history: deque[str] = deque(maxlen=HISTORY_LINES)
        # The lanes: where the leg can (TwilioLeg on our server), caller audio is appended in
        # the Twilio socket's callback and agent audio played in the Realtime socket's, with
        # no task woken per frame; anything unusual takes the task path, in order.
        self._play_now: Callable[[str, str, int], None] | None = getattr(leg, "play_nowait", None)
        self._set_audio_lane: Callable[[Callable[[str, int], bool] | None], None] | None = (
            getattr(leg, "set_audio_lane", None) if self._play_now is not None else None
        )
        self._reader_waiting: _Session | None = None  # _read awaits this session's next message
        self._recheck: asyncio.TimerHandle | None = None
        self._backlog: deque[str] = deque(maxlen=BACKLOG_FRAMES)  # base64 payloads
        self._upstream = asyncio.Lock()  # keeps caller audio in order across a backlog flush
        # Bounds each append (sent one at a time under `_upstream`) with one timer per call.
        self._append_watch = Watchdog(config.send_timeout_s)
        self._event_seq = 0
        # Counters for benchmarks and tests.
        self.frames_up = 0
        self.frames_up_by_lane = 0  # of frames_up, appended in the leg socket's callback
        self.deltas_by_lane = 0  # audio deltas played in the Realtime socket's callback
        self.frames_dropped_up = 0
        self.deltas_muted = 0

    # Lifecycle.

    @property
    def state(self) -> BridgeState:
        return self._state

    def _transition(self, new: BridgeState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise IllegalTransition(f"bridge cannot go from {self._state} to {new}")
        log.debug("call %s: bridge %s -> %s", self.ctx.call_id, self._state, new)
        self._state = new

    async def run(self) -> None:
        """Bridge the call until it ends from any side; everything is closed on return."""
        self._running = True
        if self._set_audio_lane is not None:
            self._set_audio_lane(self._audio_lane)
        try:
            self._spawn(self._leg_loop(), "leg")
            self._spawn(self._realtime_loop(), "realtime")
            await self._ended.wait()
        finally:
            await self._shutdown()

    async def end(self, reason: str) -> None:
        """End the call from outside (status callback, shutdown); returns once closed."""
        self._finish(reason)
        if self._running:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TIMEOUT_S):
                    await self._closed.wait()

    def _finish(self, reason: str) -> None:
        if not self._ended.is_set():
            self._end_reason = reason
            self._ended.set()

    async def _shutdown(self) -> None:
        if self._state is not BridgeState.ENDED:
            self._transition(BridgeState.ENDED)
        if not self._end_reason:
            self._end_reason = "bridge stopped"
        self._ended.set()
        if self._set_audio_lane is not None:
            self._set_audio_lane(None)
        if self._recheck is not None:
            self._recheck.cancel()
        self._append_watch.close()
        for item in self._items.values():
            if item.timer is not None:
                item.timer.cancel()
        self._announcing.close()
        await self._cancel(self._tasks)
        if self._tool_tasks:
            # A tool call is not undone by hanging up: let it answer briefly, then stop waiting.
            await asyncio.wait(self._tool_tasks, timeout=TOOL_GRACE_S)
        await self._cancel(self._tool_tasks)
        await self._close_session()
        with contextlib.suppress(Exception):
            await self.leg.close(self._end_reason)
        for item_id, item in self._items.items():
            if not item.recorded and item.transcript is not None:
                self._record_agent_transcript(item_id, item, final=True)
        self._announcing.settle(f"call ended: {self._end_reason}", self._unspoken_late())
        try:
            async with asyncio.timeout(TIMEOUT_S):
                await self._gateway.on_call_end(self.ctx)
        except Exception:
            log.exception("call %s: on_call_end failed", self.ctx.call_id)
        self._emit(CallEventKind.CALL_ENDED, reason=self._end_reason)
        self._closed.set()

    @staticmethod
    async def _cancel(tasks: set[asyncio.Task[Any]]) -> None:
        current = asyncio.current_task()
        pending = [t for t in tasks if t is not current]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        tasks.clear()

    def _spawn(
        self, coro: Coroutine[Any, Any, None], name: str, *, tool: bool = False
    ) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"bridge-{self.ctx.call_id}-{name}")
        owner = self._tool_tasks if tool else self._tasks
        owner.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._tool_tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("call %s: task %s failed", self.ctx.call_id, task.get_name(), exc_info=exc)
            self._emit(CallEventKind.ERROR, where=task.get_name(), error=repr(exc)[:200])
            self._finish(f"internal error in {task.get_name()}")

    def _emit(self, kind: CallEventKind, **data: Any) -> None:
        self._sink.emit(CallEvent(self.ctx.call_id, kind, data))

    # Caller side.

    async def _leg_loop(self) -> None:
        async for event in self.leg.events():
            match event:
                case AudioIn():
                    await self._send_audio(event.payload)
                case DtmfIn():
                    self._take_digit(event.digit)
                case LegClosed():
                    self._finish(f"leg closed: {event.reason}")
                    return
        self._finish("leg closed")

    def _audio_lane(self, payload: str, timestamp_ms: int) -> bool:
        """Caller audio as the leg's socket receives it (the leg's reader is idle): appended
        at once when nothing is in the way, else False and it comes through `_leg_loop`."""
        session = self._session
        if (
            session is None
            or self._state is not BridgeState.LIVE
            or self._backlog
            or self._upstream.locked()
        ):
            return False
        send_now = session.send_now
        if send_now is None or not send_now(APPEND_HEAD + payload + APPEND_TAIL):
            return False
        self.frames_up += 1
        self.frames_up_by_lane += 1
        return True

    async def _send_audio(self, payload: str) -> None:
        session = self._session
        if session is None or self._state is not BridgeState.LIVE:
            # Keep the last moments for the session being opened; older audio is stale.
            if len(self._backlog) == self._backlog.maxlen:
                self.frames_dropped_up += 1
            self._backlog.append(payload)
            return
        async with self._upstream:
            if await self._flush_backlog(session):
                await self._append(session, payload)

    async def _flush_backlog(self, session: _Session) -> bool:
        while self._backlog:
            if not await self._append(session, self._backlog.popleft()):
                return False
        return True

    async def _append(self, session: _Session, payload: str) -> bool:
        # The hot path: the leg's base64 spliced into a preformatted frame, sent raw.
        sent = await self._guarded(
            session, session.send_frame(append_frame(payload)), self._append_watch
        )
        if sent:
            self.frames_up += 1
        return sent

    def _take_digit(self, digit: str) -> None:
        """A keypad digit (any leg): one task takes the digits in order; a flood waits in a
        bounded queue (the leg's budget ends a stream that sends too many)."""
        if self._dtmf_queue.full():
            log.info("call %s: keypad digit dropped (queue full)", self.ctx.call_id)
            return
        self._dtmf_queue.put_nowait(digit)
        if self._dtmf_task is None or self._dtmf_task.done():
            self._dtmf_task = self._spawn(self._dtmf_loop(), "dtmf", tool=True)

    async def _dtmf_loop(self) -> None:
        while not self._dtmf_queue.empty():
            digit = self._dtmf_queue.get_nowait()
            async with asyncio.timeout(TIMEOUT_S):
                entry = await self._gateway.on_dtmf(self.ctx, digit)
            if entry is None or not entry.pin:
                self._evidence.digit(digit)  # a PIN's digits are never an answer
                self._emit(CallEventKind.DTMF, digit=digit)
            elif entry.submitted_digits is not None:
                # The digits of a PIN are never recorded: only that one was entered.
                self._emit(
                    CallEventKind.PIN_ENTERED,
                    digits=entry.submitted_digits,
                    outcome=entry.outcome,
                )

    async def _guarded(
        self, session: _Session, send: Awaitable[None], watch: Watchdog | None = None
    ) -> bool:
        """Run one send on `session`; a dead or stuck socket is closed so the reader reconnects.

        Bounded by `config.send_timeout_s`: by `watch` on the audio path, else a timeout.
        """
        try:
            if watch is not None:
                with watch:
                    await send
            else:
                async with asyncio.timeout(self.config.send_timeout_s):
                    await send
        except (ConnectionClosed, TimeoutError, OSError) as exc:
            log.info("call %s: send to Realtime failed: %r", self.ctx.call_id, exc)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await session.conn.close()
            return False
        except Exception as exc:  # the SDK wraps some socket errors in its own
            log.info("call %s: send to Realtime failed: %r", self.ctx.call_id, exc)
            return False
        return True

    # Realtime side: connection lifecycle.

    async def _realtime_loop(self) -> None:
        first = True
        while True:
            started = time.monotonic()
            session, attempts, error = await self._connect(resumed=not first)
            if session is None and self.ended_remotely:
                # Not a failure: the call is over (a hang-up, a transfer) on OpenAI's side.
                self._finish(f"ended on OpenAI's side: {error}")
                return
            if session is None:
                await self._fail(error or "could not connect")
                return
            self._session = session
            self._transition(BridgeState.LIVE)
            lane = lane_of(session.conn)
            if lane is not None and self._play_now is not None:
                lane.lane = functools.partial(self._delta_lane, session)
            if first:
                self._emit(CallEventKind.REALTIME_CONNECTED, attempts=attempts)
                if self.config.greeting:
                    self._queue_create(
                        _CreateRequest(
                            "greeting",
                            instructions=instructions_text(self.config)
                            + "\n\n"
                            + self.config.greeting_instructions,
                        )
                    )
            else:
                self._emit(
                    CallEventKind.REALTIME_RECONNECTED,
                    attempts=attempts,
                    down_ms=round((time.monotonic() - started) * 1000),
                )
            first = False
            if self._backlog:
                async with self._upstream:
                    await self._flush_backlog(session)
            await self._drain()
            reason = await self._read(session)
            if self._ended.is_set():
                return
            self._emit(CallEventKind.REALTIME_DROPPED, reason=reason)
            self._transition(BridgeState.RECONNECTING)
            await self._drop_session()

    async def _connect(self, *, resumed: bool) -> tuple[_Session | None, int, str | None]:
        """Open a session and configure it, retrying with backoff within the budget."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.reconnect_budget_s
        delay = 0.1
        attempts = 0
        error: str | None = None
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None, attempts, error
            attempts += 1
            conn: AsyncRealtimeConnection | None = None
            try:
                async with asyncio.timeout(min(self.config.connect_timeout_s, remaining)):
                    if self._sideband is not None:
                        conn = await self._attach_sideband(self._sideband)
                        self._generation += 1
                        return _Session(conn, self._generation), attempts, None
                    conn = await self._client.realtime.connect(
                        model=self.config.model,
                        websocket_connection_options=REALTIME_SOCKET_OPTIONS,
                    ).enter()
                    history = list(self._history) if resumed else []
                    await conn.session.update(
                        event_id=SESSION_UPDATE_EVENT_ID,
                        session=session_update(
                            self.config,
                            self.leg.audio_format,
                            self._gateway.definitions(),
                            history,
                        ),
                    )
                    await self._await_session_updated(conn)
            except asyncio.CancelledError:
                # The call ended while the session was still being configured: the socket is
                # not `self._session` yet, so nothing else would ever close it.
                if conn is not None:
                    await _close_quietly(conn)
                raise
            except _SidebandRefused as exc:
                self.ended_remotely = True
                return None, attempts, str(exc)
            except _SessionRejected as exc:
                # The server refuses our configuration: retrying cannot help.
                if conn is not None:
                    await _close_quietly(conn)
                return None, attempts, str(exc)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"[:200]
                log.info(
                    "call %s: Realtime connect attempt %d failed: %s",
                    self.ctx.call_id,
                    attempts,
                    error,
                )
                if conn is not None:
                    await _close_quietly(conn)
            else:
                self._generation += 1
                return _Session(conn, self._generation), attempts, None
            await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))
            delay = min(delay * 2, 2.0)

    async def _attach_sideband(self, leg: SidebandLeg) -> AsyncRealtimeConnection:
        """Join OpenAI's call over the sideband: the session was set by the accept."""
        try:
            return await self._client.realtime.connect(
                call_id=leg.openai_call_id, websocket_connection_options={"compression": None}
            ).enter()
        except InvalidStatus as exc:
            status = exc.response.status_code
            if 400 <= status < 500 and status not in (401, 408, 429):
                # 404/410: the call is gone. A network drop never gets an HTTP answer.
                raise _SidebandRefused(f"sideband refused ({status})") from exc
            raise

    async def _await_session_updated(self, conn: AsyncRealtimeConnection) -> None:
        """Until the server confirms the configuration: audio in another codec is noise."""
        while True:
            event = await conn.recv()
            if event.type == "session.updated":
                return
            if isinstance(event, RealtimeErrorEvent) and event.type == "error":
                error = event.error
                self._emit(
                    CallEventKind.REALTIME_ERROR,
                    code=error.code,
                    type=error.type,
                    message=error.message[:200],
                    param=error.param,
                    event_id=error.event_id,
                )
                if error.event_id == SESSION_UPDATE_EVENT_ID:
                    raise _SessionRejected(f"session.update rejected: {error.message}"[:200])

    async def _read(self, session: _Session) -> str:
        """Handle server events until the socket drops; returns why it dropped."""
        conn = session.conn
        while True:
            try:
                self._reader_waiting = session
                try:
                    raw = await conn.recv_bytes()
                finally:
                    self._reader_waiting = None
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else 1006
                return f"socket closed ({code})"
            except Exception as exc:
                return f"receive failed: {type(exc).__name__}"
            # Audio deltas (most frames) skip the SDK's model parse; nothing else does.
            delta = audio_delta(raw)
            if delta is not None:
                try:
                    await self._on_audio_delta(session, delta)
                except Exception as exc:  # one odd delta must not end the call
                    log.exception("call %s: could not play an audio delta", self.ctx.call_id)
                    self._emit(
                        CallEventKind.ERROR,
                        where="realtime:response.output_audio.delta",
                        error=repr(exc)[:200],
                    )
                continue
            try:
                event = conn.parse_event(raw)
            except ValueError as exc:  # a frame that is not JSON; skip it
                log.warning("call %s: unparsable Realtime frame: %s", self.ctx.call_id, exc)
                continue
            try:
                fatal = await self._on_event(session, event)
            except Exception as exc:  # one odd event must not end the call
                log.exception("call %s: could not handle %s", self.ctx.call_id, event.type)
                self._emit(
                    CallEventKind.ERROR, where=f"realtime:{event.type}", error=repr(exc)[:200]
                )
                continue
            if fatal is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await session.conn.close()
                return fatal

    async def _drop_session(self) -> None:
        """Forget per-connection state; audio already with the leg keeps playing."""
        session = self._session
        await self._close_session()
        self._caller_speaking = False
        self._speech_stopped_at = None
        self._requeue_late(session)

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            lane = lane_of(session.conn)
            if lane is not None:
                lane.lane = None
            with contextlib.suppress(Exception):
                async with asyncio.timeout(TIMEOUT_S):
                    await session.conn.close()

    async def _fail(self, reason: str) -> None:
        """Realtime is gone for good: apologise to the caller, hand the hang-up to the app."""
        if self._ended.is_set():
            return
        self._transition(BridgeState.FAILING)
        self._emit(CallEventKind.REALTIME_FAILED, reason=reason)
        if self._sideband is not None:
            # No audio path of ours to apologise on: the app hangs up through the API.
            await self._run_on_fatal(reason)
            self._finish(f"realtime failed: {reason}")
            return
        clip = apology_clip(self.leg.audio_format)
        clip_ms = len(clip) // BYTES_PER_MS
        with contextlib.suppress(Exception):
            await self.leg.clear()
            await self.leg.play("apology", base64.b64encode(clip).decode("ascii"))
            async with asyncio.timeout(clip_ms / 1000 + 3.0):
                # Wait for observable playout: the leg confirms what the caller heard.
                # The tracker has no notification; playout is observed by polling it.
                while self.leg.playback.is_playing() and not self._ended.is_set():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        self._emit(
            CallEventKind.APOLOGY_PLAYED,
            text=self.config.apology_text,
            clip_ms=clip_ms,
            heard_ms=self.leg.playback.heard_ms("apology"),
        )
        await self._run_on_fatal(reason)
        self._finish(f"realtime failed: {reason}")

    async def _run_on_fatal(self, reason: str) -> None:
        if self._on_fatal is not None:
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    await self._on_fatal(reason)
            except Exception:
                log.exception("call %s: on_fatal failed", self.ctx.call_id)

    # Realtime side: events.

    async def _on_event(self, session: _Session, event: RealtimeServerEvent) -> str | None:
        """Apply one server event; returns a reason when the session must be given up."""
        match event.type:
            case "response.output_audio.delta":
                # Only a delta whose fields the wire check doubted gets here.
                assert isinstance(event, ResponseAudioDeltaEvent)
                await self._on_audio_delta(
                    session, AudioDelta(event.response_id, event.item_id, event.delta)
                )
            case "input_audio_buffer.speech_started":
                assert isinstance(event, InputAudioBufferSpeechStartedEvent)
                await self._on_speech_started(session, event)
            case "input_audio_buffer.speech_stopped":
                assert isinstance(event, InputAudioBufferSpeechStoppedEvent)
                self._caller_speaking = False
                self._speech_stopped_at = time.monotonic()
                self._emit(
                    CallEventKind.SPEECH_STOPPED,
                    turn_id=self.turn_id,
                    audio_end_ms=event.audio_end_ms,
                )
            case "input_audio_buffer.committed":
                assert isinstance(event, InputAudioBufferCommittedEvent)
                self._evidence.speech_heard(event.item_id)
                if event.item_id != self._turn_item_id:
                    # A turn that began without speech_started (e.g. a manual commit).
                    self.turn_id += 1
                    self._turn_item_id = event.item_id
            case "response.created":
                assert isinstance(event, ResponseCreatedEvent)
                self._on_response_created(session, event)
            case "response.done":
                assert isinstance(event, ResponseDoneEvent)
                await self._on_response_done(session, event)
            case "response.output_item.added" if self._sideband is not None:
                assert isinstance(event, ResponseOutputItemAddedEvent)
                self._on_output_item_added(session, event)
            case "output_audio_buffer.started" if self._sideband is not None:
                self._on_output_started(self._sideband, str(getattr(event, "response_id", "")))
            case "output_audio_buffer.stopped" | "output_audio_buffer.cleared" if (
                self._sideband is not None
            ):
                self._on_output_ended(
                    self._sideband,
                    str(getattr(event, "response_id", "")),
                    cleared=event.type == "output_audio_buffer.cleared",
                )
            case "input_audio_buffer.dtmf_event_received":
                assert isinstance(event, InputAudioBufferDtmfEventReceivedEvent)
                self._take_digit(event.event)
            case "response.output_item.done":
                assert isinstance(event, ResponseOutputItemDoneEvent)
                if isinstance(event.item, RealtimeConversationItemFunctionCall):
                    self._on_function_call(session, event.item, event.response_id)
            case "response.output_audio_transcript.done":
                assert isinstance(event, ResponseAudioTranscriptDoneEvent)
                self._on_agent_transcript(event.item_id, event.transcript)
            case "conversation.item.input_audio_transcription.completed":
                assert isinstance(event, ConversationItemInputAudioTranscriptionCompletedEvent)
                self._evidence.speech_heard(event.item_id)
                # A PIN spoken aloud is in the transcript too: never stored or re-sent.
                said = mask_spoken_pins(event.transcript)
                self._emit(
                    CallEventKind.CALLER_TRANSCRIPT,
                    item_id=event.item_id,
                    text=said,
                    turn_id=self.turn_id,
                )
                self._history.append(f"Caller: {said}")
            case "error":
                assert isinstance(event, RealtimeErrorEvent)
                return await self._on_error(session, event)
        return None

    def _delta_lane(self, session: _Session, raw: bytes) -> bool:
        """A server message as the Realtime socket receives it, while `_read` waits on this
        session: an audio delta is played here and then; anything else goes to `_read`."""
        if self._reader_waiting is not session:
            return False
        fields = audio_delta_fields(raw)
        if fields is None:
            return False
        self.deltas_by_lane += 1
        response_id, item_id, delta = fields
        try:
            size = self._take_audio_delta(session, response_id, item_id, delta)
            if size >= 0:
                self._play_now(item_id, delta, size)  # type: ignore[misc]  # set with the lane
        except Exception as exc:  # as in _read: one odd delta must not end the call
            log.exception("call %s: could not play an audio delta", self.ctx.call_id)
            self._emit(
                CallEventKind.ERROR,
                where="realtime:response.output_audio.delta",
                error=repr(exc)[:200],
            )
        return True

    async def _on_audio_delta(self, session: _Session, delta: AudioDelta) -> None:
        if self._take_audio_delta(session, delta.response_id, delta.item_id, delta.delta) >= 0:
            await self.leg.play(delta.item_id, delta.delta)

    def _take_audio_delta(
        self, session: _Session, response_id: str, item_id: str, delta: str
    ) -> int:
        """Account for one audio delta: its size in bytes, or -1 if it must not be played."""
        if response_id in self._muted_responses:
            # Audio of a response the caller interrupted: it must never reach them.
            self.deltas_muted += 1
            return -1
        item = self._items.get(item_id)
        if item is None:
            item = self._items[item_id] = _AgentItem(response_id)
            session.items.add(item_id)
        size = base64_size(delta)
        item.received_ms += size / BYTES_PER_MS
        return size

    async def _on_speech_started(
        self, session: _Session, event: InputAudioBufferSpeechStartedEvent
    ) -> None:
        received_at = time.perf_counter()
        self._caller_speaking = True
        self._speech_stopped_at = None
        self._evidence.speech_started(event.item_id)
        self.turn_id += 1
        self._turn_item_id = event.item_id
        if self._sideband is not None:
            if self.leg.playback.is_playing() or session.response is ResponseState.ACTIVE:
                await self._barge_in_sideband(session, received_at)
        elif self.leg.playback.is_playing():
            await self._barge_in(session, received_at)
        self._emit(
            CallEventKind.SPEECH_STARTED, turn_id=self.turn_id, audio_start_ms=event.audio_start_ms
        )

    async def _barge_in(self, session: _Session, received_at: float) -> None:
        playback = self.leg.playback
        item_id = playback.current_item()
        # First the caller stops hearing us; everything else can take a moment longer.
        await self.leg.clear()
        clear_ms = (time.perf_counter() - received_at) * 1000
        # clear() froze every item at what the caller heard.
        played_ms = playback.heard_ms(item_id) if item_id else 0
        item = self._items.get(item_id) if item_id else None
        received_ms = int(item.received_ms) if item else 0
        audio_end_ms = min(played_ms, received_ms)
        truncated = False
        if item is not None and item_id is not None:
            self._muted_responses.add(item.response_id)
            if item_id in session.items:
                truncated = await self._guarded(
                    session,
                    session.conn.conversation.item.truncate(
                        item_id=item_id, content_index=0, audio_end_ms=audio_end_ms
                    ),
                )
            item.cut_at_ms = audio_end_ms
            if item.transcript is not None and not item.recorded:
                self._record_agent_transcript(item_id, item)
        # Items queued behind the head were cleared before a word of them was heard.
        for other_id, other in self._items.items():
            if other_id == item_id or other.cut_at_ms is not None or other.recorded:
                continue
            heard = playback.heard_ms(other_id)
            if heard + 1 >= other.received_ms:
                continue
            other.cut_at_ms = min(heard, int(other.received_ms))
            self._muted_responses.add(other.response_id)
            if other_id in session.items:
                await self._guarded(
                    session,
                    session.conn.conversation.item.truncate(
                        item_id=other_id, content_index=0, audio_end_ms=other.cut_at_ms
                    ),
                )
            if other.transcript is not None:
                self._record_agent_transcript(other_id, other)
        cancelled = False
        if session.response is ResponseState.ACTIVE and session.active_response_id:
            self._muted_responses.add(session.active_response_id)
            cancelled = await self._guarded(session, session.conn.response.cancel())
        self._announcing.check_all()
        self._emit(
            CallEventKind.BARGE_IN,
            item_id=item_id,
            played_ms=played_ms,
            received_ms=received_ms,
            audio_end_ms=audio_end_ms,
            truncated=truncated,
            cancelled=cancelled,
            turn_id=self.turn_id,
            clear_latency_ms=round(clear_ms, 3),
        )

    # Sideband mode: the server plays the audio and says what was heard.

    def _on_output_item_added(self, session: _Session, event: ResponseOutputItemAddedEvent) -> None:
        item = event.item
        if item.type != "message" or not item.id or item.id in self._items:
            return
        # Its length is known only once the server stops playing it; until then it counts as
        # not heard in full (an announcement in it is not yet heard).
        self._items[item.id] = _AgentItem(event.response_id, received_ms=OPEN_PLAYOUT_MS)
        session.items.add(item.id)

    def _items_of(self, response_id: str) -> list[tuple[str, _AgentItem]]:
        return [(i, item) for i, item in self._items.items() if item.response_id == response_id]

    def _on_output_started(self, leg: SidebandLeg, response_id: str) -> None:
        if response_id in self._muted_responses:
            return
        items = [(i, it) for i, it in self._items_of(response_id) if it.cut_at_ms is None]
        for _, item in items:
            item.received_ms = OPEN_PLAYOUT_MS  # playing, length unknown: not heard in full yet
        leg.output_started(i for i, _ in items)

    def _on_output_ended(self, leg: SidebandLeg, response_id: str, *, cleared: bool) -> None:
        items = [
            (i, it)
            for i, it in self._items_of(response_id)
            if it.cut_at_ms is None and not it.recorded and leg.playback.queued_ms(i) > 0
        ]
        if not items:
            return
        heard = {item_id: leg.playback.heard_ms(item_id) for item_id, _ in items}
        leg.output_ended()
        for item_id, item in items:
            if cleared:
                self._muted_responses.add(item.response_id)
                item.cut_at_ms = heard[item_id]
                item.received_ms = max(heard[item_id] + 2.0, self._estimated_ms(item))
            else:
                item.received_ms = float(heard[item_id])
            if item.transcript is not None:
                self._record_agent_transcript(item_id, item)
        self._announcing.check(response_id)

    @staticmethod
    def _estimated_ms(item: _AgentItem) -> float:
        return float(len(item.transcript or "") * MS_PER_CHAR)

    async def _barge_in_sideband(self, session: _Session, received_at: float) -> None:
        """Stop the model (response.cancel) and the server's playout (output_audio_buffer.clear).

        The server truncates the item at what it played; we freeze ours at the same moment.
        """
        cancelled = False
        response_id = session.active_response_id
        if session.response is ResponseState.ACTIVE and response_id:
            self._muted_responses.add(response_id)
            cancelled = await self._guarded(session, session.conn.response.cancel())
        playback = self.leg.playback
        item_id = playback.current_item()
        cleared = await self._guarded(session, session.conn.output_audio_buffer.clear())
        clear_ms = (time.perf_counter() - received_at) * 1000
        played_ms = playback.heard_ms(item_id) if item_id else 0
        await self.leg.clear()
        item = self._items.get(item_id) if item_id else None
        if item is not None and item_id is not None:
            self._muted_responses.add(item.response_id)
            item.cut_at_ms = played_ms
            item.received_ms = max(played_ms + 2.0, self._estimated_ms(item))
            if item.transcript is not None and not item.recorded:
                self._record_agent_transcript(item_id, item)
        self._announcing.check_all()
        self._emit(
            CallEventKind.BARGE_IN,
            item_id=item_id,
            played_ms=played_ms,
            received_ms=int(item.received_ms) if item else 0,
            audio_end_ms=played_ms,
            truncated=False,  # the server truncates on output_audio_buffer.clear
            cancelled=cancelled,
            output_cleared=cleared,
            turn_id=self.turn_id,
            clear_latency_ms=round(clear_ms, 3),
        )

    def _on_response_created(self, session: _Session, event: ResponseCreatedEvent) -> None:
        response_id = event.response.id or ""
        request = session.requested
        session.move(ResponseState.ACTIVE)
        session.active_response_id = response_id
        session.requested = None
        session.requested_event_id = None
        self._speech_stopped_at = None
        self._response_turn[response_id] = self.turn_id
        self._evidence.response_created(response_id)
        self._emit(
            CallEventKind.RESPONSE_CREATED,
            response_id=response_id,
            turn_id=self.turn_id,
            reason=request.reason if request else "server",
        )
        if request is not None and request.operation_ids:
            self._emit(
                CallEventKind.RESULT_ANNOUNCED,
                response_id=response_id,
                operation_ids=list(request.operation_ids),
            )
        if request is not None and request.late:
            self._announcing.spoken(response_id, request.late)

    async def _on_response_done(self, session: _Session, event: ResponseDoneEvent) -> None:
        response = event.response
        # A late or duplicate done of another response leaves the slot as it is.
        if session.response is ResponseState.ACTIVE and session.active_response_id in (
            None,
            response.id,
        ):
            session.move(ResponseState.IDLE)
            session.active_response_id = None
        self._emit(
            CallEventKind.RESPONSE_DONE,
            response_id=response.id,
            status=response.status,
            turn_id=self._response_turn.get(response.id or "", self.turn_id),
        )
        for output in response.output or []:
            if isinstance(output, RealtimeConversationItemFunctionCall):
                self._on_function_call(session, output, response.id or "")
        self._calls_per_response.pop(response.id or "", None)  # it makes no more calls
        self._announcing.done(response.id or "", response.status)
        await self._drain()

    async def _on_error(self, session: _Session, event: RealtimeErrorEvent) -> str | None:
        error = event.error
        if error.event_id is not None and error.event_id == session.requested_event_id:
            # Our response.create lost a race (e.g. with the server's VAD): try again later.
            if session.requested is not None:
                self._creates.appendleft(session.requested)
            session.requested = None
            session.requested_event_id = None
            if session.response is ResponseState.REQUESTED:
                session.move(ResponseState.IDLE)
            self._schedule_recheck()
        if error.code in EXPECTED_ERROR_CODES:
            log.debug("call %s: expected Realtime error %s", self.ctx.call_id, error.code)
            return None
        self._emit(
            CallEventKind.REALTIME_ERROR,
            code=error.code,
            type=error.type,
            message=error.message[:200],
            event_id=error.event_id,
        )
        if error.code in FATAL_ERROR_CODES:
            return f"fatal error: {error.code}"
        return None

    # Function calls.

    def _on_function_call(
        self, session: _Session, item: RealtimeConversationItemFunctionCall, response_id: str
    ) -> None:
        # Only a completed item is proof: a cancelled response's arguments are not a request.
        if item.status != "completed" or not item.call_id or item.call_id in self._seen_calls:
            return
        self._seen_calls.add(item.call_id)
        request = FunctionCallRequest(
            call_id=item.call_id,
            name=item.name,
            arguments=item.arguments,
            item_id=item.id or "",
            response_id=response_id,
            turn_id=self._response_turn.get(response_id, self.turn_id),
            evidence=self,
        )
        redacts = getattr(self._gateway, "redacts_arguments", None)
        secret = redacts is not None and redacts(request.name)
        self._emit(
            CallEventKind.FUNCTION_CALL,
            call_id=request.call_id,
            name=request.name,
            # A tool that declares `redact_arguments` (a spoken PIN): never stored.
            arguments={"redacted": True} if secret else request.arguments[:500],
            turn_id=request.turn_id,
            response_id=response_id,
        )
        refusal = self._over_tool_limits(response_id)
        if refusal is None:
            self._tools_running += 1
        self._spawn(
            self._run_tool(request, session.generation, refusal),
            f"tool-{item.call_id}",
            tool=True,
        )

    def _over_tool_limits(self, response_id: str) -> ToolReply | None:
        """A refusal when this call may not reach the tool layer now, else None.

        A model that asks for dozens of calls at once must not turn into dozens of requests
        at a provider: past the caps, each call is answered at once and goes nowhere.
        """
        count = self._calls_per_response.get(response_id, 0) + 1
        self._calls_per_response[response_id] = count
        if count > self.config.max_tool_calls_per_response:
            why = (
                f"Too many requests at once: at most {self.config.max_tool_calls_per_response} "
                "per turn."
            )
        elif self._tools_running >= self.config.max_tool_calls_in_flight:
            why = (
                f"Too many requests at once: at most {self.config.max_tool_calls_in_flight} "
                "can run together."
            )
        else:
            return None
        log.info("call %s: function call refused (%s)", self.ctx.call_id, why)
        return ToolReply(
            {
                "status": "error",
                "message": f"{why} This one was not run, so nothing was done. Make one "
                "request at a time and wait for its answer.",
                "retryable": True,
            }
        )

    def confirmation_evidence(self, operation_id: str) -> ConfirmationEvidence:
        """`CallerEvidence`: the caller's answer to `operation_id`'s readback, as observed."""
        playback = self.leg.playback
        active = self._session.active_response_id if self._session is not None else None
        spoken: list[SpokenItem] = []
        for item_id, item in self._items.items():
            audio_ms = int(item.received_ms)
            heard_ms = (
                item.cut_at_ms if item.cut_at_ms is not None else playback.confirmed_ms(item_id)
            )
            ended: float | None = None
            if (
                item.cut_at_ms is None
                and item.response_id != active  # all of its audio has arrived
                and audio_ms > 0
                and heard_ms >= audio_ms - READBACK_TOLERANCE_MS
            ):
                ended = playback.ended_at(item_id)
            spoken.append(
                SpokenItem(
                    item_id,
                    item.response_id,
                    playback.started_at(item_id),
                    ended,
                    heard_ms,
                    audio_ms,
                )
            )
        return self._evidence.judge(operation_id, spoken)

    async def _run_tool(
        self, request: FunctionCallRequest, generation: int, refusal: ToolReply | None = None
    ) -> None:
        if refusal is not None:
            reply = refusal
        else:
            try:
                reply = await self._gateway.handle(self.ctx, request)
            except Exception as exc:
                log.exception("call %s: tool gateway failed on %s", self.ctx.call_id, request.name)
                self._emit(CallEventKind.ERROR, where="tool_gateway", error=repr(exc)[:200])
                reply = ToolReply({"error": "The request could not be completed right now."})
            finally:
                self._tools_running -= 1
        if reply.awaiting_confirmation and reply.operation_id is not None:
            # What the model says after this output is the readback the caller must hear.
            self._evidence.readback_asked(reply.operation_id)
        session = self._session
        if self._ended.is_set() or session is None:
            self._emit(
                CallEventKind.FUNCTION_OUTPUT,
                call_id=request.call_id,
                operation_id=reply.operation_id,
                sent=False,
                response="call_ended",
            )
            return
        output = json.dumps(reply.output, separators=(",", ":"), default=str)
        # A re-attached sideband joins the same conversation: the function call is still there.
        if session.generation == generation or self._sideband is not None:
            sent = await self._guarded(
                session,
                session.conn.conversation.item.create(
                    item={
                        "type": "function_call_output",
                        "call_id": request.call_id,
                        "output": output,
                    }
                ),
            )
        else:
            # The session that asked is gone; tell the new one what came back.
            sent = await self._guarded(
                session,
                session.conn.conversation.item.create(
                    item=self._system_note(
                        f"Result of the earlier request ({request.name}): {output}"
                    )
                ),
            )
        current = request.turn_id == self.turn_id
        if not reply.wants_response:
            decision = "not_wanted"
        elif not current:
            decision = "deferred_stale_turn"
        elif self._caller_speaking:
            decision = "deferred_caller_speaking"
        else:
            # If the response that asked is still finishing, this waits for its response.done.
            self._queue_create(_CreateRequest("function_output", turn_id=request.turn_id))
            decision = "requested"
        self._emit(
            CallEventKind.FUNCTION_OUTPUT,
            call_id=request.call_id,
            operation_id=reply.operation_id,
            sent=sent,
            response=decision,
            turn_id=request.turn_id,
            # Refused by the per-response / in-flight caps: it reached no tool or provider.
            **({"limited": True} if refusal is not None else {}),
        )
        await self._drain()

    # Late results.

    async def deliver_result(self, result: LateResult) -> bool:
        """Speak a late result at the next safe moment; False if the call is ending."""
        if self._ended.is_set() or self._state in (BridgeState.FAILING, BridgeState.ENDED):
            return False
        if result.delivery_id is not None and self._carries(result.delivery_id):
            return True  # offered again while still on its way: it is said once
        self._late.append(result)
        await self._drain()
        self._report_held()
        return True

    def _carries(self, delivery_id: str) -> bool:
        """Whether this delivery is already queued or being announced."""
        queued = [*self._late, *(r for c in self._creates for r in c.late)]
        session = self._session
        if session is not None and session.requested is not None:
            queued.extend(session.requested.late)
        return any(r.delivery_id == delivery_id for r in queued) or self._announcing.carries(
            delivery_id
        )

    def _item_audio(self, response_id: str) -> list[ItemAudio]:
        return [
            ItemAudio(item_id, item.received_ms, item.cut_at_ms)
            for item_id, item in self._items.items()
            if item.response_id == response_id
        ]

    def _report_held(self) -> None:
        """Late results still queued after a look for a safe moment are held (and why)."""
        if not self._late:
            return
        session = self._session
        if session is None or self._state is not BridgeState.LIVE:
            reason = "the Realtime session is not ready (connecting)"
        elif self._caller_speaking:
            reason = "the caller is speaking"
        elif session.response is not ResponseState.IDLE:
            reason = "a response is under way"
        else:
            reason = "the caller just stopped speaking; the model answers first"
        self._announcing.held(self._late, reason)

    def _requeue_late(self, session: _Session | None) -> None:
        """The session dropped: results it was about to announce go to the next session
        (their notes were in the old conversation); what it was saying was not heard."""
        pending = [c for c in self._creates if c.late]
        if session is not None and session.requested is not None and session.requested.late:
            pending.insert(0, session.requested)
        for request in pending:
            if request in self._creates:
                self._creates.remove(request)
            self._late.extendleft(reversed(request.late))
        self._announcing.dropped()

    def _unspoken_late(self) -> list[LateResult]:
        unspoken = list(self._late)
        self._late.clear()
        for request in self._creates:
            unspoken.extend(request.late)
        session = self._session
        if session is not None and session.requested is not None:
            unspoken.extend(session.requested.late)
        return unspoken

    @staticmethod
    def _system_note(text: str) -> Any:
        return {
            "type": "message",
            "role": "system",
            "content": [{"type": "input_text", "text": text}],
        }

    # Response scheduling.

    def _safe_moment(self, session: _Session) -> bool:
        if self._state is not BridgeState.LIVE or session.response is not ResponseState.IDLE:
            return False
        if self._caller_speaking:
            return False
        stopped = self._speech_stopped_at
        # The server's VAD answers a finished utterance itself; do not race it.
        return stopped is None or time.monotonic() - stopped > AUTO_RESPONSE_WAIT_S

    async def _drain(self) -> None:
        """Send at most one response.create if it is safe now; otherwise look again later."""
        session = self._session
        if session is None or (not self._creates and not self._late):
            return
        if not self._safe_moment(session):
            self._schedule_recheck()
            return
        request: _CreateRequest | None = None
        if self._late:
            results = list(self._late)
            self._late.clear()
            for result in results:
                await self._guarded(
                    session,
                    session.conn.conversation.item.create(
                        item=self._system_note(
                            "An update arrived for the caller. Tell them briefly, in your own "
                            f"words: {result.text}"
                        )
                    ),
                )
            # An announcement that lost its create race rides along with the new ones.
            late = tuple(r for c in self._creates for r in c.late) + tuple(results)
            request = _CreateRequest(
                "late_result", operation_ids=tuple(r.operation_id for r in late), late=late
            )
            self._creates.clear()  # one response carries the queued work too
        else:
            # One response sees every item added so far: coalesce what is still current.
            while self._creates:
                candidate = self._creates.popleft()
                if candidate.turn_id is None or candidate.turn_id == self.turn_id:
                    request = candidate
            if request is None:
                return
        await self._create_response(session, request)

    async def _create_response(self, session: _Session, request: _CreateRequest) -> None:
        self._event_seq += 1
        event_id = f"bridge_rc_{self._event_seq}"
        session.move(ResponseState.REQUESTED)
        session.requested = request
        session.requested_event_id = event_id
        if request.instructions is not None:
            send = session.conn.response.create(
                event_id=event_id, response={"instructions": request.instructions}
            )
        else:
            send = session.conn.response.create(event_id=event_id)
        if not await self._guarded(session, send):
            session.move(ResponseState.IDLE)
            session.requested = None
            session.requested_event_id = None
            if request.late:
                # The socket is going; the next session gets them (with fresh notes).
                self._late.extendleft(reversed(request.late))

    async def _drain_then_report(self) -> None:
        await self._drain()
        self._report_held()

    def _queue_create(self, request: _CreateRequest) -> None:
        self._creates.append(request)
        while len(self._creates) > self.config.max_queued_response_creates:
            dropped = self._creates.popleft()
            log.info("call %s: response queue full, dropped %s", self.ctx.call_id, dropped.reason)

    def _schedule_recheck(self) -> None:
        if self._recheck is not None or self._ended.is_set():
            return

        def fire() -> None:
            self._recheck = None
            if not self._ended.is_set():
                self._spawn(self._drain_then_report(), "drain")

        self._recheck = asyncio.get_running_loop().call_later(RECHECK_S, fire)

    # Transcripts.

    def _on_agent_transcript(self, item_id: str, text: str) -> None:
        item = self._items.get(item_id)
        if item is None:
            # No audio reached us for it (text-only or fully muted): nothing was heard.
            self._emit(
                CallEventKind.AGENT_TRANSCRIPT,
                item_id=item_id,
                text="",
                full_text=text[:2000],
                cut=bool(text),
                heard_ms=0,
                audio_ms=0,
            )
            return
        item.transcript = text
        if item.cut_at_ms is not None:
            if self._sideband is not None:
                item.received_ms = max(item.received_ms, self._estimated_ms(item))
            self._record_agent_transcript(item_id, item)
        elif self._sideband is not None:
            # Recorded when the server says its playout stopped (or was cut).
            if not self.leg.playback.is_playing() and self.leg.playback.queued_ms(item_id) > 0:
                self._record_agent_transcript(item_id, item)
        else:
            self._check_played(item_id)

    def _check_played(self, item_id: str) -> None:
        """Record an item's transcript once its audio has played out, or look again later."""
        item = self._items[item_id]
        item.timer = None
        if item.recorded or self._ended.is_set():
            return
        remaining_ms = item.received_ms - self.leg.playback.heard_ms(item_id)
        item.checks += 1
        # A leg that stops confirming playout must not keep this polling for the whole call.
        if remaining_ms <= 1 or item.cut_at_ms is not None or item.checks > MAX_PLAYED_CHECKS:
            self._record_agent_transcript(item_id, item)
            return
        loop = asyncio.get_running_loop()
        item.timer = loop.call_later(remaining_ms / 1000 + 0.05, self._check_played, item_id)

    def _record_agent_transcript(self, item_id: str, item: _AgentItem, final: bool = False) -> None:
        if item.recorded or item.transcript is None:
            return
        item.recorded = True
        if item.timer is not None:
            item.timer.cancel()
            item.timer = None
        text = item.transcript
        heard = item.cut_at_ms
        if heard is None:
            heard = self.leg.playback.heard_ms(item_id) if final else int(item.received_ms)
        if self._sideband is not None and item.received_ms >= OPEN_PLAYOUT_MS:
            # The call ended while the server was still playing it.
            item.received_ms = max(heard + 2.0, self._estimated_ms(item))
        audio_ms = int(item.received_ms)
        cut = audio_ms > 0 and heard < audio_ms - 1
        if cut:
            text = _cut_text(text, heard / audio_ms)
        started = self.leg.playback.started_at(item_id)
        self._emit(
            CallEventKind.AGENT_TRANSCRIPT,
            item_id=item_id,
            text=text,
            cut=cut,
            heard_ms=heard,
            audio_ms=audio_ms,
            **({"full_text": item.transcript[:2000]} if cut else {}),
            # When the caller began hearing it (the timeline stamps speech at its start).
            **({"started_mono_ns": round(started * 1e9)} if started is not None else {}),
        )
        if text:
            self._history.append(f"Agent{' (interrupted)' if cut else ''}: {text}")


def _cut_text(text: str, fraction: float) -> str:
    """The part of `text` spoken in the first `fraction` of its audio (by characters)."""
    end = max(0, min(len(text), round(len(text) * fraction)))
    cut = text[:end]
    if end < len(text) and " " in cut:
        cut = cut[: cut.rfind(" ")]  # a word cut in half was not heard as a word
    return cut.rstrip()
