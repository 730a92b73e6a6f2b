"""The RTP side of a SIP call: pacing, flush, hold, latching, DTMF, SDP answers, RTP ports."""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
from typing import Any

import pytest
from aiortc.rtp import (
    RtcpPacket,
    RtcpReceiverInfo,
    RtcpRrPacket,
    RtcpSdesPacket,
    RtcpSenderInfo,
    RtcpSrPacket,
    RtpPacket,
)
from openai import AsyncOpenAI

from telephony.legs.leg import AudioIn, DtmfIn, LegClosed
from telephony.legs.sip import sdp
from telephony.legs.sip.errors import RtpPortsExhausted, SdpError
from telephony.legs.sip.leg import SipLeg
from telephony.legs.sip.ports import RtpPorts, parse_range
from telephony.legs.sip.rtp import (
    MediaPolicy,
    MediaStats,
    Reception,
    RtpClock,
    RtpStream,
    SentPlayback,
)
from telephony.legs.sip.sdp import PCMA, PCMU, LocalMedia, RemoteMedia
from telephony.sim.simulator import RealtimeSimulator
from tests.sip_support import sdp_offer

PEER = ("127.0.0.1", 40000)


class FakeTransport:
    """What the stream sends, parsed."""

    def __init__(self) -> None:
        self.sent: list[tuple[RtpPacket, tuple[str, int]]] = []

    def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        self.sent.append((RtpPacket.parse(data), addr))

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


def stream(**kw: Any) -> tuple[RtpStream, FakeTransport, list[bytes], list[str]]:
    audio: list[bytes] = []
    digits: list[str] = []
    rtp = RtpStream(
        kw.get("codec", PCMU), 101, SentPlayback(), RtpClock(), lambda a, _: audio.append(a),
        digits.append,
    )  # fmt: skip
    transport = FakeTransport()
    rtp.connection_made(transport)  # type: ignore[arg-type]
    rtp.set_remote(RemoteMedia(kw.get("codec", PCMU), 101, PEER, "sendrecv"), "sendrecv")
    return rtp, transport, audio, digits


def agent(ms: int, fill: int = 0x11) -> bytes:
    return bytes([fill]) * (8 * ms)


def test_every_tick_sends_one_packet_agent_audio_first_then_silence() -> None:
    rtp, out, _, _ = stream()
    rtp.enqueue("item1", agent(50))  # 2.5 frames
    for _ in range(5):
        rtp.tick()
    payloads = [p.payload for p, _ in out.sent]
    assert payloads[0] == payloads[1] == agent(20)
    assert payloads[2] == agent(10) + b"\xff" * 80  # the short tail, padded with silence
    assert payloads[3] == payloads[4] == b"\xff" * 160
    assert rtp.playback.heard_ms("item1") == 50
    assert [p.marker for p, _ in out.sent] == [1, 0, 0, 0, 0]


def test_a_flush_drops_the_queue_and_the_stream_runs_on_without_a_gap() -> None:
    rtp, out, _, _ = stream()
    rtp.enqueue("item1", agent(200))
    for _ in range(3):
        rtp.tick()
    assert rtp.flush() == 7
    rtp.playback.cleared()
    rtp.tick()
    rtp.tick()
    packets = [p for p, _ in out.sent]
    assert [p.payload for p in packets[3:]] == [b"\xff" * 160] * 2
    assert rtp.playback.heard_ms("item1") == 60  # exactly the three frames that left
    assert len({p.ssrc for p in packets}) == 1
    for a, b in itertools.pairwise(packets):
        assert (b.sequence_number - a.sequence_number) & 0xFFFF == 1
        assert (b.timestamp - a.timestamp) & 0xFFFFFFFF == 160


def test_on_hold_nothing_is_sent_nothing_counts_as_heard_and_resume_goes_to_the_new_port() -> None:
    rtp, out, audio, _ = stream()
    rtp.enqueue("item1", agent(100))
    rtp.tick()
    rtp.set_remote(RemoteMedia(PCMU, 101, PEER, "sendonly"), "recvonly")
    for _ in range(10):
        rtp.tick()
    assert len(out.sent) == 1 and rtp.playback.heard_ms("item1") == 20
    # Their music on hold reaches us but is not forwarded to the model.
    rtp.datagram_received(RtpPacket(0, 0, 1, 160, 7, b"\x55" * 160).serialize(), PEER)
    assert audio == []
    rtp.set_remote(RemoteMedia(PCMU, 101, ("127.0.0.1", 41000), "sendrecv"), "sendrecv")
    rtp.tick()
    resumed, where = out.sent[-1]
    first = out.sent[0][0]
    assert where == ("127.0.0.1", 41000) and resumed.marker == 1
    assert (resumed.sequence_number - first.sequence_number) & 0xFFFF == 1
    assert (resumed.timestamp - first.timestamp) & 0xFFFFFFFF == 160 * 11  # time ran on
    assert rtp.playback.heard_ms("item1") == 40


