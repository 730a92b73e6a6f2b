"""The audio path: caller audio up to the model, agent audio down to the leg, and the keypad.

Owns the lanes (where the leg can, TwilioLeg on our server, caller audio is appended in the
leg socket's callback and agent audio played in the model socket's, with no task woken per
frame; anything unusual takes the task path, in order), the backlog of caller audio kept
while the model is (re)connecting, the order of appends across a backlog flush, and keypad
digits handed one at a time to the tool layer. How much of the agent's audio may be played
is the playout's call (`Playout.take_delta`); this only moves it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from telephony.bridge.model_link import ModelSession
from telephony.bridge.playout import Playout
from telephony.bridge.port import Port
from telephony.call_events import CallEventKind
from telephony.caller_evidence import EvidenceLog
from telephony.legs.leg import AudioLane, CallLeg, lanes_of
from telephony.realtime_wire import AudioDelta
from telephony.tool_gateway import CallContext, ToolGateway

log = logging.getLogger(__name__)

# Caller audio kept while the session is (re)connecting, sent once it is up (2 s of frames).
BACKLOG_FRAMES = 100
DTMF_QUEUE = 32  # keypad digits waiting for the tool layer; more are dropped
TIMEOUT_S = 10.0  # bound for one keypad digit's handling


class AudioPath:
    """Moves one call's audio both ways and its keypad digits to the tool layer."""

    def __init__(
        self,
        port: Port,
        leg: CallLeg,
        playout: Playout,
        ctx: CallContext,
        gateway: ToolGateway,
        evidence: EvidenceLog,
    ) -> None:
        self._port = port
        self._leg = leg
        self._playout = playout
        self._ctx = ctx
        self._gateway = gateway
        self._evidence = evidence
        # The model session audio goes to; set by the bridge while it is live, else None.
        self.session: ModelSession | None = None
        # Caller audio dropped, not sent: an outbound call until it is known who answered (a
        # machine's greeting must not start the model talking).
        self.deaf = False
        lanes = lanes_of(leg)
        self._play_now: Callable[[str, str, int], None] | None = (
            lanes.play_nowait if lanes is not None else None
        )
        self._set_audio_lane: Callable[[AudioLane | None], None] | None = (
            lanes.set_audio_lane if lanes is not None else None
        )
        self._backlog: deque[str] = deque(maxlen=BACKLOG_FRAMES)  # base64 payloads
        self._upstream = asyncio.Lock()  # keeps caller audio in order across a backlog flush
        self._dtmf_queue: asyncio.Queue[str] = asyncio.Queue(maxsize=DTMF_QUEUE)
        self._dtmf_task: asyncio.Task[None] | None = None
        # Counters for benchmarks and tests.
        self.frames_up = 0
        self.frames_up_by_lane = 0  # of frames_up, appended in the leg socket's callback
        self.frames_dropped_up = 0

    @property
    def has_down_lane(self) -> bool:
        """Whether agent audio can be played in the model socket's callback."""
        return self._play_now is not None

    def open(self) -> None:
        if self._set_audio_lane is not None:
            self._set_audio_lane(self._up_lane)

    def close(self) -> None:
        self.session = None
        if self._set_audio_lane is not None:
            self._set_audio_lane(None)

    # Caller audio.

    def _up_lane(self, payload: str, timestamp_ms: int) -> bool:
        """Caller audio as the leg's socket receives it (the leg's reader is idle): appended
        at once when nothing is in the way, else False and it comes through `send`."""
        if self.deaf:
            return True  # taken, and dropped
        session = self.session
        if (
            session is None
            or self._backlog
            or self._upstream.locked()
            or not session.append_now(payload)
        ):
            return False
        self.frames_up += 1
        self.frames_up_by_lane += 1
        return True

    async def send(self, payload: str) -> None:
        """Caller audio from the leg's event loop."""
        if self.deaf:
            return
        session = self.session
        if session is None:
            # Keep the last moments for the session being opened; older audio is stale.
            if len(self._backlog) == self._backlog.maxlen:
                self.frames_dropped_up += 1
            self._backlog.append(payload)
            return
        async with self._upstream:
            if await self._flush(session):
                await self._append(session, payload)

    async def flush_backlog(self, session: ModelSession) -> None:
        """The session is up: what the caller said meanwhile goes first."""
        if self._backlog:
            async with self._upstream:
                await self._flush(session)

    async def _flush(self, session: ModelSession) -> bool:
        while self._backlog:
            if not await self._append(session, self._backlog.popleft()):
                return False
        return True

    async def _append(self, session: ModelSession, payload: str) -> bool:
        sent = await session.append(payload)
        if sent:
            self.frames_up += 1
        return sent

    # Agent audio.

    def take_delta_now(
        self, session: ModelSession, response_id: str, item_id: str, delta: str
    ) -> None:
        """An audio delta in the model socket's callback: played there and then."""
        try:
            size = self._playout.take_delta(session, response_id, item_id, delta)
            if size >= 0:
                self._play_now(item_id, delta, size)  # type: ignore[misc]  # lane needs it
        except Exception as exc:  # as in the read loop: one odd delta must not end the call
            log.exception("call %s: could not play an audio delta", self._port.call_id)
            self._port.emit(
                CallEventKind.ERROR,
                where="realtime:response.output_audio.delta",
                error=repr(exc)[:200],
            )

    async def play(self, session: ModelSession, delta: AudioDelta) -> None:
        """An audio delta from the read loop."""
        if self._playout.take_delta(session, delta.response_id, delta.item_id, delta.delta) >= 0:
            await self._leg.play(delta.item_id, delta.delta)

    # Keypad.

    def digit(self, digit: str) -> None:
        """A keypad digit (any leg): one task takes the digits in order; a flood waits in a
        bounded queue (the leg's budget ends a stream that sends too many)."""
        if self._dtmf_queue.full():
            log.info("call %s: keypad digit dropped (queue full)", self._port.call_id)
            return
        self._dtmf_queue.put_nowait(digit)
        if self._dtmf_task is None or self._dtmf_task.done():
            self._dtmf_task = self._port.spawn(self._dtmf_loop(), "dtmf", tool=True)

    async def _dtmf_loop(self) -> None:
        while not self._dtmf_queue.empty():
            digit = self._dtmf_queue.get_nowait()
            async with asyncio.timeout(TIMEOUT_S):
                entry = await self._gateway.on_dtmf(self._ctx, digit)
            if entry is None or not entry.pin:
                self._evidence.digit(digit)  # a PIN's digits are never an answer
                self._port.emit(CallEventKind.DTMF, digit=digit)
            elif entry.submitted_digits is not None:
                # The digits of a PIN are never recorded: only that one was entered.
                self._port.emit(
                    CallEventKind.PIN_ENTERED,
                    digits=entry.submitted_digits,
                    outcome=entry.outcome,
                )
