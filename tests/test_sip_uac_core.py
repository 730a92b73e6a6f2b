"""The INVITE client transaction on a fake clock: timer A doubles without a cap until timer B
gives up (408), a provisional stops both, and a retransmitted 2xx gets the same ACK again."""

from __future__ import annotations

from telephony.legs.sip.message import Flow
from telephony.legs.sip.sdp import LocalMedia
from telephony.legs.sip.timers import TimerConfig
from telephony.legs.sip.uac import OutgoingAnswered, OutgoingFailed
from telephony.legs.sip.uas import UasConfig, UserAgentServer

FAR = ("127.0.0.1", 5099)
ANSWER = (
    b"v=0\r\no=far 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    b"m=audio 30000 RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n"
)


def _core() -> UserAgentServer:
    return UserAgentServer(UasConfig(host="127.0.0.1", port=5070, timers=TimerConfig(t1=0.5)))


def _run(core: UserAgentServer, until: float) -> list[float]:
    """Fire timers up to `until`; the times at which something was sent."""
    sent: list[float] = []
    while (deadline := core.next_deadline()) is not None and deadline <= until:
        core.poll(deadline)
        if core.take_transmits():
            sent.append(deadline)
    return sent


def _response(invite: bytes, status: str, *, tag: str = "far1", body: bytes = b"") -> bytes:
    lines = invite.split(b"\r\n\r\n")[0].split(b"\r\n")
    keep = [x for x in lines if x.split(b":")[0] in (b"Via", b"From", b"Call-ID", b"CSeq")]
    to = next(x for x in lines if x.startswith(b"To:"))
    head = [f"SIP/2.0 {status}".encode(), *keep, to + f";tag={tag}".encode(),
            b"Contact: <sip:far@127.0.0.1:5099>"]  # fmt: skip
    if body:
        head.append(b"Content-Type: application/sdp")
    head.append(f"Content-Length: {len(body)}".encode())
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def test_timer_a_doubles_without_cap_and_timer_b_ends_it_as_408() -> None:
    core = _core()
    key = core.invite("sip:far@127.0.0.1:5099", LocalMedia("127.0.0.1", 40000, 1), 0.0)
    assert len(core.take_transmits()) == 1
    sent = _run(core, 40.0)
    # 0.5, 1.5, 3.5, 7.5, 15.5, 31.5: T1 doubling past T2 (no cap for INVITE), until 64*T1.
    assert sent == [0.5, 1.5, 3.5, 7.5, 15.5, 31.5]
    failed = [e for e in core.take_events() if isinstance(e, OutgoingFailed)]
    assert failed and failed[0].key == key and failed[0].status == 408
    assert core.footprint()["calls"] == 0


def test_a_provisional_stops_retransmissions() -> None:
    core = _core()
    core.invite("sip:far@127.0.0.1:5099", LocalMedia("127.0.0.1", 40000, 1), 0.0)
    invite = core.take_transmits()[0].data
    core.receive(_response(invite, "100 Trying"), Flow("udp", FAR), 0.2)
    assert _run(core, 20.0) == []
    assert not [e for e in core.take_events() if isinstance(e, OutgoingFailed)]


def test_a_retransmitted_2xx_gets_the_same_ack_again() -> None:
    core = _core()
    core.invite("sip:far@127.0.0.1:5099", LocalMedia("127.0.0.1", 40000, 1), 0.0)
    invite = core.take_transmits()[0].data
    ok = _response(invite, "200 OK", body=ANSWER)
    core.receive(ok, Flow("udp", FAR), 0.1)
    first = core.take_transmits()
    assert len(first) == 1 and first[0].data.startswith(b"ACK sip:far@127.0.0.1:5099 ")
    answered = [e for e in core.take_events() if isinstance(e, OutgoingAnswered)]
    assert answered and answered[0].remote.address == ("127.0.0.1", 30000)
    core.receive(ok, Flow("udp", FAR), 0.6)
    again = core.take_transmits()
    assert [t.data for t in again] == [first[0].data]
    assert not core.take_events()  # answered once