def test_inactive_stops_both_directions() -> None:
    rtp, out, audio, _ = stream()
    rtp.set_remote(RemoteMedia(PCMU, 101, PEER, "inactive"), "inactive")
    rtp.tick()
    rtp.datagram_received(RtpPacket(0, 0, 1, 160, 7, b"\x55" * 160).serialize(), PEER)
    assert out.sent == [] and audio == []


class StillClock:
    """An RTP clock that never ticks by itself (the test ticks), so start() opens learning."""

    def add(self, stream: RtpStream) -> None:
        pass

    def remove(self, stream: RtpStream) -> None:
        pass


def strict_stream(
    policy: MediaPolicy, stats: MediaStats | None = None
) -> tuple[RtpStream, FakeTransport, list[tuple[bytes, int]], list[tuple[str, int]]]:
    audio: list[tuple[bytes, int]] = []
    foreign: list[tuple[str, int]] = []
    rtp = RtpStream(
        PCMU, 101, SentPlayback(), StillClock(), lambda a, ms: audio.append((a, ms)),  # type: ignore[arg-type]
        lambda _: None, policy=policy, stats=stats, on_foreign=foreign.append,
    )  # fmt: skip
    transport = FakeTransport()
    rtp.connection_made(transport)  # type: ignore[arg-type]
    rtp.set_remote(RemoteMedia(PCMU, 101, PEER, "sendrecv"), "sendrecv")
    rtp.start()
    return rtp, transport, audio, foreign


def rtp_packet(seq: int, ts: int, ssrc: int = 7, fill: int = 1, pt: int = 0) -> bytes:
    return RtpPacket(pt, 0, seq & 0xFFFF, ts & 0xFFFFFFFF, ssrc, bytes([fill]) * 160).serialize()


def test_strict_rtp_takes_the_signalled_address_and_drops_every_other_host() -> None:
    stats = MediaStats()
    rtp, out, audio, foreign = strict_stream(MediaPolicy(signalling_host="127.0.0.1"), stats)
    sprayer = ("127.0.0.9", 50123)
    for n in range(10):  # before the caller: in sequence, but from a host nobody named
        rtp.datagram_received(rtp_packet(n, n * 160, fill=9), sprayer)
    rtp.tick()
    assert out.sent[-1][1] == PEER  # agent audio goes where the SDP says, not to the sprayer
    rtp.datagram_received(rtp_packet(1, 160), PEER)
    rtp.datagram_received(rtp_packet(96, 160, pt=96), PEER)  # wrong payload type
    for n in range(10, 20):
        rtp.datagram_received(rtp_packet(n, n * 160, fill=9), sprayer)
    rtp.tick()
    assert [a for a, _ in audio] == [b"\x01" * 160]
    assert rtp.foreign_packets == 20 and stats.foreign_packets == 20 and rtp.bad_packets == 1
    assert foreign == [sprayer]  # reported once, however many packets
    assert {where for _, where in out.sent} == {PEER}


def test_another_port_of_the_peers_host_is_learned_after_packets_in_sequence_in_the_window() -> (
    None
):
    rtp, out, audio, foreign = strict_stream(MediaPolicy(signalling_host="127.0.0.5", probation=4))
    nat = ("127.0.0.1", 50123)  # the SDP's host, another port: NAT rewrote it
    rtp.datagram_received(rtp_packet(1, 160), nat)
    rtp.datagram_received(rtp_packet(3, 480), nat)  # out of sequence: probation starts over
    for seq in (4, 5):
        rtp.datagram_received(rtp_packet(seq, seq * 160), nat)
    assert audio == [] and rtp.remote == PEER
    rtp.datagram_received(rtp_packet(6, 6 * 160), nat)  # the fourth in a row: learned
    rtp.datagram_received(rtp_packet(7, 7 * 160), nat)
    rtp.tick()
    assert len(audio) == 2 and out.sent[-1][1] == nat
    # The INVITE's host may be learned too, but not once a source is in (learning is closed).
    for seq in range(10):
        rtp.datagram_received(rtp_packet(seq, seq * 160), ("127.0.0.5", 4000))
    assert rtp.remote == nat and foreign == [("127.0.0.5", 4000)]
    # The SDP's own address is the peer whatever was learned.
    rtp.datagram_received(rtp_packet(9, 9 * 160), PEER)
    rtp.tick()
    assert out.sent[-1][1] == PEER and len(audio) == 3


