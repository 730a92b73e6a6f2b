"""The simulator's GPT-Live mode: one connection on `/v1/live/sessions`, driven by a scenario.

The same scenario files as the Realtime mode, the other protocol. What it does, per connection:

- Every client message is validated against the SDK's own `openai.types.live.ClientEvent`
  union (and refused with an `error` event naming the reason when it does not fit, or when it
  carries a top-level field the union does not know); `session.start` must come first, once,
  and is answered with `session.started` (the resolved configuration). Its `audio.format` is
  what caller and agent audio use (`audio/pcmu` or `audio/pcma` at 8000 Hz, `audio/pcm` at
  24000 Hz); left out, the server's default (`audio/pcm` at 24000 Hz) is used and recorded.
- Turns are the server's: the greeting is spoken as soon as the session starts; caller speech
  (detected on `session.input_audio.append`) interrupts the agent (its audio simply stops:
  `interruptions` counts it) and is transcribed as it goes (`session.input_transcript.delta`:
  the first word of the step's `caller_transcript` when speech starts, the rest when it
  ends); its end is answered by the next step, with no `response.create` from the client.
- A step's function call becomes a delegation: `session.delegation.created`, then (Responses
  delegation) a `response.event` envelope whose nested `response.output_item.done` carries the
  `function_call` item. The answer is taken the ways the protocol allows: a
  `response.item.create` with the `function_call_output` for that call, then `response.create`
  (Responses delegation); or `session.commentary.append` (its `delegation_id` naming the
  delegation under client delegation, null under Responses delegation). Then the next step
  speaks, with `{output}` / `{note}` rendered from what came back.

Test hooks: `received` / `sent` logs of `(monotonic time, event dict)`, `wait_for_sent` /
`wait_for_received`, `function_outputs`, `commentary`, `refused` (every client event refused,
with its reason) and `interruptions`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import secrets
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from openai.types.live import (
    ClientEvent,
    CommentaryAppendedEvent,
    CommentaryAppendEvent,
    ConnectClientEvent,
    DelegationCreatedEvent,
    ErrorEvent,
    InputAudioAppendEvent,
    InputTranscriptDeltaEvent,
    InstructionsAppendEvent,
    OutputAudioDeltaEvent,
    OutputTranscriptDeltaEvent,
    ResponseCreateEvent,
    ResponseEvent,
    ResponseItemCreateEvent,
    SessionClosedEvent,
    SessionCloseEvent,
    SessionResource,
    SessionStartedEvent,
    SessionStartEvent,
    SessionUpdatedEvent,
    SessionUpdateEvent,
    SessionUsage,
)
from openai.types.live.delegation_created_event import Delegation
from openai.types.live.error import Error
from pydantic import BaseModel, TypeAdapter, ValidationError
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from telephony.sim.scenario import (
    FunctionCallStep,
    Reply,
    Scenario,
    output_status,
    render_reply_text,
)
from telephony.sim.vad import AudioEncoding, EnergyVad, SpeechStarted, SpeechStopped, VadConfig

log = logging.getLogger(__name__)

LIVE_PATH = "/v1/live/sessions"
DEFAULT_LIVE_MODEL = "gpt-live-1"
SESSION_SECONDS = 3600
# Paced like the Realtime mode: first audio after ~250 ms, then ~4x faster than real time.
FIRST_AUDIO_DELAY_S = 0.25
GENERATION_SPEEDUP = 4.0

Synthesize = Callable[[int, int, AudioEncoding], bytes]
_CLIENT_EVENTS: TypeAdapter[Any] = TypeAdapter(ClientEvent)
# What a sideband may send (no session.start, no audio: the session and its audio are the
# primary transport's), OpenAI's SIP leg on GPT-Live.
_SIDEBAND_EVENTS: TypeAdapter[Any] = TypeAdapter(ConnectClientEvent)


def _fields_of(union: Any) -> dict[str, frozenset[str]]:
    """The top-level fields each client event may carry (the SDK's models accept extras
    silently), by type."""
    return {
        model.model_fields["type"].annotation.__args__[0]: frozenset(model.model_fields)
        for model in get_args(get_args(union)[0])
    }


_CLIENT_FIELDS = _fields_of(ClientEvent)
_SIDEBAND_FIELDS = _fields_of(ConnectClientEvent)
_ENCODINGS: dict[tuple[str, int], AudioEncoding] = {
    ("audio/pcmu", 8000): "pcmu",
    ("audio/pcma", 8000): "pcma",
    ("audio/pcm", 24000): "pcm16",
}


def new_id(prefix: str) -> str:
    """An id in the style of the real API (`sess_…`, `dlg_…`, `call_…`)."""
    return f"{prefix}_{secrets.token_hex(10)}"


def _tool_names(delegation: Any) -> list[str]:
    """The function tools a session's Responses delegation declares, by name."""
    responses = getattr(delegation, "responses", None)
    tools = getattr(responses, "tools", None) or ()
    return [name for tool in tools if (name := getattr(tool, "name", None))]


