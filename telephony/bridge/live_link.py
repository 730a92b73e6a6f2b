"""The GPT-Live model link: `session.start` and `session.started`, reconnect within a budget,
read; and each client event the parts send (`LiveSession`), bounded by the send timeout.

GPT-Live is full duplex and takes its turns itself: there is no response to create, cancel or
truncate. What the parts ask of a `ModelSession` maps as follows: caller audio is
`session.input_audio.append` (the leg's G.711 as is: `session.start` names it, 8000 Hz, so
there is no resampling); a function output is `response.item.create` (`function_call_output`)
and the `response.create` that lets the Responses backend go on; a note (a late result, a
result for a session that is gone) is `session.commentary.append`, speakable context the model
says when it sees fit; truncate, cancel and clear have no Live counterpart and send nothing.

A reconnect starts the new session with the conversation so far (`session.start`'s `input`);
a handoff updates the Responses backend (`session.update`: the new agent's rules and tools) and
appends the new agent's persona (`session.instructions.append`), since the frontend instructions
cannot change after startup.

Live audio deltas carry no item: the link names each agent utterance itself
(`LiveSession.item_id`, moved on by `next_utterance` at every turn boundary) so that playout
accounts for what the caller heard per utterance, as it does per Realtime item.

Sideband mode (`sideband_session_id`: OpenAI's SIP interconnect on GPT-Live): OpenAI carries
the audio and the session was configured by the accept, so the link attaches to it
(`client.live.sideband.connect(session_id=…)`, no `session.start`) for control only, and a
re-attach finds the conversation still there. No audio reaches us; what the caller heard is
inferred from the agent's transcript fragments, whose `start_ms`/`end_ms` place their audio on
the session's timeline: each fragment stands for that much audio, played out in real time from
when the fragment arrives (the leg's clock, `LiveSidebandLeg`), and stopped when the caller
begins to speak (the model stops talking over the caller by itself). A fragment without a span
counts as its text's length spoken (about 15 characters a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from openai import AsyncOpenAI
from openai.resources.live.live import AsyncLiveConnection
from openai.resources.live.sideband import AsyncSidebandConnection
from openai.types.live import ConnectServerEvent
from openai.types.live.server_event import ServerEvent
from websockets.exceptions import ConnectionClosed, InvalidStatus

from telephony.bridge.link_common import (
    SessionRefused,
    bounded_send,
    close_quietly,
    emit_server_error,
    open_within_budget,
)
from telephony.bridge.live_backend import ClientBackend
from telephony.bridge.live_items import functions, history_input
from telephony.bridge.model_link import DeltaHandler, DeltaLane, EventHandler
from telephony.bridge.port import Port
from telephony.bridge.slot import ResponseSlot, ResponseState
from telephony.call_events import CallEventKind
from telephony.legs.leg import AudioFormat
from telephony.realtime_wire import (
    AudioDelta,
    ReleasingConnection,
    event_classes,
    frame_object,
    proxy_resolved,
    release_connection,
    sdk_event,
)
from telephony.session_config import BridgeConfig, instructions_text

log = logging.getLogger(__name__)

SESSION_START_EVENT_ID = "bridge_session_start"
OUTPUT_AUDIO_DELTA = "session.output_audio.delta"
# The SDK's GPT-Live server-event models by type, on the primary socket and on the sideband
# (each connection's `parse_event` has its own union): see realtime_wire.sdk_event.
SERVER_EVENTS = event_classes(ServerEvent)
SIDEBAND_EVENTS = event_classes(ConnectServerEvent)
# Server events the read loop itself needs, whatever its handler acts on (beside the audio
# deltas, read before them): the sideband's transcript deltas (their span played as silence)
# and the session's close.
LINK_EVENTS = frozenset({"session.output_transcript.delta", "session.closed"})
SESSION_UPDATE_EVENT_ID = "bridge_session_update"
# `session.instructions.append` takes at most 500 tokens.
MAX_APPEND_CHARS = 1_500
LIVE_RESUMED_NOTE = (
    "The connection to this call was interrupted for a moment and has been restored; the "
    "conversation so far is this session's input. Continue naturally from there; do not greet "
    "the caller again."
)
HANDOFF_APPEND = (
    "From now on you speak as another agent of this service; what follows replaces what the "
    "earlier instructions said about who you are and what you do (the call rules still hold):\n"
)
TIMEOUT_S = 10.0
LIVE_SOCKET_OPTIONS: Any = {"compression": None, "create_connection": ReleasingConnection}
# The leg's codec is what GPT-Live carries too (G.711 at 8 kHz): no transcoding either way.
LIVE_FORMATS: dict[AudioFormat, dict[str, Any]] = {
    "audio/pcmu": {"type": "audio/pcmu", "rate": 8000},
    "audio/pcma": {"type": "audio/pcma", "rate": 8000},
}


class LiveSessionRejected(SessionRefused):
    """The server refused our `session.start`."""


class LiveSidebandRefused(SessionRefused):
    """OpenAI refused to (re-)attach the sideband of a Live session: the call is over there."""

    call_over = True


# Speech runs at ~15 characters a second: a transcript fragment with no span on the timeline.
MS_PER_CHAR = 65


def spoken_ms(event: Any) -> int:
    """The audio a `session.output_transcript.delta` stands for: its span on the session's
    timeline, else its text's length spoken."""
    span = int(getattr(event, "end_ms", 0) or 0) - int(getattr(event, "start_ms", 0) or 0)
    return span if span > 0 else len(getattr(event, "delta", "") or "") * MS_PER_CHAR


