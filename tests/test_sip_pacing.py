"""The RTP clock thread over real UDP sockets: every call's packets in order at its packet time,
flushes that drop what has not left, heard audio that counts only what left, and sends that
keep the GIL (udp_send)."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from aiortc.rtp import RtcpPacket, RtcpSrPacket, RtpPacket

from telephony.legs.sip.pacer import PacedStream, PacerClock
from telephony.legs.sip.rtp import RtpClock, RtpStream, SentPlayback
from telephony.legs.sip.sdp import PCMU, RemoteMedia
from telephony.legs.sip.udp_send import KEEPS_GIL, GilSender, sender, sockaddr

SILENCE = b"\xff"


class Peer:
    """The caller's RTP socket: what arrives, parsed, in arrival order."""

    def __init__(self, made: list[socket.socket]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        made.append(self.sock)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.address = ("127.0.0.1", int(self.sock.getsockname()[1]))
        self.packets: list[RtpPacket] = []

    def until(self, done: Callable[[list[RtpPacket]], bool], timeout: float = 10.0) -> None:
        """Read until `done(packets)` holds (observable state, not a sleep)."""
        deadline = time.monotonic() + timeout
        while not done(self.packets):
            assert time.monotonic() < deadline, f"{len(self.packets)} packets arrived"
            try:
                self.packets.append(RtpPacket.parse(self.sock.recv(2048)))
            except TimeoutError:
                pass


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for sock in made:
        sock.close()


@pytest.fixture(params=["thread", "process"])
def clock(request: pytest.FixtureRequest) -> Iterator[RtpClock]:
    """The clock thread of the serving process, or the pacer process (SIP_PACER)."""
    made = RtpClock() if request.param == "thread" else PacerClock()
    yield made
    if isinstance(made, PacerClock):
        made.close()


def paced(clock: RtpClock, peer: Peer, made: list[socket.socket], ptime: int = 20) -> RtpStream:
    """A stream sending from a real non-blocking socket of its own, as the SIP listener's."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    made.append(sock)
    kind = PacedStream if isinstance(clock, PacerClock) else RtpStream
    rtp = kind(PCMU, 101, SentPlayback(), clock, lambda a, _: None, lambda d: None,
               ptime_ms=ptime)  # fmt: skip
    rtp.use_socket(sock)
    if isinstance(clock, PacerClock):
        assert isinstance(rtp, PacedStream) and rtp.remote_paced
    rtp.set_remote(RemoteMedia(PCMU, 101, peer.address, "sendrecv"), "sendrecv")
    return rtp


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def agent_frames(packets: list[RtpPacket]) -> list[bytes]:
    return [p.payload for p in packets if p.payload_type == 0 and p.payload[:1] != SILENCE]


def test_the_clock_sends_every_calls_packets_in_order_at_its_packet_time(
    sockets: list[socket.socket], clock: RtpClock
) -> None:
    peers = {ptime: Peer(sockets) for ptime in (20, 30, 40)}
    streams = {ptime: paced(clock, peer, sockets, ptime) for ptime, peer in peers.items()}
    for ptime, rtp in streams.items():
        rtp.enqueue("item1", b"".join(bytes([i]) * (8 * ptime) for i in range(1, 6)))
    try:
        for rtp in streams.values():
            rtp.start()
        for ptime, peer in peers.items():
            peer.until(lambda packets: len(packets) >= 8)
            packets = peer.packets
            # Agent audio first, frame by frame in order, then silence; one packet per packet
            # time on the RTP clock, without a gap in sequence or timestamp.
            assert [p.payload for p in packets[:5]] == [
                bytes([i]) * (8 * ptime) for i in range(1, 6)
            ]
            assert all(p.payload == SILENCE * (8 * ptime) for p in packets[5:8])
            assert [p.marker for p in packets[:2]] == [1, 0]
            assert len({p.ssrc for p in packets}) == 1
            for a, b in itertools.pairwise(packets):
                assert (b.sequence_number - a.sequence_number) & 0xFFFF == 1
                assert (b.timestamp - a.timestamp) & 0xFFFFFFFF == 8 * ptime
            rtp = streams[ptime]
            # (From the pacer process, what left is told right after its tick.)
            eventually(lambda rtp=rtp, ptime=ptime: rtp.playback.heard_ms("item1") == 5 * ptime)
    finally:
        for rtp in streams.values():
            rtp.close()


def test_a_flush_drops_what_has_not_left_and_heard_is_what_the_caller_received(
    sockets: list[socket.socket], clock: RtpClock
) -> None:
    peer = Peer(sockets)
    rtp = paced(clock, peer, sockets)
    rtp.enqueue("item1", b"".join(bytes([1 + i % 100]) * 160 for i in range(150)))  # 3 s
    try:
        rtp.start()
        peer.until(lambda packets: len(agent_frames(packets)) >= 5)
        dropped = rtp.flush(then=rtp.playback.cleared)
        sent = rtp.agent_frames_sent
        assert dropped == 150 - sent
        peer.until(lambda packets: len(packets) >= sent + 10)
        received = agent_frames(peer.packets)
        # Everything that left before the flush arrives, nothing queued after it does.
        assert received == [bytes([1 + i % 100]) * 160 for i in range(sent)]
        assert all(p.payload == SILENCE * 160 for p in peer.packets[sent:])
        assert rtp.playback.heard_ms("item1") == 20 * sent
        for a, b in itertools.pairwise(peer.packets):
            assert (b.sequence_number - a.sequence_number) & 0xFFFF == 1
    finally:
        rtp.close()


def test_a_stream_the_loop_holds_is_ticked_after_the_others_not_skipped(
    sockets: list[socket.socket],
) -> None:
    clock = RtpClock()
    peer = Peer(sockets)
    rtp = paced(clock, peer, sockets)
    rtp.enqueue("item1", bytes([7]) * 160)
    with rtp.lock:  # the loop queueing or flushing
        assert rtp.tick_locked(20, False) is False
    assert rtp.packets_sent == 0
    assert rtp.tick_locked(20, True) is True
    peer.until(lambda packets: len(packets) == 1)
    assert peer.packets[0].payload == bytes([7]) * 160
    assert rtp.packets_sent == 1
    assert rtp.octets_sent == 160


def test_sends_that_keep_the_gil_deliver_what_the_sockets_own_sendto_would() -> None:
    assert KEEPS_GIL  # Linux: the clock's sends do not give the GIL up
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx,
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as rx6,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx,
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as tx6,
    ):
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(5)
        tx.bind(("127.0.0.1", 0))
        rx6.bind(("::1", 0))
        rx6.settimeout(5)
        port, port6 = rx.getsockname()[1], rx6.getsockname()[1]
        send = sender(tx)
        assert isinstance(send, GilSender)
        assert send(b"four", ("127.0.0.1", port)) == 4
        assert rx.recvfrom(100) == (b"four", tx.getsockname())
        # A name is not a literal address: the socket's own send resolves it.
        assert sockaddr(socket.AF_INET, "localhost", port) is None
        send(b"named", ("localhost", port))
        assert rx.recv(100) == b"named"
        send6 = sender(tx6)
        send6(b"six", ("::1", port6))
        assert rx6.recv(100) == b"six"
        tx.close()
        with pytest.raises(OSError):
            send(b"closed", ("127.0.0.1", port))


def test_an_ipv4_peer_of_an_ipv6_socket_is_reached_through_its_mapped_address() -> None:
    assert sockaddr(socket.AF_INET6, "192.0.2.1", 5004) == sockaddr(
        socket.AF_INET6, "::ffff:192.0.2.1", 5004
    )
    assert sockaddr(socket.AF_INET6, "fe80::1%eth0", 5004) is None
    assert sockaddr(socket.AF_INET, "::1", 5004) is None


def test_when_the_pacer_process_dies_its_calls_go_on_from_the_thread(
    sockets: list[socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    clock = PacerClock()
    peer = Peer(sockets)
    rtp = paced(clock, peer, sockets)
    assert isinstance(rtp, PacedStream)
    try:
        rtp.enqueue("item1", bytes([5]) * 160 * 3)
        rtp.start()
        peer.until(lambda packets: len(packets) >= 6)
        assert clock._proc is not None
        clock._proc.kill()
        eventually(lambda: not rtp.remote_paced)
        assert "the RTP pacer process is gone" in caplog.text
        before = len(peer.packets)
        rtp.enqueue("item2", bytes([9]) * 160 * 2)
        peer.until(lambda packets: agent_frames(packets).count(bytes([9]) * 160) == 2)
        after = peer.packets[before:]
        # The thread goes on with the same stream: the same SSRC, no sequence number twice.
        assert {p.ssrc for p in peer.packets} == {rtp.ssrc}
        seqs = [p.sequence_number for p in peer.packets]
        assert len(set(seqs)) == len(seqs)
        assert after and all(
            (b.sequence_number - a.sequence_number) & 0xFFFF == 1
            for a, b in itertools.pairwise(after)
        )
        eventually(lambda: rtp.playback.heard_ms("item2") == 40)
    finally:
        rtp.close()
        clock.close()


def test_digits_and_sender_reports_go_out_with_the_pacer_process(
    sockets: list[socket.socket],
) -> None:
    clock = PacerClock()
    peer = Peer(sockets)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    sockets.append(sock)
    rtp = PacedStream(PCMU, 101, SentPlayback(), clock, lambda a, _: None, lambda d: None,
                      rtcp_interval_s=1.0)  # fmt: skip
    rtp.use_socket(sock)
    rtp.set_remote(RemoteMedia(PCMU, 101, peer.address, "sendrecv", rtcp_mux=True), "sendrecv")
    reports: list[RtcpSrPacket] = []
    media: list[RtpPacket] = []
    try:
        rtp.start()
        rtp.send_events([(1, 3, 2)])  # digit 1: three packets of tone, two of gap
        deadline = time.monotonic() + 10
        while not reports or rtp.events_sent < 1:
            assert time.monotonic() < deadline
            try:
                data = peer.sock.recv(2048)
            except TimeoutError:
                continue
            if 200 <= data[1] <= 204:
                reports += [p for p in RtcpPacket.parse(data) if isinstance(p, RtcpSrPacket)]
            else:
                media.append(RtpPacket.parse(data))
        events = [p for p in media if p.payload_type == 101]
        assert events and events[0].payload[0] == 1 and events[0].marker == 1
        # The parent's report speaks of the child's packets: its SSRC, a count of them.
        report = reports[0]
        assert report.ssrc == rtp.ssrc
        assert 0 < report.sender_info.packet_count <= rtp.packets_sent
    finally:
        rtp.close()
        clock.close()
