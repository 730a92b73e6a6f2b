"""RTP for one call: our own playout queue paced by one shared 20 ms clock, packets through
aiortc's `RtpPacket`, strict symmetric RTP, and RFC 4733 digits in.

One socket per call sends from the port we advertise and receives on it. Media is accepted only
from where the signalling says it comes from (strict RTP, as rtpengine and Asterisk's
`strictrtp`): the address of the SDP's `c=` and `m=` lines at once; another port of the SDP's
or the INVITE's host, or of a host in the media allow-list, only after `probation` packets in
sequence from it, and only within the learning window after the answer or a re-INVITE that
moves the media (NAT rewrites ports). Whatever else arrives is dropped and counted, and agent
audio goes only to the source so learned. Outbound, every 20 ms tick sends the next queued agent
frame, or silence when the queue is empty, so SSRC, sequence and timestamp run on without a gap
through barge-in flushes and the peer's jitter buffer never starves; a frame counts as played
when it leaves.

Caller audio carries its stream time in ms, from the RTP timestamp as a signed 32-bit
difference (wraps and reordering are small steps) and re-anchored on the arrival clock at a new
SSRC, a new remote address, or a jump of more than `MAX_TS_JUMP_MS` from arrival: whatever a
peer puts in its timestamps, the stream time stays within seconds of the call's own clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiortc.rtp import (
    RtcpPacket,
    RtcpReceiverInfo,
    RtcpRrPacket,
    RtcpSdesPacket,
    RtcpSenderInfo,
    RtcpSourceInfo,
    RtcpSrPacket,
    RtpPacket,
)

from telephony.legs.sip.access import AllowList
from telephony.legs.sip.dtmf import DtmfDecoder
from telephony.legs.sip.sdp import Codec, Direction, RemoteMedia
from telephony.legs.sip.udp_send import sender
from telephony.playback import PlaybackTracker

log = logging.getLogger(__name__)

FRAME_MS = 20
FRAME_BYTES = 160  # 20 ms of 8 kHz G.711
PERIOD_S = FRAME_MS / 1000
# The clock's finer period, for streams whose packets are not a multiple of 20 ms (ptime 10, 30).
FINE_PERIOD_S = 0.010
# A loop stalled this many frames behind gives up catching up (a burst would not help anyone).
MAX_CATCH_UP = 5
MAX_PAYLOAD = 1500
# An RTP header without CSRCs or extension: V=2, M and PT, sequence, timestamp, SSRC (what
# aiortc's RtpPacket.serialize gives for our packets, in a tenth of the time).
_HEADER = struct.Struct("!BBHII")
# Stream time further than this from the arrival clock is a discontinuity (a new stream after a
# re-INVITE, a hostile or broken peer), never hours of silence: re-anchor on arrival.
MAX_TS_JUMP_MS = 3000


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Where one call's media may come from besides the SDP's own address (strict RTP)."""

    signalling_host: str | None = None  # the INVITE's source address
    allow: AllowList | None = None  # SIP_MEDIA_ALLOW_FROM: media from elsewhere than signalling
    learn_s: float = 3.0  # the learning window after an answer or a move
    probation: int = 4  # packets in sequence from a new source before it is learned


class RtcpSocket(asyncio.DatagramProtocol):
    """The RTCP port of a stream that does not multiplex it: what comes in goes to the
    stream (the stream sends from the same socket, off the loop)."""

    def __init__(self, stream: RtpStream) -> None:
        self.stream = stream

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if len(data) >= 8 and data[0] >> 6 == 2 and 200 <= data[1] <= 204:
            self.stream.rtcp_received(data, addr)
        else:
            self.stream.bad_rtcp += 1

    def error_received(self, exc: Exception) -> None:
        log.debug("RTCP socket error: %r", exc)


class MediaStats:
    """Counters shared by every stream of a process (metrics)."""

    __slots__ = ("foreign_packets",)

    def __init__(self) -> None:
        self.foreign_packets = 0


