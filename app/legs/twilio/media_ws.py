"""uvicorn's WebSocket protocol with a lane for media streams that skips the ASGI queue.

Per 20 ms of a Twilio call one `media` frame comes in, and an agent's `media` plus now and then
a `mark` go out. Through ASGI each incoming frame is queued, the reading task is woken, the
socket's reading is paused until the app takes the frame and resumed after (two epoll calls),
and it passes Starlette and the leg's async generators; each outgoing one is an awaited
`send` through the same layers. `MediaWebSocketProtocol` is uvicorn's own sans-I/O protocol
with two additions, used by `/twilio/media` once a stream is admitted:

- `set_lane(callback, max_bytes)`: a text message (of at most `max_bytes`) is first offered
  to `callback(data)`, its UTF-8 bytes, where it is received, if no earlier message is still
  waiting for the app; when the callback takes it (returns True) it is done, otherwise it
  goes the ASGI way as before. So order is kept: the app sees nothing out of order, and once
  one message goes the slow way, the ones after it follow until the app has caught up. The
  bytes are offered before they are checked as UTF-8 (the lane parses them with orjson,
  which rejects invalid UTF-8): a lane must take only what it has parsed; a message it
  leaves is checked, and closes the socket with 1007 when it is not UTF-8.
- `send_text_nowait(texts)`: writes text messages at once, in one write (an agent's `media`
  and the `mark` after it cost one system call), when the socket is open and not under
  back-pressure; False (nothing written) tells the caller to use the ASGI send.

From the accept, the protocol reads plain frames itself (`_read_own`: final masked text
frames and pongs, about a fifth of websockets' cost per frame); the first frame of any other
kind hands the byte stream, from that frame on, to websockets' parser for good.

And on a protocol error (a frame over the size limit, say) the close frame is sent and the
peer's remaining data read and dropped for a moment before the socket closes, so the peer
learns the close code. Everything else (handshake, close, ping, limits, compression
settings) is uvicorn's.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import State

from telephony.fast_paths import FastPath
from telephony.ws_frames import (
    NO_LIMIT,
    PONG,
    TEXT,
    OwnFrameReader,
    message_limit,
    offer_to_lane,
    server_text_frame,
    state_reader,
    waiting_items,
)

# The key of the protocol in the ASGI scope's extensions.
LANE_EXTENSION = "voice-agent.media-lane"

Lane = Callable[[bytes], bool]
# After a protocol error, how long the peer has to read the close frame before the socket
# is closed (it usually closes its side first).
CLOSE_LINGER_S = 1.0
_TEXT_126 = bytes((TEXT, 126))  # a final, unmasked text frame with a 16-bit length


class MediaWebSocketProtocol(OwnFrameReader, WebSocketsSansIOProtocol):
    """uvicorn's `websockets-sansio` protocol plus the media lane (see the module docstring)."""

    lane: Lane | None = None
    _lane_max: int | None = None  # larger messages are not offered to the lane
    _app_queue: Any = ()  # the deque under uvicorn's ASGI queue (empty: nothing waits)
    _write_paused = False  # the transport asked us to stop writing (pause_writing)
    _state_of: Callable[[Any], Any] | None = None  # reads websockets' state (state_reader)
    _discarding = False
    _linger: asyncio.TimerHandle | None = None
    # Reading frames here (see `_read_own`): from the accept, while every frame is plain.
    _own = False
    _early = False  # bytes came between the request and the accept
    _masked = True
    _accept = frozenset({TEXT, PONG})  # read here; anything else goes to websockets

    async def send(self, message: Any) -> None:
        accepting = not self.handshake_complete and message.get("type") == "websocket.accept"
        await super().send(message)
        if accepting and self.handshake_complete and not self.close_sent:
            # The client waits for the 101 before sending (RFC 6455 4.1), so websockets'
            # parser is between frames with nothing buffered: frames can be read here.
            conn = self.conn
            self._own = (
                not self._early
                and not conn.extensions
                and not conn.reader.buffer
                and conn.state is State.OPEN
            )
            self._max_size = message_limit(conn)
            self._fast_limits()

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None and not self.handshake_complete:
            scope["extensions"][LANE_EXTENSION] = self

    def set_lane(self, lane: Lane | None, max_bytes: int | None = None) -> None:
        self.lane = lane
        self._lane_max = max_bytes
        self._fast_limits()

    def _fast_limits(self) -> None:
        limits = [x for x in (self._lane_max, self._max_size) if x is not None]
        self._fast_max = min(limits, default=NO_LIMIT)
        self._app_queue = waiting_items(self.queue, "_queue")

    def pause_writing(self) -> None:
        self._write_paused = True
        super().pause_writing()

    def resume_writing(self) -> None:
        self._write_paused = False
        super().resume_writing()

    def send_receive_event_to_app(self) -> None:
        if self.lane is not None and self.curr_msg_data_type == "text" and len(self.frames) == 1:
            data = self.frames[0]
            try:
                text = data.decode()
            except UnicodeDecodeError:
                pass  # uvicorn's path closes with 1007
            else:
                self.frames = []
                self._deliver_text(text, data)
                return
        super().send_receive_event_to_app()

    def _offer(self, data: bytes) -> bool:
        """True if the lane took the message `data` (nothing queued before it)."""
        limit = self._lane_max
        return (
            self.lane is not None
            and (limit is None or len(data) <= limit)
            and not self._app_queue
            and offer_to_lane(self, data)
        )

    def _deliver_text(self, text: str, data: bytes | None = None) -> None:
        """One text message for the app: to the lane if it takes it now, else queued."""
        if self.close_sent:
            return  # the app is past `websocket.close` (as uvicorn does)
        if self._offer(text.encode() if data is None else data):
            return
        self._queue_text(text)

    def _queue_text(self, text: str) -> None:
        self.queue.put_nowait({"type": "websocket.receive", "text": text})
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def _own_text(self, payload: bytes) -> bool:
        """A text message read here (`OwnFrameReader`): to the lane if it takes it now, else
        checked as UTF-8 and queued for the app."""
        if self.close_sent:
            return True  # the app is past `websocket.close` (as uvicorn does)
        if self._offer(payload):
            return True
        return self._leave_text(payload)

    def _leave_text(self, payload: bytes) -> bool:
        """A text message the lane did not take: checked as UTF-8 and queued for the app;
        False if it is not UTF-8 (nothing was done with it)."""
        try:
            text = payload.decode()
        except UnicodeDecodeError:
            return False
        self._queue_text(text)
        return True

    def _own_control(self, first: int, payload: bytes) -> None:
        self.handle_pong(Frame(Opcode.PONG, payload))

    def _hand_over(self, rest: bytes) -> None:
        """websockets' parser reads from here on, for good, starting with `rest`."""
        self._own = False
        self._rest = b""
        super().data_received(rest)

    def send_text_nowait(self, texts: Iterable[str]) -> bool:
        """Write each of `texts` as a message, now and in one write; False when they must
        wait (nothing written)."""
        if (
            not self.handshake_complete
            or self.close_sent
            or self.disconnected
            or self.initial_response is not None
            or self._write_paused
            or self.transport.is_closing()
        ):
            return False
        conn = self.conn
        state_of = self._state_of
        if state_of is None:
            state_of = self._state_of = state_reader(conn)
        if state_of(conn) is not State.OPEN:
            return False  # closing: the ASGI send says so properly
        if conn.extensions:  # compression negotiated (WS_DEFLATE): websockets frames it
            for text in texts:
                conn.send_text(text.encode())
            self.transport.write(b"".join(conn.data_to_send()))
            return True
        parts: list[bytes] = []
        for text in texts:
            payload = text.encode()
            length = len(payload)
            # A final text frame, unmasked (RFC 6455 5.2); a 20 ms media frame is 126+ bytes.
            if 125 < length < 65536:
                parts.append(_TEXT_126 + length.to_bytes(2, "big"))
                parts.append(payload)
            else:
                parts.append(server_text_frame(payload))
        self.transport.write(b"".join(parts))
        return True

    def data_received(self, data: bytes) -> None:
        if self._own:
            # The usual read (one whole media frame or mark echo) is read in one step.
            lane = self.lane
            if lane is None or self._app_queue or self.close_sent or not self._read_one(data, lane):
                self._read_own(data)
            return
        if self._discarding:
            return  # after a protocol error: the close is sent, the rest is not read
        if self.handshake_initiated and not self.handshake_complete:
            self._early = True
        super().data_received(data)

    def handle_parser_exception(self) -> None:
        """A protocol error (an oversized or malformed frame): send the close frame, then let
        the peer read it before the connection goes. uvicorn closes the socket at once,
        which, with the peer's frame still arriving, resets the connection and can destroy
        the close frame in the peer's buffer (it then sees 1006, not why)."""
        assert self.conn.close_sent is not None
        code = self.conn.close_sent.code
        reason = self.conn.close_sent.reason
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.lane = None
        self._discarding = True
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self._linger = self.loop.call_later(CLOSE_LINGER_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lane = None
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)
        # The scope (which this protocol holds) names this protocol for the route: a
        # reference cycle, which would leave the stream's objects to a full collection.
        extensions = getattr(self, "scope", {}).get("extensions")
        if extensions is not None and extensions.get(LANE_EXTENSION) is self:
            del extensions[LANE_EXTENSION]