def test_learning_ends_with_its_window_and_a_reinvite_to_the_same_address_keeps_it_shut() -> None:
    rtp, out, audio, _ = strict_stream(MediaPolicy(learn_s=0.05, probation=2))
    time.sleep(0.06)
    nat = ("127.0.0.1", 50123)
    for seq in range(5):
        rtp.datagram_received(rtp_packet(seq, seq * 160), nat)
    assert audio == [] and rtp.foreign_packets == 5
    # Hold and resume at the same address: learning stays closed.
    rtp.set_remote(RemoteMedia(PCMU, 101, PEER, "sendonly"), "recvonly")
    rtp.set_remote(RemoteMedia(PCMU, 101, PEER, "sendrecv"), "sendrecv")
    for seq in range(5, 10):
        rtp.datagram_received(rtp_packet(seq, seq * 160), nat)
    assert audio == [] and rtp.foreign_packets == 10
    # A move to a new port opens it again, for that host.
    moved = ("127.0.0.1", 41000)
    rtp.set_remote(RemoteMedia(PCMU, 101, moved, "sendrecv"), "sendrecv")
    for seq in range(10, 12):
        rtp.datagram_received(rtp_packet(seq, seq * 160), nat)
    rtp.tick()
    assert len(audio) == 1 and out.sent[-1][1] == nat


def test_caller_stream_time_stays_on_the_arrival_clock_whatever_the_timestamps_say() -> None:
    rtp, _, audio, _ = strict_stream(MediaPolicy())
    base = 0xFFFFF000  # wraps past 2**32 after a few packets
    stamps = [base, base - 160]  # the second is reordered: below the first
    stamps += [base + 160 * n for n in range(1, 60)]  # runs across the wrap
    for seq, ts in enumerate(stamps):
        rtp.datagram_received(rtp_packet(seq, ts), PEER)
    rtp.datagram_received(rtp_packet(100, 12345, ssrc=99), PEER)  # a new stream (new SSRC)
    rtp.datagram_received(rtp_packet(101, 12345 + 8000 * 3600 * 5, ssrc=99), PEER)  # +5 hours
    rtp.datagram_received(rtp_packet(102, 12345 - 8000 * 3600, ssrc=99), PEER)  # -1 hour
    times = [ms for _, ms in audio]
    assert times[:3] == [0, 0, 20]  # the reordered packet is not 149 hours in
    assert times[60] == 59 * 20  # across the wrap: still 20 ms steps
    assert all(0 <= ms < 1000 + 59 * 20 for ms in times), times  # the test took well under 1 s
    assert rtp.discontinuities == 3


def test_rfc4733_digits_come_out_once_per_key_press() -> None:
    rtp, _, _, digits = stream()
    for flags in (0x0A, 0x0A, 0x8A, 0x8A, 0x8A):
        rtp.datagram_received(
            RtpPacket(101, 0, 1, 4000, 7, bytes([9, flags, 0, 160])).serialize(), PEER
        )
    assert digits == ["9"]


async def test_the_sip_leg_hangs_up_once_and_a_remote_bye_ends_its_events() -> None:
    hung: list[str] = []
    leg = SipLeg("call-1", PCMU, 101, RtpClock(), hung.append)
    leg.digit("5")
    await leg.close("tool ended the call")
    await leg.close("again")
    events = [e async for e in leg.events()]
    assert events == [DtmfIn("5"), LegClosed("tool ended the call")]
    assert hung == ["tool ended the call"]
    other = SipLeg("call-2", PCMA, None, RtpClock(), hung.append)
    other.remote_ended("bye")
    assert [e async for e in other.events()] == [LegClosed("bye")]
    await other.close("late")
    assert hung == ["tool ended the call"]  # their BYE ended it: we send none
    assert other.audio_format == "audio/pcma"


