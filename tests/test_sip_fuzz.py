"""Hostile input for the SIP core, the RTP stream and the listener: no crash, no traceback per
datagram, and nothing kept once the timers ran."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import pytest
from aiosipua import SipMessage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.legs.sip.access import AllowList
from telephony.legs.sip.dtmf import DtmfDecoder
from telephony.legs.sip.message import Flow
from telephony.legs.sip.rtp import RtpClock, RtpStream
from telephony.legs.sip.sdp import PCMU
from telephony.legs.sip.timers import TimerConfig
from telephony.legs.sip.transport import SipTransport
from telephony.legs.sip.uas import UasConfig, UserAgentServer
from telephony.playback import PlaybackTracker
from tests.e2e_support import wait_until
from tests.sip_support import Uac, sdp_offer
from tests.sipp_support import sip_stack

FAST = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PEER = Flow("udp", ("127.0.0.1", 5070))


def core() -> UserAgentServer:
    return UserAgentServer(
        UasConfig(host="127.0.0.1", port=5060, timers=TimerConfig(), rate_per_source=0)
    )


def drain(ua: UserAgentServer) -> None:
    """Every reply the core produced must itself be a SIP message."""
    for transmit in ua.take_transmits():
        SipMessage.parse(transmit.data)
    ua.take_events()


def settle(ua: UserAgentServer, now: float) -> None:
    """Run every timer until none is left (nobody answers: offered calls time out)."""
    for _ in range(10_000):
        deadline = ua.next_deadline()
        if deadline is None:
            return
        now = max(now, deadline)
        ua.poll(now)
        drain(ua)
    raise AssertionError("timers never ran out")


# Pieces of real messages, to get past the first checks and into the state machines.
METHODS = st.sampled_from(
    "INVITE ACK BYE CANCEL OPTIONS UPDATE INFO PRACK REGISTER FOO NOTIFY REFER".split()
)
HEADER_VALUES = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "",
            "1 INVITE",
            "99999999999 BYE",
            "-1 ACK",
            "<sip:a@b>;tag=x",
            "SIP/2.0/UDP 127.0.0.1:5070;branch=z9hG4bKfuzz;rport",
            "SIP/2.0/TCP [::1]:99999",
            "application/sdp",
            "timer, 100rel",
            "90;refresher=uac",
            'Digest username="a", nonce=""',
            "\x00",
        ]
    ),
)
HEADER_NAMES = st.sampled_from(
    [
        "Via",
        "From",
        "To",
        "Call-ID",
        "CSeq",
        "Contact",
        "Content-Type",
        "Content-Length",
        "Record-Route",
        "Require",
        "Supported",
        "Session-Expires",
        "Authorization",
        "Max-Forwards",
        "v",
        "i",
        "l",
        "x",
    ]
)
SDP_LINES = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "v=0",
                "c=IN IP4 127.0.0.1",
                "c=IN IP4 0.0.0.0",
                "c=IN IP6 ::1",
                "c=IN IP4 example.com",
                "m=audio 40000 RTP/AVP 0 101",
                "m=audio 0 RTP/AVP 8",
                "m=audio 99999 RTP/AVP x",
                "m=audio 4000 RTP/SAVP 0",
                "m=video 4002 RTP/AVP 96",
                "a=rtpmap:101 telephone-event/8000",
                "a=rtpmap:x PCMU/8000",
                "a=fmtp:zz 0-15",
                "a=sendonly",
                "a=inactive",
                "b=AS:abc",
                "t=a b",
            ]
        ),
        st.text(max_size=30),
    ),
    max_size=10,
)


@st.composite
def sip_messages(draw: st.DrawFn) -> bytes:
    uac = Uac(call_id=draw(st.sampled_from(["fuzz-call", "fuzz-2", "x" * 1100, "a b"])))
    method = draw(METHODS)
    body = "\r\n".join(draw(SDP_LINES)).encode() if draw(st.booleans()) else b""
    if method == "INVITE":
        data = uac.invite(body or sdp_offer())
    elif method == "ACK":
        data = uac.ack(body)
    elif method == "CANCEL":
        data = uac.cancel()
    elif method == "BYE":
        data = uac.bye()
    else:
        data = uac._request(method, body=body)
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    for _ in range(draw(st.integers(0, 4))):
        action = draw(st.sampled_from(["drop", "replace", "add"]))
        index = draw(st.integers(1, max(1, len(lines) - 1)))
        if action == "drop" and len(lines) > 1:
            lines.pop(min(index, len(lines) - 1))
        else:
            line = f"{draw(HEADER_NAMES)}: {draw(HEADER_VALUES)}".encode("utf-8", "replace")
            if action == "replace" and len(lines) > 1:
                lines[min(index, len(lines) - 1)] = line
            else:
                lines.insert(index, line)
    if draw(st.booleans()):
        lines[0] = draw(st.sampled_from([b"INVITE sip:x SIP/3.0", b"SIP/2.0 200 OK", b"", b"x"]))
    return b"\r\n".join(lines) + b"\r\n\r\n" + rest


@FAST
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_never_break_the_core(data: bytes) -> None:
    ua = core()
    ua.receive(data, PEER, 1.0)
    drain(ua)
    assert ua.stats.internal_errors == 0


@FAST
@given(st.lists(st.tuples(sip_messages(), st.floats(0, 40)), min_size=1, max_size=8))
def test_mangled_sip_dialogues_never_break_the_core_and_leave_nothing_behind(
    steps: list[tuple[bytes, float]],
) -> None:
    ua = core()
    now = 1.0
    for data, wait in steps:
        ua.receive(data, PEER, now)
        drain(ua)
        now += wait
        ua.poll(now)
        drain(ua)
    assert ua.stats.internal_errors == 0
    settle(ua, now)
    assert ua.footprint() == dict.fromkeys(ua.footprint(), 0)


@FAST
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_arbitrary_rtp_datagrams_never_break_the_stream(datagrams: list[bytes]) -> None:
    audio: list[bytes] = []
    digits: list[str] = []
    stream = RtpStream(
        PCMU, 101, PlaybackTracker(), RtpClock(), lambda a, _: audio.append(a), digits.append
    )
    for data in datagrams:
        stream.datagram_received(data, ("127.0.0.1", 4000))
    assert all(d in "0123456789*#ABCD" for d in digits)


@FAST
@given(
    st.lists(
        st.tuples(st.binary(min_size=0, max_size=8), st.integers(0, 2**32 - 1) | st.integers(0, 3)),
        max_size=15,
    )
)
def test_the_dtmf_decoder_reports_each_key_press_once(packets: list[tuple[bytes, int]]) -> None:
    decoder = DtmfDecoder()
    reported: list[int] = []
    for payload, timestamp in packets:
        digits = decoder.feed(payload, timestamp)
        # End packets come three times; updates many times: the same packet says nothing new.
        assert decoder.feed(payload, timestamp) == []
        assert all(d in "0123456789*#ABCD" for d in digits)
        reported += [timestamp] * len(digits)
    valid = {t for p, t in packets if len(p) >= 4 and p[0] < 16}
    assert len(reported) <= len(valid)


def test_dtmf_end_packets_are_deduplicated_and_a_lost_end_still_reports_the_digit() -> None:
    decoder = DtmfDecoder()
    start, end = bytes([5, 0x0A, 0, 160]), bytes([5, 0x8A, 3, 0x20])
    assert decoder.feed(start, 1000) == []
    assert decoder.feed(end, 1000) == ["5"]
    assert decoder.feed(end, 1000) == [] and decoder.feed(end, 1000) == []
    # "7" loses all its end packets; "#" starting reports it.
    assert decoder.feed(bytes([7, 0x0A, 0, 160]), 2000) == []
    assert decoder.feed(bytes([11, 0x8A, 3, 0x20]), 3000) == ["7", "#"]
    assert decoder.feed(bytes([7, 0x8A, 3, 0x20]), 2000) == []  # a late end of the "7"


async def test_garbage_and_a_scanner_burst_over_real_sockets_leave_the_listener_serving(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="telephony.legs.sip")
    caplog.set_level(logging.DEBUG, logger="aiosipua")
    async with sip_stack(engine, sip_t1_s=0.05, sip_rate_per_source=5) as stack:
        sip = stack.service.runtime.sip
        server = ("127.0.0.1", sip.port)
        loop = asyncio.get_running_loop()
        udp, _ = await loop.create_datagram_endpoint(
            asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0), family=socket.AF_INET
        )
        stats = sip.core.stats
        sent = 0  # datagrams the server counts as messages (keepalives it does not)

        async def send(datagram: bytes, n: int) -> None:
            nonlocal sent
            udp.sendto(datagram, server)
            sent += 1 if datagram.strip(b"\r\n \t") else 0
            if n % 20 == 19:
                # A burst, not a socket-buffer overflow: loopback UDP drops what a busy
                # machine's receiver has not read yet, so wait until this burst was read.
                await wait_until(lambda: stats.messages >= sent, 10, "the burst read")

        try:
            for n in range(300):
                await send(bytes((n * 7 + k) % 256 for k in range(n % 97)), n)
            await send(b"INVITE sip:x SIP/2.0\r\nContent-Length: 99999\r\n\r\n", 0)
            await send(b"\r\n\r\n", 0)
            # The scanner: many INVITEs at once from one address, each a new Call-ID.
            for n in range(200):
                scan = Uac(call_id=f"scan-{n}", extra_headers=["User-Agent: friendly-scanner"])
                await send(scan.invite(), n)
            # Garbage over TCP, then a stream that cannot be framed.
            reader, writer = await asyncio.open_connection(*server)
            writer.write(b"\x16\x03\x01\x02\x00" + bytes(range(256)) * 4 + b"\r\n\r\n")
            writer.write(b"OPTIONS sip:x SIP/2.0\r\nContent-Length: -5\r\n\r\n")
            await writer.drain()
            async with asyncio.timeout(5):
                await reader.read()  # the server closes the stream it cannot frame
            writer.close()
        finally:
            udp.close()
        await wait_until(lambda: stats.malformed > 250 and stats.rate_limited >= 150, 10, "seen")
        # Still serving: an OPTIONS over TCP is answered.
        reader, writer = await asyncio.open_connection(*server)
        writer.write(Uac(transport="TCP").options())
        await writer.drain()
        async with asyncio.timeout(5):
            status = await reader.readline()
        writer.close()
        assert status.startswith(b"SIP/2.0 200")
        # The few INVITEs within the rate became calls; once they are over, nothing is left.
        for key in list(sip._calls):
            sip.transport.act(lambda now, key=key: sip.core.reject(key, 486, now))
        await wait_until(lambda: sip.live_calls() == 0, 20, "scanner calls gone")
        await wait_until(
            lambda: sip.core.footprint() == dict.fromkeys(sip.core.footprint(), 0),
            20,
            "core state gone",
        )
    assert sip.core.stats.internal_errors == 0
    assert not [r for r in caplog.records if r.exc_info], "a traceback reached the log"
    noisy = [
        r for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith(("telephony.legs.sip", "aiosipua"))
    ]  # fmt: skip
    assert noisy == []


async def test_sources_outside_sip_allow_from_get_no_answer_over_udp_or_tcp(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, sip_allow_from="10.0.0.0/8") as stack:
        sip = stack.service.runtime.sip
        server = ("127.0.0.1", sip.port)
        loop = asyncio.get_running_loop()
        got: list[bytes] = []

        class Catch(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                got.append(data)

        udp, _ = await loop.create_datagram_endpoint(Catch, local_addr=("127.0.0.1", 0))
        try:
            udp.sendto(Uac().options(), server)
            udp.sendto(Uac().invite(), server)
            await wait_until(lambda: sip.core.stats.denied >= 2, 5, "datagrams seen")
        finally:
            udp.close()
        reader, writer = await asyncio.open_connection(*server)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed at once, nothing said
        writer.close()
        assert got == []
        assert sip.core.footprint()["server_transactions"] == 0
        assert AllowList.from_spec("10.0.0.0/8").allows("10.1.2.3")


async def _through_the_transport(batch: list[bytes]) -> UserAgentServer:
    ua = core()
    events: list[object] = []
    transport = SipTransport(ua, "127.0.0.1", 0, events.append)
    await transport.start()
    server = ("127.0.0.1", transport.port)
    loop = asyncio.get_running_loop()
    udp, _ = await loop.create_datagram_endpoint(
        asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0)
    )
    try:
        for data in batch:
            udp.sendto(data, server)
        reader, writer = await asyncio.open_connection(*server)
        for data in batch:
            writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
        # Every datagram was read (the TCP stream may have been cut where it stopped framing).
        blank = sum(1 for d in batch if not d.strip(b"\r\n \t"))
        await wait_until(lambda: ua.stats.messages >= len(batch) - blank, 5, "datagrams read")
        # Still serving afterwards.
        reader, writer = await asyncio.open_connection(*server)
        writer.write(Uac(transport="TCP").options())
        await writer.drain()
        async with asyncio.timeout(5):
            status = await reader.readline()
        writer.close()
        assert status.startswith(b"SIP/2.0 200")
    finally:
        udp.close()
        await transport.stop()
    return ua


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(sip_messages() | st.binary(max_size=600), min_size=1, max_size=6))
def test_fuzzed_messages_over_real_udp_and_tcp_never_break_the_transport(
    batch: list[bytes],
) -> None:
    ua = asyncio.run(_through_the_transport(batch))
    assert ua.stats.internal_errors == 0