_monotonic = time.monotonic  # (a global lookup less per packet)
RTCP_INTERVAL_S = 5.0
# The RTCP interval's randomization (RFC 3550 6.3.1) draws from its own generator: the clock
# thread never touches the process's global `random` state.
_RNG = random.Random()
NTP_EPOCH_OFFSET = 2208988800  # 1900-01-01 to 1970-01-01, in seconds


def _ntp_now() -> int:
    """The wallclock as a 64-bit NTP timestamp (RFC 3550 4)."""
    return int((time.time() + NTP_EPOCH_OFFSET) * (1 << 32)) & 0xFFFFFFFFFFFFFFFF


def _ntp_middle() -> int:
    """The middle 32 bits of the NTP timestamp now (units of 1/65536 s), as LSR is."""
    return (_ntp_now() >> 16) & 0xFFFFFFFF


# RFC 3550's bounds for a source's sequence numbers (appendix A.1).
MAX_DROPOUT = 3000
MAX_MISORDER = 100
CLOCK_RATE = 8000  # G.711


class Reception:
    """What the caller's packets say of the network, as an RTCP receiver report would (RFC 3550
    section 6.4.1, appendix A.1 and A.8): packets expected from the extended highest sequence
    number, packets lost (expected minus received, never below 0), and the interarrival jitter
    estimate from the audio packets' timestamps against their arrival. A new SSRC starts a new
    count; what the earlier ones expected and received is kept in the totals."""

    __slots__ = (
        "_bad",
        "_base",
        "_cycles",
        "_expected_prior",
        "_max",
        "_prior_expected",
        "_prior_received",
        "_received",
        "_received_prior",
        "_ssrc",
        "_transit",
        "jitter",
    )

    def __init__(self) -> None:
        self._ssrc: int | None = None
        self._prior_expected = 0
        self._prior_received = 0
        self._base = self._max = self._cycles = self._received = 0
        self._bad = -1
        self._transit: float | None = None
        self.jitter = 0.0  # in timestamp units (1/8 ms)
        self._expected_prior = self._received_prior = 0

    def packet(self, ssrc: int, seq: int, timestamp: int, arrival_s: float, audio: bool) -> None:
        if ssrc != self._ssrc:
            self._prior_expected += self._expected()
            self._prior_received += self._received
            self._ssrc = ssrc
            self._base = self._max = seq
            self._cycles = self._received = 0
            self._bad = -1
            self._transit = None
            self._expected_prior = self._received_prior = 0
        else:
            delta = (seq - self._max) & 0xFFFF
            if delta < MAX_DROPOUT:
                if seq < self._max:
                    self._cycles += 0x10000  # wrapped
                self._max = seq
            elif delta <= 0x10000 - MAX_MISORDER:
                # A very large jump: the source restarted, once two in a row say so.
                if seq == self._bad:
                    self._base = self._max = seq
                    self._cycles = self._received = 0
                    self._transit = None
                else:
                    self._bad = (seq + 1) & 0xFFFF
                    return
            # else: a duplicate or a reordered packet; counted as received
        self._received += 1
        if audio:
            transit = arrival_s * CLOCK_RATE - timestamp
            if self._transit is not None:
                d = abs(transit - self._transit)
                if d < 0x80000000:  # not a timestamp wrap
                    self.jitter += (d - self.jitter) / 16
            self._transit = transit

    def _expected(self) -> int:
        if self._ssrc is None:
            return 0
        return self._cycles + self._max - self._base + 1

    def block(self, lsr: int, dlsr: int) -> RtcpReceiverInfo | None:
        """A receiver report block about the current source (RFC 3550 6.4.1, A.3): fraction
        lost since the last block, cumulative lost, extended highest sequence, jitter; None
        before any packet."""
        if self._ssrc is None:
            return None
        expected = self._expected()
        expected_interval = expected - self._expected_prior
        received_interval = self._received - self._received_prior
        self._expected_prior, self._received_prior = expected, self._received
        lost_interval = expected_interval - received_interval
        fraction = (
            0
            if expected_interval <= 0 or lost_interval <= 0
            else ((lost_interval << 8) // expected_interval)
        )
        lost = max(-0x800000, min(0x7FFFFF, expected - self._received))
        return RtcpReceiverInfo(
            ssrc=self._ssrc,
            fraction_lost=min(255, fraction),
            packets_lost=lost,
            highest_sequence=(self._cycles + self._max) & 0xFFFFFFFF,
            jitter=int(self.jitter),
            lsr=lsr,
            dlsr=dlsr,
        )

    def report(self) -> dict[str, float | int]:
        """Totals for the call: received, expected, lost, loss ratio, jitter (ms)."""
        expected = self._prior_expected + self._expected()
        received = self._prior_received + self._received
        lost = max(0, expected - received)
        return {
            "packets_received": received,
            "packets_expected": expected,
            "packets_lost": lost,
            "loss_ratio": round(lost / expected, 4) if expected else 0.0,
            "jitter_ms": round(self.jitter / (CLOCK_RATE / 1000), 2),
        }


def _host(ip: str) -> str:
    return ip[7:] if ip.startswith("::ffff:") else ip


class SentPlayback(PlaybackTracker):
    """Playback as our own playout clock knows it: a frame is heard once it was sent.

    The Twilio tracker interpolates between marks because marks come late; here every frame is
    confirmed as it leaves, and interpolating past it would count audio never sent.
    """

    def _estimate(self, item: Any) -> float:
        return float(item.played_ms)


class RtpClock:
    """One clock for every RTP stream of the process, in its own thread: 20 ms, or 10 ms while
    a stream's packets are not a multiple of 20 ms (an offer's `ptime:30` or `ptime:10`); each
    stream sends when its own packet time has passed.

    The event loop also runs the bridges (JSON, WebSockets, the event writer); a tick waiting
    behind their callbacks would leave late. The thread sleeps to absolute deadlines and asks
    for the GIL once per tick: its sends keep the GIL (udp_send) and a stream whose lock the
    loop holds is done last, so no stream gives the GIL up for another to wait for it back (a
    busy loop can still take it every switch interval, and holds it through a collection).
    Each stream's tick runs under that stream's lock, shared with what the loop does to it
    (queueing, flushing, renegotiating, closing).
    """

    def __init__(
        self, period_s: float = PERIOD_S, after_tick: Callable[[], None] | None = None
    ) -> None:
        self.period_s = period_s
        # Called on the clock's thread after each tick (the pacer process reports from it).
        self._after_tick = after_tick
        self._coarse_s = period_s
        self._fine = 0  # streams that need the finer period
        self._streams: set[RtpStream] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.ticks = 0
        self._last_error = 0.0

    def add(self, stream: RtpStream) -> None:
        with self._lock:
            if stream not in self._streams and stream.ptime_ms % round(self._coarse_s * 1000):
                self._fine += 1
                self.period_s = min(self._coarse_s, FINE_PERIOD_S)
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rtp-clock", daemon=True)
                self._thread.start()

    def remove(self, stream: RtpStream) -> None:
        with self._lock:
            if stream in self._streams and stream.ptime_ms % round(self._coarse_s * 1000):
                self._fine -= 1
                if self._fine == 0:
                    self.period_s = self._coarse_s
            self._streams.discard(stream)

    def _tick(self, stream: RtpStream, period_ms: int, wait: bool) -> bool:
        try:
            return stream.tick_locked(period_ms, wait)
        except Exception:
            now = time.monotonic()
            if now - self._last_error > 60:
                self._last_error = now
                log.exception("RTP tick failed")
            return True

    def _run(self) -> None:
        next_at = time.monotonic() + self.period_s
        while True:
            with self._lock:
                if not self._streams:
                    self._thread = None  # the next add() starts a new thread
                    return
                streams = list(self._streams)
                period_s = self.period_s
            period_ms = round(period_s * 1000)
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.ticks += 1
            # A stream whose lock the loop holds (queueing, a flush) waits for it last: waiting
            # for a lock gives up the GIL, and getting the GIL back from a busy loop takes up
            # to the switch interval, which every stream after it would lose.
            busy = [stream for stream in streams if not self._tick(stream, period_ms, False)]
            for stream in busy:
                self._tick(stream, period_ms, True)
            if self._after_tick is not None:
                try:
                    self._after_tick()
                except Exception:
                    now = time.monotonic()
                    if now - self._last_error > 60:
                        self._last_error = now
                        log.exception("RTP clock: the after-tick report failed")
            next_at += period_s
            now = time.monotonic()
            if next_at < now - MAX_CATCH_UP * period_s:
                next_at = now + period_s  # stalled: resume from now, no burst


def _unheard_audio(audio: bytes, timestamp_ms: int) -> None:
    return None


def _unheard_digit(digit: str) -> None:
    return None


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
        policy: MediaPolicy | None = None,
        stats: MediaStats | None = None,
        on_foreign: Callable[[tuple[str, int]], None] | None = None,
        rtcp_interval_s: float = RTCP_INTERVAL_S,
        ptime_ms: int = FRAME_MS,
    ) -> None:
        if ptime_ms <= 0 or ptime_ms % 10:
            raise ValueError(f"ptime {ptime_ms} ms is not a multiple of 10 ms")
        self.codec = codec
        # Our packets' length (the offer's ptime, see sdp.choose_ptime), in ms and in bytes.
        self.ptime_ms = ptime_ms
        self.frame_bytes = ptime_ms * 8
        self._elapsed_ms = 0
        self.dtmf_pt = dtmf_pt
        self.playback = playback
        self._clock = clock
        self._on_audio = on_audio
        self._on_digit = on_digit
        self.transport: asyncio.DatagramTransport | None = None
        self._sendto: Callable[[bytes, tuple[str, int]], object] | None = None
        self.lock = threading.Lock()  # the clock thread's tick against the loop's changes
        self.ssrc = secrets.randbits(32)
        self.seq = secrets.randbits(16)
        self.ts = secrets.randbits(32)
        self._silence = bytes([codec.silence]) * self.frame_bytes
        self._queue: deque[_Frame] = deque()
        self._tail = b""
        self._tail_item: str | None = None
        self._marker = True
        self._dtmf = DtmfDecoder()
        # Where agent audio goes: the SDP's address until a source is learned, then that source.
        self.remote: tuple[str, int] | None = None
        self._policy = policy or MediaPolicy()
        self._stats = stats or MediaStats()
        self._on_foreign = on_foreign
        self._signalled: tuple[str, int] | None = None  # the SDP's c= and m= address
        self._source: tuple[Any, ...] | None = None  # the learned media source, as recvfrom says
        self._learn_until = 0.0  # monotonic; learning is closed once it passes or a source is in
        self._candidate: tuple[Any, ...] | None = None
        self._candidate_seq = 0
        self._candidate_count = 0
        self.sending = False
        self.receiving = True
        self._started = False
        self._closed = False
        # Stream time of caller audio: (SSRC, RTP timestamp, ms) of the last anchor.
        self._t0_ms = 0.0
        self._in_ssrc: int | None = None
        self._ts_base = 0
        self._ms_base = 0
        # Counters (tests, benchmarks, the call's end event).
        self.packets_sent = 0
        self.agent_frames_sent = 0
        self.packets_received = 0
        self.bad_packets = 0
        self.foreign_packets = 0
        self.discontinuities = 0  # re-anchored stream times (a new SSRC, address or a jump)
        self.reception = Reception()
        # Digits to send as RFC 4733 events: (code, packets of tone, packets of gap after), and
        # the one being sent: [code, start timestamp, packets sent, of tone, end packets left].
        self._digits: deque[tuple[int, int, int]] = deque()
        self._event: list[int] | None = None
        self._gap = 0
        self.events_sent = 0
        # RTCP (RFC 3550): sender/receiver reports every interval (randomized, 6.3.1), on the
        # RTP port when multiplexed (RFC 5761) else from the socket on the port above.
        self.rtcp_mux = False
        self._rtcp_port: int | None = None  # the peer's, from its SDP (not multiplexed)
        self._rtcp_sendto: Callable[[bytes, tuple[str, int]], object] | None = None
        self._rtcp_ticks = max(1, round(rtcp_interval_s * 1000 / ptime_ms))
        self._rtcp_due = max(1, round(self._rtcp_ticks * _RNG.uniform(0.25, 0.75)))
        self._cname = f"voice-agent-{self.ssrc:08x}".encode()
        self._peer_sr: tuple[int, float] | None = None  # (LSR, monotonic when it came)
        self.octets_sent = 0
        self.rtcp_sent = 0
        self.rtcp_reports_received = 0
        self.bad_rtcp = 0
        self.remote_report: dict[str, float | int] | None = None  # the peer's view of ours

    # ---- asyncio ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (3.11's selector transport is not a DatagramTransport subclass, though it is one.)
        self.transport = cast(asyncio.DatagramTransport, transport)
        if self._sendto is None:
            self._sendto = self.transport.sendto

    def use_socket(self, sock: socket.socket) -> None:
        """Send from the clock thread on the raw socket (asyncio transports are loop-only),
        keeping the GIL through the send (udp_send)."""
        self._sendto = sender(sock)

    def use_rtcp_socket(self, sock: socket.socket) -> None:
        """Send RTCP (not multiplexed) from this socket, bound on the RTP port + 1."""
        self._rtcp_sendto = sender(sock)

    # ---- RTCP -----------------------------------------------------------------------------

    def rtcp_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        """A compound RTCP packet from the peer: its sender report (for our LSR/DLSR) and its
        report block about our stream (loss, jitter, round trip)."""
        host = _host(str(addr[0]))
        peers = {h for h in (self.remote, self._signalled) if h is not None}
        if host not in {p[0] for p in peers}:
            self.foreign_packets += 1
            return
        try:
            packets = RtcpPacket.parse(data)
        except Exception:
            self.bad_rtcp += 1
            return
        now = _monotonic()
        self.rtcp_reports_received += 1
        for packet in packets:
            reports: list[RtcpReceiverInfo] = []
            if isinstance(packet, RtcpSrPacket):
                self._peer_sr = ((packet.sender_info.ntp_timestamp >> 16) & 0xFFFFFFFF, now)
                reports = packet.reports
            elif isinstance(packet, RtcpRrPacket):
                reports = packet.reports
            for block in reports:
                if block.ssrc != self.ssrc:
                    continue
                report: dict[str, float | int] = {
                    "loss_ratio": round(block.fraction_lost / 256, 4),
                    "packets_lost": block.packets_lost,
                    "jitter_ms": round(block.jitter / (CLOCK_RATE / 1000), 2),
                }
                if block.lsr:
                    rtt = (_ntp_middle() - block.lsr - block.dlsr) & 0xFFFFFFFF
                    if rtt < 0x80000000:
                        report["rtt_ms"] = round(rtt / 65.536, 1)
                self.remote_report = report

    def _next_rtcp_due(self) -> int:
        """Packets until the next report: the interval, randomized (RFC 3550 6.3.1)."""
        return max(1, round(self._rtcp_ticks * _RNG.uniform(0.5, 1.5)))

    def _rtcp_target(self) -> tuple[str, int] | None:
        remote = self.remote
        if remote is None:
            return None
        if self.rtcp_mux:
            return remote
        same_host = self._signalled is not None and remote[0] == self._signalled[0]
        return remote[0], (self._rtcp_port if same_host and self._rtcp_port else remote[1] + 1)

    def _send_rtcp(self) -> None:
        """One compound report (SR when we send, else RR; with SDES CNAME). Lock held."""
        target = self._rtcp_target()
        sendto = self._sendto if self.rtcp_mux else self._rtcp_sendto
        if target is None or sendto is None or self._closed:
            return
        lsr = dlsr = 0
        if self._peer_sr is not None:
            lsr = self._peer_sr[0]
            dlsr = min(0xFFFFFFFF, int((_monotonic() - self._peer_sr[1]) * 65536))
        block = self.reception.block(lsr, dlsr)
        reports = [block] if block is not None else []
        report: RtcpSrPacket | RtcpRrPacket
        if self.sending and self.packets_sent:
            info = RtcpSenderInfo(
                ntp_timestamp=_ntp_now(),
                rtp_timestamp=self.ts,
                packet_count=self.packets_sent & 0xFFFFFFFF,
                octet_count=self.octets_sent & 0xFFFFFFFF,
            )
            report = RtcpSrPacket(ssrc=self.ssrc, sender_info=info, reports=reports)
        else:
            report = RtcpRrPacket(ssrc=self.ssrc, reports=reports)
        sdes = RtcpSdesPacket(chunks=[RtcpSourceInfo(ssrc=self.ssrc, items=[(1, self._cname)])])
        try:
            sendto(bytes(report) + bytes(sdes), target)
        except OSError:
            return
        self.rtcp_sent += 1

    def error_received(self, exc: Exception) -> None:
        log.debug("RTP socket error: %r", exc)  # ICMP unreachable before the peer listens

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if len(data) < 12 or len(data) > MAX_PAYLOAD or data[0] >> 6 != 2:
            self.bad_packets += 1
            return
        if 200 <= data[1] <= 204:
            self.rtcp_received_muxed(data, addr)  # RTCP multiplexed on the RTP port (RFC 5761)
            return
        if addr != self._source and not self._admit(addr, data):
            return
        try:
            packet = RtpPacket.parse(data)
        except Exception:
            self.bad_packets += 1
            return
        pt = packet.payload_type
        if pt != self.codec.payload_type and pt != self.dtmf_pt:
            self.bad_packets += 1
            return
        self.packets_received += 1
        # Digits share the stream's sequence numbers but not its timing (RFC 4733).
        arrival = _monotonic()
        self.reception.packet(
            packet.ssrc, packet.sequence_number, packet.timestamp, arrival, pt != self.dtmf_pt
        )
        if pt == self.dtmf_pt:
            for digit in self._dtmf.feed(packet.payload, packet.timestamp):
                self._on_digit(digit)
            return
        if not self.receiving or not packet.payload:
            return  # on hold: the caller's music is not a turn of the conversation
        now_ms = arrival * 1000.0 - self._t0_ms
        ts = packet.timestamp
        # Signed 32-bit difference: a reordered packet or a wrap is a small step either way.
        ms = self._ms_base + (((ts - self._ts_base + 0x80000000) & 0xFFFFFFFF) - 0x80000000) // 8
        if packet.ssrc != self._in_ssrc or not -MAX_TS_JUMP_MS < ms - now_ms < MAX_TS_JUMP_MS:
            ms = self._anchor(packet.ssrc, ts, now_ms)
        elif ms < 0:
            ms = 0  # reordered before the first packet
        self._on_audio(packet.payload, ms)

    def rtcp_received_muxed(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if self.rtcp_mux:
            self.rtcp_received(data, addr)
        else:
            self.bad_rtcp += 1  # not negotiated: RTCP belongs on the other port

    def _anchor(self, ssrc: int, timestamp: int, now_ms: float) -> int:
        """A new stream time base: this packet plays at its arrival (a new stream or a jump)."""
        if self._in_ssrc is None:
            self._t0_ms = _monotonic() * 1000.0
            at = 0
        else:
            self.discontinuities += 1
            at = int(now_ms)
        self._in_ssrc, self._ts_base, self._ms_base = ssrc, timestamp, at
        return at

    def _admit(self, addr: tuple[Any, ...], data: bytes) -> bool:
        """A packet from somewhere other than the learned source: learn it, or drop it."""
        pt = data[1] & 0x7F
        if pt != self.codec.payload_type and pt != self.dtmf_pt:
            self.bad_packets += 1
            return False
        host = _host(str(addr[0]))
        source = (host, int(addr[1]))
        if source == self._signalled:
            # What the SDP names is the peer, whatever was learned before; learning is over.
            self._learn(addr, source)
            return True
        policy = self._policy
        if time.monotonic() < self._learn_until and (
            (self._signalled is not None and host == self._signalled[0])
            or host == policy.signalling_host
            or (policy.allow is not None and policy.allow.allows(host))
        ):
            # Another port of the peer's host (NAT) or of an allowed media host: learned after
            # `probation` packets in sequence, as Asterisk's strictrtp does. Until then the
            # packets are dropped (60 ms at the start of a call), and not counted as foreign.
            seq = (data[2] << 8) | data[3]
            if addr == self._candidate and seq == (self._candidate_seq + 1) & 0xFFFF:
                self._candidate_count += 1
            else:
                self._candidate, self._candidate_count = addr, 1
            self._candidate_seq = seq
            if self._candidate_count >= policy.probation:
                self._learn(addr, source)
                return True
            return False
        self.foreign_packets += 1
        self._stats.foreign_packets += 1
        if self.foreign_packets == 1 and self._on_foreign is not None:
            self._on_foreign(source)  # once a call: the counters say how many
        return False

    def _learn(self, addr: tuple[Any, ...], source: tuple[str, int]) -> None:
        with self.lock:
            self._source = addr
            self.remote = source
            self._learn_until = 0.0
            self._candidate = None

    # ---- media state --------------------------------------------------------------------

    def set_remote(self, remote: RemoteMedia, direction: Direction) -> None:
        """Apply a negotiation: where to send, and whether to send and receive at all."""
        with self.lock:
            was_sending = self.sending
            if remote.address is not None and remote.address != self._signalled:
                # The media moved (a new address or port): nothing learned before holds, the
                # new address is where to send, and another port of it may be learned anew. A
                # re-INVITE that keeps the address (hold, resume, a session refresh) changes
                # none of this, so it cannot re-open learning.
                self._signalled = remote.address
                self.remote = remote.address
                self._source = None
                self._candidate = None
                self._in_ssrc = None if self._in_ssrc is None else -1  # a new stream time base
                if self._started:
                    self._learn_until = time.monotonic() + self._policy.learn_s
            self.rtcp_mux = remote.rtcp_mux
            rtcp = remote.rtcp_address
            self._rtcp_port = rtcp[1] if rtcp is not None and not remote.rtcp_mux else None
            self.sending = remote.we_send and direction in ("sendrecv", "sendonly")
            # Only a two-way call feeds the model: what a caller on hold sends us (music) is
            # not a turn of the conversation, so while we answered `recvonly` it is dropped.
            self.receiving = direction == "sendrecv"
            if self.sending and not was_sending:
                self._marker = True  # a new talkspurt after hold

    def start(self) -> None:
        """Begin pacing (after the 200 OK)."""
        if not self._started and not self._closed:
            self._started = True
            if self._source is None:
                self._learn_until = time.monotonic() + self._policy.learn_s
            self._clock.add(self)

    # ---- outbound -----------------------------------------------------------------------

    def enqueue(self, item_id: str, audio: bytes) -> None:
        """Queue agent audio of `item_id` as frames of our packet time."""
        with self.lock:
            self._enqueue(item_id, audio)

    def _enqueue(self, item_id: str, audio: bytes) -> None:
        if self._closed:
            return
        if self._tail and self._tail_item != item_id:
            self._push_tail()
        data = self._tail + audio
        size = self.frame_bytes
        whole = len(data) - len(data) % size
        for offset in range(0, whole, size):
            self._push(item_id, data[offset : offset + size])
        self._tail = data[whole:]
        self._tail_item = item_id if self._tail else None

    def _push(self, item_id: str, payload: bytes) -> None:
        epoch, end_ms = self.playback.queued(item_id, len(payload) / 8)
        if len(payload) < self.frame_bytes:
            payload += self._silence[len(payload) :]
        self._queue.append(_Frame(item_id, payload, epoch, end_ms))

    def _push_tail(self) -> None:
        if self._tail and self._tail_item is not None:
            self._push(self._tail_item, self._tail)
        self._tail = b""
        self._tail_item = None

    def flush(self, then: Callable[[], None] | None = None) -> int:
        """Drop every queued frame (barge-in); returns how many. SSRC/seq/timestamp run on.

        `then` runs under the same lock (the leg passes `playback.cleared`), so no tick can
        send a frame between the flush and the tracker's new epoch.
        """
        with self.lock:
            dropped = len(self._queue) + (1 if self._tail else 0)
            self._queue.clear()
            self._tail = b""
            self._tail_item = None
            if then is not None:
                then()
            return dropped

    @property
    def queued_frames(self) -> int:
        return len(self._queue)

    def send_events(self, keys: list[tuple[int, int, int]]) -> None:
        """Queue digits as RFC 4733 telephone-events: (event code, tone ticks, gap ticks after);
        a code of -1 is a pause. Sent in place of agent audio, which waits meanwhile."""
        with self.lock:
            self._digits.extend(keys)

    def _event_packet(self) -> RtpPacket | None:
        """The next telephone-event packet, or None when no digit is being sent (the caller
        holds the lock). A digit's packets share its start timestamp, with a growing duration;
        its end is sent three times (RFC 4733 2.5.1.4); a gap of audio/silence follows."""
        if self._event is None:
            if self._gap > 0:
                self._gap -= 1
                return None
            while self._digits:
                code, tone, gap = self._digits.popleft()
                if code < 0:  # a pause
                    self._gap = tone + gap
                    return None
                self._event = [code, self.ts, 0, tone, 3]
                self._gap = gap
                break
            else:
                return None
        event = self._event
        code, start, sent, tone, ends = event
        first = sent == 0
        if sent < tone:
            sent += 1
        end = sent >= tone
        if end:
            ends -= 1
        event[2], event[4] = sent, ends
        if end and ends <= 0:
            self._event = None
            self.events_sent += 1
        duration = sent * self.frame_bytes
        payload = bytes([code, (0x80 if end else 0) | 10, duration >> 8, duration & 0xFF])
        assert self.dtmf_pt is not None
        return RtpPacket(
            payload_type=self.dtmf_pt,
            marker=1 if first else 0,
            sequence_number=self.seq,
            timestamp=start,
            ssrc=self.ssrc,
            payload=payload,
        )

    def tick(self, elapsed_ms: int | None = None) -> None:
        """The clock moved on by `elapsed_ms` (None: a whole packet time): once a packet time
        has passed, send the next agent frame, or silence (the clock thread)."""
        with self.lock:
            self._tick(elapsed_ms)

    def tick_locked(self, elapsed_ms: int, wait: bool) -> bool:
        """`tick` if the stream's lock is free or `wait`; False (nothing done) if it was not."""
        if not self.lock.acquire(wait):
            return False
        try:
            self._tick(elapsed_ms)
        finally:
            self.lock.release()
        return True

    def _tick(self, elapsed_ms: int | None) -> None:
        if elapsed_ms is not None:
            self._elapsed_ms += elapsed_ms
            if self._elapsed_ms < self.ptime_ms:
                return
            self._elapsed_ms -= self.ptime_ms
        self.ts = (self.ts + self.frame_bytes) & 0xFFFFFFFF  # time runs on, on hold too
        self._rtcp_due -= 1
        if self._rtcp_due <= 0:
            # Reports go on, on hold too (a receiver report then), at a randomized pace.
            self._rtcp_due = self._next_rtcp_due()
            self._send_rtcp()
        remote, sendto = self.remote, self._sendto
        if not self.sending or remote is None or sendto is None or self._closed:
            return  # paused: agent audio stays queued and nothing counts as heard
        event = (
            self._event_packet()
            if self.dtmf_pt is not None and (self._event or self._digits or self._gap)
            else None
        )
        frame = None
        if event is not None:
            payload = event.payload
            data = event.serialize()
        else:
            if not self._queue and self._tail:
                self._push_tail()  # the last, short frame of a response
            frame = self._queue.popleft() if self._queue else None
            payload = frame.payload if frame is not None else self._silence
            marker = 0x80 if self._marker else 0
            data = (
                _HEADER.pack(0x80, marker | self.codec.payload_type, self.seq, self.ts, self.ssrc)
                + payload
            )
            self._marker = False
        self.seq = (self.seq + 1) & 0xFFFF
        try:
            sendto(data, remote)
        except OSError:
            pass  # a full socket buffer or an unreachable peer: this frame is lost
        self.packets_sent += 1
        self.octets_sent += len(payload)
        if frame is not None:
            self.agent_frames_sent += 1
            self.playback.played(frame.epoch, frame.item_id, frame.end_ms)

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
        # The callbacks are the leg's methods, and the leg holds this stream: a reference
        # cycle that would leave the ended call to a full collection. Closed, it hears nothing.
        self._on_audio, self._on_digit, self._on_foreign = _unheard_audio, _unheard_digit, None
        self._clock.remove(self)
        if self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.close()