# What MediaWebSocketProtocol overrides or calls on uvicorn's protocol, and the state it reads
# there (and on websockets' ServerProtocol, `conn`): all of it private to uvicorn.
_UVICORN_HOOKS = (
    "send",
    "handle_connect",
    "send_receive_event_to_app",
    "pause_writing",
    "resume_writing",
    "handle_pong",
    "data_received",
    "handle_parser_exception",
    "connection_lost",
)
_UVICORN_STATE = (
    "conn",
    "queue",
    "frames",
    "curr_msg_data_type",
    "handshake_initiated",
    "handshake_complete",
    "close_sent",
    "disconnected",
    "initial_response",
    "read_paused",
    "transport",
)


def missing_hooks() -> list[str]:
    """The methods of uvicorn's sans-I/O protocol the media lane overrides or calls that this
    uvicorn lacks (empty: it fits). Without them the service uses uvicorn's protocol as is."""
    return [
        name
        for name in _UVICORN_HOOKS
        if not callable(getattr(WebSocketsSansIOProtocol, name, None))
    ]


def media_fast_paths(*, deflate: bool) -> list[FastPath]:
    """The media socket's fast paths, probed on a protocol built as uvicorn builds one per
    connection (no socket); call in the event loop (uvicorn's protocol binds to it)."""
    import uvicorn
    from uvicorn.server import ServerState

    missing = missing_hooks()
    waiting = False
    if not missing:
        try:
            config = uvicorn.Config(_no_app, ws=MediaWebSocketProtocol, log_config=None)
            probe = MediaWebSocketProtocol(config, ServerState(), {})
            missing = [name for name in _UVICORN_STATE if not hasattr(probe, name)]
            conn = probe.conn
            missing += [
                f"conn.{name}"
                for name in ("reader", "extensions", "state", "data_to_send")
                if not hasattr(conn, name)
            ]
            waiting = isinstance(waiting_items(probe.queue, "_queue"), collections.deque)
        except Exception as exc:
            missing = [f"probe failed: {type(exc).__name__}"]
    if missing:
        why = f"uvicorn lacks {', '.join(missing)}"
        return [
            FastPath("media socket lane", False, why),
            FastPath("media socket own-frame reader", False, why),
            FastPath("uvicorn nowait sender", False, why),
        ]
    return [
        FastPath("media socket lane", True, "" if waiting else "its ASGI queue asked per frame"),
        FastPath(
            "media socket own-frame reader",
            True,
            "not where WS_DEFLATE negotiates compression" if deflate else "",
        ),
        FastPath("uvicorn nowait sender", True),
    ]


async def _no_app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never run
    """The probe's ASGI app (uvicorn's config wants one)."""
