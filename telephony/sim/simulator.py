"""A local stand-in for the OpenAI Realtime API (GA protocol), driven by a scenario file.

The same server also speaks GPT-Live on `/v1/live/sessions` (`client.live.connect()`), from
the same scenario: see telephony.sim.live_session.

It speaks the real wire protocol over a real WebSocket at `/v1/realtime`, so the official SDK
connects to it unchanged::

    async with RealtimeSimulator(load_scenario()) as sim:
        client = AsyncOpenAI(api_key="x", base_url=sim.base_url)
        async with client.realtime.connect(model="gpt-realtime") as conn:
            ...

What it does, per connection: `session.created`; `session.update` validated against the GA
shape (errors name the offending `param`) and answered with `session.updated`; speech
detection on appended audio (`vad`: `speech_started` / `speech_stopped` / `committed`, the user
item, its transcription: scripted, or with `recognize=True` recognised from the audio against
the scenario's expected phrases, which then choose the next step); scripted responses (audio
spoken by `voice` or synthetic tones, transcript deltas, function calls) paced faster than real
time; `response.cancel`, barge-in cancellation,
`conversation.item.truncate` and the error codes of the real server.

Pace: `realtime_factor` scales every simulated wait. At 1.0 a response's first audio comes after
~250 ms and audio is then generated at ~4x real time (like the real API, which bursts ahead of
playback); 0 sends everything as fast as possible; 2.0 is twice slower than 1.0.

Test hooks: `sim.sessions` (one `SimulatedSession` per connection, with `received` / `sent`
logs of `(monotonic time, event dict)` and waiting helpers), `await sim.drop_all()` (abort every
connection, as a network drop), `sim.fail_next_connects(n)` (refuse the next n handshakes),
`sim.handshake_delay_s` (hold every opening handshake this long, as a slow or distant API).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import enum
import errno
import functools
import json
import logging
import math
import re
import secrets
import signal
import sys
import threading
import time
import warnings
import zlib
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from types import TracebackType
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit

from openai.types.realtime import (
    ConversationItemAdded,
    ConversationItemDeletedEvent,
    ConversationItemDone,
    ConversationItemInputAudioTranscriptionCompletedEvent,
    ConversationItemTruncatedEvent,
    InputAudioBufferClearedEvent,
    InputAudioBufferCommittedEvent,
    InputAudioBufferSpeechStartedEvent,
    InputAudioBufferSpeechStoppedEvent,
    RealtimeConversationItemAssistantMessage,
    RealtimeConversationItemFunctionCall,
    RealtimeConversationItemFunctionCallOutput,
    RealtimeConversationItemSystemMessage,
    RealtimeConversationItemUserMessage,
    RealtimeError,
    RealtimeErrorEvent,
    RealtimeResponse,
    RealtimeResponseStatus,
    RealtimeResponseUsage,
    RealtimeSessionCreateRequest,
    ResponseAudioDeltaEvent,
    ResponseAudioDoneEvent,
    ResponseAudioTranscriptDeltaEvent,
    ResponseAudioTranscriptDoneEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseDoneEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    SessionCreatedEvent,
    SessionUpdatedEvent,
)
from openai.types.realtime.realtime_server_event import (
    ConversationItemRetrieved,
    OutputAudioBufferCleared,
)
from openai.types.realtime.response_content_part_added_event import Part as AddedPart
from openai.types.realtime.response_content_part_done_event import Part as DonePart
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from telephony.sim.live_session import LIVE_PATH, LiveSimulatedSession
from telephony.sim.recognizer import PhraseRecognizer, Recognition
from telephony.sim.scenario import (
    FunctionCallStep,
    Reply,
    Scenario,
    load_scenario,
    output_status,
    render_reply_text,
)
from telephony.sim.speech import SpeechError, SpeechSetup, SpeechSynthesizer
from telephony.sim.vad import (
    SAMPLE_RATES,
    AudioEncoding,
    EnergyVad,
    SpeechStarted,
    SpeechStopped,
    VadConfig,
    VadKind,
    audio_ms,
)

with warnings.catch_warnings():
    # audioop is deprecated on 3.11/3.12 and provided by `audioop-lts` from 3.13 on.
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

log = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
MODELS_PATH = "/v1/models"
DEFAULT_MODEL = "gpt-realtime"
DEFAULT_INSTRUCTIONS = "You are a helpful, concise voice assistant."
# Speech-like audio is generated this much faster than real time at realtime_factor=1.0.
GENERATION_SPEEDUP = 4.0
FIRST_AUDIO_DELAY_S = 0.25
ARGUMENT_DELTA_DELAY_S = 0.04
CANCEL_WAIT_S = 5.0
MIN_COMMIT_MS = 100
# Caller audio kept for recognition: one turn's worth (a longer turn keeps its end).
MAX_TURN_AUDIO_MS = 30_000


def new_id(prefix: str) -> str:
    """An id in the style of the real API (`event_…`, `item_…`, `resp_…`, `call_…`)."""
    return f"{prefix}_{secrets.token_hex(10)}"


# --------------------------------------------------------------------------------------------
# Client events, parsed at the edge (strict: unknown parameters are errors, like the real API)
# --------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AudioFormatConfig(_Strict):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: Literal[24000] | None = None


class ServerVadConfig(_Strict):
    type: Literal["server_vad"]
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    prefix_padding_ms: int | None = Field(default=None, ge=0)
    silence_duration_ms: int | None = Field(default=None, ge=0)
    idle_timeout_ms: int | None = Field(default=None, ge=0)
    create_response: bool | None = None
    interrupt_response: bool | None = None


class SemanticVadConfig(_Strict):
    type: Literal["semantic_vad"]
    eagerness: Literal["low", "medium", "high", "auto"] | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None


TurnDetectionConfig = Annotated[ServerVadConfig | SemanticVadConfig, Field(discriminator="type")]


class TranscriptionConfig(_Strict):
    model: str | None = None
    language: str | None = None
    languages: list[str] | None = None
    prompt: str | None = None
    keywords: list[str] | None = None
    delay: str | None = None


class NoiseReductionConfig(_Strict):
    type: Literal["near_field", "far_field"] | None = None
    strength: float | None = None


class AudioInputConfig(_Strict):
    format: AudioFormatConfig | None = None
    transcription: TranscriptionConfig | None = None
    turn_detection: TurnDetectionConfig | None = None
    noise_reduction: NoiseReductionConfig | None = None


class AudioOutputConfig(_Strict):
    format: AudioFormatConfig | None = None
    voice: Any = None
    speed: float | None = Field(default=None, ge=0.25, le=1.5)


class AudioConfig(_Strict):
    input: AudioInputConfig | None = None
    output: AudioOutputConfig | None = None


class FunctionToolConfig(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class SessionConfig(_Strict):
    """The GA `session` object of `session.update` (the fields the Realtime API accepts)."""

    type: Literal["realtime"]
    model: str | None = None
    instructions: str | None = None
    output_modalities: list[Literal["audio", "text"]] | None = None
    audio: AudioConfig | None = None
    tools: list[FunctionToolConfig] | None = None
    tool_choice: Any = None
    max_output_tokens: Any = None
    tracing: Any = None
    truncation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    reasoning: Any = None
    parallel_tool_calls: bool | None = None


class _ClientEvent(_Strict):
    event_id: str | None = None


class SessionUpdate(_ClientEvent):
    type: Literal["session.update"]
    session: SessionConfig


class InputAudioAppend(_ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str


class InputAudioCommit(_ClientEvent):
    type: Literal["input_audio_buffer.commit"]


class InputAudioClear(_ClientEvent):
    type: Literal["input_audio_buffer.clear"]


class OutputAudioClear(_ClientEvent):
    type: Literal["output_audio_buffer.clear"]


class ClientMessageItem(_Strict):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: list[dict[str, Any]]
    id: str | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class ClientFunctionCallItem(_Strict):
    type: Literal["function_call"]
    name: str
    arguments: str
    call_id: str | None = None
    id: str | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class ClientFunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


ClientItem = Annotated[
    ClientMessageItem | ClientFunctionCallItem | ClientFunctionCallOutputItem,
    Field(discriminator="type"),
]


class ItemCreate(_ClientEvent):
    type: Literal["conversation.item.create"]
    item: ClientItem
    previous_item_id: str | None = None


class ItemTruncate(_ClientEvent):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ItemDelete(_ClientEvent):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemRetrieve(_ClientEvent):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ResponseCreate(_ClientEvent):
    type: Literal["response.create"]
    # Per-response overrides; the scripted model ignores them, so any object is accepted.
    response: dict[str, Any] | None = None


class ResponseCancel(_ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = (
    SessionUpdate
    | InputAudioAppend
    | InputAudioCommit
    | InputAudioClear
    | OutputAudioClear
    | ItemCreate
    | ItemTruncate
    | ItemDelete
    | ItemRetrieve
    | ResponseCreate
    | ResponseCancel
)

_CLIENT_EVENTS: dict[str, type[_ClientEvent]] = {
    "session.update": SessionUpdate,
    "input_audio_buffer.append": InputAudioAppend,
    "input_audio_buffer.commit": InputAudioCommit,
    "input_audio_buffer.clear": InputAudioClear,
    "output_audio_buffer.clear": OutputAudioClear,
    "conversation.item.create": ItemCreate,
    "conversation.item.truncate": ItemTruncate,
    "conversation.item.delete": ItemDelete,
    "conversation.item.retrieve": ItemRetrieve,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
}
# Discriminator values pydantic puts into error locations; the real API's `param` omits them.
_UNION_TAGS = frozenset(
    {"server_vad", "semantic_vad", "message", "function_call", "function_call_output"}
)


class ClientEventError(Exception):
    """A client event the real API would answer with an `error` event (the session survives)."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.type = type_