class LiveEventError(Exception):
    """A client event the server refuses, shaped like the API's `error` event."""

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


def parse_live_client_event(data: object, *, sideband: bool = False) -> Any:
    """One decoded client message as the SDK's `ClientEvent` (a sideband's: its
    `ConnectClientEvent`); LiveEventError when it is not."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise LiveEventError("Expected an object with a string 'type'.", code="invalid_request")
    allowed = (_SIDEBAND_FIELDS if sideband else _CLIENT_FIELDS).get(data["type"])
    if allowed is None:
        raise LiveEventError(
            f"Invalid value: '{data['type']}'. Unknown client event type.",
            code="invalid_value",
            param="type",
        )
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise LiveEventError(
            f"Unknown parameter: '{unknown[0]}'.", code="unknown_parameter", param=unknown[0]
        )
    try:
        return (_SIDEBAND_EVENTS if sideband else _CLIENT_EVENTS).validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        raise LiveEventError(
            f"Invalid {param or 'event'}: {first['msg']}", code="invalid_value", param=param
        ) from None


@dataclass
class _PendingCall:
    """A function call handed out in a delegation, until its answer comes back."""

    delegation_id: str
    call_id: str
    name: str
    answered: bool = False
    arguments: str = "{}"  # as the scenario renders them (the client backend's function call)


class LiveSimulatedSession:
    """One GPT-Live connection: protocol state plus logs that tests can inspect."""

    def __init__(
        self,
        ws: ServerConnection,
        scenario: Scenario,
        *,
        authorization: str | None,
        realtime_factor: float,
        chunk_ms: int,
        synthesize: Synthesize,
        record: bool = True,
    ) -> None:
        """`synthesize` is the Realtime mode's voice: (duration_ms, seed, encoding) -> audio."""
        self.id = new_id("sess")
        self.authorization = authorization
        self.model: str | None = None
        self.encoding: AudioEncoding | None = None  # set by session.start
        self.delegation: str = "client"  # who owns delegated work: client | responses
        # The Responses backend's function tools by name, as started and then updated.
        self.delegation_tools: list[str] = []
        # What session.start gave as history (a reconnect's conversation so far), and every
        # session.instructions.append.
        self.initial_input: list[dict[str, Any]] = []
        self.appended_instructions: list[str] = []
        self._resolved: dict[str, Any] = {}
        self.received: list[tuple[float, dict[str, Any]]] = []
        self.sent: list[tuple[float, dict[str, Any]]] = []
        self.refused: list[tuple[dict[str, Any], str]] = []
        self.function_outputs: list[tuple[str, str]] = []
        self.commentary: list[tuple[str | None, str]] = []
        self.interruptions = 0
        self.closed = asyncio.Event()
        self._ws = ws
        self._scenario = scenario
        self._factor = max(0.0, realtime_factor)
        self._chunk_ms = chunk_ms
        self._synthesize = synthesize
        self._recording = record
        self._changed = asyncio.Event()
        self._started_at = 0.0
        self._vad: EnergyVad | None = None
        self._speaking: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_step = 0
        self._cases_taken: Counter[tuple[int, int]] = Counter()
        self._latest_output: str | None = None
        self._latest_note: str | None = None
        self._calls: dict[str, _PendingCall] = {}  # by call_id
        self._delegations: dict[str, _PendingCall] = {}  # by delegation id
        self._caller_rest = ""  # the caller's words not yet transcribed
        self._answer_ready = False  # a function output came back; response.create speaks it

    # ---- the client delegation's backend (telephony/sim/responses_backend.py) -------------

    def client_task(self, delegation_id: str) -> _PendingCall | None:
        """The function call behind a client delegation of this session, while unanswered."""
        pending = self._delegations.get(delegation_id)
        if self.delegation != "client" or pending is None or pending.answered:
            return None
        return pending

    def backend_output(self, pending: _PendingCall, output: str) -> None:
        """What the engine answered the client backend's function call (the session hears of
        it only through the delegation's commentary)."""
        self.function_outputs.append((pending.call_id, output))
        self._notify()

    # ---- test helpers ------------------------------------------------------------------

    def sent_events(self, type_: str | None = None) -> list[dict[str, Any]]:
        return [e for _, e in self.sent if type_ is None or e.get("type") == type_]

    def received_events(self, type_: str | None = None) -> list[dict[str, Any]]:
        return [e for _, e in self.received if type_ is None or e.get("type") == type_]

    async def wait_for_sent(
        self, type_: str, *, count: int = 1, within: float = 5.0
    ) -> dict[str, Any]:
        """Wait until `count` server events of `type_` were sent; returns the `count`-th."""
        return await self._wait(lambda: self.sent_events(type_), count, within)

    async def wait_for_received(
        self, type_: str, *, count: int = 1, within: float = 5.0
    ) -> dict[str, Any]:
        """Wait until `count` client events of `type_` arrived; returns the `count`-th."""
        return await self._wait(lambda: self.received_events(type_), count, within)

    async def _wait(
        self, select: Callable[[], list[dict[str, Any]]], count: int, within: float
    ) -> dict[str, Any]:
        async with asyncio.timeout(within):
            while len(selected := select()) < count:
                if self.closed.is_set():
                    raise ConnectionError(f"live session {self.id} closed")
                await self._changed.wait()
            return selected[count - 1]

    @property
    def speaking(self) -> bool:
        return self._speaking is not None and not self._speaking.done()

    # ---- connection loop ---------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until it closes; never raises for client mistakes."""
        try:
            async for message in self._ws:
                if not await self._on_message(message):
                    break
        except ConnectionClosed:
            pass
        finally:
            for task in [*self._tasks]:
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            self.closed.set()
            self._notify()

    async def _on_message(self, message: str | bytes) -> bool:
        """Handle one client message; False once the session is closed."""
        try:
            data = json.loads(message)
        except (ValueError, RecursionError):
            await self._refuse({}, LiveEventError("Invalid JSON.", code="invalid_json"))
            return True
        if isinstance(data, dict):
            self._record(self.received, data)
        event_id = data.get("event_id") if isinstance(data, dict) else None
        try:
            event = self._parse(data)
            return await self._dispatch(event)
        except LiveEventError as exc:
            await self._refuse(
                data if isinstance(data, dict) else {},
                exc,
                event_id if isinstance(event_id, str) else None,
            )
            return True

    def _parse(self, data: object) -> Any:
        return parse_live_client_event(data)

    async def _dispatch(self, event: Any) -> bool:
        if self.encoding is None and not isinstance(event, SessionStartEvent):
            raise LiveEventError(
                "Send session.start and wait for session.started first.",
                code="session_not_started",
            )
        match event:
            case SessionStartEvent():
                await self._on_start(event)
            case InputAudioAppendEvent():
                await self._on_append(event)
            case ResponseItemCreateEvent():
                self._on_item_create(event)
            case ResponseCreateEvent():
                self._on_response_create()
            case CommentaryAppendEvent():
                await self._on_commentary(event)
            case SessionCloseEvent():
                await self._close("close_requested")
                return False
            case SessionUpdateEvent():
                await self._on_update(event)
            case InstructionsAppendEvent():
                self.appended_instructions.append(event.content)
        # Everything else the union allows (mute, instructions, thinking, decisions…) is
        # accepted and logged: the scenario does not act on it.
        return True

    # ---- session -----------------------------------------------------------------------

    async def _on_start(self, event: SessionStartEvent) -> None:
        if self.encoding is not None:
            raise LiveEventError("The session has already started.", code="session_already_started")
        session = event.session
        fmt = session.audio.format if session.audio is not None else None
        kind, rate = (fmt.type, fmt.rate) if fmt is not None else ("audio/pcm", 24000)
        encoding = _ENCODINGS.get((kind, rate))
        if encoding is None:
            raise LiveEventError(
                f"The simulator does not carry {kind} at {rate} Hz.",
                code="unsupported_audio_format",
                param="session.audio.format",
            )
        delegation = session.delegation
        self.delegation = delegation.type if delegation is not None else "client"
        self.model = session.model
        self.encoding = encoding
        self._started_at = time.monotonic()
        self._vad = EnergyVad(VadConfig(silence_ms=500), encoding, kind="energy")
        self.delegation_tools = _tool_names(session.delegation)
        self.initial_input = [item.model_dump(mode="json") for item in session.input or ()]
        resolved = session.model_dump(mode="json", exclude_none=True)
        resolved.setdefault("audio", {})["format"] = {"type": kind, "rate": rate}
        resolved.update(id=self.id, expires_at=int(time.time()) + SESSION_SECONDS, status="active")
        self._resolved = resolved
        await self._send(
            SessionStartedEvent(
                type="session.started",
                event_id="",
                session=SessionResource.model_validate(resolved),
                client_event_id=event.event_id,
            )
        )
        greeting = self._scenario.greeting
        # A session started with the conversation so far (a reconnect) goes on from it.
        if greeting is not None and not self.initial_input:
            self._speak(greeting, greeting.text, None)

    async def _on_update(self, event: SessionUpdateEvent) -> None:
        """Delegation changes (a handoff's tools and backend rules); the delegation's owner
        cannot change."""
        update = event.session.delegation
        if update is not None:
            if update.type != self.delegation:
                raise LiveEventError(
                    "The delegation type cannot change.",
                    code="invalid_value",
                    param="session.delegation.type",
                )
            responses = getattr(update, "responses", None)
            if responses is not None and responses.tools is not None:
                self.delegation_tools = [
                    name for t in responses.tools if (name := getattr(t, "name", None))
                ]
            merged = self._resolved.setdefault("delegation", {"type": update.type})
            for key, value in update.model_dump(mode="json", exclude_none=True).items():
                if isinstance(value, dict) and isinstance(merged.get(key), dict):
                    merged[key].update(value)
                else:
                    merged[key] = value
        await self._send(
            SessionUpdatedEvent(
                type="session.updated",
                event_id="",
                session=SessionResource.model_validate(self._resolved),
                client_event_id=event.event_id,
            )
        )

    async def _close(self, reason: Any) -> None:
        self._stop_speaking()
        await self._send(
            SessionClosedEvent(
                type="session.closed",
                event_id="",
                reason=reason,
                session=SessionResource(
                    id=self.id,
                    expires_at=int(time.time()),
                    model=self.model or DEFAULT_LIVE_MODEL,
                    status="active",
                ),
                usage=SessionUsage(seconds=round(time.monotonic() - self._started_at, 3)),
            )
        )
        await self._ws.close()

    # ---- caller audio and turns --------------------------------------------------------

    async def _on_append(self, event: InputAudioAppendEvent) -> None:
        try:
            audio = base64.b64decode(event.audio, validate=True)
        except (binascii.Error, ValueError):
            raise LiveEventError(
                "Invalid 'audio'. Expected base64-encoded audio bytes.",
                code="invalid_value",
                param="audio",
            ) from None
        assert self._vad is not None
        for vad_event in self._vad.feed(audio):
            if isinstance(vad_event, SpeechStarted):
                if self.speaking:
                    # Full duplex: the model stops talking over the caller; nobody asked it to.
                    self.interruptions += 1
                    self._stop_speaking()
                await self._caller_turn_started()
            elif isinstance(vad_event, SpeechStopped):
                await self._caller_turn_ended()

    async def _caller_turn_started(self) -> None:
        # The transcript streams while the caller speaks: its first word now, the rest at
        # the end of the turn.
        steps = self._scenario.steps
        heard = steps[self._next_step].caller_transcript if self._next_step < len(steps) else None
        first, _, self._caller_rest = (heard or "(inaudible)").partition(" ")
        await self._transcribed(first)

    async def _transcribed(self, text: str) -> None:
        now = self._now_ms()
        await self._send(
            InputTranscriptDeltaEvent(
                type="session.input_transcript.delta",
                event_id="",
                delta=text,
                start_ms=now,
                end_ms=now,
            )
        )

    async def _caller_turn_ended(self) -> None:
        if self._caller_rest:
            await self._transcribed(" " + self._caller_rest)
            self._caller_rest = ""
        if self._calls_open():
            return  # the model waits for its delegated work before it goes on
        self._take_step()

    def _calls_open(self) -> bool:
        return any(not call.answered for call in self._calls.values())

    def _take_step(self) -> None:
        """The next scripted turn: what it says, and the delegation it starts."""
        steps = self._scenario.steps
        if self._next_step >= len(steps):
            fallback = self._scenario.fallback
            self._speak(fallback, fallback.text, None)
            return
        index = self._next_step
        step = steps[index]
        self._next_step += 1
        spoken = step.spoken()
        case = step.case_for(
            output_status(self._latest_output), lambda i: self._cases_taken[(index, i)]
        )
        if case is not None:
            self._cases_taken[(index, case)] += 1
            chosen = step.on_output[case]
            spoken = chosen.reply
            if chosen.then is not None:
                self._next_step = self._scenario.step_index(chosen.then)
        text = (
            render_reply_text(spoken.text, self._latest_output, note=self._latest_note)
            if spoken is not None
            else ""
        )
        self._speak(spoken, text, step.function_call)

    # ---- agent speech ------------------------------------------------------------------

    def _speak(self, reply: Reply | None, text: str, call: FunctionCallStep | None) -> None:
        """Say this after what is being said (a barge-in cancels the whole chain)."""
        previous = self._speaking if self.speaking else None
        task = asyncio.create_task(
            self._say(previous, reply, text, call), name=f"live-sim-{self.id}"
        )
        self._speaking = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _stop_speaking(self) -> None:
        if self._speaking is not None and not self._speaking.done():
            self._speaking.cancel()
        self._speaking = None

    async def _say(
        self,
        previous: asyncio.Task[None] | None,
        reply: Reply | None,
        text: str,
        call: FunctionCallStep | None,
    ) -> None:
        if previous is not None:
            await previous
        if reply is not None and text:
            await self._stream_audio(reply, text)
        if call is not None:
            for _ in range(call.repeat):
                await self._delegate(call)

    async def _stream_audio(self, reply: Reply, text: str) -> None:
        assert self.encoding is not None
        audio = self._synthesize(reply.duration_ms(text), zlib.crc32(text.encode()), self.encoding)
        width = 2 if self.encoding == "pcm16" else 1
        per_ms = (24 if self.encoding == "pcm16" else 8) * width
        chunk = max(per_ms, self._chunk_ms * per_ms)
        await asyncio.sleep(FIRST_AUDIO_DELAY_S * self._factor)
        start = self._now_ms()
        await self._send(
            OutputTranscriptDeltaEvent(
                type="session.output_transcript.delta",
                event_id="",
                delta=text,
                start_ms=start,
                end_ms=start + len(audio) // per_ms,
            )
        )
        for offset in range(0, len(audio), chunk):
            piece = audio[offset : offset + chunk]
            await self._send(
                OutputAudioDeltaEvent(
                    type="session.output_audio.delta",
                    delta=base64.b64encode(piece).decode("ascii"),
                )
            )
            await asyncio.sleep(len(piece) / per_ms / 1000 / GENERATION_SPEEDUP * self._factor)

    # ---- delegation --------------------------------------------------------------------

    async def _delegate(self, call: FunctionCallStep) -> None:
        target: Literal["client", "responses"] = (
            "responses" if self.delegation == "responses" else "client"
        )
        delegation_id = new_id("dlg")
        response_id = new_id("resp") if target == "responses" else None
        pending = _PendingCall(
            delegation_id,
            new_id("call"),
            call.name,
            arguments=call.rendered_arguments(output=self._latest_output),
        )
        self._calls[pending.call_id] = pending
        self._delegations[delegation_id] = pending
        await self._send(
            DelegationCreatedEvent(
                type="session.delegation.created",
                event_id="",
                offset_ms=self._now_ms(),
                delegation=Delegation(
                    id=delegation_id, target=target, type="delegation", response_id=response_id
                ),
            )
        )
        if target != "responses":
            return  # client delegation: the task is the application's to work out
        item = {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": pending.call_id,
            "name": call.name,
            "arguments": pending.arguments,
            "status": "completed",
        }
        await self._send(
            ResponseEvent(
                type="response.event",
                event_id="",
                delegation_id=delegation_id,
                event={
                    "type": "response.output_item.done",
                    "response_id": response_id,
                    "output_index": 0,
                    "item": item,
                },
            )
        )

    def _on_item_create(self, event: ResponseItemCreateEvent) -> None:
        item = event.item
        if getattr(item, "type", None) != "function_call_output":
            return  # a message for the backend model: context only
        call_id = getattr(item, "call_id", "")
        pending = self._calls.get(call_id)
        if pending is None or self.delegation != "responses":
            raise LiveEventError(
                f"No delegated function call '{call_id}' awaits an output.",
                code="invalid_value",
                param="item.call_id",
            )
        output = getattr(item, "output", "")
        output = output if isinstance(output, str) else json.dumps(output)
        pending.answered = True
        self.function_outputs.append((call_id, output))
        self._latest_output = output
        self._answer_ready = True

    def _on_response_create(self) -> None:
        # The backend model goes on with what it was given: the next step speaks it.
        if self._answer_ready and not self._calls_open():
            self._answer_ready = False
            self._take_step()

    async def _on_commentary(self, event: CommentaryAppendEvent) -> None:
        if event.delegation_id is not None:
            pending = self._delegations.get(event.delegation_id)
            if self.delegation == "responses" or pending is None:
                raise LiveEventError(
                    f"Unknown client delegation '{event.delegation_id}'.",
                    code="invalid_value",
                    param="delegation_id",
                )
            pending.answered = True
        self.commentary.append((event.delegation_id, event.content))
        self._latest_note = event.content
        self._latest_output = event.content
        now = self._now_ms()
        await self._send(
            CommentaryAppendedEvent(
                type="session.commentary.appended",
                event_id="",
                start_ms=now,
                end_ms=now,
                client_event_id=event.event_id,
            )
        )
        if not self._calls_open():
            self._answer_ready = False
            self._take_step()

    # ---- wire --------------------------------------------------------------------------

    async def _refuse(
        self, data: dict[str, Any], error: LiveEventError, event_id: str | None = None
    ) -> None:
        self.refused.append((data, f"{error.code}: {error.message}"))
        await self._send(
            ErrorEvent(
                type="error",
                event_id="",
                client_event_id=event_id,
                error=Error(
                    type="invalid_request_error",
                    code=error.code,
                    message=error.message,
                    param=error.param,
                    client_event_id=event_id,
                ),
            )
        )

    def _now_ms(self) -> int:
        return round((time.monotonic() - self._started_at) * 1000)

    async def _send(self, event: BaseModel) -> None:
        data = event.model_dump(mode="json", exclude_none=True)
        if "event_id" in type(event).model_fields:
            data["event_id"] = new_id("event")
        self._record(self.sent, data)
        await self._ws.send(json.dumps(data))

    def _record(self, log_: list[tuple[float, dict[str, Any]]], data: dict[str, Any]) -> None:
        if self._recording:
            log_.append((time.monotonic(), data))
            self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


__all__ = [
    "DEFAULT_LIVE_MODEL",
    "LIVE_PATH",
    "LiveEventError",
    "LiveSimulatedSession",
    "parse_live_client_event",
]