def test_the_answer_follows_the_offers_preference_and_its_dtmf_payload_type() -> None:
    remote = sdp.read_offer(sdp_offer(formats="8 0 99", dtmf=99))
    assert remote.codec is PCMA and remote.dtmf_pt == 99
    local = LocalMedia("192.0.2.10", 20002, 7)
    body = sdp.answer(sdp_offer(formats="8 0 99", dtmf=99), remote, local, 1, "sendrecv").decode()
    assert "m=audio 20002 RTP/AVP 8 99" in body
    assert "c=IN IP4 192.0.2.10" in body and "a=fmtp:99 0-15" in body and "a=ptime:20" in body


def test_extra_streams_are_refused_with_port_zero_in_the_answer() -> None:
    offer = sdp_offer() + b"m=video 40002 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\n"
    remote = sdp.read_offer(offer)
    body = sdp.answer(offer, remote, LocalMedia("127.0.0.1", 20000, 1), 1, "sendrecv").decode()
    assert "m=video 0 RTP/AVP 96" in body


@pytest.mark.parametrize(
    ("offer", "status"),
    [
        (sdp_offer(formats="18 9"), 488),  # G.729, G.722: no common codec
        (sdp_offer().replace(b"RTP/AVP", b"RTP/SAVP"), 488),  # SRTP
        (sdp_offer().replace(b"IN IP4 127.0.0.1", b"IN IP4 example.com"), 488),
        (b"v=0\r\nm=audio x RTP/AVP 0\r\n", 400),
        (b"\xff\xfe", 400),
    ],
)
def test_offers_we_cannot_answer(offer: bytes, status: int) -> None:
    with pytest.raises(SdpError) as caught:
        sdp.read_offer(offer)
    assert caught.value.status == status


def test_old_style_hold_with_a_zero_address_means_do_not_send() -> None:
    remote = sdp.read_offer(sdp_offer().replace(b"c=IN IP4 127.0.0.1", b"c=IN IP4 0.0.0.0"))
    assert remote.address is None and not remote.we_send


def test_a_session_level_direction_counts() -> None:
    offer = (
        sdp_offer()
        .replace(b"a=sendrecv\r\n", b"")
        .replace(b"t=0 0\r\n", b"t=0 0\r\na=sendonly\r\n")
    )
    assert sdp.read_offer(offer).direction == "sendonly"


async def test_rtp_ports_come_from_the_range_even_and_run_out_cleanly() -> None:
    assert parse_range("0") is None and parse_range("20000-20003") == (20000, 20003)
    with pytest.raises(ValueError):
        parse_range("80-90")
    ports = RtpPorts("43000-43003")
    first = await ports.bind("127.0.0.1", asyncio.DatagramProtocol)
    second = await ports.bind("127.0.0.1", asyncio.DatagramProtocol)
    assert {first[2], second[2]} == {43000, 43002}
    with pytest.raises(RtpPortsExhausted):
        await ports.bind("127.0.0.1", asyncio.DatagramProtocol)
    first[0].close()
    await asyncio.sleep(0)  # the socket closes on the next loop iteration
    ports.release(first[2])
    third = await ports.bind("127.0.0.1", asyncio.DatagramProtocol)
    assert third[2] == first[2]
    second[0].close()
    third[0].close()


async def test_the_simulator_takes_pcma_sessions_and_reports_the_format() -> None:
    async with RealtimeSimulator(realtime_factor=0) as sim:
        client = AsyncOpenAI(api_key="x", base_url=sim.base_url)
        async with client.realtime.connect(model="gpt-realtime") as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "audio": {
                        "input": {"format": {"type": "audio/pcma"}},
                        "output": {"format": {"type": "audio/pcma"}},
                    },
                }
            )
            async for event in conn:
                if event.type == "session.updated":
                    break
        session = await sim.wait_for_session(0)
        assert session.input_format == "audio/pcma" and session.output_format == "audio/pcma"
        await client.close()


