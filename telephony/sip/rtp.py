"""RTP for one call: our own playout queue paced by one shared 20 ms clock, packets through
aiortc's `RtpPacket`, symmetric RTP with latching, and RFC 4733 digits in.

One socket per call sends from the port we advertise and receives on it. The first valid packet
after each negotiation names the peer's real address (NAT): we latch to it and drop packets from
anyone else. Outbound, every 20 ms tick sends the next queued agent frame, or silence when the
queue is empty, so SSRC, sequence and timestamp run on without a gap through barge-in flushes
and the peer's jitter buffer never starves; a frame counts as played when it leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiortc.rtp import RtpPacket

from telephony.playback import PlaybackTracker
from telephony.sip.dtmf import DtmfDecoder
from telephony.sip.sdp import Codec, Direction, RemoteMedia

log = logging.getLogger(__name__)

FRAME_MS = 20
FRAME_BYTES = 160  # 20 ms of 8 kHz G.711
PERIOD_S = FRAME_MS / 1000
# A loop stalled this many frames behind gives up catching up (a burst would not help anyone).
MAX_CATCH_UP = 5
MAX_PAYLOAD = 1500


class SentPlayback(PlaybackTracker):
    """Playback as our own playout clock knows it: a frame is heard once it was sent.

    The Twilio tracker interpolates between marks because marks come late; here every frame is
    confirmed as it leaves, and interpolating past it would count audio never sent.
    """

    def _estimate(self, item: Any) -> float:
        return float(item.played_ms)


class RtpClock:
    """One 20 ms clock for every RTP stream of the process (one timer, not one per call)."""

    def __init__(self, period_s: float = PERIOD_S) -> None:
        self.period_s = period_s
        self._streams: set[RtpStream] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._next = 0.0
        self.ticks = 0

    def add(self, stream: RtpStream) -> None:
        self._streams.add(stream)
        if self._handle is None:
            loop = asyncio.get_running_loop()
            self._next = loop.time() + self.period_s
            self._handle = loop.call_at(self._next, self._tick)

    def remove(self, stream: RtpStream) -> None:
        self._streams.discard(stream)
        if not self._streams and self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self.ticks += 1
        for stream in list(self._streams):
            try:
                stream.tick()
            except Exception:
                log.exception("RTP tick failed for a stream; closing it")
                stream.close()
        if not self._streams:
            self._handle = None
            return
        self._next += self.period_s
        now = loop.time()
        if self._next < now - MAX_CATCH_UP * self.period_s:
            self._next = now + self.period_s
        self._handle = loop.call_at(self._next, self._tick)


@dataclass(slots=True)
class _Frame:
    item_id: str
    payload: bytes
    epoch: int
    end_ms: float


class RtpStream(asyncio.DatagramProtocol):
    """The RTP side of one call. Feed it agent audio; it calls back with caller audio and digits."""

    def __init__(
        self,
        codec: Codec,
        dtmf_pt: int | None,
        playback: PlaybackTracker,
        clock: RtpClock,
        on_audio: Callable[[bytes, int], None],
        on_digit: Callable[[str], None],
    ) -> None:
        self.codec = codec
        self.dtmf_pt = dtmf_pt
        self.playback = playback
        self._clock = clock
        self._on_audio = on_audio
        self._on_digit = on_digit
        self.transport: asyncio.DatagramTransport | None = None
        self.ssrc = secrets.randbits(32)
        self.seq = secrets.randbits(16)
        self.ts = secrets.randbits(32)
        self._silence = bytes([codec.silence]) * FRAME_BYTES
        self._queue: deque[_Frame] = deque()
        self._tail = b""
        self._tail_item: str | None = None
        self._marker = True
        self._dtmf = DtmfDecoder()
        self.remote: tuple[str, int] | None = None
        self._latched = False
        self.sending = False
        self.receiving = True
        self._started = False
        self._closed = False
        self._first_ts: int | None = None
        # Counters (tests, benchmarks, the call's end event).
        self.packets_sent = 0
        self.agent_frames_sent = 0
        self.packets_received = 0
        self.bad_packets = 0
        self.foreign_packets = 0

    # ---- asyncio ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (3.11's selector transport is not a DatagramTransport subclass, though it is one.)
        self.transport = cast(asyncio.DatagramTransport, transport)

    def error_received(self, exc: Exception) -> None:
        log.debug("RTP socket error: %r", exc)  # ICMP unreachable before the peer listens

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        source = (str(addr[0]), int(addr[1]))
        if len(data) < 12 or len(data) > MAX_PAYLOAD or data[0] >> 6 != 2:
            self.bad_packets += 1
            return
        if 200 <= data[1] <= 204:
            return  # RTCP multiplexed on the RTP port (RFC 5761)
        try:
            packet = RtpPacket.parse(data)
        except Exception:
            self.bad_packets += 1
            return
        pt = packet.payload_type
        if pt != self.codec.payload_type and pt != self.dtmf_pt:
            self.bad_packets += 1
            return
        if not self._latched:
            # Symmetric RTP: the peer is where its media comes from, whatever its SDP said.
            self.remote = source
            self._latched = True
        elif source != self.remote:
            self.foreign_packets += 1
            return
        self.packets_received += 1
        if pt == self.dtmf_pt:
            for digit in self._dtmf.feed(packet.payload, packet.timestamp):
                self._on_digit(digit)
            return
        if not self.receiving or not packet.payload:
            return  # on hold: the caller's music is not a turn of the conversation
        if self._first_ts is None:
            self._first_ts = packet.timestamp
        ms = ((packet.timestamp - self._first_ts) & 0xFFFFFFFF) // 8
        self._on_audio(packet.payload, ms)

    # ---- media state --------------------------------------------------------------------

    def set_remote(self, remote: RemoteMedia, direction: Direction) -> None:
        """Apply a negotiation: where to send, and whether to send and receive at all."""
        was_sending = self.sending
        if remote.address != self.remote or not self._latched:
            self.remote = remote.address
            self._latched = False  # latch again to whatever the new offer's media comes from
        self.sending = remote.we_send and direction in ("sendrecv", "sendonly")
        # Only a two-way call feeds the model: what a caller on hold sends us (music) is not a
        # turn of the conversation, so while we answered `recvonly` it is dropped.
        self.receiving = direction == "sendrecv"
        if self.sending and not was_sending:
            self._marker = True  # a new talkspurt after hold

    def start(self) -> None:
        """Begin pacing (after the 200 OK)."""
        if not self._started and not self._closed:
            self._started = True
            self._clock.add(self)

    # ---- outbound -----------------------------------------------------------------------

    def enqueue(self, item_id: str, audio: bytes) -> None:
        """Queue agent audio of `item_id` as 20 ms frames."""
        if self._closed:
            return
        if self._tail and self._tail_item != item_id:
            self._push_tail()
        data = self._tail + audio
        whole = len(data) - len(data) % FRAME_BYTES
        for offset in range(0, whole, FRAME_BYTES):
            self._push(item_id, data[offset : offset + FRAME_BYTES])
        self._tail = data[whole:]
        self._tail_item = item_id if self._tail else None

    def _push(self, item_id: str, payload: bytes) -> None:
        epoch, end_ms = self.playback.queued(item_id, len(payload) / 8)
        if len(payload) < FRAME_BYTES:
            payload += self._silence[len(payload) :]
        self._queue.append(_Frame(item_id, payload, epoch, end_ms))

    def _push_tail(self) -> None:
        if self._tail and self._tail_item is not None:
            self._push(self._tail_item, self._tail)
        self._tail = b""
        self._tail_item = None

    def flush(self) -> int:
        """Drop every queued frame (barge-in); returns how many. SSRC/seq/timestamp run on."""
        dropped = len(self._queue) + (1 if self._tail else 0)
        self._queue.clear()
        self._tail = b""
        self._tail_item = None
        return dropped

    @property
    def queued_frames(self) -> int:
        return len(self._queue)

    def tick(self) -> None:
        """One 20 ms period: send the next agent frame, or silence."""
        self.ts = (self.ts + FRAME_BYTES) & 0xFFFFFFFF  # time runs on, on hold too
        transport = self.transport
        if not self.sending or self.remote is None or transport is None or self._closed:
            return  # paused: agent audio stays queued and nothing counts as heard
        if not self._queue and self._tail:
            self._push_tail()  # the last, short frame of a response
        frame = self._queue.popleft() if self._queue else None
        packet = RtpPacket(
            payload_type=self.codec.payload_type,
            marker=1 if self._marker else 0,
            sequence_number=self.seq,
            timestamp=self.ts,
            ssrc=self.ssrc,
            payload=frame.payload if frame is not None else self._silence,
        )
        self._marker = False
        self.seq = (self.seq + 1) & 0xFFFF
        transport.sendto(packet.serialize(), self.remote)
        self.packets_sent += 1
        if frame is not None:
            self.agent_frames_sent += 1
            self.playback.played(frame.epoch, frame.item_id, frame.end_ms)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._clock.remove(self)
        self._queue.clear()
        if self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.close()
