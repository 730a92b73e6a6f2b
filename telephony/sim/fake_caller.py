"""A fake Twilio caller: Twilio's side of one inbound call, over real sockets.

It posts the signed `/twilio/voice` webhook, follows the TwiML into a Media Stream
WebSocket, sends what Twilio sends (`connected`, `start`, paced 20 ms `media`, `dtmf`,
`stop`), and emulates Twilio's playout of the server's audio: a buffer that plays at
8000 bytes/s, marks echoed only when playout reaches them, and `clear` dropping unplayed
audio and echoing every pending mark at once. It records what the caller heard (a
timeline) and every message in both directions, so tests and the CLI can inspect a call.

Used by the end-to-end tests, the offline demo and `voice-agent call`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import enum
import json
import os
import secrets
import time
import xml.etree.ElementTree as ET
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeAlias

import httpx
from twilio.request_validator import RequestValidator
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from telephony import audio
from telephony.errors import MalformedFrame, TelephonyError
from telephony.legs.twilio.events import OutClear, OutMark, OutMedia, parse_outbound
from telephony.sim.speech import (
    CALLER_ESPEAK_VOICE,
    SpeechError,
    SpeechSynthesizer,
    espeak_available,
)

BYTES_PER_SECOND = audio.TELEPHONY_RATE  # mu-law: one byte per sample
FRAME_BYTES = audio.G711_FRAME_BYTES
FRAME_S = audio.FRAME_MS / 1000
DEFAULT_AUTH_TOKEN = "dev-auth-token"
DEFAULT_ACCOUNT_SID = "AC" + "0" * 32


def new_call_sid() -> str:
    """A CallSid as Twilio forms it: "CA" and 32 hex digits."""
    return "CA" + secrets.token_hex(16)


def new_stream_sid() -> str:
    """A StreamSid as Twilio forms it: "MZ" and 32 hex digits."""
    return "MZ" + secrets.token_hex(16)


def http_to_ws(url: str) -> str:
    """The WebSocket form of an HTTP(S) URL."""
    if url.startswith("https://"):
        return "wss://" + url.removeprefix("https://")
    if url.startswith("http://"):
        return "ws://" + url.removeprefix("http://")
    return url


class CallerError(TelephonyError):
    """The fake caller was used out of order (e.g. media before the stream is open)."""


# What the caller records.


@dataclass(frozen=True)
class HeardChunk:
    """Audio that played to the caller, starting at monotonic time `t`."""

    t: float
    audio: bytes
    speed: float = 1.0

    @property
    def ms(self) -> float:
        return audio.duration_ms(len(self.audio), "pcmu")

    @property
    def end_t(self) -> float:
        return self.t + len(self.audio) / (BYTES_PER_SECOND * self.speed)


@dataclass(frozen=True)
class ReceivedMessage:
    """One frame from the server, as it arrived (`event` None when it did not parse)."""

    t: float
    raw: str | bytes
    event: str | None
    data: dict[str, Any] | None


@dataclass(frozen=True)
class SentMessage:
    """One frame the caller sent (`event` None for raw frames)."""

    t: float
    raw: str | bytes
    event: str | None


@dataclass(frozen=True)
class MarkEcho:
    """A mark the caller echoed: on reaching it in playout, or flushed by a `clear`."""

    name: str
    t_received: float
    t_echoed: float
    cleared: bool


@dataclass(frozen=True)
class ClearRecord:
    """A `clear` from the server: how much unplayed audio it dropped, which marks it flushed."""

    t: float
    dropped_bytes: int
    marks_flushed: tuple[str, ...]

    @property
    def dropped_ms(self) -> float:
        return audio.duration_ms(self.dropped_bytes, "pcmu")


TwimlKind: TypeAlias = Literal[
    "stream", "reject", "hangup", "say", "dial", "conference", "redirect", "other", "http_error"
]


@dataclass(frozen=True)
class DialInstruction:
    """A `<Dial>`: whom to ring, for how long, and where Twilio reports on it."""

    destination: str  # the `<Number>` or `<Sip>` text
    action_url: str | None
    timeout_s: int
    answered_url: str | None  # the noun's statusCallback (statusCallbackEvent answered)


@dataclass(frozen=True)
class TwimlOutcome:
    """What the `/twilio/voice` webhook answered and what Twilio would do with it."""

    kind: TwimlKind
    http_status: int
    body: str
    verbs: tuple[str, ...] = ()
    says: tuple[str, ...] = ()
    stream_url: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    # `<Connect action>`: where Twilio asks what next when the stream ends, the call still up.
    action_url: str | None = None
    dial: DialInstruction | None = None
    # `<Dial><Conference>`: the room's name and the noun's attributes (as Twilio names them).
    conference: str | None = None
    conference_attrs: dict[str, str] = field(default_factory=dict)
    # `<Redirect>`: where Twilio asks for the next instructions once the verbs before it ran.
    redirect_url: str | None = None


def parse_twiml(body: str, http_status: int = 200) -> TwimlOutcome:
    """Read a TwiML answer the way Twilio acts on it: a `<Connect><Stream>` opens a media
    stream; `<Reject>`, `<Hangup>` or a lone `<Say>` end the call without one."""
    if http_status != 200:
        return TwimlOutcome("http_error", http_status, body)
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return TwimlOutcome("other", http_status, body)
    if root.tag != "Response":
        return TwimlOutcome("other", http_status, body)
    verbs = tuple(child.tag for child in root)
    says = tuple((el.text or "").strip() for el in root.iter("Say"))
    for connect_el in root.iter("Connect"):
        stream = connect_el.find("Stream")
        if stream is not None and stream.get("url"):
            params = {
                p.get("name", ""): p.get("value", "")
                for p in stream.iter("Parameter")
                if p.get("name")
            }
            return TwimlOutcome(
                "stream",
                http_status,
                body,
                verbs,
                says,
                stream.get("url"),
                params,
                connect_el.get("action") or None,
            )
    for dial_el in root.iter("Dial"):
        room = dial_el.find("Conference")
        if room is not None:
            return TwimlOutcome(
                "conference", http_status, body, verbs, says,
                conference=(room.text or "").strip(), conference_attrs=dict(room.attrib),
            )  # fmt: skip
        noun = dial_el.find("Number")
        if noun is None:
            noun = dial_el.find("Sip")
        destination = (noun.text if noun is not None else dial_el.text) or ""
        dial = DialInstruction(
            destination.strip(),
            dial_el.get("action") or None,
            int(dial_el.get("timeout") or 30),
            noun.get("statusCallback") if noun is not None else None,
        )
        return TwimlOutcome("dial", http_status, body, verbs, says, dial=dial)
    redirect = root.find("Redirect")
    if redirect is not None and (redirect.text or "").strip():
        url = (redirect.text or "").strip()
        return TwimlOutcome("redirect", http_status, body, verbs, says, redirect_url=url)
    kind: TwimlKind = "other"
    if "Reject" in verbs:
        kind = "reject"
    elif "Hangup" in verbs:
        kind = "hangup"
    elif "Say" in verbs:
        kind = "say"
    return TwimlOutcome(kind, http_status, body, verbs, says)


# Twilio's playout, as a clock-driven model (no I/O, so it is testable by itself).


class PlayoutBuffer:
    """Twilio's playout of a stream's outbound audio.

    Audio plays at `rate` bytes per second of the given clock from the moment it is
    queued (or from when the audio before it finishes). A mark is released once all audio
    queued before it has played; a mark queued while nothing is playing is released at
    once. `clear` drops unplayed audio and releases every pending mark.
    """

    def __init__(self, rate: float = BYTES_PER_SECOND) -> None:
        self.rate = rate
        self.heard: list[HeardChunk] = []
        self.played_bytes = 0
        self._speed = rate / BYTES_PER_SECOND
        self._buffer = bytearray()
        self._marks: deque[tuple[int, str]] = deque()
        self._clock_start: float | None = None
        self._clock_base = 0

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)

    @property
    def pending_marks(self) -> list[str]:
        return [name for _, name in self._marks]

    @property
    def playing(self) -> bool:
        return self._clock_start is not None

    def advance(self, now: float) -> list[str]:
        """Play everything due by `now`; return the marks that playout reached."""
        if self._clock_start is not None:
            target = self._clock_base + int((now - self._clock_start) * self.rate)
            n = min(target - self.played_bytes, len(self._buffer))
            if n > 0:
                started = self._clock_start + (self.played_bytes - self._clock_base) / self.rate
                self.heard.append(HeardChunk(started, bytes(self._buffer[:n]), self._speed))
                del self._buffer[:n]
                self.played_bytes += n
            if not self._buffer:
                self._clock_start = None
        released = []
        while self._marks and self._marks[0][0] <= self.played_bytes:
            released.append(self._marks.popleft()[1])
        return released

    def push_audio(self, chunk: bytes, now: float) -> list[str]:
        """Queue audio behind what is already queued."""
        released = self.advance(now)
        if chunk:
            if self._clock_start is None:
                self._clock_start = now
                self._clock_base = self.played_bytes
            self._buffer += chunk
        return released

    def push_mark(self, name: str, now: float) -> list[str]:
        """Queue a mark behind the queued audio."""
        released = self.advance(now)
        self._marks.append((self.played_bytes + len(self._buffer), name))
        return released + self.advance(now)

    def clear(self, now: float) -> tuple[int, list[str], list[str]]:
        """Drop unplayed audio: (dropped bytes, marks reached first, marks flushed)."""
        released = self.advance(now)
        dropped = len(self._buffer)
        self._buffer.clear()
        self._clock_start = None
        flushed = [name for _, name in self._marks]
        self._marks.clear()
        return dropped, released, flushed

    def next_due(self) -> float | None:
        """Clock time of the next mark or the end of the buffer; None when idle."""
        if self._clock_start is None:
            return None
        position = self._marks[0][0] if self._marks else self.played_bytes + len(self._buffer)
        return self._clock_start + (position - self._clock_base) / self.rate


# The caller.


class CallerState(enum.Enum):
    IDLE = "idle"
    DIALING = "dialing"
    STREAMING = "streaming"
    IN_CONFERENCE = "in_conference"  # `<Dial><Conference>`: talking to whoever is in the room
    ENDED = "ended"


_TRANSITIONS: dict[CallerState, set[CallerState]] = {
    CallerState.IDLE: {CallerState.DIALING, CallerState.ENDED},
    CallerState.DIALING: {CallerState.STREAMING, CallerState.ENDED},
    # A stream that ended with the call up: Twilio follows `<Connect action>` to the next.
    CallerState.STREAMING: {CallerState.DIALING, CallerState.IN_CONFERENCE, CallerState.ENDED},
    CallerState.IN_CONFERENCE: {CallerState.ENDED},
    CallerState.ENDED: set(),
}


class FakeTwilioCaller:
    """Twilio's side of one inbound call to our server, over real HTTP and WebSocket.

    `server_url` is where to connect; `public_url` is the URL the server is known by
    (what Twilio signs), since a proxy usually sits between. `speed` scales the caller's
    clock (media pacing and playout) for tests; 1.0 is real time.
    """

    def __init__(
        self,
        server_url: str = "http://127.0.0.1:8000",
        *,
        public_url: str | None = None,
        auth_token: str = DEFAULT_AUTH_TOKEN,
        account_sid: str = DEFAULT_ACCOUNT_SID,
        from_number: str = "+15551230000",
        to_number: str = "+15550000000",
        voice_path: str = "/twilio/voice",
        stream_connect_url: str | None = None,
        speed: float = 1.0,
        idle_audio: bool = True,
        timeout: float = 10.0,
        call_sid: str | None = None,
        voice: SpeechSynthesizer | None = None,
        failover_urls: tuple[str, ...] = (),
        direction: str = "inbound",
    ) -> None:
        """`voice` speaks what `say` is given (None: `say` sends speech-like noise).
        `failover_urls`: other servers behind the same public URL, tried in order when one
        refuses the connection (what a proxy in front of replicas does). `direction`:
        `outbound-api` plays the person (or machine) an outbound call reached, `voice_path`
        then the call's answer URL (path and query)."""
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.server_url = server_url.rstrip("/")
        self.public_url = (public_url or server_url).rstrip("/")
        self.auth_token = auth_token
        self.account_sid = account_sid
        self.from_number = from_number
        self.to_number = to_number
        self.voice_path = voice_path
        self.stream_connect_url = stream_connect_url
        self.speed = speed
        # Twilio streams the line continuously; between scripted audio it sends silence.
        self.idle_audio = idle_audio
        self.timeout = timeout
        self.call_sid = call_sid or new_call_sid()
        self.stream_sid = new_stream_sid()
        self.voice = voice
        self.failover_urls = tuple(u.rstrip("/") for u in failover_urls)
        self.direction = direction

        self.state = CallerState.IDLE
        self.twiml_outcome: TwimlOutcome | None = None
        # What each `<Connect action>` request answered, and every stream's StreamSid.
        self.action_outcomes: list[TwimlOutcome] = []
        self.stream_sids: list[str] = []
        self._action_url: str | None = None
        self.handshake_status: int | None = None
        self.close_code: int | None = None
        self.close_reason: str | None = None
        self.closed_reason: str | None = None
        self.closed_by: Literal["caller", "server", "twilio-api"] | None = None
        self.stream_started_at: float | None = None
        self.ended_at: float | None = None
        self.received: list[ReceivedMessage] = []
        self.sent: list[SentMessage] = []
        self.marks_echoed: list[MarkEcho] = []
        self.clears: list[ClearRecord] = []
        self.protocol_errors: list[str] = []
        self.twiml_updates: list[str] = []
        # Transfers Twilio was told to dial (`<Dial>` through the REST API): (to, result).
        self.dials: list[tuple[str, str]] = []
        self.conference: str | None = None  # the room `<Dial><Conference>` put the call in
        self.media_frames_sent = 0
        self.media_received_bytes = 0

        self._playout = PlayoutBuffer(BYTES_PER_SECOND * speed)
        self._mark_received_at: dict[str, deque[float]] = {}
        self._ws: ClientConnection | None = None
        self._send_lock = asyncio.Lock()
        self._stop_sent = False
        self._sequence = 0
        self._changed = asyncio.Event()
        self._playout_wake = asyncio.Event()
        self._outbox: deque[tuple[bytes, asyncio.Future[None] | None]] = deque()
        self._outbox_ready = asyncio.Event()
        self._closed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    # Lifecycle.

    async def __aenter__(self) -> FakeTwilioCaller:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _set_state(self, new: CallerState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise CallerError(f"caller cannot go from {self.state.value} to {new.value}")
        self.state = new
        self._notify()

    def _notify(self) -> None:
        self._changed.set()

    def _now(self) -> float:
        return time.monotonic()

    def _spawn(self, coro: Any, name: str) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro, name=f"fake-caller-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def dial(
        self, *, open_stream: bool = True, parameter_overrides: dict[str, str] | None = None
    ) -> TwimlOutcome:
        """POST the signed voice webhook; on `<Connect><Stream>`, open the media stream."""
        self._set_state(CallerState.DIALING)
        params = self.voice_webhook_params()
        response = await self._post_signed(self.public_url + self.voice_path, params)
        self.twiml_outcome = parse_twiml(response.text, response.status_code)
        outcome = self.twiml_outcome
        self._action_url = outcome.action_url
        if outcome.kind != "stream" or not open_stream:
            if outcome.kind != "stream":
                self._end(f"no stream: TwiML {outcome.kind}", None)
            return outcome
        parameters = {**outcome.parameters, **(parameter_overrides or {})}
        await self.open_stream(outcome.stream_url, parameters)
        return outcome

    def _servers(self) -> list[str]:
        return [self.server_url, *self.failover_urls]

    async def _post_signed(self, public_url: str, params: dict[str, str]) -> httpx.Response:
        """POST a webhook as Twilio does: signed over `public_url`, sent to the server
        behind it (the next one when a server refuses the connection)."""
        signature = RequestValidator(self.auth_token).compute_signature(public_url, params)
        path = public_url.removeprefix(self.public_url)
        headers = {
            "X-Twilio-Signature": signature,
            "User-Agent": "TwilioProxy/1.1",
            "Content-Type": "application/x-www-form-urlencoded; charset=UTF-8",
        }
        servers = self._servers()
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            for i, server in enumerate(servers):
                try:
                    return await client.post(server + path, data=params, headers=headers)
                except httpx.ConnectError:
                    if i == len(servers) - 1:
                        raise
        raise AssertionError("unreachable")

    async def follow_action(self, why: str) -> None:
        """The stream ended with the call up: ask `<Connect action>` what next, as Twilio
        does, and follow it (a new `<Stream>`: open it; anything else: the call ends). What
        the caller heard is kept across streams; audio not yet played is dropped."""
        action = self._action_url
        assert action is not None
        self._action_url = None
        self._playout.clear(self._now())  # unplayed audio and its marks died with the stream
        self._set_state(CallerState.DIALING)
        params = {**self.voice_webhook_params(), "CallStatus": "in-progress"}
        try:
            response = await self._post_signed(action, params)
        except httpx.HTTPError as exc:
            self._end(f"{why}; the action URL failed: {exc!r}", "server")
            return
        outcome = parse_twiml(response.text, response.status_code)
        self.action_outcomes.append(outcome)
        if outcome.kind != "stream":
            self._end(f"{why}; the action answered {outcome.kind}", "server")
            return
        self._action_url = outcome.action_url
        self.stream_sid = new_stream_sid()
        self._stop_sent = False
        self._ws = None
        await self.open_stream(outcome.stream_url, outcome.parameters)

    def voice_webhook_params(self) -> dict[str, str]:
        """The form fields Twilio posts to the voice webhook of an inbound call."""
        return {
            "CallSid": self.call_sid,
            "AccountSid": self.account_sid,
            "From": self.from_number,
            "To": self.to_number,
            "Caller": self.from_number,
            "Called": self.to_number,
            "CallStatus": "ringing" if self.direction == "inbound" else "in-progress",
            "Direction": self.direction,
            "ApiVersion": "2010-04-01",
        }

    def connect_url_for(self, stream_url: str) -> str:
        """Where to actually connect for a TwiML stream URL (which names the public host)."""
        if self.stream_connect_url:
            return self.stream_connect_url
        public_ws = http_to_ws(self.public_url)
        if stream_url.startswith(public_ws):
            return http_to_ws(self.server_url) + stream_url.removeprefix(public_ws)
        return stream_url

    async def open_stream(
        self, stream_url: str | None = None, parameters: dict[str, str] | None = None
    ) -> bool:
        """Open the media WebSocket and send `connected` and `start`; False if the handshake
        was refused or the server closed the socket before `start` went out."""
        if self.state is CallerState.IDLE:
            self._set_state(CallerState.DIALING)
        if stream_url is None:
            stream_url = http_to_ws(self.public_url) + "/twilio/media"
        # Twilio signs the WebSocket handshake too, over the stream URL as given in TwiML.
        signature = RequestValidator(self.auth_token).compute_signature(stream_url, {})
        try:
            self._ws = await self._connect_stream(stream_url, signature)
        except InvalidStatus as exc:
            self.handshake_status = exc.response.status_code
            self._end(f"stream handshake refused: HTTP {self.handshake_status}", None)
            return False
        except (InvalidHandshake, OSError, TimeoutError) as exc:
            self._end(f"stream connection failed: {exc!r}", None)
            return False
        if self.stream_started_at is None:
            self.stream_started_at = self._now()
        self.stream_sids.append(self.stream_sid)
        self._set_state(CallerState.STREAMING)
        self._spawn(self._receive_loop(), "receive")
        try:
            await self._send_opening(parameters)
        except (ConnectionClosed, CallerError):
            # Closed on us straight away; the receive loop records how.
            await self.wait_closed(self.timeout)
            return False
        self._spawn(self._media_loop(), "media")
        self._spawn(self._playout_loop(), "playout")
        return True

    async def _connect_stream(self, stream_url: str, signature: str) -> ClientConnection:
        urls = [self.connect_url_for(stream_url)]
        if not self.stream_connect_url and urls[0] != stream_url:
            public_ws = http_to_ws(self.public_url)
            urls += [http_to_ws(u) + stream_url.removeprefix(public_ws) for u in self.failover_urls]
        for i, url in enumerate(urls):
            try:
                return await connect(
                    url,
                    additional_headers={"X-Twilio-Signature": signature},
                    user_agent_header="Twilio.TmeWs/1.0",
                    open_timeout=self.timeout,
                    close_timeout=self.timeout,
                )
            except OSError:
                if i == len(urls) - 1:
                    raise
        raise AssertionError("unreachable")

    async def _send_opening(self, parameters: dict[str, str] | None) -> None:
        await self._send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self._send_json(
            {
                "event": "start",
                "sequenceNumber": self._next_sequence(),
                "start": {
                    "accountSid": self.account_sid,
                    "streamSid": self.stream_sid,
                    "callSid": self.call_sid,
                    "tracks": ["inbound"],
                    "customParameters": dict(parameters or {}),
                    "mediaFormat": {
                        "encoding": "audio/x-mulaw",
                        "sampleRate": audio.TELEPHONY_RATE,
                        "channels": 1,
                    },
                },
                "streamSid": self.stream_sid,
            }
        )

    async def hangup(self) -> None:
        """The caller hangs up: send `stop` and close the stream (idempotent)."""
        await self._finish("caller", "caller hung up")

    def drop_stream(self) -> None:
        """The stream's socket breaks (a network fault), the call stays up: no `stop`; Twilio
        then asks `<Connect action>` what next (`follow_action`, from the receive loop)."""
        self._require_ws().transport.abort()

    async def transfer_by_twilio(
        self, dial: DialInstruction, result: str, ring_s: float, talk_s: float
    ) -> None:
        """The call got `<Dial>` through the REST API: Twilio stops the stream (`stop`, no
        `<Connect action>`: the call was redirected), rings `dial.destination` for `ring_s`,
        then: `answered` tells the noun's statusCallback, talks `talk_s` and asks the Dial's
        action (DialCallStatus completed); anything else (busy, no-answer, failed) asks the
        action with that status at once. The action's answer is followed: a new `<Stream>`
        brings the caller back to the service; anything else ends the call."""
        if self.state is not CallerState.STREAMING:
            return
        await self._send_stop()
        self._stop_sent = True
        self._action_url = None
        ws, self._ws = self._ws, None
        self._playout.clear(self._now())
        self._set_state(CallerState.DIALING)
        if ws is not None:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                await asyncio.wait_for(ws.close(1000, "call redirected"), self.timeout)
        await self._stop_tasks()
        self.dials.append((dial.destination, result))
        await asyncio.sleep(ring_s)
        child = "CA" + secrets.token_hex(16)
        params = {**self.voice_webhook_params(), "CallStatus": "in-progress"}
        try:
            if result == "answered":
                if dial.answered_url:
                    await self._post_signed(
                        dial.answered_url,
                        {**params, "CallSid": child, "ParentCallSid": self.call_sid,
                         "Direction": "outbound-dial"},
                    )  # fmt: skip
                await asyncio.sleep(talk_s)
                status = {"DialCallStatus": "completed", "DialCallSid": child,
                          "DialCallDuration": str(max(1, round(talk_s)))}  # fmt: skip
            else:
                status = {"DialCallStatus": result}
            if dial.action_url is None:
                self._end(f"transferred: {result}", "twilio-api")
                return
            response = await self._post_signed(dial.action_url, {**params, **status})
        except httpx.HTTPError as exc:
            self._end(f"transfer: the callback failed: {exc!r}", "server")
            return
        outcome = parse_twiml(response.text, response.status_code)
        self.action_outcomes.append(outcome)
        if outcome.kind != "stream":
            self._end(f"transfer {result}; the action answered {outcome.kind}", "twilio-api")
            return
        self._action_url = outcome.action_url
        self.stream_sid = new_stream_sid()
        self._stop_sent = False
        await self.open_stream(outcome.stream_url, outcome.parameters)

    async def join_conference_by_twilio(self, name: str) -> None:
        """The call got `<Dial><Conference>` through the REST API: Twilio stops the stream
        (`stop`, no `<Connect action>`: the call was redirected) and puts the caller in the
        room `name` (`conference`), where they stay until the conference ends."""
        if self.state is not CallerState.STREAMING:
            return
        await self._send_stop()
        self._stop_sent = True
        self._action_url = None
        ws, self._ws = self._ws, None
        self._playout.clear(self._now())
        self.conference = name
        self._set_state(CallerState.IN_CONFERENCE)
        if ws is not None:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                await asyncio.wait_for(ws.close(1000, "call redirected"), self.timeout)
        await self._stop_tasks()

    def conference_ended(self, reason: str = "the conference ended") -> None:
        """The room's conference ended (a participant with endConferenceOnExit left)."""
        if self.state is CallerState.IN_CONFERENCE:
            self._end(reason, "twilio-api")

    async def end_by_twilio(self, reason: str = "call completed through the REST API") -> None:
        """Twilio ends the call (REST `Status=completed` or new TwiML): `stop`, then close."""
        await self._finish("twilio-api", reason)

    async def aclose(self) -> None:
        """Hang up if still on the call and stop every task the caller owns."""
        if self.state is CallerState.STREAMING:
            await self.hangup()
        elif self.state is not CallerState.ENDED:
            self._end("closed before the stream opened", None)
        await self._stop_tasks()

    async def _send_stop(self) -> None:
        """What was played so far is echoed, then Twilio's `stop` for this stream."""
        now = self._now()
        await self._echo(self._playout.advance(now), now)
        with contextlib.suppress(ConnectionClosed, CallerError):
            await self._send_json(
                {
                    "event": "stop",
                    "sequenceNumber": self._next_sequence(),
                    "streamSid": self.stream_sid,
                    "stop": {"accountSid": self.account_sid, "callSid": self.call_sid},
                }
            )

    async def _finish(self, by: Literal["caller", "twilio-api"], reason: str) -> None:
        if self.state is not CallerState.STREAMING:
            return
        await self._send_stop()
        if self.state is CallerState.STREAMING:
            self._end(reason, by)
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                await asyncio.wait_for(ws.close(1000, "call ended"), self.timeout)
            if self.close_code is None:
                self.close_code = ws.close_code
                self.close_reason = ws.close_reason
        await self._stop_tasks()

    def _end(self, reason: str, by: Literal["caller", "server", "twilio-api"] | None) -> None:
        if self.state is CallerState.ENDED:
            return
        self.closed_reason = reason
        self.closed_by = by
        self.ended_at = self._now()
        self._set_state(CallerState.ENDED)
        self._closed.set()
        for _, done in self._outbox:
            if done is not None and not done.done():
                done.set_exception(CallerError(f"call ended: {reason}"))
        self._outbox.clear()
        self._outbox_ready.set()
        self._playout_wake.set()

    async def _stop_tasks(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # Script.

    async def play_mulaw(self, mulaw: bytes) -> float:
        """Stream mu-law audio as paced 20 ms frames; return once the last was sent (ms)."""
        if self.state is not CallerState.STREAMING:
            raise CallerError(f"cannot send audio while {self.state.value}")
        frames = audio.split_frames(mulaw, "pcmu", pad=True)
        if not frames:
            return 0.0
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for frame in frames[:-1]:
            self._outbox.append((frame, None))
        self._outbox.append((frames[-1], done))
        self._outbox_ready.set()
        await done
        return len(frames) * audio.FRAME_MS

    async def play_wav(self, wav: bytes | str | Path) -> float:
        """Stream a WAV (bytes or a path; any rate, 16-bit) as the caller's voice."""
        data = wav if isinstance(wav, bytes) else await asyncio.to_thread(Path(wav).read_bytes)
        return await self.play_mulaw(audio.wav_to_mulaw(data))

    async def play_speech(self, ms: float) -> float:
        """Stream `ms` of synthesized speech-like audio."""
        return await self.play_mulaw(audio.speech_like_mulaw(ms))

    async def say(self, text: str, *, ms: float | None = None) -> float:
        """The caller says `text`: spoken by `voice`, or without one `ms` of speech-like noise
        (default: as long as the text takes to say, ~65 ms a character)."""
        if self.voice is not None:
            return await self.play_mulaw(await self.voice.speak(text, "pcmu"))
        return await self.play_speech(ms if ms is not None else max(600, 65 * len(text)))

    async def play_silence(self, ms: float) -> float:
        """Stream `ms` of silence (the caller listening)."""
        return await self.play_mulaw(audio.silence(ms, "pcmu"))

    async def send_dtmf(self, digit: str) -> None:
        """The caller presses a key."""
        await self._send_json(
            {
                "event": "dtmf",
                "streamSid": self.stream_sid,
                "sequenceNumber": self._next_sequence(),
                "dtmf": {"track": "inbound_track", "digit": digit},
            }
        )

    async def send_raw(self, frame: str | bytes) -> None:
        """Send any frame as is (for malformed-frame tests)."""
        ws = self._require_ws()
        async with self._send_lock:
            self.sent.append(SentMessage(self._now(), frame, None))
            await ws.send(frame)

    # A timeout argument keeps test scripts short: `await caller.wait_for(pred, 5)`.
    async def wait_for(
        self,
        predicate: Callable[[FakeTwilioCaller], bool],
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> None:
        """Wait until `predicate(caller)` holds; TimeoutError after `timeout` seconds."""
        deadline = self._now() + timeout
        while True:
            self._changed.clear()
            if predicate(self):
                return
            remaining = deadline - self._now()
            if remaining <= 0:
                raise TimeoutError(f"caller condition not met within {timeout} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def wait_closed(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait until the call has ended, from any side."""
        await asyncio.wait_for(self._closed.wait(), timeout)

    async def wait_until_heard_all(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait until playout has nothing left to play."""
        await self.wait_for(lambda c: c.buffered_ms == 0, timeout)

    # Recorded data.

    @property
    def closed(self) -> bool:
        return self.state is CallerState.ENDED

    @property
    def heard(self) -> list[HeardChunk]:
        """The timeline of audio that played to the caller."""
        return self._playout.heard

    @property
    def heard_ms(self) -> float:
        return audio.duration_ms(self._playout.played_bytes, "pcmu")

    @property
    def buffered_ms(self) -> float:
        """Audio queued in playout, not yet heard."""
        return audio.duration_ms(self._playout.buffered_bytes, "pcmu")

    @property
    def media_received_ms(self) -> float:
        """All outbound audio the server sent, heard or not."""
        return audio.duration_ms(self.media_received_bytes, "pcmu")

    def heard_audio(self, after: float | None = None) -> bytes:
        """Everything the caller heard (that played after monotonic time `after`), back to
        back (mu-law)."""
        if after is None:
            return b"".join(chunk.audio for chunk in self.heard)
        rate = BYTES_PER_SECOND * self.speed
        return b"".join(
            chunk.audio[max(0, round((after - chunk.t) * rate)) :]
            for chunk in self.heard
            if chunk.end_t > after
        )

    def heard_ms_after(self, t: float) -> float:
        """Milliseconds of audio that played after monotonic time `t`."""
        rate = BYTES_PER_SECOND * self.speed
        total = 0.0
        for chunk in self.heard:
            if chunk.end_t <= t:
                continue
            skip = max(0.0, (t - chunk.t) * rate)
            total += max(0.0, len(chunk.audio) - skip)
        return audio.duration_ms(round(total), "pcmu")

    def received_events(self, after: float | None = None) -> list[str | None]:
        """The event names of frames from the server, in order (optionally after `t`)."""
        return [m.event for m in self.received if after is None or m.t > after]

    def messages(self, event: str) -> list[ReceivedMessage]:
        """Frames from the server with this event name."""
        return [m for m in self.received if m.event == event]

    def heard_timeline_mulaw(self) -> bytes:
        """What the caller heard as one time-aligned mu-law track from stream start:
        silence where nothing played."""
        if self.stream_started_at is None:
            return b""
        start = self.stream_started_at
        rate = BYTES_PER_SECOND * self.speed
        end = max([c.end_t for c in self.heard] + [self.ended_at or self._now()])
        track = bytearray([audio.MULAW_SILENCE]) * round((end - start) * rate)
        for chunk in self.heard:
            offset = round((chunk.t - start) * rate)
            track[offset : offset + len(chunk.audio)] = chunk.audio
        return bytes(track)

    def heard_wav(self) -> bytes:
        """`heard_timeline_mulaw` as a 16-bit 8 kHz WAV."""
        return audio.mulaw_to_wav(self.heard_timeline_mulaw())

    async def write_heard_wav(self, path: str | Path) -> None:
        """Write the time-aligned heard audio to a WAV file."""
        data = self.heard_wav()
        await asyncio.to_thread(Path(path).write_bytes, data)

    def summary(self) -> dict[str, Any]:
        """A short account of the call for people."""
        outcome = self.twiml_outcome
        return {
            "call_sid": self.call_sid,
            "twiml": outcome.kind if outcome else None,
            "media_frames_sent": self.media_frames_sent,
            "heard_ms": round(self.heard_ms),
            "media_received_ms": round(self.media_received_ms),
            "marks_echoed": len(self.marks_echoed),
            "marks_flushed_by_clear": sum(1 for m in self.marks_echoed if m.cleared),
            "clears_received": len(self.clears),
            "dtmf_sent": sum(1 for m in self.sent if m.event == "dtmf"),
            "closed_by": self.closed_by,
            "closed_reason": self.closed_reason,
            "close_code": self.close_code,
            "protocol_errors": len(self.protocol_errors),
        }

    # Internals.

    def _require_ws(self) -> ClientConnection:
        if self._ws is None or self.state is not CallerState.STREAMING:
            raise CallerError(f"no open stream (caller is {self.state.value})")
        return self._ws

    def _next_sequence(self) -> str:
        self._sequence += 1
        return str(self._sequence)

    async def _send_json(self, message: dict[str, Any]) -> None:
        ws = self._require_ws()
        text = json.dumps(message, separators=(",", ":"))
        async with self._send_lock:
            # Twilio sends nothing after `stop`; a frame queued behind it is dropped.
            if self._stop_sent:
                raise CallerError("stream already stopped")
            # Sequence numbers were taken in call order; sends keep that order (FIFO lock).
            self.sent.append(SentMessage(self._now(), text, message["event"]))
            await ws.send(text)
            if message["event"] == "stop":
                self._stop_sent = True

    async def _media_loop(self) -> None:
        frame_s = FRAME_S / self.speed
        start = self._now()
        n = 0
        silence = audio.silence(audio.FRAME_MS, "pcmu")
        try:
            while self.state is CallerState.STREAMING:
                if not self._outbox and not self.idle_audio:
                    self._outbox_ready.clear()
                    await self._outbox_ready.wait()
                    # Resume on the current slot of the stream clock: time has passed.
                    n = max(n, int((self._now() - start) / frame_s))
                    continue
                # Drift-corrected pacing: frame n is due at start + n * 20 ms.
                delay = start + n * frame_s - self._now()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif not self._outbox:
                    # Behind the clock (after a stall) frames go out back to back with no
                    # yield: let a script woken by its last frame queue its next words first,
                    # or the catch-up is a pause it never made in the middle of its speech
                    # (500 ms of it ends a VAD turn).
                    await asyncio.sleep(0)
                if self.state is not CallerState.STREAMING:
                    break
                frame, done = self._outbox.popleft() if self._outbox else (silence, None)
                chunk = self.media_frames_sent + 1
                await self._send_json(
                    {
                        "event": "media",
                        "sequenceNumber": self._next_sequence(),
                        "media": {
                            "track": "inbound",
                            "chunk": str(chunk),
                            "timestamp": str(n * audio.FRAME_MS),
                            "payload": base64.b64encode(frame).decode("ascii"),
                        },
                        "streamSid": self.stream_sid,
                    }
                )
                self.media_frames_sent = chunk
                if done is not None and not done.done():
                    done.set_result(None)
                n += 1
        except (ConnectionClosed, CallerError):
            pass

    async def _receive_loop(self) -> None:
        ws = self._ws
        assert ws is not None
        try:
            async for raw in ws:
                await self._on_frame(raw)
        except ConnectionClosed:
            pass
        if self.state is CallerState.STREAMING and ws is self._ws:
            self._advance_playout()
            self.close_code = ws.close_code
            self.close_reason = ws.close_reason
            why = f"server closed the stream: {ws.close_code} {ws.close_reason}"
            if self._action_url is not None and not self._stop_sent:
                # The call is still up (nobody hung up): Twilio asks the action URL.
                await self._stop_tasks()
                await self.follow_action(why)
                return
            self._end(why, "server")
            for task in list(self._tasks):
                if task is not asyncio.current_task():
                    task.cancel()

    async def _on_frame(self, raw: str | bytes) -> None:
        now = self._now()
        try:
            message = parse_outbound(raw)
        except MalformedFrame as exc:
            self.received.append(ReceivedMessage(now, raw, None, None))
            self.protocol_errors.append(str(exc))
            self._notify()
            return
        data = json.loads(raw)
        self.received.append(ReceivedMessage(now, raw, message.event, data))
        if message.stream_sid != self.stream_sid:
            # Twilio ignores messages for another stream.
            self.protocol_errors.append(f"{message.event} for unknown stream {message.stream_sid}")
            self._notify()
            return
        if isinstance(message, OutMedia):
            try:
                chunk = base64.b64decode(message.media.payload, validate=True)
            except ValueError:
                self.protocol_errors.append("media payload is not base64")
                self._notify()
                return
            self.media_received_bytes += len(chunk)
            await self._echo(self._playout.push_audio(chunk, now), now)
        elif isinstance(message, OutMark):
            self._mark_received_at.setdefault(message.mark.name, deque()).append(now)
            await self._echo(self._playout.push_mark(message.mark.name, now), now)
        elif isinstance(message, OutClear):
            dropped, reached, flushed = self._playout.clear(now)
            await self._echo(reached, now)
            self.clears.append(ClearRecord(now, dropped, tuple(flushed)))
            await self._echo(flushed, now, cleared=True)
        self._playout_wake.set()
        self._notify()

    def _advance_playout(self) -> list[str]:
        released = self._playout.advance(self._now())
        self._notify()
        return released

    async def _echo(self, names: list[str], now: float, *, cleared: bool = False) -> None:
        for name in names:
            queue = self._mark_received_at.get(name)
            t_received = queue.popleft() if queue else now
            self.marks_echoed.append(MarkEcho(name, t_received, self._now(), cleared))
            with contextlib.suppress(ConnectionClosed, CallerError):
                await self._send_json(
                    {
                        "event": "mark",
                        "sequenceNumber": self._next_sequence(),
                        "streamSid": self.stream_sid,
                        "mark": {"name": name},
                    }
                )
        if names:
            self._notify()

    async def _playout_loop(self) -> None:
        while self.state is CallerState.STREAMING:
            now = self._now()
            await self._echo(self._playout.advance(now), now)
            self._notify()
            due = self._playout.next_due()
            # Wake at the next mark or buffer end, and at least every frame while playing
            # so `heard_ms` stays current for waiters.
            wait = None if due is None else max(0.0, min(due - now, FRAME_S / self.speed))
            self._playout_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._playout_wake.wait(), wait)


# Command line: `voice-agent call`.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `voice-agent call`."""
    parser.add_argument("--server", default="http://127.0.0.1:8000", help="base URL to connect to")
    parser.add_argument(
        "--public-url",
        default=os.environ.get("PUBLIC_BASE_URL"),
        help="base URL the server is known by, which Twilio signs "
        "(default: $PUBLIC_BASE_URL, else --server)",
    )
    parser.add_argument(
        "--auth-token",
        default=os.environ.get("TWILIO_AUTH_TOKEN", DEFAULT_AUTH_TOKEN),
        help="Twilio auth token used to sign the webhook (default: $TWILIO_AUTH_TOKEN)",
    )
    parser.add_argument(
        "--account-sid",
        default=os.environ.get("TWILIO_ACCOUNT_SID", DEFAULT_ACCOUNT_SID),
        help="AccountSid the webhook carries (default: $TWILIO_ACCOUNT_SID, else a dev one)",
    )
    says = parser.add_mutually_exclusive_group()
    says.add_argument("--wav", default=None, help="what the caller says (default: built in)")
    says.add_argument(
        "--say",
        default=None,
        metavar="TEXT",
        help="the caller says TEXT (needs espeak-ng; default: --wav or the built-in lines)",
    )
    parser.add_argument("--out", default="heard.wav", help="where to write what was heard")
    parser.add_argument(
        "--from", dest="from_number", default="+15551230000", help="the caller's number"
    )
    parser.add_argument("--to", dest="to_number", default="+15550000000", help="the number called")
    parser.add_argument(
        "--tail-ms", type=int, default=8000, help="how long to stay on after speaking"
    )
    parser.add_argument(
        "--greeting-timeout-ms",
        type=int,
        default=5000,
        help="before speaking, wait this long at most for a greeting to finish playing",
    )
    parser.add_argument(
        "--lead-ms", type=int, default=300, help="silence before speaking, after the greeting"
    )


def spoken_caller_audio(text: str) -> bytes:
    """`text` in the caller's eSpeak NG voice, as 8 kHz mu-law. Raises CallerError."""
    if not text.strip():
        raise CallerError("--say needs some words")
    if not espeak_available():
        raise CallerError("--say needs espeak-ng (apt-get install espeak-ng), or use --wav")
    voice = SpeechSynthesizer("espeak", voice=CALLER_ESPEAK_VOICE)
    try:
        return asyncio.run(voice.speak(text, "pcmu"))
    except SpeechError as exc:
        raise CallerError(str(exc)) from exc


def load_caller_audio(path: str | Path) -> bytes:
    """The caller's voice from a WAV file, as 8 kHz mu-law; checked before any call is
    placed. Raises CallerError with a one-line reason."""
    wav = Path(path)
    if not wav.is_file():
        raise CallerError(f"no such file: {wav}" if not wav.exists() else f"not a file: {wav}")
    try:
        data = wav.read_bytes()
    except OSError as exc:
        raise CallerError(f"cannot read {wav}: {exc.strerror or exc}") from exc
    try:
        mulaw = audio.wav_to_mulaw(data)
    except audio.AudioFormatError as exc:
        raise CallerError(f"{wav}: {exc}") from exc
    if not mulaw:
        raise CallerError(f"{wav}: the WAV file has no audio")
    return mulaw


async def run_call(args: argparse.Namespace, speech: bytes | None = None) -> FakeTwilioCaller:
    """Place one call as the CLI does; return the caller for its records. `speech` is what
    the caller says (mu-law; default: synthesized speech-like audio)."""
    caller = FakeTwilioCaller(
        args.server,
        public_url=args.public_url,
        auth_token=args.auth_token,
        account_sid=args.account_sid,
        from_number=args.from_number,
        to_number=args.to_number,
    )
    async with caller:
        outcome = await caller.dial()
        if outcome.kind == "stream" and not caller.closed:
            try:
                with contextlib.suppress(TimeoutError):
                    await caller.wait_for(
                        lambda c: c.heard_ms > 0 and c.buffered_ms == 0,
                        args.greeting_timeout_ms / 1000,
                    )
                await caller.play_silence(args.lead_ms)
                await caller.play_mulaw(speech or audio.speech_like_mulaw(2500))
                with contextlib.suppress(TimeoutError):
                    await caller.wait_closed(args.tail_ms / 1000)
            except CallerError:
                pass  # the server ended the call while we spoke; the records say so
            await caller.hangup()
            await caller.write_heard_wav(args.out)
    return caller


def _refused(caller: FakeTwilioCaller, args: argparse.Namespace) -> str:
    """Why the webhook gave no media stream, in one line with the likely fix."""
    outcome = caller.twiml_outcome
    if outcome is None:
        return "no answer from the voice webhook"
    voice_url = caller.public_url + caller.voice_path
    if outcome.http_status == 403:
        return (
            f"the voice webhook answered 403: the signature did not verify: the auth token "
            f"differs from the server's (TWILIO_AUTH_TOKEN or --auth-token), or PUBLIC_BASE_URL "
            f"does not match the URL called ({voice_url}; set --public-url or PUBLIC_BASE_URL)"
        )
    if outcome.http_status == 404:
        return f"{args.server} has no voice webhook ({caller.voice_path} answered 404)"
    if outcome.http_status != 200:
        return f"the voice webhook answered HTTP {outcome.http_status}"
    says = " / ".join(outcome.says) if outcome.says else ""
    return f"no media stream: TwiML {outcome.kind}{': ' + says if says else ''}"


def main(args: argparse.Namespace) -> int:
    """`voice-agent call`: one call against a running server; prints a summary.

    Problems are one line on stderr: 2 for bad input (checked before calling), 1 for a call
    that could not be made.
    """
    import sys

    try:
        speech = load_caller_audio(args.wav) if args.wav else None
        if getattr(args, "say", None) is not None:
            speech = spoken_caller_audio(args.say)
        if not Path(args.out).resolve().parent.is_dir():
            raise CallerError(f"cannot write {args.out}: no such directory")
    except CallerError as exc:
        print(f"voice-agent call: {exc}", file=sys.stderr)
        return 2
    try:
        caller = asyncio.run(run_call(args, speech))
    except (httpx.HTTPError, OSError) as exc:
        reason = str(exc).strip() or type(exc).__name__
        print(f"voice-agent call: could not reach {args.server}: {reason}", file=sys.stderr)
        return 1
    outcome = caller.twiml_outcome
    if outcome is None or outcome.kind != "stream":
        print(f"voice-agent call: {_refused(caller, args)}", file=sys.stderr)
        return 1
    if caller.handshake_status is not None:
        print(
            f"voice-agent call: the media stream was refused (HTTP {caller.handshake_status})",
            file=sys.stderr,
        )
        return 1
    s = caller.summary()
    print(f"call {s['call_sid']}: heard {s['heard_ms']} ms of {s['media_received_ms']} ms sent")
    print(
        f"marks echoed {s['marks_echoed']} ({s['marks_flushed_by_clear']} flushed by clear), "
        f"clears received {s['clears_received']}, frames sent {s['media_frames_sent']}"
    )
    print(f"ended by {s['closed_by']}: {s['closed_reason']}; heard audio in {args.out}")
    return 0


__all__ = [
    "CallerError",
    "CallerState",
    "ClearRecord",
    "FakeTwilioCaller",
    "HeardChunk",
    "MarkEcho",
    "PlayoutBuffer",
    "ReceivedMessage",
    "SentMessage",
    "TwimlOutcome",
    "add_arguments",
    "load_caller_audio",
    "main",
    "new_call_sid",
    "new_stream_sid",
    "parse_twiml",
    "run_call",
]