def parse_client_event(data: object) -> ClientEvent:
    """Validate one decoded client message; raises ClientEventError shaped like the real API's."""
    if not isinstance(data, dict):
        raise ClientEventError(
            "Invalid type for event: expected an object.", code="invalid_type", param=None
        )
    event_type = data.get("type")
    if event_type is None:
        raise ClientEventError(
            "Missing required parameter: 'type'.", code="missing_required_parameter", param="type"
        )
    model = _CLIENT_EVENTS.get(event_type) if isinstance(event_type, str) else None
    if model is None:
        supported = ", ".join(f"'{name}'" for name in _CLIENT_EVENTS)
        raise ClientEventError(
            f"Invalid value: '{event_type}'. Supported values are: {supported}.",
            code="invalid_value",
            param="type",
        )
    try:
        return model.model_validate(data)  # type: ignore[return-value]
    except ValidationError as exc:
        raise _as_client_error(exc) from None


def _as_client_error(exc: ValidationError) -> ClientEventError:
    first = exc.errors()[0]
    parts: list[str] = []
    for segment in first["loc"]:
        if isinstance(segment, int):
            parts.append(f"[{segment}]")
        elif segment not in _UNION_TAGS:
            parts.append(("." if parts else "") + segment)
    param = "".join(parts) or None
    kind = first["type"]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        param = f"{param}.type" if param else "type"
        kind = "literal_error"
    if kind == "missing":
        return ClientEventError(
            f"Missing required parameter: '{param}'.",
            code="missing_required_parameter",
            param=param,
        )
    if kind == "extra_forbidden":
        return ClientEventError(
            f"Unknown parameter: '{param}'.", code="unknown_parameter", param=param
        )
    value = first.get("input")
    detail = first["msg"]
    return ClientEventError(
        f"Invalid value for '{param}': {value!r}. {detail}.", code="invalid_value", param=param
    )


# --------------------------------------------------------------------------------------------
# Session configuration: the merged state and what the simulator derives from it
# --------------------------------------------------------------------------------------------

_FORMAT_ENCODINGS: dict[str, AudioEncoding] = {
    "audio/pcmu": "pcmu",
    "audio/pcma": "pcma",
    "audio/pcm": "pcm16",
}
_EAGERNESS_SILENCE_MS = {"low": 800, "medium": 500, "auto": 500, "high": 300}


def default_session(model: str) -> SessionConfig:
    """The session a new connection starts with (the real API's defaults)."""
    return SessionConfig.model_validate(
        {
            "type": "realtime",
            "model": model,
            "instructions": DEFAULT_INSTRUCTIONS,
            "output_modalities": ["audio"],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": 24000},
                    "transcription": None,
                    "noise_reduction": None,
                    "turn_detection": {
                        "type": "server_vad",
                        "threshold": 0.5,
                        "prefix_padding_ms": 300,
                        "silence_duration_ms": 500,
                        "idle_timeout_ms": None,
                        "create_response": True,
                        "interrupt_response": True,
                    },
                },
                "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin"},
            },
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
            "tracing": None,
            "truncation": "auto",
            "prompt": None,
        }
    )


def merge_session(current: SessionConfig, update: SessionConfig) -> SessionConfig:
    """Apply a `session.update`: given fields replace, `audio.input`/`audio.output` merge."""
    merged = current.model_dump()
    changes = update.model_dump(exclude_unset=True)
    audio_changes = changes.pop("audio", None)
    merged.update(changes)
    if audio_changes is not None:
        audio = merged.get("audio") or {}
        for side in ("input", "output"):
            if side in audio_changes:
                if audio_changes[side] is None:
                    audio[side] = None
                else:
                    audio[side] = {**(audio.get(side) or {}), **audio_changes[side]}
        merged["audio"] = audio
    result = SessionConfig.model_validate(merged)
    detection = result.audio.input.turn_detection if result.audio and result.audio.input else None
    if detection is not None:
        # The real API fills these in; the bridge relies on the defaults being true.
        if detection.create_response is None:
            detection.create_response = True
        if detection.interrupt_response is None:
            detection.interrupt_response = True
        if isinstance(detection, ServerVadConfig):
            detection.threshold = 0.5 if detection.threshold is None else detection.threshold
            if detection.prefix_padding_ms is None:
                detection.prefix_padding_ms = 300
            if detection.silence_duration_ms is None:
                detection.silence_duration_ms = 500
        elif detection.eagerness is None:
            detection.eagerness = "auto"
    return result


@dataclass(frozen=True, slots=True)
class TurnDetection:
    """What the simulator's VAD does for the current session."""

    vad: VadConfig
    create_response: bool
    interrupt_response: bool


@dataclass(frozen=True, slots=True)
class EffectiveConfig:
    input_encoding: AudioEncoding
    output_encoding: AudioEncoding
    turn_detection: TurnDetection | None
    transcription: bool

    @classmethod
    def of(cls, session: SessionConfig) -> EffectiveConfig:
        audio = session.audio or AudioConfig()
        inp = audio.input or AudioInputConfig()
        out = audio.output or AudioOutputConfig()
        detection: TurnDetection | None = None
        td = inp.turn_detection
        if isinstance(td, ServerVadConfig):
            threshold = 0.5 if td.threshold is None else td.threshold
            vad = VadConfig(
                threshold_dbfs=-60.0 + 40.0 * threshold,
                silence_ms=500 if td.silence_duration_ms is None else td.silence_duration_ms,
                prefix_padding_ms=300 if td.prefix_padding_ms is None else td.prefix_padding_ms,
            )
            detection = TurnDetection(
                vad, td.create_response is not False, td.interrupt_response is not False
            )
        elif isinstance(td, SemanticVadConfig):
            vad = VadConfig(silence_ms=_EAGERNESS_SILENCE_MS[td.eagerness or "auto"])
            detection = TurnDetection(
                vad, td.create_response is not False, td.interrupt_response is not False
            )
        return cls(
            input_encoding=_FORMAT_ENCODINGS[inp.format.type if inp.format else "audio/pcm"],
            output_encoding=_FORMAT_ENCODINGS[out.format.type if out.format else "audio/pcm"],
            turn_detection=detection,
            transcription=inp.transcription is not None,
        )