def silence(ms: int) -> str:
    """`ms` of G.711 mu-law silence, base64: what a sideband utterance's audio counts as."""
    return "////" * max(1, ms * 8 // 3)


def session_start(
    config: BridgeConfig,
    audio_format: AudioFormat | None,
    tools: list[dict[str, Any]],
    persona: str | None,
    voice: str | None,
    history: list[str] | None = None,
) -> dict[str, Any]:
    """The `session.start` payload: model, instructions, audio format and voice, the catalog's
    tools as function tools of the Responses delegation (their calls come to us) with the same
    rules as its backend prompt, and after a reconnect the conversation so far as input.
    No `audio_format` (a SIP accept): SIP negotiates the media, the session names none."""
    instructions = instructions_text(config, persona=persona)
    audio: dict[str, Any] = {"output": {"voice": voice}}
    if audio_format is not None:
        audio = {"format": LIVE_FORMATS[audio_format], **audio}
    start: dict[str, Any] = {
        "model": config.live_model,
        "instructions": instructions + (f"\n\n{LIVE_RESUMED_NOTE}" if history else ""),
        "audio": audio,
        "delegation": (
            {"type": "client"}  # our own backend agent (telephony/bridge/live_backend.py)
            if config.live_delegation == "client"
            else {
                "type": "responses",
                "responses": {
                    "model": config.live_delegation_model,
                    "instructions": instructions,
                    "tools": functions(tools),
                },
            }
        ),
    }
    if history:
        start["input"] = history_input(history)
    return start


class LiveSession:
    """One GPT-Live connection: the client events the parts send, each bounded."""

    def __init__(
        self,
        conn: AsyncLiveConnection | AsyncSidebandConnection,
        generation: int,
        call_id: str,
        timeout_s: float,
        config: BridgeConfig | None = None,
    ) -> None:
        self.conn = conn
        self._config = config or BridgeConfig()
        self.generation = generation
        self.items: set[str] = set()  # never truncated: Live has no truncate
        self.voice: str | None = None
        self.session_id = f"{call_id}/{generation}"
        self.slot = ResponseSlot()
        # Turns are the server's: no response.created follows a create (see Utterances).
        self.server_turns = True
        self._call_id = call_id
        self._timeout_s = timeout_s
        self._utterance = 0
        self._outputs_waiting = False  # a function output awaits its response.create
        # Client delegation: our backend agent, whose function calls' outputs go to it.
        self.backend: ClientBackend | None = None

    # The agent's utterances, named by us (Live deltas carry no item).

    @property
    def item_id(self) -> str:
        return f"{self.session_id}/u{self._utterance}"

    @property
    def response_id(self) -> str:
        return f"{self.session_id}/r{self._utterance}"

    def next_utterance(self) -> None:
        self._utterance += 1

    # ModelSession.

    async def append(self, payload: str) -> bool:
        return await self._send({"type": "session.input_audio.append", "audio": payload})

    def append_now(self, payload: str) -> bool:
        return False  # no synchronous lane on the Live socket: the audio path awaits append

    async def truncate(self, item_id: str, audio_end_ms: int) -> bool:
        return False  # the model decides where it stopped; nothing to tell it

    async def cancel_response(self, response_id: str) -> bool:
        return False

    async def clear_output(self) -> bool:
        return False

    async def add_function_output(self, function_call_id: str, output: str) -> bool:
        if self.backend is not None and self.backend.owns(function_call_id):
            return self.backend.output(function_call_id, output)
        sent = await self._send(
            {
                "type": "response.item.create",
                "item": {
                    "type": "function_call_output",
                    "call_id": function_call_id,
                    "output": output,
                },
            }
        )
        self._outputs_waiting = self._outputs_waiting or sent
        return sent

    async def add_note(self, text: str) -> bool:
        # Speakable context, not a forced turn: the model says it when the moment suits.
        return await self.add_commentary(text, None)

    async def add_commentary(self, text: str, delegation_id: str | None) -> bool:
        """Speakable context; `delegation_id`: the answer to that client delegation."""
        return await self._send(
            {"type": "session.commentary.append", "content": text, "delegation_id": delegation_id}
        )

    async def create_response(self, event_id: str, instructions: str | None) -> bool:
        # Turns are the server's: the only create is the one that lets the Responses backend
        # go on with the outputs it was given. Nothing answers it, so the slot is free again.
        sent = True
        if self._outputs_waiting:
            sent = await self._send({"type": "response.create", "event_id": event_id})
            self._outputs_waiting = False
        self.slot.move(ResponseState.IDLE)
        self.slot.forget_request()
        return sent

    async def update_session(self, persona: str, tools: list[dict[str, Any]]) -> bool:
        """A handoff: the frontend instructions cannot change after startup, so the new agent's
        tools and rules go to the Responses backend (`session.update`) and its persona is
        appended to the conversation's instructions (`session.instructions.append`)."""
        # Client delegation: our backend reads the active agent's rules and tools itself.
        updated = self.backend is not None or await self._send(
            {
                "type": "session.update",
                "event_id": SESSION_UPDATE_EVENT_ID,
                "session": {
                    "delegation": {
                        "type": "responses",
                        "responses": {
                            "instructions": instructions_text(self._config, persona=persona),
                            "tools": functions(tools),
                        },
                    }
                },
            }
        )
        appended = await self._send(
            {
                "type": "session.instructions.append",
                "content": (HANDOFF_APPEND + persona.strip())[:MAX_APPEND_CHARS],
                "delegation_id": None,
            }
        )
        return updated and appended

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(TIMEOUT_S):
                await self.conn.close()
        release_connection(self.conn)

    async def _send(self, event: dict[str, Any]) -> bool:
        return await bounded_send(
            self.conn.send(event),  # type: ignore[arg-type]
            self.conn, call_id=self._call_id, api="GPT-Live", timeout_s=self._timeout_s,
        )  # fmt: skip


class LiveLink:
    """`ModelLink` for GPT-Live: its primary WebSocket (Twilio and our SIP legs), or the
    sideband of a session OpenAI's SIP interconnect carries (`sideband_session_id`)."""

    def __init__(
        self,
        port: Port,
        config: BridgeConfig,
        client: AsyncOpenAI,
        audio_format: AudioFormat,
        tools: Callable[[], list[dict[str, Any]]],
        history: deque[str] | None = None,
        persona: Callable[[], str | None] = lambda: None,
        voice: Callable[[], str | None] = lambda: None,
        sideband_session_id: str | None = None,
    ) -> None:
        self._port = port
        self._history: deque[str] = history if history is not None else deque()
        # Sideband mode: OpenAI carries the audio; we attach to its session for control only.
        self._sideband_session_id = sideband_session_id
        self._config = config
        self._client = client
        self._audio_format = audio_format
        self._tools = tools
        self._persona = persona
        self._voice = voice
        self.keeps_conversation = sideband_session_id is not None
        self.backend: ClientBackend | None = None
        self._current: LiveSession | None = None
        if config.live_delegation == "client":
            self.backend = ClientBackend(port, config, client, tools, persona, self._history)
            self.backend.follow(lambda: self._current)
        self.ended_remotely = False
        self.deltas_by_lane = 0
        self.events_dropped = 0  # read and dropped unparsed: nothing acts on their type
        self._generation = 0

    async def connect(self, *, resumed: bool) -> tuple[LiveSession | None, int, str | None]:
        """Open a session and start it, retrying with backoff within the budget."""
        opened, attempts, error, refused = await open_within_budget(
            self._config, self._port.call_id, "GPT-Live", self._dial,
            lambda conn: self._start(conn, resumed),
        )  # fmt: skip
        if refused is not None and refused.call_over:
            self.ended_remotely = True
        if opened is None:
            return None, attempts, error
        conn, server_id = opened
        self._generation += 1
        session = LiveSession(
            conn, self._generation, self._port.call_id, self._config.send_timeout_s, self._config
        )
        session.voice = self._voice() or self._config.voice
        session.session_id = server_id[:64] or session.session_id
        session.backend = self.backend
        self._current = session
        return session, attempts, None

    async def _dial(self) -> AsyncLiveConnection | AsyncSidebandConnection:
        if self._sideband_session_id is not None:
            return await self._attach_sideband(self._sideband_session_id)
        return await self._client.live.connect(
            websocket_connection_options=proxy_resolved(LIVE_SOCKET_OPTIONS, self._client),
            max_retries=0,
        ).enter()

    async def _attach_sideband(self, session_id: str) -> AsyncSidebandConnection:
        """Join the Live session OpenAI's SIP leg carries: it was configured by the accept."""
        try:
            return await self._client.live.sideband.connect(
                session_id=session_id,
                websocket_connection_options=proxy_resolved(LIVE_SOCKET_OPTIONS, self._client),
                max_retries=0,
            ).enter()  # fmt: skip
        except InvalidStatus as exc:
            status = exc.response.status_code
            if 400 <= status < 500 and status not in (401, 408, 429):
                # 404/410: the session is over. A network drop never gets an HTTP answer.
                raise LiveSidebandRefused(f"sideband refused ({status})") from exc
            raise

    async def _start(self, conn: Any, resumed: bool) -> str:
        """`session.start` (after a reconnect, with the conversation so far), then wait for
        `session.started`; the server's session id. A sideband starts nothing: the accept
        did, and the session keeps its conversation across re-attaches."""
        if self._sideband_session_id is not None:
            return self._sideband_session_id
        start = session_start(
            self._config,
            self._audio_format,
            self._tools(),
            self._persona(),
            self._voice() or self._config.voice,
            list(self._history) if resumed else None,
        )
        await conn.send(
            {
                "type": "session.start",
                "event_id": SESSION_START_EVENT_ID,
                "session": start,
            }
        )
        return await self._await_started(conn)

    async def _await_started(self, conn: Any) -> str:
        """Until `session.started` (audio before it would be refused); the server's id."""
        while True:
            event = await conn.recv()
            if event.type == "session.started":
                return event.session.id
            if event.type == "error":
                error = event.error
                emit_server_error(self._port, error, error.client_event_id)
                if error.client_event_id == SESSION_START_EVENT_ID:
                    raise LiveSessionRejected(f"session.start rejected: {error.message}"[:200])

    def open_lane(self, session: Any, lane: DeltaLane) -> bool:
        return False

    async def read(
        self,
        session: Any,
        on_delta: DeltaHandler,
        on_event: EventHandler,
        handles: frozenset[str] | None = None,
    ) -> str:
        """Handle server events until the socket drops; returns why it dropped.

        Each frame is parsed once (orjson): an audio delta on the primary socket goes to
        `on_delta` without the SDK's model (about 30 us each, 50 a second), the sideband's is
        dropped (see the module's docstring), an event whose type neither `handles` nor this
        link needs is dropped unparsed, and the rest goes to `on_event` as the SDK's model
        (`sdk_event`: validated against its own model, not the SDK's whole union)."""
        conn = session.conn
        call_id = self._port.call_id
        sideband = self._sideband_session_id is not None
        while True:
            try:
                raw = await conn.recv_bytes()
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else 1006
                return f"socket closed ({code})"
            except Exception as exc:
                return f"receive failed: {type(exc).__name__}"
            data = frame_object(raw)
            if data is None:
                log.warning("call %s: a GPT-Live frame that is not a JSON object: skipped", call_id)
                continue
            kind = data.get("type")
            if kind == OUTPUT_AUDIO_DELTA:
                if sideband:
                    continue  # the transcript's span accounts for it (see the docstring)
                audio = data.get("delta")
                if type(audio) is not str:
                    log.warning("call %s: a GPT-Live audio delta without audio: skipped", call_id)
                    continue
                delta = AudioDelta(session.response_id, session.item_id, audio)
                try:
                    await on_delta(session, delta)
                except Exception as exc:  # one odd delta must not end the call
                    log.exception("call %s: could not play a GPT-Live audio delta", call_id)
                    self._port.emit(
                        CallEventKind.ERROR, where=f"live:{kind}", error=repr(exc)[:200]
                    )
                continue
            if handles is not None and (
                type(kind) is not str or (kind not in handles and kind not in LINK_EVENTS)
            ):
                self.events_dropped += 1
                continue
            try:
                event = sdk_event(data, SIDEBAND_EVENTS if sideband else SERVER_EVENTS)
                if event is None:
                    event = conn.parse_event(raw)
            except Exception as exc:  # a frame the SDK's models cannot take
                log.warning("call %s: unreadable GPT-Live event: %r", call_id, exc)
                continue
            try:
                fatal = await on_event(session, event)
                if sideband and event.type == "session.output_transcript.delta":
                    # The audio this fragment stands for, played out by the leg's clock.
                    ms = spoken_ms(event)
                    delta = AudioDelta(session.response_id, session.item_id, silence(ms))
                    await on_delta(session, delta)
                if sideband and event.type == "session.closed":
                    # The caller hung up, the session expired: a re-attach will be refused.
                    self.ended_remotely = event.reason != "connection_lost"
            except Exception as exc:  # one odd event must not end the call
                log.exception("call %s: could not handle %s", call_id, event.type)
                self._port.emit(
                    CallEventKind.ERROR, where=f"live:{event.type}", error=repr(exc)[:200]
                )
                continue
            if fatal is not None:
                await close_quietly(conn)
                return fatal

    async def close(self, session: Any) -> None:
        await session.close()


__all__ = ["LiveLink", "LiveSession", "session_start"]
