"""The OpenAI Realtime model link: connect and configure, reconnect within a budget, read.

Owns the Realtime socket and nothing above it: opening a session (our own, configured with one
`session.update` and confirmed by `session.updated`; or attached to OpenAI's call over the
sideband, configured by the accept), retrying with backoff within the reconnect budget, the
read loop (each frame parsed once: audio deltas played without the SDK's models, events no
handler acts on dropped unparsed, the rest made into the SDK's models; in the set-up,
`session.created`/`session.updated` read from the raw frame too),
the audio-delta lane in the socket's callback, and each client event the parts send
(`RealtimeSession`), bounded by the send timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from openai import AsyncOpenAI
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from openai.types.realtime import RealtimeErrorEvent, RealtimeServerEvent
from websockets.exceptions import ConnectionClosed, InvalidStatus

from telephony.bridge.link_common import (
    SessionRefused,
    bounded_send,
    close_quietly,
    emit_server_error,
    open_within_budget,
)
from telephony.bridge.model_link import DeltaHandler, DeltaLane, EventHandler
from telephony.bridge.port import Port
from telephony.bridge.slot import ResponseSlot
from telephony.call_events import CallEventKind
from telephony.legs.leg import AudioFormat
from telephony.realtime_wire import (
    APPEND_HEAD,
    APPEND_TAIL,
    EVENT_TEXTS,
    AudioDelta,
    LaneConnection,
    ReleasingConnection,
    append_frame,
    delta_fields_of,
    event_classes,
    frame_object,
    lane_of,
    nowait_sender,
    proxy_resolved,
    raw_sender,
    release_connection,
    sdk_event,
    session_event_fields,
)
from telephony.session_config import BridgeConfig, agent_update, session_update
from telephony.watchdog import Watchdog

log = logging.getLogger(__name__)

SESSION_UPDATE_EVENT_ID = "bridge_session_update"
TIMEOUT_S = 10.0  # bound for closing a socket at the end

# The Realtime socket: base64 audio both ways, 50 frames a second, so compression costs CPU
# per frame and saves little (stated, so an SDK default cannot change it); and the lane for
# audio deltas (realtime_wire.LaneConnection), which the SDK passes on to websockets.
REALTIME_SOCKET_OPTIONS: Any = {"compression": None, "create_connection": LaneConnection}
# The sideband carries no audio: no lane, only a connection that leaves no cycle once lost.
SIDEBAND_SOCKET_OPTIONS: Any = {"compression": None, "create_connection": ReleasingConnection}


# The SDK's Realtime server-event models by type: a handled event is validated against its
# own model (realtime_wire.sdk_event), not the whole union.
SERVER_EVENTS = event_classes(RealtimeServerEvent)


class SessionRejected(SessionRefused):
    """The server refused the session configuration."""


class SidebandRefused(SessionRefused):
    """OpenAI refused to (re-)attach the sideband: the call is over on its side."""

    call_over = True


def _system_note(text: str) -> Any:
    return {
        "type": "message",
        "role": "system",
        "content": [{"type": "input_text", "text": text}],
    }


class RealtimeSession:
    """One Realtime connection: the client events the parts send, each bounded."""

    __slots__ = (
        "_append_watch",
        "_call_id",
        "_config",
        "_send_frame",
        "_send_now",
        "_timeout_s",
        "conn",
        "generation",
        "items",
        "server_turns",
        "session_id",
        "slot",
        "voice",
    )

    def __init__(
        self,
        conn: AsyncRealtimeConnection,
        generation: int,
        call_id: str,
        timeout_s: float,
        config: BridgeConfig | None = None,
    ) -> None:
        self.conn = conn
        self._config = config or BridgeConfig()
        self.generation = generation
        self.items: set[str] = set()
        self.voice: str | None = None
        self.session_id = f"{call_id}/{generation}"
        self.server_turns = False  # every response is one we asked for
        self.slot = ResponseSlot()
        self._call_id = call_id
        self._timeout_s = timeout_s
        # How a preformatted audio frame goes out on `conn` (realtime_wire.raw_sender), and
        # the same, synchronous, for the lanes (False when the socket cannot take it now).
        self._send_frame = raw_sender(conn)
        self._send_now = nowait_sender(conn)
        # Bounds each append (sent one at a time by the audio path) with one timer.
        self._append_watch = Watchdog(timeout_s)

    async def append(self, payload: str) -> bool:
        # The hot path: the leg's base64 spliced into a preformatted frame, sent raw.
        return await self._send(self._send_frame(append_frame(payload)), self._append_watch)

    def append_now(self, payload: str) -> bool:
        send_now = self._send_now
        return send_now is not None and send_now(APPEND_HEAD + payload + APPEND_TAIL)

    async def truncate(self, item_id: str, audio_end_ms: int) -> bool:
        return await self._send(
            self.conn.conversation.item.truncate(
                item_id=item_id, content_index=0, audio_end_ms=audio_end_ms
            )
        )

    async def cancel_response(self, response_id: str) -> bool:
        return await self._send(self.conn.response.cancel(response_id=response_id))

    async def clear_output(self) -> bool:
        return await self._send(self.conn.output_audio_buffer.clear())

    async def add_function_output(self, function_call_id: str, output: str) -> bool:
        # The Realtime field `call_id` is the model's function call id.
        item: Any = {"type": "function_call_output", "call_id": function_call_id, "output": output}
        return await self._send(self.conn.conversation.item.create(item=item))

    async def add_note(self, text: str) -> bool:
        return await self._send(self.conn.conversation.item.create(item=_system_note(text)))

    async def create_response(self, event_id: str, instructions: str | None) -> bool:
        # As the SDK's `response.create` writes it, its text kept for the next (EVENT_TEXTS).
        event: dict[str, Any] = {"type": "response.create", "event_id": event_id}
        if instructions is not None:
            event["response"] = {"instructions": instructions}
        return await self._send(EVENT_TEXTS.send(self.conn, event))

    async def update_session(self, persona: str, tools: list[dict[str, Any]]) -> bool:
        return await self._send(
            self.conn.session.update(session=agent_update(self._config, persona, tools))
        )

    async def close(self) -> None:
        lane = lane_of(self.conn)
        if lane is not None:
            lane.lane = None
        self._append_watch.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(TIMEOUT_S):
                await self.conn.close()
        release_connection(self.conn)

    async def _send(self, send: Awaitable[None], watch: Watchdog | None = None) -> bool:
        """Run one send, bounded by `watch` on the audio path, else by the send timeout."""
        return await bounded_send(
            send, self.conn, call_id=self._call_id, api="Realtime", timeout_s=self._timeout_s,
            watch=watch,
        )  # fmt: skip


class RealtimeLink:
    """`ModelLink` for the OpenAI Realtime API, own socket or sideband (`sideband_call_sid`)."""

    def __init__(
        self,
        port: Port,
        config: BridgeConfig,
        client: AsyncOpenAI,
        audio_format: AudioFormat,
        tools: Callable[[], list[dict[str, Any]]],
        history: deque[str],
        sideband_call_sid: str | None = None,
        persona: Callable[[], str | None] = lambda: None,
        voice: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._port = port
        self._config = config
        self._client = client
        self._audio_format = audio_format
        self._tools = tools
        self._persona = persona  # the active agent's instructions (None: the config's)
        self._voice = voice  # the active agent's voice (None: the config's)
        self._session_id: str | None = None  # the server's id of the session being set up
        self._history = history
        # Sideband mode: OpenAI carries the audio; we attach to its call for control only.
        self._sideband_call_sid = sideband_call_sid
        self.keeps_conversation = sideband_call_sid is not None
        self.ended_remotely = False
        self._generation = 0
        self._reader_waiting: RealtimeSession | None = None  # `read` awaits its next message
        self.deltas_by_lane = 0
        # Events read and dropped unparsed: no handler acts on their type (benchmarks).
        self.events_dropped = 0
        self._handles: frozenset[str] | None = None  # the reader's handler's (read)

    async def connect(self, *, resumed: bool) -> tuple[RealtimeSession | None, int, str | None]:
        """Open a session and configure it, retrying with backoff within the budget."""
        opened, attempts, error, refused = await open_within_budget(
            self._config, self._port.call_id, "Realtime", self._dial,
            lambda conn: self._configure(conn, resumed),
        )  # fmt: skip
        if refused is not None and refused.call_over:
            self.ended_remotely = True
        if opened is None:
            return None, attempts, error
        self._generation += 1
        session = RealtimeSession(
            opened[0],
            self._generation,
            self._port.call_id,
            self._config.send_timeout_s,
            self._config,
        )
        if self._sideband_call_sid is None:
            session.voice = self._voice() or self._config.voice
        if self._session_id is not None:
            session.session_id = self._session_id
        return session, attempts, None

    async def _dial(self) -> AsyncRealtimeConnection:
        if self._sideband_call_sid is not None:
            return await self._attach_sideband(self._sideband_call_sid)
        options = proxy_resolved(REALTIME_SOCKET_OPTIONS, self._client)
        return await self._client.realtime.connect(
            model=self._config.model, websocket_connection_options=options
        ).enter()

    async def _configure(self, conn: AsyncRealtimeConnection, resumed: bool) -> None:
        """Our own session: one `session.update`, confirmed (the sideband's was the accept)."""
        if self._sideband_call_sid is not None:
            return
        history = list(self._history) if resumed else []
        session = session_update(
            self._config,
            self._audio_format,
            self._tools(),
            history,
            self._persona(),
            self._voice(),
        )
        # What `conn.session.update(...)` sends, its wire form reused from the last call
        # (realtime_wire.EventTexts); not a resumed call's, which carries what was said (kept
        # by no one past the call, and the same for no other call).
        event = {"type": "session.update", "session": session, "event_id": SESSION_UPDATE_EVENT_ID}
        if history:
            await conn.session.update(event_id=SESSION_UPDATE_EVENT_ID, session=session)
        else:
            await EVENT_TEXTS.send(conn, event)
        await self._await_session_updated(conn)

    async def _attach_sideband(self, sideband_call_sid: str) -> AsyncRealtimeConnection:
        """Join OpenAI's call over the sideband: the session was set by the accept."""
        try:
            return await self._client.realtime.connect(
                call_id=sideband_call_sid,
                websocket_connection_options=proxy_resolved(SIDEBAND_SOCKET_OPTIONS, self._client),
            ).enter()
        except InvalidStatus as exc:
            status = exc.response.status_code
            if 400 <= status < 500 and status not in (401, 408, 429):
                # 404/410: the call is gone. A network drop never gets an HTTP answer.
                raise SidebandRefused(f"sideband refused ({status})") from exc
            raise

    async def _await_session_updated(self, conn: AsyncRealtimeConnection) -> None:
        """Until the server confirms the configuration: audio in another codec is noise."""
        self._session_id = None
        while True:
            raw = await conn.recv_bytes()
            # The two session events are read from the raw frame (their type and the session's
            # id: realtime_wire.session_event_fields); anything else is the SDK's to parse.
            fields = session_event_fields(raw)
            if fields is not None:
                kind, sid = fields
                if sid is not None:
                    self._session_id = sid[:64]
                if kind == "session.updated":
                    return
                continue
            event = conn.parse_event(raw)
            if isinstance(event, RealtimeErrorEvent) and event.type == "error":
                error = event.error
                emit_server_error(self._port, error, error.event_id)
                if error.event_id == SESSION_UPDATE_EVENT_ID:
                    raise SessionRejected(f"session.update rejected: {error.message}"[:200])

    def open_lane(self, session: Any, lane: DeltaLane) -> bool:
        conn_lane = lane_of(session.conn)
        if conn_lane is None:
            return False
        conn_lane.lane = functools.partial(self._lane, session, lane)
        return True

    def _lane(self, session: RealtimeSession, take: DeltaLane, raw: bytes) -> bool:
        """A server message as the Realtime socket receives it, while `read` waits on this
        session (so nothing is queued before it): an audio delta is taken here and then, an
        event the reader's handler does not act on is dropped here; anything else goes to
        `read`."""
        if self._reader_waiting is not session:
            return False
        data = frame_object(raw)
        if data is None:
            return False  # `read` says what was wrong with it
        fields = delta_fields_of(data)
        if fields is None:
            if not self._unwanted(data):
                return False
            self.events_dropped += 1
            return True
        self.deltas_by_lane += 1
        take(session, *fields)
        return True

    def _unwanted(self, data: dict[str, Any]) -> bool:
        """An event of a type the reader's handler does not act on (the handler's `handles`)."""
        handles = self._handles
        if handles is None:
            return False
        kind = data.get("type")
        return type(kind) is not str or kind not in handles

    async def read(
        self,
        session: Any,
        on_delta: DeltaHandler,
        on_event: EventHandler,
        handles: frozenset[str] | None = None,
    ) -> str:
        """Handle server events until the socket drops; returns why it dropped.

        Each frame is parsed once (orjson); an audio delta (most frames) goes to `on_delta`
        without the SDK's models, an event whose type is not in `handles` is dropped there
        (transcript deltas, content parts, item notices: the SDK's parse, 40-200 us each,
        would build them for nothing), and the rest goes to `on_event` as the SDK's model
        (`sdk_event`: validated against its own model, not the SDK's whole union).
        `handles` None: every event goes to `on_event`."""
        conn = session.conn
        call_id = self._port.call_id
        self._handles = handles
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
            data = frame_object(raw)
            if data is None:
                log.warning("call %s: a Realtime frame that is not a JSON object: skipped", call_id)
                continue
            fields = delta_fields_of(data)
            if fields is not None:
                try:
                    await on_delta(session, AudioDelta(*fields))
                except Exception as exc:  # one odd delta must not end the call
                    log.exception("call %s: could not play an audio delta", call_id)
                    self._port.emit(
                        CallEventKind.ERROR,
                        where="realtime:response.output_audio.delta",
                        error=repr(exc)[:200],
                    )
                continue
            if self._unwanted(data):
                self.events_dropped += 1
                continue
            try:
                event = sdk_event(data, SERVER_EVENTS)
                if event is None:
                    event = conn.parse_event(raw)
            except Exception as exc:  # a frame the SDK's models cannot take
                log.warning("call %s: unreadable Realtime event: %r", call_id, exc)
                continue
            try:
                fatal = await on_event(session, event)
            except Exception as exc:  # one odd event must not end the call
                log.exception("call %s: could not handle %s", call_id, event.type)
                self._port.emit(
                    CallEventKind.ERROR, where=f"realtime:{event.type}", error=repr(exc)[:200]
                )
                continue
            if fatal is not None:
                await close_quietly(conn)
                return fatal

    async def close(self, session: Any) -> None:
        await session.close()


__all__ = ["RealtimeLink", "RealtimeSession"]
