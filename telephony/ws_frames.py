"""WebSocket text frames for the audio hot path, serialized without websockets' frame objects.

websockets builds a `Frame`, runs the extensions and, for a client, draws each frame's mask
with `secrets.token_bytes(4)`: one `getrandom` system call per frame, 50 times a second per
call toward Realtime. For a plain text frame (FIN, no extension negotiated) the bytes are a
fixed header, the mask and the masked payload (RFC 6455 section 5.2), which this builds
directly; masks come from a buffer of `os.urandom` drawn 1,024 masks at a time, so they are
as unpredictable as websockets' own (RFC 6455 section 5.3 asks for a strong source).
Everything else (control frames, compression, fragmentation) stays with websockets.
"""

from __future__ import annotations

import collections
import logging
import operator
import os
import struct
from collections.abc import Callable
from typing import Any

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - the C extension is in every wheel we install
    from websockets.utils import apply_mask

log = logging.getLogger(__name__)

TEXT = 0x81  # the first byte of a final text frame
PING = 0x89
PONG = 0x8A
_MASK_BIT = 0x80
MASKS_PER_DRAW = 1024
NO_LIMIT = 1 << 62  # a frame-size limit where none is set


class MaskSource:
    """Four unpredictable bytes per call, from `os.urandom` drawn in blocks."""

    __slots__ = ("_at", "_pool")

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def next(self) -> bytes:
        at = self._at
        if at >= len(self._pool):
            self._pool = os.urandom(4 * MASKS_PER_DRAW)
            at = 0
        self._at = at + 4
        return self._pool[at : at + 4]


def _header(length: int, mask_bit: int, first: int = TEXT) -> bytes:
    if length < 126:
        return bytes((first, mask_bit | length))
    if length < 65536:
        return struct.pack("!BBH", first, mask_bit | 126, length)
    return struct.pack("!BBQ", first, mask_bit | 127, length)


def text_frame_header(length: int, *, masked: bool) -> bytes:
    """The header of a final text frame of `length` bytes (the mask, if any, follows it)."""
    return _header(length, _MASK_BIT if masked else 0)


def server_text_frame(payload: bytes) -> bytes:
    """One unmasked, final text frame (server to client)."""
    return _header(len(payload), 0) + payload


def client_text_frame(payload: bytes, mask: bytes) -> bytes:
    """One masked, final text frame (client to server) with the 4-byte `mask`."""
    return _header(len(payload), _MASK_BIT) + mask + apply_mask(payload, mask)


def client_pong_frame(payload: bytes, mask: bytes) -> bytes:
    """The masked pong (client to server) answering a ping that carried `payload` (<= 125)."""
    return _header(len(payload), _MASK_BIT, PONG) + mask + apply_mask(payload, mask)


def read_plain_frames(
    buf: bytes,
    *,
    masked: bool,
    accept: frozenset[int],
    max_size: int | None,
    text_as_str: bool,
) -> tuple[list[tuple[int, Any]], int, bool]:
    """The complete plain frames at the start of `buf`: each final, masked as `masked` says,
    its first byte in `accept` (TEXT, PING, PONG), within `max_size`, a text one valid UTF-8
    (given as str when `text_as_str`, else as its bytes). Returns them as (first byte,
    payload), the offset after the last, and False if reading stopped at a frame that is not
    plain (True: at the end, or at a frame still incomplete)."""
    frames: list[tuple[int, Any]] = []
    size = len(buf)
    mask_len = 4 if masked else 0
    pos = 0
    while size - pos >= 2:
        head1, head2 = buf[pos], buf[pos + 1]
        if head1 not in accept or (head2 & _MASK_BIT != 0) is not masked:
            return frames, pos, False
        length = head2 & 0x7F
        at = pos + 2
        if length >= 126:
            if head1 != TEXT:
                return frames, pos, False  # a control frame carries at most 125 bytes
            wide = 2 if length == 126 else 8
            if size - at < wide:
                break
            length = int.from_bytes(buf[at : at + wide], "big")
            at += wide
        if max_size is not None and length > max_size:
            return frames, pos, False
        stop = at + mask_len + length
        if stop > size:
            break  # the rest of this frame is still on its way
        payload: Any = buf[at + mask_len : stop]
        if masked:
            payload = apply_mask(payload, buf[at : at + mask_len])
        if head1 == TEXT:
            try:
                text = payload.decode()
            except UnicodeDecodeError:
                return frames, pos, False
            if text_as_str:
                payload = text
        frames.append((head1, payload))
        pos = stop
    return frames, pos, True


def whole_text_frames(
    buf: bytes, *, masked: bool, max_size: int | None
) -> tuple[list[bytes], list[int]]:
    """The usual frames at the start of `buf`, read in one pass: whole, final text frames
    with a 7- or 16-bit length, masked as `masked` says, within `max_size`. Returns their
    payloads (unmasked; not yet checked as UTF-8) and the offset after each; reading stops
    at the first frame of any other kind, or one not complete yet (`read_plain_frames`
    takes it from there)."""
    payloads: list[bytes] = []
    ends: list[int] = []
    size = len(buf)
    head = 6 if masked else 2  # header and mask
    bit = _MASK_BIT if masked else 0
    pos = 0
    while size - pos >= head and buf[pos] == TEXT:
        length = buf[pos + 1] ^ bit  # a mask bit other than `masked` makes it > 127
        if length < 126:
            at = pos + head
        elif length == 126:
            at = pos + head + 2
            if at > size:
                break
            length = (buf[pos + 2] << 8) | buf[pos + 3]
        else:
            break
        end = at + length
        if end > size or (max_size is not None and length > max_size):
            break
        payloads.append(apply_mask(buf[at:end], buf[at - 4 : at]) if masked else buf[at:end])
        ends.append(end)
        pos = end
    return payloads, ends