async def test_rtp_ports_are_chosen_at_random_over_the_whole_range() -> None:
    # A sprayer that tries the lowest free port (or the next in turn) must not find the call.
    ports = RtpPorts("43100-43199")  # 50 even ports
    chosen = []
    for _ in range(30):
        transport, _, port, _ = await ports.bind("127.0.0.1", asyncio.DatagramProtocol)
        chosen.append(port)
        transport.close()
        await asyncio.sleep(0)  # the socket closes on the next loop iteration
        ports.release(port)
    assert all(43100 <= p <= 43198 and p % 2 == 0 for p in chosen)
    assert len(set(chosen)) >= 10 and max(chosen) - min(chosen) >= 50
    assert chosen != sorted(chosen)


def test_reception_counts_loss_from_sequence_numbers_across_a_wrap_a_reorder_and_a_new_ssrc() -> (
    None
):
    reception = Reception()
    seqs = [65530 + n for n in range(12)]  # wraps past 65535
    del seqs[3], seqs[5]  # two lost
    seqs[6], seqs[7] = seqs[7], seqs[6]  # one reordered
    seqs.append(seqs[-1])  # one duplicated
    for n, seq in enumerate(seqs):
        reception.packet(7, seq & 0xFFFF, 160 * n, 0.02 * n, audio=True)
    report = reception.report()
    assert report["packets_expected"] == 12
    assert report["packets_received"] == 11  # the duplicate counts, as RFC 3550 says
    assert report["packets_lost"] == 1
    # A new stream (a new SSRC after a re-INVITE): counted on its own, kept in the totals.
    for n in range(10):
        if n != 4:
            reception.packet(99, 100 + n, 8000 + 160 * n, 1 + 0.02 * n, audio=True)
    report = reception.report()
    assert report["packets_expected"] == 22 and report["packets_received"] == 20
    assert report["packets_lost"] == 2 and report["loss_ratio"] == round(2 / 22, 4)


def test_reception_jitter_is_zero_for_steady_packets_and_follows_late_ones() -> None:
    steady, shaky = Reception(), Reception()
    for n in range(200):
        steady.packet(7, n, 160 * n, 10 + 0.02 * n, audio=True)
        late = 0.01 if n % 2 else 0.0  # every other packet 10 ms late
        shaky.packet(7, n, 160 * n, 10 + 0.02 * n + late, audio=True)
    assert steady.report()["jitter_ms"] == 0.0
    # |D| = 10 ms on every packet: the estimate converges on it.
    assert 9.0 < shaky.report()["jitter_ms"] <= 10.0
    # Digits share the sequence numbers but not the timing: counted, not timed.
    shaky.packet(7, 200, 0, 99.0, audio=False)
    assert 9.0 < shaky.report()["jitter_ms"] <= 10.0
    assert shaky.report()["packets_expected"] == 201 == shaky.report()["packets_received"]


def test_the_stream_feeds_its_reception_from_admitted_packets_only() -> None:
    rtp, _, _, _ = stream()
    for seq in (1, 2, 4, 5):
        rtp.datagram_received(rtp_packet(seq, seq * 160), PEER)
    rtp.datagram_received(b"\x80" + bytes(5), PEER)  # too short: not RTP
    report = rtp.reception.report()
    assert (report["packets_received"], report["packets_lost"]) == (4, 1)


def test_digits_go_out_as_rfc4733_events_in_place_of_audio_then_audio_resumes() -> None:
    rtp, out, _, _ = stream()  # ticked by hand: never started on a real clock
    rtp.enqueue("item", agent(60))  # agent audio waits while the keys are sent
    rtp.send_events([(1, 5, 4), (11, 5, 0)])  # "1", a gap, "#"
    for _ in range(20):
        rtp.tick()
    sent = [p for p, _ in out.sent]
    events = [p for p in sent if p.payload_type == 101]
    by_code: dict[int, list[RtpPacket]] = {}
    for p in events:
        by_code.setdefault(p.payload[0], []).append(p)
    assert list(by_code) == [1, 11]
    for packets in by_code.values():
        # One timestamp per key, a marker on its first packet, a growing duration, and its
        # end sent three times (RFC 4733).
        assert len({p.timestamp for p in packets}) == 1
        assert [p.marker for p in packets] == [1] + [0] * (len(packets) - 1)
        durations = [int.from_bytes(p.payload[2:4], "big") for p in packets]
        assert durations == [160, 320, 480, 640, 800, 800, 800]
        assert [bool(p.payload[1] & 0x80) for p in packets] == [False] * 4 + [True] * 3
    # Sequence numbers run on without a gap through events and audio alike.
    seqs = [p.sequence_number for p in sent]
    assert all((b - a) & 0xFFFF == 1 for a, b in itertools.pairwise(seqs))
    # The agent's audio went out only after the keys (the gap between them is audio time).
    first_event = sent.index(events[0])
    audio = [i for i, p in enumerate(sent) if p.payload_type == 0 and p.payload[0] == 0x11]
    assert audio and audio[0] > first_event and rtp.events_sent == 2


