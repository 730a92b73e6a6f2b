"""The Realtime audio hot path on the wire, beside the SDK's typed events.

Per 20 ms of a call the bridge sends one `input_audio_buffer.append` and receives about one
`response.output_audio.delta`; everything else is rare. So those two are handled here at the
wire: the append frame is built by concatenation around the leg's base64 payload (no JSON
encoder, no SDK transform, no decode and re-encode), and an audio delta is recognised from
the raw frame before the SDK's pydantic parse (about 57 us per delta on our machines, 21% of
the server's CPU at 40 calls). The set-up's `session.created` and `session.updated` are read
the same way, for their type and the session's id (`session_event_fields`). A frame is parsed
once (`frame_object`); an event whose type the bridge does not act on (transcript deltas,
content parts, item notices, rate limits) is dropped there (`RealtimeLink.read`); every other
server event is still the SDK's model, as `AsyncRealtimeConnection.parse_event` makes it
(`sdk_event`, without resolving the SDK's whole union), and every client event we send is
the SDK's.

Under the SDK's connection sits `LaneConnection`, websockets' client connection with a lane:
while the bridge's reader waits and nothing is queued before it, an audio delta is played in
the socket's callback instead of waking the reader; and once websockets' parser is between
frames, plain frames are read by the connection itself. `nowait_sender` writes an append
synchronously (the caller's frame arrives in the Twilio socket's callback and leaves in the
same step). Each falls back to the SDK's awaited path whenever it cannot act at once.
"""

from __future__ import annotations

import json
import logging
import operator
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

import orjson
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection
from websockets.frames import Frame, Opcode
from websockets.protocol import Event, State

from telephony.ws_frames import (
    MASKS_PER_DRAW,
    NO_LIMIT,
    PING,
    PONG,
    TEXT,
    MaskSource,
    OwnFrameReader,
    apply_mask,
    client_pong_frame,
    message_limit,
    offer_to_lane,
    state_reader,
    text_frame_header,
    waiting_items,
)

log = logging.getLogger(__name__)

AUDIO_DELTA = "response.output_audio.delta"
SESSION_EVENTS = frozenset(("session.created", "session.updated"))
APPEND_HEAD = '{"type":"input_audio_buffer.append","audio":"'
APPEND_TAIL = '"}'


def append_frame(payload: str) -> str:
    """The `input_audio_buffer.append` frame for canonical base64 `payload` (no escaping
    needed: the base64 alphabet has nothing JSON must escape)."""
    return APPEND_HEAD + payload + APPEND_TAIL


@dataclass(slots=True)  # not frozen: built per delta, and frozen costs 3x
class AudioDelta:
    """The fields of a `response.output_audio.delta` the bridge uses."""

    response_id: str
    item_id: str
    delta: str  # base64 G.711 in the session's output format