# --------------------------------------------------------------------------------------------
# Synthesized "speech": deterministic, non-silent, recognisably not the caller
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def synthesize_speech(duration_ms: int, seed: int, encoding: AudioEncoding) -> bytes:
    """Amplitude-modulated harmonic tones at a syllable rate (~4 Hz), encoded as `encoding`."""
    rate = SAMPLE_RATES[encoding]
    n = rate * duration_ms // 1000
    f0 = 110.0 + seed % 90
    syllable_hz = 3.5 + (seed % 7) * 0.2
    two_pi = 2.0 * math.pi
    samples = array("h", bytes(2 * n))
    for i in range(n):
        t = i / rate
        envelope = 0.6 + 0.4 * math.sin(two_pi * syllable_hz * t)  # never below 0.2: not silent
        tone = (
            0.6 * math.sin(two_pi * f0 * t)
            + 0.3 * math.sin(two_pi * 2 * f0 * t)
            + 0.1 * math.sin(two_pi * 3 * f0 * t)
        )
        samples[i] = int(9000 * envelope * tone)
    if sys.byteorder == "big":
        samples.byteswap()
    linear = samples.tobytes()
    if encoding == "pcmu":
        return audioop.lin2ulaw(linear, 2)
    if encoding == "pcma":
        return audioop.lin2alaw(linear, 2)
    return linear


def _bytes_per_ms(encoding: AudioEncoding) -> int:
    return SAMPLE_RATES[encoding] // 1000 * (2 if encoding == "pcm16" else 1)


_SILENCE: dict[AudioEncoding, int] = {"pcmu": 0xFF, "pcma": 0xD5, "pcm16": 0}


# --------------------------------------------------------------------------------------------
# Conversation state
# --------------------------------------------------------------------------------------------