class OwnFrameReader:
    """Reading plain frames without websockets' parser, for a connection class that mixes
    this in (the media socket's server protocol, the Realtime client connection).

    `_read_own(data)` reads the usual frames of each read in one pass (`whole_text_frames`),
    the rest with `read_plain_frames`; the first frame that is not plain (or a text one that
    is not UTF-8) and everything after it go to `_hand_over`, for websockets' parser for good.
    The class says what its peer sends (`_masked`, `_accept`) and supplies `_own_text`,
    `_own_control` and `_hand_over`."""

    _masked: bool = True  # the peer masks its frames (a client)
    _accept: frozenset[int] = frozenset({TEXT})  # the frames read here (TEXT, PING, PONG)
    _rest = b""  # the start of a frame not complete yet
    _max_size: int | None = None

    _fast_max = 0  # the largest frame `_read_one` takes (the lane's and the socket's limits)
    lane: Callable[[bytes], bool] | None = None

    def _own_text(self, payload: bytes) -> bool:
        """One text message; False if it is not UTF-8 (nothing was done with it)."""
        raise NotImplementedError

    def _leave_text(self, payload: bytes) -> bool:
        """A text message the lane did not take, for the normal path; False if it is not
        UTF-8 (nothing was done with it)."""
        raise NotImplementedError

    def _own_control(self, first: int, payload: bytes) -> None:
        """A ping or pong this class accepts."""
        raise NotImplementedError

    def _hand_over(self, rest: bytes) -> None:
        """websockets' parser reads from here on, for good, starting with `rest`."""
        raise NotImplementedError

    def _read_one(self, data: bytes, lane: Callable[[bytes], bool]) -> bool:
        """The usual read, with nothing waiting before it: `data` is one whole final text frame
        (a 7- or 16-bit length within `_fast_max`), offered to `lane` as it is and, if the lane
        leaves it, to the normal path; True when done. False: not that shape, nothing done
        (`_read_own` reads it the same way, with a few more steps)."""
        size = len(data)
        if size < 2 or data[0] != TEXT or self._rest:
            return False
        masked = self._masked
        length = data[1] ^ _MASK_BIT if masked else data[1]  # >= 128: the mask bit is wrong
        head = 6 if masked else 2
        if length == 126:
            if size < 4:
                return False
            head += 2
            length = (data[2] << 8) | data[3]
        elif length > 126:
            return False
        if size - head != length or length > self._fast_max:
            return False
        payload = apply_mask(data[head:], data[head - 4 : head]) if masked else data[head:]
        try:
            if lane(payload):
                return True
        except Exception:
            lane_failed(self)
        if not self._leave_text(payload):
            self._hand_over(data)  # websockets closes with 1007, from this frame on
        return True

    def _read_own(self, data: bytes) -> None:
        buf = self._rest + data if self._rest else data
        payloads, ends = whole_text_frames(buf, masked=self._masked, max_size=self._max_size)
        start = 0
        for payload, end in zip(payloads, ends, strict=True):
            if not self._own_text(payload):
                self._hand_over(buf[start:])  # websockets closes with 1007, from this frame on
                return
            start = end
        if start == len(buf):
            self._rest = b""
            return
        if start:
            buf = buf[start:]
        frames, pos, plain = read_plain_frames(
            buf,
            masked=self._masked,
            accept=self._accept,
            max_size=self._max_size,
            text_as_str=False,
        )
        for first, payload in frames:
            if first == TEXT:
                self._own_text(payload)  # checked as UTF-8 already
            else:
                self._own_control(first, payload)
        if plain:
            self._rest = buf[pos:]
            return
        self._hand_over(buf[pos:])


def offer_to_lane(holder: Any, data: Any) -> bool:
    """Offer `data` to `holder.lane`: True if it took it. A lane that raises is logged and
    removed (it must never break its socket); everything then takes the normal path."""
    lane = holder.lane
    if lane is None:
        return False
    try:
        return bool(lane(data))
    except Exception:
        lane_failed(holder)
        return False


def lane_failed(holder: Any) -> None:
    """`holder.lane` raised (called from its `except`): logged and removed."""
    log.exception("a hot-path lane failed; frames take the normal path from now on")
    holder.lane = None


class _Sized:
    """True while `len(queue)` is not zero (a queue whose items cannot be read directly)."""

    __slots__ = ("_queue",)

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def __bool__(self) -> bool:
        return bool(self._queue.qsize() if hasattr(self._queue, "qsize") else len(self._queue))


def waiting_items(queue: Any, attribute: str) -> Any:
    """Something true exactly while `queue` holds items, cheap to test per frame: the deque
    a library's queue keeps them in (asyncio.Queue's `_queue`, websockets' `queue`) where it
    has one, else a probe that asks the queue."""
    items = getattr(queue, attribute, None)
    return items if isinstance(items, collections.deque) else _Sized(queue)


def message_limit(protocol: Any) -> int | None:
    """The largest message websockets' `protocol` takes (None: no limit). websockets 15 keeps
    it as `max_size`, later releases as `max_message_size` (beside a fragment limit)."""
    if hasattr(protocol, "max_message_size"):
        limit: int | None = protocol.max_message_size
        return limit
    limit = protocol.max_size
    return limit


def state_reader(protocol: Any) -> Callable[[Any], Any]:
    """How to read `protocol.state` per frame: websockets' `state` is a property over
    `_state`; where that holds, `_state` is read without the property's call."""
    prop = getattr(type(protocol), "state", None)
    if (
        isinstance(prop, property)
        and getattr(protocol, "_state", None) is protocol.state
        and protocol.state is not None
    ):
        return operator.attrgetter("_state")
    return operator.attrgetter("state")