def frame_object(raw: bytes | str) -> dict[str, Any] | None:
    """A server frame's JSON object, parsed once for every look at it; None when the frame
    is not one (not UTF-8, not JSON, or JSON but not an object)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return data if type(data) is dict else None


def delta_fields_of(data: dict[str, Any]) -> tuple[str, str, str] | None:
    """(response_id, item_id, delta) of a parsed frame that is a well-formed audio delta;
    None for anything else (another event, or a delta whose fields the SDK must judge)."""
    if data.get("type") != AUDIO_DELTA:
        return None
    response_id = data.get("response_id")
    item_id = data.get("item_id")
    delta = data.get("delta")
    if type(response_id) is not str or type(item_id) is not str or type(delta) is not str:
        return None  # odd shape: let the typed path deal with it
    return response_id, item_id, delta


def event_classes(union: Any) -> dict[str, Any]:
    """The models of an SDK server-event union (`RealtimeServerEvent`, GPT-Live's
    `ConnectServerEvent`) by their `type`. A type two members share is left out: the SDK's
    own parse decides those."""
    members = get_args(union)
    if get_origin(union) is Annotated:
        members = get_args(members[0])
    found: dict[str, Any] = {}
    shared: set[str] = set()
    for member in members:
        field = getattr(member, "model_fields", {}).get("type")
        for literal in get_args(field.annotation) if field is not None else ():
            if literal in found:
                shared.add(literal)
            found[literal] = member
    return {kind: model for kind, model in found.items() if kind not in shared}


def sdk_event(data: dict[str, Any], classes: dict[str, Any]) -> Any | None:
    """The SDK's model of a parsed server frame, as its `parse_event` makes it; None for a
    type not in `classes` (then the SDK's parse is the way).

    `parse_event` validates the frame against the whole union (its ~50 models tried one by
    one: 40-200 us) and, where that fails, constructs the model its type names, unchecked.
    No other member takes that type, so validating against that one model gives the same event
    (2-20 us), and the same unchecked construction where it fails. May raise what the SDK's
    construction raises on a frame it cannot take."""
    kind = data.get("type")
    model = classes.get(kind) if type(kind) is str else None
    if model is None:
        return None
    try:
        return model.model_validate(data)
    except ValidationError:
        return model.construct(**data)


def session_event_fields(raw: bytes | str) -> tuple[str, str | None] | None:
    """For a `session.created` or `session.updated` frame, (its type, the session's id if it
    is a non-empty string); None for anything else (the SDK parses those).

    All a call's set-up reads of the two: the SDK's parse builds the whole session model
    (every field of the configuration echoed back) twice a call, about 0.4 ms."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None  # the SDK's parse reports it
    if type(data) is not dict:
        return None
    kind = data.get("type")
    if type(kind) is not str or kind not in SESSION_EVENTS:
        return None
    session = data.get("session")
    sid = session.get("id") if type(session) is dict else None
    return kind, sid if type(sid) is str and sid else None


def raw_sender(conn: Any) -> Callable[[str], Awaitable[None]]:
    """How to put a preformatted frame on `conn`, an SDK Realtime connection.

    `send_raw` first checks the SDK's reconnect send queue (a receipt, the current task's id,
    the queue's state: about a tenth of the server's CPU at 50 calls, once per 20 ms frame).
    That queue is used only while the SDK reconnects by itself, and the bridge never asks it
    to (it reconnects on its own, with a new connection). So while the connection has no
    reconnect handler and nothing queued, the frame goes straight to the same websockets
    connection `send_raw` ends in; any other shape of connection gets `send_raw`.
    """
    inner = getattr(conn, "_connection", None)
    queue = getattr(conn, "_send_queue", None)
    if (
        inner is not None
        and getattr(conn, "_on_reconnecting", True) is None
        and queue is not None
        and not queue
        and callable(getattr(inner, "send", None))
    ):
        send: Callable[[str], Awaitable[None]] = inner.send
        return send
    raw: Callable[[str], Awaitable[None]] = conn.send_raw
    return raw


try:  # the SDK's own transform of a client event (what its `send` runs), see EventTexts
    from openai._utils import async_maybe_transform as _sdk_transform
    from openai.resources.realtime.realtime import ResponseCreateEventWithReferencesParam
    from openai.types.realtime import RealtimeClientEventParam

    # The type the SDK's `send` transforms against (a typing.Union, as it spells it).
    _CLIENT_EVENT: Any = RealtimeClientEventParam | ResponseCreateEventWithReferencesParam
except ImportError:  # a release that moved it: events take the SDK's `send`
    _sdk_transform = None  # type: ignore[assignment]


class EventTexts:
    """Client events as the SDK's `send` writes them, kept by content for the next call.

    `send` runs the SDK's transform over a client event, walked against every member of the
    client-event union, then `json.dumps`: 0.85 ms for a call's `session.update` (5.9 kB with
    the demo's tools), the same every call. The same event has the same wire form, so the
    last few are kept here, keyed by the event's own JSON (orjson's: 2.4 us for those 5.9 kB,
    where `json.dumps` took 36), and go out through the connection's `send_raw`, where `send`
    ends. An event's `event_id` (a string, which the transform leaves as it is) is not part of
    the key: it is written into the kept text, so a `response.create` that differs from the
    last only by its id (as a call's do) is not transformed again either. Without the SDK's
    transform (a release that moved it), or on a connection without `send_raw`, the event
    goes through `send`.
    """

    def __init__(self, size: int = 16) -> None:
        self._size = size
        self._texts: OrderedDict[bytes, str] = OrderedDict()
        self.reused = 0

    @staticmethod
    def available() -> bool:
        return _sdk_transform is not None

    async def send(self, conn: Any, event: Any) -> None:
        send_raw = getattr(conn, "send_raw", None)
        if _sdk_transform is None or send_raw is None:
            await conn.send(event)
            return
        event_id = event.get("event_id")
        if isinstance(event_id, str):
            event = {k: v for k, v in event.items() if k != "event_id"}
        try:
            key = orjson.dumps(event)
        except TypeError:  # what orjson does not write (a key not a string, say) json does
            key = json.dumps(event).encode()
        text = self._texts.get(key)
        if text is None:
            text = json.dumps(await _sdk_transform(event, _CLIENT_EVENT))
            self._texts[key] = text
            if len(self._texts) > self._size:
                self._texts.popitem(last=False)
        else:
            self._texts.move_to_end(key)
            self.reused += 1
        if isinstance(event_id, str):  # the transform's text is an object, its type in it
            text = f'{text[:-1]}, "event_id": {json.dumps(event_id)}}}'
        await send_raw(text)


# The process's: a deployment's session.update is the same for every call it starts.
EVENT_TEXTS = EventTexts()


try:  # websockets 15 looks up a proxy for every connection it opens (`proxy=True`)
    import inspect

    # The lookup and the URL parser its client uses (where it imports them: `websockets.uri`
    # in 15, `websockets.proxy` later).
    from websockets.asyncio.client import connect as _ws_connect
    from websockets.asyncio.client import get_proxy as _get_proxy
    from websockets.asyncio.client import parse_uri as _parse_uri

    _TAKES_PROXY = "proxy" in inspect.signature(_ws_connect.__init__).parameters
except ImportError:  # pragma: no cover  (an older or moved API: no lookup to save)
    _TAKES_PROXY = False

# (server URL, id of the options) -> (those options, the same with the proxy looked up).
_RESOLVED: dict[tuple[str, int], tuple[Any, dict[str, Any]]] = {}


def proxy_resolved(options: Any, client: Any) -> Any:
    """`options` (the SDK's `websocket_connection_options`) with the proxy websockets would
    use to reach `client`'s server, looked up once per server and options.

    websockets 15 runs its proxy lookup (`get_proxy`: the standard library's `getproxies` and
    `proxy_bypass`, each walking the whole environment, 80 us with 35 variables) on every
    connection it opens, so on every call's Realtime socket. The lookup depends only on the
    process's environment and the server's scheme, host and port, so it is made here with
    websockets' own `get_proxy` for the URL the SDK connects to (its `websocket_base_url`,
    else its base URL with `ws`/`wss` for `http`/`https`) and handed to websockets as
    `proxy` (the proxy's address, or None for none). Options that name a proxy, a
    websockets without the parameter, or a URL it cannot read go as they are."""
    if not _TAKES_PROXY or "proxy" in options:
        return options
    base = str(getattr(client, "websocket_base_url", None) or getattr(client, "base_url", ""))
    key = (base, id(options))
    kept = _RESOLVED.get(key)
    if kept is not None and kept[0] is options:  # the same options (not another at its id)
        return kept[1]
    scheme, sep, rest = base.partition("://")
    if scheme in ("http", "https"):
        base = ("ws" if scheme == "http" else "wss") + sep + rest
    try:
        proxy = _get_proxy(_parse_uri(base))
    except Exception:  # not a URL websockets reads: its own lookup decides, per connect
        return options
    resolved = {**options, "proxy": proxy}
    _RESOLVED[key] = (options, resolved)
    return resolved


class ReleasingConnection(ClientConnection):
    """websockets' client connection, which leaves no reference cycle once it is lost (the
    SDK's connections take it as `websocket_connection_options={"create_connection": ...}`)."""

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        # websockets keeps its cancelled keepalive task (whose traceback holds its frame, and
        # the frame this connection) and puts this connection in its logger's `extra`: both
        # reference cycles, which would leave the connection, and what it reaches, to a full
        # collection. Nothing reads either once the connection is lost.
        self.keepalive_task = None
        extra = getattr(self.logger, "extra", None)
        if isinstance(extra, dict) and extra.get("websocket") is self:
            extra["websocket"] = None


class LaneConnection(OwnFrameReader, ReleasingConnection):
    """websockets' client connection (the one the SDK's Realtime connection wraps), with a
    lane for server messages: a text message is first offered to `lane(data)` where it is
    received, if no earlier message waits for `recv`; when the lane takes it (True) `recv`
    never sees it. So the bridge plays an audio delta in the socket's callback, without
    waking its reader, while order holds: once a message waits, the ones after it wait too.

    Passed to the SDK as `websocket_connection_options={"create_connection": ...}`, which the
    SDK hands to `websockets.asyncio.client.connect`.
    """

    lane: Callable[[bytes], bool] | None = None
    # Reading frames here (see `_read_own`), once websockets' parser is between frames.
    _own = False
    _masked = False  # server frames
    _accept = frozenset({TEXT, PING, PONG})  # read here; anything else goes to websockets
    _masks: MaskSource | None = None
    _waiting: Any = ()  # the deque of messages waiting for recv() (empty: none)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.lane = None  # into the call: not past the connection's end

    def data_received(self, data: bytes) -> None:
        if self._own:
            # The usual read (one whole audio delta) is read in one step.
            lane = self.lane
            if lane is None or self._waiting or not self._read_one(data, lane):
                self._read_own(data)
            return
        super().data_received(data)
        if self.lane is not None and between_frames(self.protocol):
            self._own = True
            self._max_size = message_limit(self.protocol)
            self._fast_max = self._max_size if self._max_size is not None else NO_LIMIT
            self._waiting = waiting_items(self.recv_messages.frames, "queue")

    def _own_text(self, payload: bytes) -> bool:
        """A text message read here (`OwnFrameReader`): to the lane if nothing waits before
        it and it takes it (it parsed it: valid UTF-8 JSON), else checked as UTF-8 for recv()."""
        if not len(self.recv_messages.frames) and offer_to_lane(self, payload):
            return True
        return self._leave_text(payload)

    def _leave_text(self, payload: bytes) -> bool:
        """A text message the lane did not take: checked as UTF-8 and queued for recv();
        False if it is not UTF-8 (nothing was done with it)."""
        try:
            payload.decode()
        except UnicodeDecodeError:
            return False
        self.recv_messages.put(Frame(Opcode.TEXT, payload))
        return True

    def _own_control(self, first: int, payload: bytes) -> None:
        if first == PING:
            masks = self._masks
            if masks is None:
                masks = self._masks = MaskSource()
            self.transport.write(client_pong_frame(payload, masks.next()))
        else:
            self.acknowledge_pings(payload)

    def _hand_over(self, rest: bytes) -> None:
        """websockets' parser reads from here on, for good, starting with `rest`."""
        self._own = False
        self._rest = b""
        super().data_received(rest)

    def _deliver(self, payload: bytes) -> None:
        """One text message: to the lane if nothing waits before it and it takes it, else
        to recv()."""
        if not len(self.recv_messages.frames) and offer_to_lane(self, payload):
            return
        self.recv_messages.put(Frame(Opcode.TEXT, payload))

    def process_event(self, event: Event) -> None:
        # websockets reads (before `_own`, or after a hand-back): a text message still goes
        # to the lane first.
        if (
            self.lane is not None
            and type(event) is Frame
            and event.opcode is Opcode.TEXT
            and event.fin
        ):
            self._deliver(bytes(event.data))
            return
        super().process_event(event)


_UNKNOWN = object()


def between_frames(protocol: Any) -> bool:
    """websockets' parser waits for the first byte of a frame, with nothing buffered, no
    fragmented message open and no extension: frames can be read elsewhere from here on.

    Told from its parser's innermost generator being `StreamReader.at_eof`, where
    `Protocol.parse` waits between frames; any other shape (another websockets version) is
    simply "no", and websockets keeps reading."""
    # The size of the message being assembled: `cur_size` in websockets 15, `current_size`
    # later (None: no fragmented message open; missing: a shape we do not know, so "no").
    size = getattr(protocol, "current_size", getattr(protocol, "cur_size", _UNKNOWN))
    reader = getattr(protocol, "reader", None)
    if (
        size is not None
        or reader is None
        or getattr(reader, "buffer", True)
        or protocol.extensions
        or protocol.state is not State.OPEN
    ):
        return False
    gen = getattr(protocol, "parser", None)
    for _ in range(8):
        inner = getattr(gen, "gi_yieldfrom", None)
        if inner is None:
            break
        gen = inner
    code = getattr(gen, "gi_code", None)
    return code is not None and code.co_name == "at_eof" and code.co_filename.endswith("streams.py")


def release_connection(conn: Any) -> None:
    """After an SDK connection (Realtime or GPT-Live) is closed: drop its resources (`session`,
    `response`, ...), each of which holds the connection back, a reference cycle that would
    leave the connection, its websocket and buffers to a full collection."""
    try:
        attributes = vars(conn)
    except TypeError:
        return
    for name in [n for n, v in attributes.items() if getattr(v, "_connection", None) is conn]:
        del attributes[name]


def lane_of(conn: Any) -> LaneConnection | None:
    """The LaneConnection under an SDK Realtime connection, if it has one."""
    inner = getattr(conn, "_connection", None)
    return inner if isinstance(inner, LaneConnection) else None


def nowait_sender(conn: Any) -> Callable[[str], bool] | None:
    """A synchronous send of one text frame on `conn` (an SDK Realtime connection), for
    where `raw_sender` would pick the websockets connection itself: writes now and returns
    True when the socket is open and nothing is waiting to be written, else returns False
    (nothing written: use the awaited send)."""
    inner = lane_of(conn)
    if inner is None or raw_sender(conn) != inner.send:
        return None
    sending = send_in_progress(inner)
    if sending is None:
        return None  # a websockets we do not know: the awaited send
    protocol = inner.protocol
    if protocol.extensions:  # compression negotiated: websockets builds the frames
        return _framed_sender(inner, sending)
    state_of = state_reader(protocol)
    # Masks as MaskSource draws them (os.urandom, 1,024 at a time), kept here per frame.
    pool = b""
    at = 0

    def send(text: str) -> bool:
        nonlocal pool, at
        transport = inner.transport
        if (
            state_of(protocol) is not State.OPEN
            or sending(inner) is not None
            or transport.is_closing()
            or transport.get_write_buffer_size()
        ):
            return False
        payload = text.encode()
        if at >= len(pool):
            pool = os.urandom(4 * MASKS_PER_DRAW)
            at = 0
        mask = pool[at : at + 4]
        at += 4
        length = len(payload)
        # A final text frame, masked (RFC 6455 5.2); a 20 ms append is 126 to 65,535 bytes.
        if 125 < length < 65536:
            head = _MASKED_TEXT_126 + length.to_bytes(2, "big")
        else:
            head = text_frame_header(length, masked=True)
        try:
            transport.write(head + mask + apply_mask(payload, mask))
        except Exception as exc:  # as websockets' own send does: the reader sees the end
            log.info("Realtime send failed: %r", exc)
            transport.abort()
        return True

    return send


_MASKED_TEXT_126 = bytes((TEXT, 0x80 | 126))


def send_in_progress(inner: Any) -> Callable[[Any], Any] | None:
    """How to read whether websockets' connection is sending a fragmented message (a frame
    written now would land inside it): `fragmented_send_waiter` in websockets 15,
    `send_in_progress` later; None where neither is there."""
    for name in ("send_in_progress", "fragmented_send_waiter"):
        if hasattr(inner, name):
            return operator.attrgetter(name)
    return None


def _framed_sender(inner: ClientConnection, sending: Callable[[Any], Any]) -> Callable[[str], bool]:
    """`nowait_sender` where websockets must build the frame (an extension negotiated)."""
    protocol = inner.protocol

    def send(text: str) -> bool:
        transport = inner.transport
        if (
            protocol.state is not State.OPEN
            or sending(inner) is not None
            or transport.is_closing()
            or transport.get_write_buffer_size()
        ):
            return False
        try:
            protocol.send_text(text.encode())
            inner.send_data()
        except Exception as exc:  # as websockets' own send does: the reader sees the end
            log.info("Realtime send failed: %r", exc)
            transport.abort()
        return True

    return send