class Datagrams:
    """What a socket sends, raw."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, tuple[str, int]]] = []

    def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        self.sent.append((data, addr))


def test_the_answer_names_its_rtcp_port_or_multiplexes_when_the_offer_does() -> None:
    local = LocalMedia("127.0.0.1", 30000, 1)
    plain = sdp_offer(port=40000, formats="0 101")
    remote = sdp.read_offer(plain)
    assert not remote.rtcp_mux and remote.rtcp_address == ("127.0.0.1", 40001)
    assert b"a=rtcp:30001\r\n" in sdp.answer(plain, remote, local, 1, "sendrecv")
    muxed = plain.replace(b"a=sendrecv", b"a=rtcp-mux\r\na=rtcp:40000\r\na=sendrecv")
    remote = sdp.read_offer(muxed)
    assert remote.rtcp_mux and remote.rtcp_address == ("127.0.0.1", 40000)
    answer = sdp.answer(muxed, remote, local, 1, "sendrecv")
    assert b"a=rtcp-mux\r\n" in answer and b"a=rtcp:30000\r\n" in answer
    elsewhere = plain.replace(b"a=sendrecv", b"a=rtcp:40011 IN IP4 127.0.0.1\r\na=sendrecv")
    assert sdp.read_offer(elsewhere).rtcp_address == ("127.0.0.1", 40011)


def _reporting_stream(mux: bool) -> tuple[RtpStream, FakeTransport, Datagrams]:
    rtp = RtpStream(PCMU, 101, SentPlayback(), StillClock(), lambda a, _: None,  # type: ignore[arg-type]
                    lambda d: None, rtcp_interval_s=0.1)  # fmt: skip
    out = FakeTransport()
    rtp.connection_made(out)  # type: ignore[arg-type]
    rtcp = Datagrams()
    if mux:
        rtp._sendto = rtcp.sendto  # RTP and RTCP leave from the same socket
    else:
        rtp.use_rtcp_socket(rtcp)  # type: ignore[arg-type]
    remote = RemoteMedia(PCMU, 101, PEER, "sendrecv", rtcp_mux=mux)
    rtp.set_remote(remote, "sendrecv")
    rtp.start()
    return rtp, out, rtcp


def test_sender_and_receiver_reports_go_both_ways_with_loss_jitter_and_round_trip() -> None:
    rtp, _, rtcp = _reporting_stream(mux=False)
    for seq in (1, 2, 3, 5):  # the caller's packet 4 is lost
        rtp.datagram_received(rtp_packet(seq, seq * 160, ssrc=0x1234), PEER)
    # The caller's sender report, with its view of our stream: a quarter lost, 10 ms jitter.
    peer_ntp = (3_900_000_000 << 32) | 0x12345678
    block = RtcpReceiverInfo(ssrc=rtp.ssrc, fraction_lost=64, packets_lost=3,
                             highest_sequence=99, jitter=80, lsr=0, dlsr=0)  # fmt: skip
    sr = RtcpSrPacket(
        ssrc=0x1234,
        sender_info=RtcpSenderInfo(
            ntp_timestamp=peer_ntp, rtp_timestamp=800, packet_count=5, octet_count=800
        ),
        reports=[block],
    )
    rtp.rtcp_received(bytes(sr), (PEER[0], PEER[1] + 1))
    rtp.rtcp_received(bytes(sr), ("10.9.9.9", PEER[1] + 1))  # not the peer: dropped
    rtp.rtcp_received(b"\x80\xc8garbage", (PEER[0], PEER[1] + 1))  # not RTCP: counted
    for _ in range(20):
        rtp.tick()
    assert rtp.remote_report == {"loss_ratio": 0.25, "packets_lost": 3, "jitter_ms": 10.0}
    assert rtp.rtcp_reports_received == 1 and rtp.bad_rtcp == 1
    assert rtcp.sent and {addr for _, addr in rtcp.sent} == {(PEER[0], PEER[1] + 1)}
    data, _ = rtcp.sent[-1]
    ours, sdes = RtcpPacket.parse(data)
    assert isinstance(ours, RtcpSrPacket) and ours.ssrc == rtp.ssrc
    assert 0 < ours.sender_info.packet_count <= rtp.packets_sent
    assert ours.sender_info.octet_count == 160 * ours.sender_info.packet_count
    [about_caller] = ours.reports
    assert about_caller.ssrc == 0x1234 and about_caller.packets_lost == 1
    assert about_caller.highest_sequence == 5
    assert about_caller.lsr == (peer_ntp >> 16) & 0xFFFFFFFF and about_caller.dlsr > 0
    assert isinstance(sdes, RtcpSdesPacket)


def test_multiplexed_rtcp_shares_the_rtp_port_both_ways() -> None:
    rtp, _, socket_out = _reporting_stream(mux=True)
    rr = RtcpRrPacket(ssrc=0x1234, reports=[RtcpReceiverInfo(
        ssrc=rtp.ssrc, fraction_lost=0, packets_lost=0, highest_sequence=1, jitter=8,
        lsr=0, dlsr=0)])  # fmt: skip
    rtp.datagram_received(bytes(rr), PEER)  # on the RTP port
    for _ in range(20):
        rtp.tick()
    reports = [d for d, addr in socket_out.sent if 200 <= d[1] <= 204]
    assert reports and all(addr == PEER for d, addr in socket_out.sent)
    assert rtp.remote_report == {"loss_ratio": 0.0, "packets_lost": 0, "jitter_ms": 1.0}


@pytest.mark.parametrize(
    ("ptime", "maxptime", "ours"),
    [
        (None, None, 20),  # no wish: our 20 ms
        (30, None, 30),  # a wish we can pace
        (10, None, 10),
        (60, None, 60),
        (25, None, 20),  # not a packet time we pace: 20 ms
        (60, 40, 40),  # the wish is over their maximum: the longest within it
        (None, 10, 10),  # 20 ms would be over their maximum
        (30, 5, 10),  # a maximum under anything: the shortest we have
    ],
)
def test_our_packet_time_is_the_offers_where_we_can_pace_it_within_its_maxptime(
    ptime: int | None, maxptime: int | None, ours: int
) -> None:
    assert sdp.choose_ptime(ptime, maxptime) == ours


def _with_ptime(body: bytes, attributes: str) -> bytes:
    return body.replace(b"a=ptime:20\r\n", attributes.encode())


def test_the_answer_says_the_packet_time_the_offer_asked_for() -> None:
    local = LocalMedia("127.0.0.1", 30000, 1)
    base = sdp_offer(port=40000, formats="0 101")
    offer = _with_ptime(base, "a=ptime:30\r\n")
    remote = sdp.read_offer(offer)
    assert remote.ptime == 30
    answer = sdp.answer(offer, remote, local, 1, "sendrecv")
    assert b"a=ptime:30\r\n" in answer and b"a=ptime:20" not in answer
    capped = _with_ptime(base, "a=ptime:60.0\r\na=maxptime:40\r\n")
    remote = sdp.read_offer(capped)
    answer = sdp.answer(capped, remote, local, 1, "sendrecv")
    assert remote.ptime == 40 and b"a=ptime:40\r\n" in answer and b"maxptime" not in answer
    garbage = _with_ptime(base, "a=ptime:soon\r\n")
    assert sdp.read_offer(garbage).ptime == 20


def _paced(ptime: int) -> tuple[RtpStream, FakeTransport]:
    rtp = RtpStream(PCMU, 101, SentPlayback(), RtpClock(), lambda a, _: None, lambda d: None,
                    ptime_ms=ptime)  # fmt: skip
    out = FakeTransport()
    rtp.connection_made(out)  # type: ignore[arg-type]
    rtp.set_remote(RemoteMedia(PCMU, 101, PEER, "sendrecv", ptime=ptime), "sendrecv")
    return rtp, out


def test_a_30_ms_stream_sends_a_packet_of_30_ms_every_third_10_ms_tick() -> None:
    rtp, out = _paced(30)
    rtp.enqueue("item1", agent(75))  # two and a half packets
    for _ in range(12):  # 120 ms of a 10 ms clock: four packets
        rtp.tick(10)
    packets = [p for p, _ in out.sent]
    assert [len(p.payload) for p in packets] == [240] * 4
    assert packets[0].payload == packets[1].payload == agent(30)
    assert packets[2].payload == agent(15) + b"\xff" * 120
    assert packets[3].payload == b"\xff" * 240
    for a, b in itertools.pairwise(packets):
        assert (b.timestamp - a.timestamp) & 0xFFFFFFFF == 240
        assert (b.sequence_number - a.sequence_number) & 0xFFFF == 1
    assert rtp.playback.heard_ms("item1") == 75


def test_digits_on_a_30_ms_stream_last_as_long_as_on_a_20_ms_one() -> None:
    rtp, out = _paced(30)
    tone = -(-100 // 30)  # the leg's tone of 100 ms, in packets of 30 ms
    rtp.send_events([(5, tone, 0)])
    for _ in range(10):
        rtp.tick()
    events = [p for p, _ in out.sent if p.payload_type == 101]
    durations = [(p.payload[2] << 8) | p.payload[3] for p in events]
    assert durations == [240, 480, 720, 960, 960, 960]  # 120 ms of tone, its end sent 3 times


def test_the_clock_ticks_every_10_ms_while_a_stream_needs_it_and_every_20_ms_otherwise() -> None:
    clock = RtpClock()
    even, _ = _paced(40)
    odd, _ = _paced(30)
    even._clock = odd._clock = clock
    clock.add(even)
    assert clock.period_s == 0.020
    clock.add(odd)
    clock.add(odd)  # twice: still one stream
    assert clock.period_s == 0.010
    clock.remove(odd)
    assert clock.period_s == 0.020
    clock.remove(even)
    clock.remove(even)
    assert clock.period_s == 0.020


def test_an_invalid_packet_time_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 10"):
        _paced(25)


def _rtp(seq: int, fill: int) -> bytes:
    packet = RtpPacket(payload_type=0, sequence_number=seq, timestamp=seq * 160, ssrc=7)
    packet.payload = bytes([fill]) * 160
    return packet.serialize()


async def test_caller_audio_takes_the_lane_only_with_nothing_queued_before_it() -> None:
    """The audio lane takes a frame in the RTP socket's callback only while `events()` waits
    with nothing queued; a frame the lane refused is queued, and frames after it queue behind
    it until the reader has taken it, so the caller's audio reaches the model in order. The
    audio tap sees each frame the lane took; agent audio through `play_nowait` is tapped and
    queued for the pacer as `play`'s is."""
    leg = SipLeg("call-lane", PCMU, 101, RtpClock(), lambda reason: None)
    transport = FakeTransport()
    leg.rtp.connection_made(transport)  # type: ignore[arg-type]
    leg.answered(RemoteMedia(PCMU, 101, PEER, "sendrecv"), "sendrecv")
    taken: list[int] = []
    tapped: list[int] = []
    played: list[str] = []
    accept = [True]

    def lane(payload: str, _ms: int) -> bool:
        if accept[0]:
            taken.append(base64.b64decode(payload)[0])
        return accept[0]

    leg.set_audio_lane(lane)
    leg.set_taps(audio=lambda p, _ms: tapped.append(base64.b64decode(p)[0]), play=played.append)
    read: list[int] = []

    async def reader() -> None:
        async for event in leg.events():
            if isinstance(event, AudioIn):
                read.append(event.audio[0])

    task = asyncio.create_task(reader())
    await asyncio.sleep(0)  # the reader waits
    leg.rtp.datagram_received(_rtp(1, 1), PEER)  # the lane takes it
    accept[0] = False
    leg.rtp.datagram_received(_rtp(2, 2), PEER)  # refused: queued
    accept[0] = True
    leg.rtp.datagram_received(_rtp(3, 3), PEER)  # 2 is queued before it: queued too
    await asyncio.sleep(0.01)  # the reader takes 2 and 3, and waits again
    leg.rtp.datagram_received(_rtp(4, 4), PEER)  # the lane again
    leg.play_nowait("item-1", base64.b64encode(agent(20)).decode())
    sent = any(packet.payload == agent(20) for packet, _ in transport.sent)
    assert leg.rtp.queued_frames == 1 or sent  # queued for the pacer, or already out
    await leg.close("done")
    await asyncio.wait_for(task, 1)
    assert taken == [1, 4] and tapped == [1, 4] and read == [2, 3]
    assert leg.frames_by_lane == 2
    assert played == [base64.b64encode(agent(20)).decode()]