@dataclass
class ConversationItemState:
    """The simulator's record of one conversation item (what truncate/delete act on)."""

    id: str
    type: Literal["message", "function_call", "function_call_output"]
    role: Literal["user", "assistant", "system"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    transcript: str | None = None  # assistant audio transcript / user transcription
    audio_ms: int = 0  # assistant audio generated for this item
    truncated: bool = False
    content: list[dict[str, Any]] = field(default_factory=list)  # client-created messages
    name: str | None = None
    call_id: str | None = None
    arguments: str = ""
    output: str | None = None


def _item_model(item: ConversationItemState) -> Any:
    """The SDK's typed item for `item` (what the real API puts in item events)."""
    common: dict[str, Any] = {"id": item.id, "object": "realtime.item", "status": item.status}
    if item.type == "function_call":
        return RealtimeConversationItemFunctionCall(
            **common,
            type="function_call",
            name=item.name or "",
            call_id=item.call_id,
            arguments=item.arguments,
        )
    if item.type == "function_call_output":
        return RealtimeConversationItemFunctionCallOutput(
            **common,
            type="function_call_output",
            call_id=item.call_id or "",
            output=item.output or "",
        )
    if item.role == "assistant":
        content = item.content or (
            [{"type": "output_audio", "transcript": item.transcript}]
            if item.transcript is not None
            else []
        )
        return RealtimeConversationItemAssistantMessage.model_validate(
            {**common, "type": "message", "role": "assistant", "content": content}
        )
    if item.role == "system":
        return RealtimeConversationItemSystemMessage.model_validate(
            {**common, "type": "message", "role": "system", "content": item.content}
        )
    content = item.content or [{"type": "input_audio", "transcript": item.transcript}]
    return RealtimeConversationItemUserMessage.model_validate(
        {**common, "type": "message", "role": "user", "content": content}
    )


class ResponseState(enum.Enum):
    IN_PROGRESS = "in_progress"
    CANCELLING = "cancelling"
    DONE = "done"


_RESPONSE_TRANSITIONS: dict[ResponseState, frozenset[ResponseState]] = {
    ResponseState.IN_PROGRESS: frozenset({ResponseState.CANCELLING, ResponseState.DONE}),
    ResponseState.CANCELLING: frozenset({ResponseState.DONE}),
    ResponseState.DONE: frozenset(),
}


def _told_to_say(event: ResponseCreate | None) -> str | None:
    """The line in `Say exactly: "…"` of a response.create's instructions, if any."""
    instructions = ((event.response if event else None) or {}).get("instructions")
    if not isinstance(instructions, str):
        return None
    match = re.search(r'Say exactly: "([^"]+)"', instructions)
    return match.group(1) if match else None


@dataclass
class _ResponsePlan:
    spoken: Reply | None
    text: str
    function_call: FunctionCallStep | None


@dataclass
class _ActiveResponse:
    id: str
    plan: _ResponsePlan
    state: ResponseState = ResponseState.IN_PROGRESS
    cancel_reason: Literal["client_cancelled", "turn_detected"] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    output: list[ConversationItemState] = field(default_factory=list)

    def advance(self, to: ResponseState) -> None:
        """The only way `state` changes; refuses an illegal transition."""
        if to not in _RESPONSE_TRANSITIONS[self.state]:
            raise RuntimeError(f"response {self.id}: illegal transition {self.state} -> {to}")
        self.state = to


# --------------------------------------------------------------------------------------------
# One connection
# --------------------------------------------------------------------------------------------


class SimulatedSession:
    """One Realtime connection: its protocol state plus logs that tests can inspect.

    `received` and `sent` hold `(time.monotonic(), event dict)` in order; `function_outputs`
    holds `(call_id, output)` for every `function_call_output` item the client created.
    """

    def __init__(
        self,
        ws: ServerConnection,
        scenario: Scenario,
        *,
        model: str,
        call_id: str | None,
        authorization: str | None,
        realtime_factor: float,
        chunk_ms: int,
        record: bool = True,
        voice: SpeechSynthesizer | None = None,
        recognizer: Callable[[], PhraseRecognizer] | None = None,
        vad: VadKind = "auto",
    ) -> None:
        self.id = new_id("sess")
        self.model = model
        self.call_id = call_id
        self.authorization = authorization
        self.received: list[tuple[float, dict[str, Any]]] = []
        self.sent: list[tuple[float, dict[str, Any]]] = []
        self.function_outputs: list[tuple[str, str]] = []
        self.items: dict[str, ConversationItemState] = {}
        self.closed = asyncio.Event()
        self.config = default_session(model)
        # Whether the assistant has produced audio: from then on the voice is fixed, and a
        # session.update changing it is refused (`cannot_update_voice`), as the API does.
        self.spoke = False
        self._ws = ws
        self._scenario = scenario
        self._factor = max(0.0, realtime_factor)
        self._chunk_ms = chunk_ms
        self._recording = record
        self._effective = EffectiveConfig.of(self.config)
        self._vad: EnergyVad | None = None
        self._order: list[str] = []
        self._changed = asyncio.Event()  # replaced after every log append; see _wait
        self._active: _ActiveResponse | None = None
        self._last_response_id: str | None = None
        self._buffer_ms = 0.0
        self._speech_item_id: str | None = None
        self._stream_ms = 0.0  # all input audio appended in this session
        self._greeting_pending = scenario.greeting is not None
        self._next_step = 0
        self._latest_output: str | None = None
        # How often each (step, on_output case) was taken: `at_most` bounds a retry loop.
        self._cases_taken: Counter[tuple[int, int]] = Counter()
        self._latest_note: str | None = None  # text of the latest system message we got
        self._voice = voice
        self._recognizer = recognizer
        self._vad_kind: VadKind = vad
        self._turn_audio = bytearray()  # this turn's caller audio, when recognising
        self._misheard = False  # the last turn matched no expected phrase: ask again
        self.recognitions: list[Recognition] = []
        self._rebuild_vad()

    # ---- test helpers ------------------------------------------------------------------

    def sent_events(self, type_: str | None = None) -> list[dict[str, Any]]:
        """Server events sent so far, optionally of one type."""
        return [e for _, e in self.sent if type_ is None or e.get("type") == type_]

    def received_events(self, type_: str | None = None) -> list[dict[str, Any]]:
        """Client events received so far, optionally of one type."""
        return [e for _, e in self.received if type_ is None or e.get("type") == type_]

    async def wait_for_sent(
        self, type_: str, *, count: int = 1, within: float = 5.0
    ) -> dict[str, Any]:
        """Wait until `count` events of `type_` were sent; returns the `count`-th."""
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
                    raise ConnectionError(f"session {self.id} closed")
                await self._changed.wait()
            return selected[count - 1]

    @property
    def response_active(self) -> bool:
        return self._active is not None

    @property
    def input_format(self) -> str:
        """The caller-audio format this session was configured with (`audio/pcma`, ...)."""
        audio = self.config.audio
        fmt = audio.input.format if audio and audio.input else None
        return fmt.type if fmt else "audio/pcm"

    @property
    def output_format(self) -> str:
        """The agent-audio format this session sends."""
        audio = self.config.audio
        fmt = audio.output.format if audio and audio.output else None
        return fmt.type if fmt else "audio/pcm"

    # ---- connection loop ---------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until it closes; never raises for client mistakes."""
        try:
            await self._send(
                SessionCreatedEvent(
                    type="session.created", event_id="", session=self._session_payload()
                )
            )
            async for message in self._ws:
                await self._on_message(message)
        except ConnectionClosed:
            pass
        finally:
            await self._stop_active(reason=None)
            self.closed.set()
            self._notify()

    async def _on_message(self, message: str | bytes) -> None:
        try:
            data = json.loads(message)
        except (ValueError, RecursionError):
            await self._send_error(
                ClientEventError(
                    "We could not parse the JSON body of your request. (HINT: This likely "
                    "means you aren't using your HTTP library correctly.)",
                    code="invalid_json",
                )
            )
            return
        event_id = data.get("event_id") if isinstance(data, dict) else None
        if isinstance(data, dict):
            self._record(self.received, data)
        try:
            event = parse_client_event(data)
            await self._dispatch(event)
        except ClientEventError as exc:
            await self._send_error(exc, event_id=event_id if isinstance(event_id, str) else None)

    async def _dispatch(self, event: ClientEvent) -> None:
        match event:
            case SessionUpdate():
                await self._on_session_update(event)
            case InputAudioAppend():
                await self._on_append(event)
            case InputAudioCommit():
                await self._on_commit()
            case InputAudioClear():
                self._buffer_ms = 0.0
                self._turn_audio.clear()
                self._speech_item_id = None
                if self._vad is not None:
                    self._vad.reset()
                await self._send(
                    InputAudioBufferClearedEvent(type="input_audio_buffer.cleared", event_id="")
                )
            case OutputAudioClear():
                await self._on_output_clear()
            case ItemCreate():
                await self._on_item_create(event)
            case ItemTruncate():
                await self._on_truncate(event)
            case ItemDelete():
                item = self._find_item(event.item_id, param="item_id")
                del self.items[item.id]
                self._order.remove(item.id)
                await self._send(
                    ConversationItemDeletedEvent(
                        type="conversation.item.deleted", event_id="", item_id=item.id
                    )
                )
            case ItemRetrieve():
                item = self._find_item(event.item_id, param="item_id")
                await self._send(
                    ConversationItemRetrieved(
                        type="conversation.item.retrieved", event_id="", item=_item_model(item)
                    )
                )
            case ResponseCreate():
                await self._on_response_create(event)
            case ResponseCancel():
                await self._on_response_cancel(event)

    async def _on_output_clear(self) -> None:
        await self._send(
            OutputAudioBufferCleared(
                type="output_audio_buffer.cleared",
                event_id="",
                response_id=self._last_response_id or "",
            )
        )

    # ---- session -----------------------------------------------------------------------

    def _session_payload(self) -> RealtimeSessionCreateRequest:
        payload = self.config.model_dump(mode="json")
        for side in (payload.get("audio") or {}).values():
            for key, value in (side or {}).items():
                if isinstance(value, dict):
                    # `{"type": "audio/pcmu"}`, not `{"type": "audio/pcmu", "rate": null}`.
                    side[key] = {k: v for k, v in value.items() if v is not None}
        payload.update(
            object="realtime.session",
            id=self.id,
            expires_at=int(time.time()) + 3600,
        )
        return RealtimeSessionCreateRequest.model_validate(payload)

    async def _on_session_update(self, event: SessionUpdate) -> None:
        output = event.session.audio.output if event.session.audio is not None else None
        voice = output.voice if output is not None else None
        current = self.config.audio.output if self.config.audio is not None else None
        if self.spoke and voice is not None and (current is None or voice != current.voice):
            raise ClientEventError(
                "Cannot update a conversation's voice if assistant audio is present.",
                code="cannot_update_voice",
            )
        try:
            self.config = merge_session(self.config, event.session)
        except ValidationError as exc:
            raise _as_client_error(exc) from None
        self._effective = EffectiveConfig.of(self.config)
        self._rebuild_vad()
        await self._send(
            SessionUpdatedEvent(
                type="session.updated", event_id="", session=self._session_payload()
            )
        )

    def _rebuild_vad(self) -> None:
        detection = self._effective.turn_detection
        if detection is None:
            self._vad = None
            return
        self._vad = EnergyVad(
            detection.vad,
            self._effective.input_encoding,
            offset_ms=int(self._stream_ms),
            kind=self._vad_kind,
        )

    # ---- input audio -------------------------------------------------------------------

    async def _on_append(self, event: InputAudioAppend) -> None:
        try:
            audio = base64.b64decode(event.audio, validate=True)
        except (binascii.Error, ValueError):
            raise ClientEventError(
                "Invalid 'audio'. Expected base64-encoded audio bytes.",
                code="invalid_value",
                param="audio",
            ) from None
        ms = audio_ms(len(audio), self._effective.input_encoding)
        self._buffer_ms += ms
        self._stream_ms += ms
        if self._recognizer is not None:
            self._turn_audio += audio
            keep = _bytes_per_ms(self._effective.input_encoding) * MAX_TURN_AUDIO_MS
            if len(self._turn_audio) > keep:
                del self._turn_audio[:-keep]
        if self._vad is None:
            return
        for vad_event in self._vad.feed(audio):
            if isinstance(vad_event, SpeechStarted):
                await self._on_speech_started(vad_event)
            elif isinstance(vad_event, SpeechStopped):
                await self._on_speech_stopped(vad_event)

    async def _on_speech_started(self, event: SpeechStarted) -> None:
        self._speech_item_id = new_id("item")
        self._greeting_pending = False
        if self._recognizer is not None:
            # The turn starts at the VAD's start (prefix padding included), as the model hears it.
            since = max(0.0, self._stream_ms - event.audio_start_ms)
            keep = int(since) * _bytes_per_ms(self._effective.input_encoding)
            del self._turn_audio[: max(0, len(self._turn_audio) - keep)]
        await self._send(
            InputAudioBufferSpeechStartedEvent(
                type="input_audio_buffer.speech_started",
                event_id="",
                audio_start_ms=event.audio_start_ms,
                item_id=self._speech_item_id,
            )
        )
        detection = self._effective.turn_detection
        if detection is not None and detection.interrupt_response and self._active is not None:
            await self._stop_active(reason="turn_detected")

    async def _on_speech_stopped(self, event: SpeechStopped) -> None:
        item_id = self._speech_item_id or new_id("item")
        await self._send(
            InputAudioBufferSpeechStoppedEvent(
                type="input_audio_buffer.speech_stopped",
                event_id="",
                audio_end_ms=event.audio_end_ms,
                item_id=item_id,
            )
        )
        await self._commit_user_audio(item_id)
        detection = self._effective.turn_detection
        if detection is not None and detection.create_response and self._active is None:
            self._start_response(self._next_plan())

    async def _on_commit(self) -> None:
        if self._buffer_ms < MIN_COMMIT_MS:
            raise ClientEventError(
                "Error committing input audio buffer: buffer too small. Expected at least "
                f"{MIN_COMMIT_MS}ms of audio, but buffer only has {self._buffer_ms:.2f}ms of "
                "audio.",
                code="input_audio_buffer_commit_empty",
            )
        await self._commit_user_audio(self._speech_item_id or new_id("item"))

    async def _commit_user_audio(self, item_id: str) -> None:
        self._speech_item_id = None
        self._buffer_ms = 0.0
        self._greeting_pending = False
        if self._vad is not None:
            self._vad.reset()
        previous = self._order[-1] if self._order else None
        recognized = await self._recognized_transcript()
        transcript = recognized if recognized is not None else self._caller_transcript()
        item = ConversationItemState(id=item_id, type="message", role="user")
        self._append_item(item)
        await self._send(
            InputAudioBufferCommittedEvent(
                type="input_audio_buffer.committed",
                event_id="",
                item_id=item_id,
                previous_item_id=previous,
            )
        )
        await self._send_item_added_done(item, previous)
        if self._effective.transcription:
            item.transcript = transcript
            await self._send(
                ConversationItemInputAudioTranscriptionCompletedEvent.model_validate(
                    {
                        "type": "conversation.item.input_audio_transcription.completed",
                        "event_id": "",
                        "item_id": item_id,
                        "content_index": 0,
                        "transcript": transcript,
                        "usage": {"type": "duration", "seconds": 1.0},
                    }
                )
            )

    async def _recognized_transcript(self) -> str | None:
        """With a recogniser: what the caller said, matched to the scenario's expected phrases;
        the step whose phrase it is plays next (None: no recogniser, use the script)."""
        if self._recognizer is None:
            return None
        speech = bytes(self._turn_audio)
        self._turn_audio.clear()
        recognizer = self._recognizer
        encoding = self._effective.input_encoding
        # Decoding is CPU-bound: off the event loop (other calls' audio keeps flowing).
        try:
            result = await asyncio.to_thread(lambda: recognizer().recognize(speech, encoding))
        except Exception as exc:  # the engine's own failure: this turn falls back to the script
            log.warning("simulator: recognition failed (%s); the script says what was said", exc)
            return None
        self.recognitions.append(result)
        steps = self._scenario.steps
        for index in range(self._next_step, len(steps)):
            if result.phrase is not None and steps[index].caller_transcript == result.phrase:
                self._next_step = index
                self._misheard = False
                return result.phrase
        # Nothing expected was said: the scripted model asks again, as a real one would.
        self._misheard = True
        return result.heard

    def _caller_transcript(self) -> str:
        steps = self._scenario.steps
        if self._next_step < len(steps) and steps[self._next_step].caller_transcript:
            return steps[self._next_step].caller_transcript or ""
        return "(caller speech)"

    # ---- conversation items ------------------------------------------------------------

    def _append_item(self, item: ConversationItemState, after: str | None = None) -> None:
        self.items[item.id] = item
        if after is None:
            self._order.append(item.id)
        elif after == "root":
            self._order.insert(0, item.id)
        else:
            self._order.insert(self._order.index(after) + 1, item.id)

    def _find_item(self, item_id: str, *, param: str) -> ConversationItemState:
        item = self.items.get(item_id)
        if item is None:
            raise ClientEventError(
                f"Conversation item with id '{item_id}' not found.",
                code="item_not_found",
                param=param,
            )
        return item

    async def _send_item_added_done(
        self, item: ConversationItemState, previous: str | None
    ) -> None:
        await self._send(
            ConversationItemAdded(
                type="conversation.item.added",
                event_id="",
                item=_item_model(item),
                previous_item_id=previous,
            )
        )
        await self._send(
            ConversationItemDone(
                type="conversation.item.done",
                event_id="",
                item=_item_model(item),
                previous_item_id=previous,
            )
        )

    async def _on_item_create(self, event: ItemCreate) -> None:
        previous = event.previous_item_id
        if previous is not None and previous != "root" and previous not in self.items:
            raise ClientEventError(
                f"Previous item with id '{previous}' not found.",
                code="item_not_found",
                param="previous_item_id",
            )
        spec = event.item
        item_id = spec.id or new_id("item")
        if item_id in self.items:
            raise ClientEventError(
                f"Item with id '{item_id}' already exists.", code="invalid_value", param="item.id"
            )
        if isinstance(spec, ClientFunctionCallOutputItem):
            if not any(
                i.type == "function_call" and i.call_id == spec.call_id for i in self.items.values()
            ):
                raise ClientEventError(
                    f"Tool call ID '{spec.call_id}' not found in conversation.",
                    code="invalid_value",
                    param="item.call_id",
                )
            item = ConversationItemState(
                id=item_id, type="function_call_output", call_id=spec.call_id, output=spec.output
            )
            self.function_outputs.append((spec.call_id, spec.output))
            self._latest_output = spec.output
        elif isinstance(spec, ClientFunctionCallItem):
            item = ConversationItemState(
                id=item_id,
                type="function_call",
                name=spec.name,
                call_id=spec.call_id or new_id("call"),
                arguments=spec.arguments,
            )
        else:
            item = ConversationItemState(
                id=item_id, type="message", role=spec.role, content=spec.content
            )
            if spec.role == "system":
                texts = [
                    str(part.get("text", ""))
                    for part in spec.content
                    if isinstance(part, dict) and part.get("type") == "input_text"
                ]
                self._latest_note = " ".join(t for t in texts if t) or self._latest_note
            try:
                _item_model(item)
            except ValidationError as exc:
                raise ClientEventError(
                    f"Invalid 'item.content': {exc.errors()[0]['msg']}.",
                    code="invalid_value",
                    param="item.content",
                ) from None
        shown_previous = self._order[-1] if previous is None and self._order else previous
        self._append_item(item, after=previous)
        await self._send_item_added_done(item, shown_previous)

    async def _on_truncate(self, event: ItemTruncate) -> None:
        item = self._find_item(event.item_id, param="item_id")
        if item.type != "message" or item.role != "assistant":
            raise ClientEventError(
                "Only assistant messages can be truncated.", code="invalid_value", param="item_id"
            )
        if event.content_index != 0:
            raise ClientEventError(
                f"Invalid 'content_index': {event.content_index}. The item has one audio part.",
                code="invalid_value",
                param="content_index",
            )
        if event.audio_end_ms > item.audio_ms:
            raise ClientEventError(
                f"Audio content of {item.audio_ms}ms is already shorter than "
                f"{event.audio_end_ms}ms",
                code="invalid_value",
                param="audio_end_ms",
            )
        text = item.transcript or ""
        keep = round(len(text) * event.audio_end_ms / item.audio_ms) if item.audio_ms else 0
        if keep < len(text):
            # Keep whole words: a word cut off mid-way was not heard.
            keep = max(0, text.rfind(" ", 0, keep + 1))
        item.transcript = text[:keep].rstrip()
        item.audio_ms = event.audio_end_ms
        item.truncated = True
        await self._send(
            ConversationItemTruncatedEvent(
                type="conversation.item.truncated",
                event_id="",
                item_id=item.id,
                content_index=event.content_index,
                audio_end_ms=event.audio_end_ms,
            )
        )

    # ---- responses ---------------------------------------------------------------------

    def _next_plan(self) -> _ResponsePlan:
        if self._greeting_pending and self._scenario.greeting is not None:
            self._greeting_pending = False
            greeting = self._scenario.greeting
            return _ResponsePlan(greeting, greeting.text, None)
        self._greeting_pending = False
        steps = self._scenario.steps
        if self._misheard or self._next_step >= len(steps):
            self._misheard = False
            fallback = self._scenario.fallback
            return _ResponsePlan(fallback, fallback.text, None)
        index = self._next_step
        step = steps[index]
        if self._latest_note is None and step.says_note():
            # Nothing to tell yet (another turn came first): a model asked to say an
            # update says it once told; until then it answers as it would anything else.
            fallback = self._scenario.fallback
            return _ResponsePlan(fallback, fallback.text, None)
        self._next_step += 1
        spoken = step.spoken()
        # A real model answers what the output said: a refusal is not a success line.
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
            if spoken
            else ""
        )
        return _ResponsePlan(spoken, text, step.function_call)

    async def _on_response_create(self, event: ResponseCreate | None = None) -> None:
        if self._active is not None:
            raise ClientEventError(
                f"Conversation already has an active response in progress: {self._active.id}. "
                "Wait until the response is finished before creating a new one.",
                code="conversation_already_has_active_response",
            )
        told = _told_to_say(event)
        if told is not None:
            # A response asked to say a given line (a resumed call's apology) says it, as a
            # model following its instructions would.
            self._greeting_pending = False
            self._start_response(_ResponsePlan(Reply(text=told), told, None))
            return
        self._start_response(self._next_plan())

    async def _on_response_cancel(self, event: ResponseCancel) -> None:
        active = self._active
        if active is None or (event.response_id is not None and event.response_id != active.id):
            raise ClientEventError(
                "Cancellation failed: no active response found",
                code="response_cancel_not_active",
            )
        await self._stop_active(reason="client_cancelled")

    def _start_response(self, plan: _ResponsePlan) -> None:
        response = _ActiveResponse(id=new_id("resp"), plan=plan)
        self._active = response
        self._last_response_id = response.id
        response.task = asyncio.create_task(self._run_response(response), name=response.id)

    async def _stop_active(
        self, reason: Literal["client_cancelled", "turn_detected"] | None
    ) -> None:
        """Cancel the active response and wait until its `response.done` went out.

        `reason=None` is for a closing connection: nothing more is sent.
        """
        active = self._active
        if active is None or active.task is None:
            return
        if active.state is ResponseState.IN_PROGRESS:
            active.advance(ResponseState.CANCELLING)
            active.cancel_reason = reason
        active.wake.set()
        task = active.task
        if reason is not None:
            # The response winds itself down and sends its cancelled `response.done`.
            await asyncio.wait([task], timeout=CANCEL_WAIT_S)
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
        if self._active is active:
            self._active = None

    async def _pause(self, response: _ActiveResponse, seconds: float) -> bool:
        """Wait `seconds` (scaled by realtime_factor); False when the response was cancelled."""
        delay = seconds * self._factor
        if delay <= 0:
            await asyncio.sleep(0)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(response.wake.wait(), delay)
        return response.state is ResponseState.IN_PROGRESS

    async def _run_response(self, response: _ActiveResponse) -> None:
        try:
            await self._stream_response(response)
        except ConnectionClosed:
            pass
        except Exception:
            log.exception("simulated response %s failed", response.id)
        finally:
            if self._active is response:
                self._active = None

    async def _stream_response(self, response: _ActiveResponse) -> None:
        plan = response.plan
        await self._send(
            ResponseCreatedEvent(
                type="response.created", event_id="", response=self._response_model(response)
            )
        )
        if plan.spoken is not None:
            await self._stream_message(response, plan.spoken, plan.text)
        if plan.function_call is not None:
            for _ in range(plan.function_call.repeat):
                if response.state is not ResponseState.IN_PROGRESS:
                    break
                await self._stream_function_call(response, plan.function_call)
        # No active response from here on: the client may send response.create at once.
        response.advance(ResponseState.DONE)
        if self._active is response:
            self._active = None
        await self._send(
            ResponseDoneEvent(
                type="response.done", event_id="", response=self._response_model(response)
            )
        )

    def _response_model(self, response: _ActiveResponse) -> RealtimeResponse:
        if response.state is ResponseState.DONE:
            status: Literal["completed", "cancelled", "in_progress"] = (
                "cancelled" if response.cancel_reason else "completed"
            )
        else:
            status = "in_progress"
        audio_ms_total = sum(i.audio_ms for i in response.output)
        text_tokens = sum(len((i.transcript or "") + i.arguments) // 4 for i in response.output)
        audio_tokens = audio_ms_total // 100
        fmt = {"pcmu": "audio/pcmu", "pcma": "audio/pcma", "pcm16": "audio/pcm"}[
            self._effective.output_encoding
        ]
        voice = (
            self.config.audio.output.voice
            if self.config.audio and self.config.audio.output
            else None
        )
        return RealtimeResponse.model_validate(
            {
                "id": response.id,
                "object": "realtime.response",
                "status": status,
                "status_details": (
                    RealtimeResponseStatus(type="cancelled", reason=response.cancel_reason)
                    if status == "cancelled"
                    else None
                ),
                "output": [_item_model(i) for i in response.output],
                "conversation_id": "conv_" + self.id.removeprefix("sess_"),
                "output_modalities": ["audio"],
                "max_output_tokens": "inf",
                "audio": {
                    "output": {
                        "format": {"type": fmt},
                        "voice": voice if isinstance(voice, str) else None,
                    }
                },
                "metadata": None,
                "usage": (
                    RealtimeResponseUsage.model_validate(
                        {
                            "total_tokens": 200 + text_tokens + audio_tokens,
                            "input_tokens": 200,
                            "output_tokens": text_tokens + audio_tokens,
                            "input_token_details": {
                                "text_tokens": 150,
                                "audio_tokens": 50,
                                "cached_tokens": 0,
                            },
                            "output_token_details": {
                                "text_tokens": text_tokens,
                                "audio_tokens": audio_tokens,
                            },
                        }
                    )
                    if status != "in_progress"
                    else None
                ),
            }
        )

    async def _add_output_item(self, response: _ActiveResponse, item: ConversationItemState) -> int:
        previous = self._order[-1] if self._order else None
        self._append_item(item)
        response.output.append(item)
        output_index = len(response.output) - 1
        await self._send(
            ResponseOutputItemAddedEvent(
                type="response.output_item.added",
                event_id="",
                response_id=response.id,
                output_index=output_index,
                item=_item_model(item),
            )
        )
        await self._send(
            ConversationItemAdded(
                type="conversation.item.added",
                event_id="",
                item=_item_model(item),
                previous_item_id=previous,
            )
        )
        return output_index

    async def _finish_output_item(
        self, response: _ActiveResponse, item: ConversationItemState, output_index: int
    ) -> None:
        item.status = "completed" if response.state is ResponseState.IN_PROGRESS else "incomplete"
        await self._send(
            ResponseOutputItemDoneEvent(
                type="response.output_item.done",
                event_id="",
                response_id=response.id,
                output_index=output_index,
                item=_item_model(item),
            )
        )
        index = self._order.index(item.id) if item.id in self._order else 0
        await self._send(
            ConversationItemDone(
                type="conversation.item.done",
                event_id="",
                item=_item_model(item),
                previous_item_id=self._order[index - 1] if index > 0 else None,
            )
        )

    async def _stream_message(self, response: _ActiveResponse, reply: Reply, text: str) -> None:
        item = ConversationItemState(
            id=new_id("item"), type="message", role="assistant", status="in_progress"
        )
        output_index = await self._add_output_item(response, item)
        ids: dict[str, Any] = {
            "response_id": response.id,
            "item_id": item.id,
            "output_index": output_index,
            "content_index": 0,
        }
        await self._send(
            ResponseContentPartAddedEvent(
                type="response.content_part.added",
                event_id="",
                part=AddedPart(type="audio", transcript=""),
                **ids,
            )
        )
        item.transcript = ""
        encoding = self._effective.output_encoding
        audio = await self._speech(reply, text, encoding)
        total_ms = max(1, len(audio) // _bytes_per_ms(encoding))
        step = _bytes_per_ms(encoding) * self._chunk_ms
        sent_ms = 0
        sent_chars = 0
        if await self._pause(response, FIRST_AUDIO_DELAY_S):
            for offset in range(0, len(audio), step):
                chunk = audio[offset : offset + step]
                chunk_ms = len(chunk) // _bytes_per_ms(encoding)
                self.spoke = True
                await self._send_audio_chunk(response, ids, chunk, total_ms, first=offset == 0)
                sent_ms += chunk_ms
                upto = len(text) if sent_ms >= total_ms else len(text) * sent_ms // total_ms
                if upto < len(text):
                    # Whole words only, like the real transcript deltas.
                    space = text.rfind(" ", sent_chars, upto)
                    upto = space + 1 if space >= sent_chars else sent_chars
                if not item.truncated:
                    item.audio_ms = sent_ms
                if upto > sent_chars:
                    delta = text[sent_chars:upto]
                    sent_chars = upto
                    if not item.truncated:
                        item.transcript = text[:sent_chars]
                    await self._send(
                        ResponseAudioTranscriptDeltaEvent(
                            type="response.output_audio_transcript.delta",
                            event_id="",
                            delta=delta,
                            **ids,
                        )
                    )
                if not await self._pause(response, chunk_ms / 1000.0 / GENERATION_SPEEDUP):
                    break
        transcript = item.transcript or ""
        await self._send(
            ResponseAudioDoneEvent(type="response.output_audio.done", event_id="", **ids)
        )
        await self._send(
            ResponseAudioTranscriptDoneEvent(
                type="response.output_audio_transcript.done",
                event_id="",
                transcript=text[:sent_chars],
                **ids,
            )
        )
        await self._send(
            ResponseContentPartDoneEvent(
                type="response.content_part.done",
                event_id="",
                part=DonePart(type="audio", transcript=transcript),
                **ids,
            )
        )
        await self._finish_output_item(response, item, output_index)

    async def _speech(self, reply: Reply, text: str, encoding: AudioEncoding) -> bytes:
        """The reply's audio: spoken by the voice (padded with silence to the scripted
        `audio_ms`, never cut), else synthetic tones of the reply's duration; then its
        `tail_samples`."""
        audio = await self._spoken_or_tones(reply, text, encoding)
        if reply.tail_samples:
            width = 2 if encoding == "pcm16" else 1
            audio += audio[-width:] * reply.tail_samples
        return audio

    async def _spoken_or_tones(self, reply: Reply, text: str, encoding: AudioEncoding) -> bytes:
        if self._voice is not None and text.strip():
            try:
                spoken = await self._voice.speak(text, encoding)
            except SpeechError as exc:
                log.warning("simulator: %s; this reply is synthetic tones", exc)
            else:
                scripted = reply.audio_ms or 0
                missing = scripted * _bytes_per_ms(encoding) - len(spoken)
                if missing > 0:
                    silence = b"\x00" if encoding == "pcm16" else bytes([_SILENCE[encoding]])
                    spoken += silence * missing
                return spoken
        return synthesize_speech(reply.duration_ms(text), zlib.crc32(text.encode()), encoding)

    async def _send_audio_chunk(
        self, response: _ActiveResponse, ids: dict[str, Any], chunk: bytes, total_ms: int,
        *, first: bool,
    ) -> None:  # fmt: skip
        """Hand one chunk of agent audio to the client (the sideband plays it out itself)."""
        await self._send(
            ResponseAudioDeltaEvent(
                type="response.output_audio.delta",
                event_id="",
                delta=base64.b64encode(chunk).decode("ascii"),
                **ids,
            )
        )

    async def _stream_function_call(
        self, response: _ActiveResponse, call: FunctionCallStep
    ) -> None:
        item = ConversationItemState(
            id=new_id("item"),
            type="function_call",
            status="in_progress",
            name=call.name,
            call_id=new_id("call"),
        )
        output_index = await self._add_output_item(response, item)
        arguments = call.rendered_arguments(output=self._latest_output)
        pieces = max(1, min(4, len(arguments) // 12))
        size = math.ceil(len(arguments) / pieces)
        pause_s = (
            ARGUMENT_DELTA_DELAY_S
            if call.arguments_ms is None
            else call.arguments_ms / 1000 / pieces
        )
        for start in range(0, len(arguments), size):
            if not await self._pause(response, pause_s):
                break
            delta = arguments[start : start + size]
            item.arguments += delta
            await self._send(
                ResponseFunctionCallArgumentsDeltaEvent(
                    type="response.function_call_arguments.delta",
                    event_id="",
                    response_id=response.id,
                    item_id=item.id,
                    output_index=output_index,
                    call_id=item.call_id or "",
                    delta=delta,
                )
            )
        # The real server sends this for cancelled responses too: it is not proof of a call.
        await self._send(
            ResponseFunctionCallArgumentsDoneEvent(
                type="response.function_call_arguments.done",
                event_id="",
                response_id=response.id,
                item_id=item.id,
                output_index=output_index,
                call_id=item.call_id or "",
                name=call.name,
                arguments=item.arguments,
            )
        )
        await self._finish_output_item(response, item, output_index)

    # ---- sending -----------------------------------------------------------------------

    async def _send_error(self, error: ClientEventError, *, event_id: str | None = None) -> None:
        await self._send(
            RealtimeErrorEvent(
                type="error",
                event_id="",
                error=RealtimeError(
                    type=error.type,
                    code=error.code,
                    message=error.message,
                    param=error.param,
                    event_id=event_id,
                ),
            )
        )

    async def _send(self, event: BaseModel) -> None:
        data = event.model_dump(mode="json", exclude_unset=True)
        data["event_id"] = new_id("event")
        # Logged before the write so the log order is the wire order.
        self._record(self.sent, data)
        await self._ws.send(json.dumps(data))

    def _record(self, log_: list[tuple[float, dict[str, Any]]], data: dict[str, Any]) -> None:
        if self._recording:
            log_.append((time.monotonic(), data))
            self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


class RealtimeSimulator:
    """A Realtime API stand-in on a real socket; see the module docstring for the protocol."""

    def __init__(
        self,
        scenario: Scenario | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        realtime_factor: float = 1.0,
        chunk_ms: int = 150,
        record: bool = True,
        voice: SpeechSynthesizer | None = None,
        recognize: bool = False,
        vad: VadKind = "auto",
    ) -> None:
        """`record=False` keeps no event logs and forgets closed sessions (long-running use).

        `voice` speaks the replies (None: synthetic tones of the scripted durations);
        `recognize` decodes the caller's turns with PocketSphinx against the scenario's
        expected phrases instead of taking them from the script; `vad` chooses the speech
        detector (`auto`: WebRTC's where installed)."""
        self.scenario = scenario if scenario is not None else load_scenario()
        self.voice = voice
        self.recognize = recognize
        self.vad: VadKind = vad
        self._recognizer: PhraseRecognizer | None = None
        self._recognizer_lock = threading.Lock()
        self.record = record
        self.host = host
        self.realtime_factor = realtime_factor
        self.chunk_ms = chunk_ms
        self.sessions: list[SimulatedSession] = []
        # GPT-Live connections (`/v1/live/sessions`, `client.live.connect()`), in order.
        self.live_sessions: list[LiveSimulatedSession] = []
        self.connect_attempts = 0
        self._requested_port = port
        self._port: int | None = None
        self._server: Server | None = None
        self._refuse = 0
        # Every opening handshake waits this long before it is answered (a slow API).
        self.handshake_delay_s = 0.0
        self._handlers: set[asyncio.Task[None]] = set()
        self._sessions_changed = asyncio.Event()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the simulator is not started")
        return self._port

    @property
    def base_url(self) -> str:
        """The SDK's `base_url` (or `OPENAI_BASE_URL`) for this simulator."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}{REALTIME_PATH}"

    async def start(self) -> int:
        """Bind and serve; returns the bound port."""
        self._server = await serve(
            self._handle,
            self.host,
            self._requested_port,
            process_request=self._process_request,
            max_size=16 * 1024 * 1024,
            compression=None,
        )
        sockname = next(iter(self._server.sockets)).getsockname()
        self._port = int(sockname[1])
        log.info("realtime simulator listening at %s", self.base_url)
        return self._port

    async def stop(self) -> None:
        """Close every connection (1001 going away) and stop listening."""
        if self._server is None:
            return
        self._server.close()
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> RealtimeSimulator:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # ---- test hooks --------------------------------------------------------------------

    def fail_next_connects(self, n: int) -> None:
        """Refuse the next `n` connection attempts with HTTP 503 (to test reconnect budgets)."""
        self._refuse = n

    async def drop_all(self, *, within: float = 5.0) -> None:
        """Abort every open connection without a close frame, like a network drop (1006)."""
        live: list[Any] = [s for s in self.sessions if not s.closed.is_set()]
        live += [s for s in self.live_sessions if not s.closed.is_set()]
        for session in live:
            transport = session._ws.transport
            if transport is not None:
                transport.abort()
        async with asyncio.timeout(within):
            for session in live:
                await session.closed.wait()

    async def wait_for_session(
        self,
        index: int = 0,
        *,
        within: float = 5.0,
        timeout: float | None = None,  # noqa: ASYNC109 - alias of `within` for existing callers
    ) -> SimulatedSession:
        """Wait until connection number `index` (0-based) was accepted."""
        async with asyncio.timeout(within if timeout is None else timeout):
            while len(self.sessions) <= index:
                await self._sessions_changed.wait()
            return self.sessions[index]

    def _shared_recognizer(self) -> PhraseRecognizer:
        """One recogniser for every session (its model loads once); built on first use, in
        the recognising thread."""
        with self._recognizer_lock:
            if self._recognizer is None:
                phrases = [s.caller_transcript for s in self.scenario.steps if s.caller_transcript]
                self._recognizer = PhraseRecognizer(phrases)
            return self._recognizer

    # ---- websockets plumbing -----------------------------------------------------------

    async def _process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | None:
        url = urlsplit(request.path)
        if url.path.rstrip("/").startswith(MODELS_PATH):
            return self._models(connection, request, url.path.rstrip("/"))
        self.connect_attempts += 1
        if self.handshake_delay_s > 0:
            await asyncio.sleep(self.handshake_delay_s)
        if url.path.rstrip("/") not in (REALTIME_PATH, LIVE_PATH):
            return connection.respond(HTTPStatus.NOT_FOUND, "Not Found\n")
        if self._refuse > 0:
            self._refuse -= 1
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "Service Unavailable\n")
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth.removeprefix("Bearer ").strip():
            return connection.respond(HTTPStatus.UNAUTHORIZED, "Missing bearer authentication\n")
        return None

    def _models(self, connection: ServerConnection, request: Request, path: str) -> Response:
        """GET /v1/models[/{id}] as the API answers it (`serve` checks its key this way)."""
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth.removeprefix("Bearer ").strip():
            return connection.respond(HTTPStatus.UNAUTHORIZED, "Missing bearer authentication\n")
        model_id = path.removeprefix(MODELS_PATH).strip("/")
        model = {"id": model_id or DEFAULT_MODEL, "object": "model", "created": 0, "owned_by": ""}
        body = model if model_id else {"object": "list", "data": [model]}
        response = connection.respond(HTTPStatus.OK, json.dumps(body))
        del response.headers["Content-Type"]
        response.headers["Content-Type"] = "application/json"
        response.headers["Connection"] = "close"  # websockets serves one request a connection
        return response

    async def wait_for_live_session(
        self, index: int = 0, *, within: float = 5.0
    ) -> LiveSimulatedSession:
        """Wait until GPT-Live connection number `index` (0-based) was accepted."""
        async with asyncio.timeout(within):
            while len(self.live_sessions) <= index:
                await self._sessions_changed.wait()
            return self.live_sessions[index]

    async def _handle_live(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        session = LiveSimulatedSession(
            ws,
            self.scenario,
            authorization=ws.request.headers.get("Authorization"),
            realtime_factor=self.realtime_factor,
            chunk_ms=self.chunk_ms,
            synthesize=synthesize_speech,
            record=self.record,
        )
        self.live_sessions.append(session)
        changed, self._sessions_changed = self._sessions_changed, asyncio.Event()
        changed.set()
        try:
            await session.run()
        except Exception:
            log.exception("simulator live session %s failed", session.id)
        finally:
            if not self.record:
                self.live_sessions.remove(session)

    async def _handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None  # set once the handshake completed
        if urlsplit(ws.request.path).path.rstrip("/") == LIVE_PATH:
            await self._handle_live(ws)
            return
        query = parse_qs(urlsplit(ws.request.path).query)
        session = SimulatedSession(
            ws,
            self.scenario,
            model=query.get("model", [DEFAULT_MODEL])[0],
            call_id=query.get("call_id", [None])[0],
            authorization=ws.request.headers.get("Authorization"),
            realtime_factor=self.realtime_factor,
            chunk_ms=self.chunk_ms,
            record=self.record,
            voice=self.voice,
            recognizer=self._shared_recognizer if self.recognize else None,
            vad=self.vad,
        )
        self.sessions.append(session)
        changed, self._sessions_changed = self._sessions_changed, asyncio.Event()
        changed.set()
        try:
            await session.run()
        except Exception:
            log.exception("simulator session %s failed", session.id)
        finally:
            if not self.record:
                self.sessions.remove(session)


def run_simulator(
    host: str, port: int, scenario: str | None, speech: SpeechSetup | None = None
) -> int:
    """Blocking entry point of `voice-agent simulator`: serve until SIGINT/SIGTERM."""
    loaded = load_scenario(scenario)
    speech = speech or SpeechSetup(None, None, recognize=False, vad="energy")
    for notice in speech.notices:
        print(notice, file=sys.stderr, flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with RealtimeSimulator(
            loaded,
            host=host,
            port=port,
            record=False,
            voice=speech.agent,
            recognize=speech.recognize,
            vad=speech.vad,
        ) as sim:
            print(f"Realtime simulator ({loaded.name}) at {sim.base_url}", flush=True)
            print(f"  {speech.describe()}", flush=True)
            print(f"  export OPENAI_BASE_URL={sim.base_url}", flush=True)
            await stop.wait()

    try:
        asyncio.run(main())
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(
            f"voice-agent simulator: port {port} on {host} is already in use (another "
            "simulator?): stop that process or choose another port with --port",
            file=sys.stderr,
        )
        return 2
    return 0
