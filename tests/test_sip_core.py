"""The sans-I/O SIP core with a fake clock: transactions, timers, dialogs, offer/answer."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from aiosipua import SipRequest, SipResponse

from telephony.legs.sip.access import AllowList
from telephony.legs.sip.digest import DigestAuth
from telephony.legs.sip.message import Flow
from telephony.legs.sip.sdp import LocalMedia
from telephony.legs.sip.timers import TimerConfig
from telephony.legs.sip.uas import (
    CallCancelled,
    CallConfirmed,
    CallEnded,
    DtmfReceived,
    IncomingCall,
    MediaUpdated,
    SipEvent,
    UasConfig,
    UserAgentServer,
)
from tests.sip_support import Uac, parsed, sdp_offer

PEER = Flow("udp", ("127.0.0.1", 5070))
LOCAL = LocalMedia("127.0.0.1", 20000, 42)
T1 = 0.5


@dataclass
class Harness:
    """The core, a fake clock and everything it said."""

    core: UserAgentServer
    now: float = 1000.0
    sent: list[tuple[Flow, SipResponse | SipRequest]] = field(default_factory=list)
    events: list[SipEvent] = field(default_factory=list)

    def feed(self, data: bytes, flow: Flow = PEER) -> list[SipResponse | SipRequest]:
        self.core.receive(data, flow, self.now)
        return self._collect()

    def advance(self, seconds: float) -> list[SipResponse | SipRequest]:
        """Move the clock, firing each timer at its own deadline."""
        end = self.now + seconds
        out: list[SipResponse | SipRequest] = []
        while (deadline := self.core.next_deadline()) is not None and deadline <= end:
            self.now = max(self.now, deadline)
            self.core.poll(self.now)
            out += self._collect()
        self.now = end
        return out

    def _collect(self) -> list[SipResponse | SipRequest]:
        out: list[SipResponse | SipRequest] = []
        for transmit in self.core.take_transmits():
            msg = parsed(transmit.data)
            assert isinstance(msg, SipResponse | SipRequest)
            self.sent.append((transmit.flow, msg))
            out.append(msg)
        self.events += self.core.take_events()
        return out

    def incoming(self) -> IncomingCall:
        calls = [e for e in self.events if isinstance(e, IncomingCall)]
        assert calls, self.events
        return calls[-1]

    def answered_call(self, uac: Uac) -> IncomingCall:
        self.feed(uac.invite())
        call = self.incoming()
        out = self._answer(call)
        ok = [m for m in out if isinstance(m, SipResponse) and m.status_code == 200]
        assert ok
        uac.learn(ok[0])
        return call

    def _answer(self, call: IncomingCall) -> list[SipResponse | SipRequest]:
        assert self.core.answer(call.key, LOCAL, self.now)
        return self._collect()


def statuses(messages: list[SipResponse | SipRequest]) -> list[int]:
    return [m.status_code for m in messages if isinstance(m, SipResponse)]


def make(**overrides: object) -> Harness:
    digest = overrides.pop("digest", None)
    config = UasConfig(
        host="127.0.0.1",
        port=5060,
        timers=TimerConfig(t1=T1, t2=4.0, t4=5.0),
        **overrides,  # type: ignore[arg-type]
    )
    return Harness(UserAgentServer(config, digest=digest))  # type: ignore[arg-type]


@pytest.fixture
def h() -> Harness:
    return make()


def test_an_invite_gets_100_at_once_then_ringing_and_a_200_with_an_sdp_answer(h: Harness) -> None:
    uac = Uac()
    assert statuses(h.feed(uac.invite())) == [100]
    call = h.incoming()
    assert call.codec.name == "PCMU" and call.remote and call.remote.dtmf_pt == 101
    assert h.core.ring(call.key, h.now)
    ringing = h._collect()
    assert statuses(ringing) == [180]
    out = h._answer(call)
    (ok,) = out
    assert isinstance(ok, SipResponse) and ok.status_code == 200
    body = ok.text
    assert "m=audio 20000 RTP/AVP 0 101" in body
    assert "a=rtpmap:101 telephone-event/8000" in body and "a=sendrecv" in body
    assert ok.to_addr is not None and ok.to_addr.tag == call.key.local_tag
    assert ringing[0].to_addr is not None and ringing[0].to_addr.tag == call.key.local_tag


def test_the_answer_takes_pcma_when_the_offer_prefers_it_and_keeps_its_dtmf_type(
    h: Harness,
) -> None:
    uac = Uac()
    h.feed(uac.invite(sdp_offer(formats="8 0 96", dtmf=96)))
    call = h.incoming()
    assert call.codec.name == "PCMA"
    (ok,) = h._answer(call)
    assert "m=audio 20000 RTP/AVP 8 96" in ok.text
    assert "a=rtpmap:96 telephone-event/8000" in ok.text


def test_a_retransmitted_invite_before_the_answer_replays_the_last_provisional(h: Harness) -> None:
    uac = Uac()
    h.feed(uac.invite())
    call = h.incoming()
    h.core.ring(call.key, h.now)
    h._collect()
    assert statuses(h.feed(uac.retransmit_invite())) == [180]
    assert len([e for e in h.events if isinstance(e, IncomingCall)]) == 1


def test_a_retransmitted_invite_after_the_200_is_absorbed_and_makes_no_second_call(
    h: Harness,
) -> None:
    uac = Uac()
    h.answered_call(uac)
    assert h.feed(uac.retransmit_invite()) == []
    assert len([e for e in h.events if isinstance(e, IncomingCall)]) == 1
    # The 200 itself is still retransmitted by its own timer until the ACK.
    assert statuses(h.advance(T1)) == [200]
    h.feed(uac.ack())
    assert statuses(h.advance(10)) == []


def test_the_200_is_retransmitted_at_t1_doubling_to_t2_until_the_ack(h: Harness) -> None:
    uac = Uac()
    h.answered_call(uac)
    start = h.now
    at: list[float] = []
    while h.now - start < 20:
        if statuses(h.advance(0.25)):
            at.append(round(h.now - start, 2))
    # Intervals T1, 2T1, 4T1, then capped at T2: 0.5, 1.5, 3.5, 7.5, 11.5, 15.5, 19.5.
    assert at == [0.5, 1.5, 3.5, 7.5, 11.5, 15.5, 19.5]
    h.feed(uac.ack())
    assert [e for e in h.events if isinstance(e, CallConfirmed)]
    assert statuses(h.advance(20)) == []


def test_no_ack_within_64_t1_ends_the_call_with_a_bye(h: Harness) -> None:
    uac = Uac()
    call = h.answered_call(uac)
    out = h.advance(64 * T1 + 0.01)
    byes = [m for m in out if isinstance(m, SipRequest) and m.method == "BYE"]
    assert len(byes) == 1
    assert statuses(out).count(200) == 10  # at 0.5, 1.5, 3.5, 7.5, then every 4 s until 32 s
    assert CallEnded(call.key, "no ACK for our 200 within 32 s (64*T1)") in h.events
    bye = byes[0]
    assert bye.headers.get_first("call-id") == uac.call_id
    assert bye.to_addr is not None and bye.to_addr.tag == uac.from_tag
    assert bye.from_addr is not None and bye.from_addr.tag == call.key.local_tag
    h.feed(Uac.reply_to(bytes(bye), 200))
    h.advance(60)
    assert h.core.footprint() == dict.fromkeys(h.core.footprint(), 0)


def test_cancel_before_the_answer_gets_200_and_the_invite_487(h: Harness) -> None:
    uac = Uac()
    h.feed(uac.invite())
    call = h.incoming()
    out = h.feed(uac.cancel())
    assert sorted(statuses(out)) == [200, 487]
    assert CallCancelled(call.key, "cancelled") in h.events
    assert not h.core.answer(call.key, LOCAL, h.now)  # too late: never a 200 after a CANCEL
    assert h._collect() == []
    # The 487 is retransmitted until its ACK (timer G), then the ACK quiets it.
    assert statuses(h.advance(T1)) == [487]
    h.feed(uac.ack(non_2xx=True))
    assert statuses(h.advance(40)) == []
    assert h.core.footprint() == dict.fromkeys(h.core.footprint(), 0)


def test_a_cancel_that_crosses_the_200_does_not_end_the_call(h: Harness) -> None:
    uac = Uac()
    call = h.answered_call(uac)
    assert statuses(h.feed(uac.cancel())) == [200]
    h.feed(uac.ack())
    assert not [e for e in h.events if isinstance(e, CallCancelled | CallEnded)]
    assert h.core.call_state(call.key) == "confirmed"


def test_a_cancel_for_nothing_gets_481(h: Harness) -> None:
    assert statuses(h.feed(Uac().cancel())) == [481]


def test_their_bye_ends_the_call_and_a_retransmitted_bye_gets_the_same_200(h: Harness) -> None:
    uac = Uac()
    call = h.answered_call(uac)
    h.feed(uac.ack())
    bye = uac.bye()
    assert statuses(h.feed(bye)) == [200]
    assert CallEnded(call.key, "bye") in h.events
    assert statuses(h.feed(bye)) == [200]
    assert statuses(h.feed(uac.bye())) == [481]  # a new BYE: the dialog is gone
    h.advance(64 * T1 + 1)
    assert h.core.footprint() == dict.fromkeys(h.core.footprint(), 0)


def test_our_bye_is_retransmitted_until_answered(h: Harness) -> None:
    uac = Uac()
    call = h.answered_call(uac)
    h.feed(uac.ack())
    h.core.hangup(call.key, h.now)
    (bye,) = h._collect()
    assert isinstance(bye, SipRequest) and bye.method == "BYE"
    again = h.advance(T1)
    assert [m.method for m in again if isinstance(m, SipRequest)] == ["BYE"]
    h.feed(Uac.reply_to(bytes(bye), 200))
    assert h.advance(10) == []
    assert h.core.footprint()["calls"] == 0


def test_hangup_before_the_ack_waits_for_it_then_sends_bye(h: Harness) -> None:
    uac = Uac()
    call = h.answered_call(uac)
    h.core.hangup(call.key, h.now)
    assert h._collect() == []
    out = h.feed(uac.ack())
    assert [m.method for m in out if isinstance(m, SipRequest)] == ["BYE"]


def test_hold_sendonly_is_answered_recvonly_and_resume_with_a_new_port(h: Harness) -> None:
    uac = Uac()
    call = h.answered_call(uac)
    h.feed(uac.ack())
    (ok,) = h.feed(uac.reinvite(sdp_offer(direction="sendonly", formats="0 101")))
    assert isinstance(ok, SipResponse) and ok.status_code == 200
    assert "a=recvonly" in ok.text and "a=sendrecv" not in ok.text
    update = [e for e in h.events if isinstance(e, MediaUpdated)][-1]
    assert update.direction == "recvonly" and not update.remote.we_send
    h.feed(uac.ack())
    (ok,) = h.feed(uac.reinvite(sdp_offer(port=41000, formats="0 101")))
    assert "a=sendrecv" in ok.text
    update = [e for e in h.events if isinstance(e, MediaUpdated)][-1]
    assert update.remote.address == ("127.0.0.1", 41000) and update.remote.we_send
    assert update.key == call.key


def test_inactive_is_answered_inactive(h: Harness) -> None:
    uac = Uac()
    h.answered_call(uac)
    h.feed(uac.ack())
    (ok,) = h.feed(uac.reinvite(sdp_offer(direction="inactive", formats="0")))
    assert "a=inactive" in ok.text


def test_a_reinvite_with_another_codec_gets_488_and_the_call_goes_on(h: Harness) -> None:
    uac = Uac()
    call = h.answered_call(uac)
    h.feed(uac.ack())
    assert statuses(h.feed(uac.reinvite(sdp_offer(formats="8")))) == [488]
    assert h.core.call_state(call.key) == "confirmed"


def test_an_update_without_sdp_refreshes_and_with_sdp_is_answered(h: Harness) -> None:
    uac = Uac()
    h.answered_call(uac)
    h.feed(uac.ack())
    assert statuses(h.feed(uac.update())) == [200]
    (ok,) = h.feed(uac.update(sdp_offer(direction="sendonly", formats="0")))
    assert "a=recvonly" in ok.text


def test_requests_for_unknown_dialogs_get_481(h: Harness) -> None:
    uac = Uac(to_tag="nosuchtag")
    assert statuses(h.feed(uac.bye())) == [481]
    assert statuses(h.feed(uac.reinvite(sdp_offer()))) == [481]
    assert h.feed(uac.ack()) == []


def test_options_is_answered_with_what_we_support(h: Harness) -> None:
    (ok,) = h.feed(Uac().options())
    assert isinstance(ok, SipResponse) and ok.status_code == 200
    assert "INVITE" in (ok.headers.get_first("allow") or "")


def test_a_draining_server_answers_options_503_but_serves_live_dialogs(h: Harness) -> None:
    uac = Uac()
    h.answered_call(uac)
    h.feed(uac.ack())
    h.core.stop_accepting()
    (probe,) = h.feed(Uac().options())
    assert isinstance(probe, SipResponse) and probe.status_code == 503
    assert probe.headers.get_first("retry-after") == "5"
    # The live call still gets its in-dialog requests answered.
    (ok,) = h.feed(uac.options(in_dialog=True))
    assert isinstance(ok, SipResponse) and ok.status_code == 200
    assert statuses(h.feed(uac.bye())) == [200]


def test_a_busy_server_answers_options_503_while_it_is_busy_then_200(h: Harness) -> None:
    busy = True
    h.core.busy = lambda: busy
    (probe,) = h.feed(Uac().options())
    assert isinstance(probe, SipResponse) and probe.status_code == 503
    assert probe.headers.get_first("retry-after") == "5"
    busy = False
    (ok,) = h.feed(Uac().options())
    assert isinstance(ok, SipResponse) and ok.status_code == 200


def test_record_route_is_echoed_in_order_and_becomes_the_route_set(h: Harness) -> None:
    uac = Uac(extra_headers=[
        "Record-Route: <sip:p1.example;lr>",
        "Record-Route: <sip:p2.example;lr>, <sip:p3.example;lr>",
    ])  # fmt: skip
    call = h.answered_call(uac)
    ok = next(m for _, m in h.sent if isinstance(m, SipResponse) and m.status_code == 200)
    assert ok.headers.get("record-route") == [
        "<sip:p1.example;lr>",
        "<sip:p2.example;lr>",
        "<sip:p3.example;lr>",
    ]
    h.feed(uac.ack())
    h.core.hangup(call.key, h.now)
    transmit = h.core.take_transmits()[0]
    bye = parsed(transmit.data)
    assert bye.headers.get("route") == [
        "<sip:p1.example;lr>",
        "<sip:p2.example;lr>",
        "<sip:p3.example;lr>",
    ]
    assert transmit.flow.remote == ("p1.example", 5060)
    assert isinstance(bye, SipRequest) and bye.uri == "sip:caller@127.0.0.1:5070"


def test_responses_go_to_the_source_port_and_via_gets_received_and_rport(h: Harness) -> None:
    uac = Uac(ip="10.9.9.9")  # what the caller believes; behind NAT it arrives from elsewhere
    nat = Flow("udp", ("127.0.0.2", 40123))
    h.core.receive(uac.invite(), nat, h.now)
    (transmit,) = h.core.take_transmits()
    assert transmit.flow == nat
    via = parsed(transmit.data).headers.get_first("via") or ""
    assert "received=127.0.0.2" in via and "rport=40123" in via


def test_tcp_replies_use_the_arriving_connection_and_contact_says_tcp(h: Harness) -> None:
    uac = Uac(transport="TCP")
    flow = Flow("tcp", ("127.0.0.1", 40999), conn_id=7)
    h.core.receive(uac.invite(), flow, h.now)
    call = next(e for e in h.core.take_events() if isinstance(e, IncomingCall))
    h.core.answer(call.key, LOCAL, h.now)
    transmits = h.core.take_transmits()
    assert all(t.flow.conn_id == 7 for t in transmits)
    ok = parsed(transmits[-1].data)
    assert "transport=tcp" in (ok.headers.get_first("contact") or "")


def test_session_timer_asked_for_is_granted_and_a_missing_refresh_ends_the_call() -> None:
    h = make()
    uac = Uac(extra_headers=["Supported: timer", "Session-Expires: 120;refresher=uac"])
    call = h.answered_call(uac)
    ok = next(m for _, m in h.sent if isinstance(m, SipResponse) and m.status_code == 200)
    assert ok.headers.get_first("session-expires") == "120;refresher=uac"
    assert "timer" in (ok.headers.get_first("require") or "")
    h.feed(uac.ack())
    assert h.advance(60) == []
    h.feed(uac.update(headers=["Session-Expires: 120;refresher=uac", "Supported: timer"]))
    # Refreshed: the watchdog starts again, 120 - min(32, 120/3) = 88 s (RFC 4028 10).
    assert h.advance(87) == []
    out = h.advance(1.2)
    assert [m.method for m in out if isinstance(m, SipRequest)] == ["BYE"]
    assert CallEnded(call.key, "session expired") in h.events


def test_a_session_interval_below_min_se_gets_422() -> None:
    h = make()
    uac = Uac(extra_headers=["Session-Expires: 30"])
    out = h.feed(uac.invite())
    assert statuses(out) == [100, 422]
    assert out[1].headers.get_first("min-se") == "90"


def test_we_refresh_with_update_when_the_peer_does_not_support_timers() -> None:
    h = make()
    uac = Uac(extra_headers=["Session-Expires: 100"])
    h.answered_call(uac)
    h.feed(uac.ack())
    out = h.advance(50.01)
    updates = [m for m in out if isinstance(m, SipRequest) and m.method == "UPDATE"]
    assert len(updates) == 1
    assert updates[0].headers.get_first("session-expires") == "100;refresher=uas"


def test_what_we_cannot_use_gets_400_415_488_and_420(h: Harness) -> None:
    uac = Uac()
    assert statuses(h.feed(uac.invite(sdp_offer(formats="18")))) == [100, 488]
    uac = Uac()
    assert statuses(h.feed(uac.invite(b"hello"))) == [100, 488]
    uac = Uac()
    data = uac.invite().replace(b"Content-Type: application/sdp", b"Content-Type: text/plain")
    assert statuses(h.feed(data)) == [100, 415]
    uac = Uac(extra_headers=["Require: 100rel"])
    assert statuses(h.feed(uac.invite())) == [100, 420]
    uac = Uac()
    broken = uac.invite().replace(b"CSeq: 1 INVITE", b"CSeq: one INVITE")
    assert statuses(h.feed(broken)) == [400]


def test_digest_auth_challenges_then_admits_the_right_password() -> None:
    from aiosipua import SipDigestAuth
    from aiosipua.auth import answer_challenge

    h = make(digest=DigestAuth({"alice": "s3cret"}))
    uac = Uac()
    out = h.feed(uac.invite())
    assert statuses(out) == [100, 401]
    challenge = out[1]
    assert isinstance(challenge, SipResponse)
    h.feed(uac.ack(non_2xx=True))
    uri = "sip:agent@127.0.0.1:5060"
    wrong = answer_challenge(SipDigestAuth("alice", "nope"), challenge, 401, "INVITE", uri)
    assert wrong is not None
    uac.cseq += 1
    assert statuses(h.feed(uac.invite(headers=[f"{wrong[0]}: {wrong[1]}"]))) == [100, 403]
    # The failed response burnt its nonce: the right password with it is challenged again.
    right = answer_challenge(SipDigestAuth("alice", "s3cret"), challenge, 401, "INVITE", uri)
    assert right is not None
    uac.cseq += 1
    out = h.feed(uac.invite(headers=[f"{right[0]}: {right[1]}"]))
    assert statuses(out) == [100, 401]
    challenge = out[1]
    assert isinstance(challenge, SipResponse)
    right = answer_challenge(SipDigestAuth("alice", "s3cret"), challenge, 401, "INVITE", uri)
    assert right is not None
    uac.cseq += 1
    assert statuses(h.feed(uac.invite(headers=[f"{right[0]}: {right[1]}"]))) == [100]
    assert h.incoming()
    # The same credentials again are a replay.
    uac2 = Uac()
    assert statuses(h.feed(uac2.invite(headers=[f"{right[0]}: {right[1]}"]))) == [100, 403]


def test_an_expired_nonce_is_challenged_again_as_stale() -> None:
    from aiosipua import SipDigestAuth
    from aiosipua.auth import answer_challenge

    h = make(digest=DigestAuth({"alice": "s3cret"}, nonce_ttl_s=10))
    uac = Uac()
    challenge = h.feed(uac.invite())[1]
    assert isinstance(challenge, SipResponse)
    right = answer_challenge(
        SipDigestAuth("alice", "s3cret"), challenge, 401, "INVITE", "sip:agent@127.0.0.1:5060"
    )
    assert right is not None
    h.advance(11)
    uac.cseq += 1
    out = h.feed(uac.invite(headers=[f"{right[0]}: {right[1]}"]))
    assert statuses(out) == [100, 401]
    assert "stale=true" in (out[1].headers.get_first("www-authenticate") or "")


def test_beyond_max_calls_invites_get_503(h: Harness) -> None:
    h = make(max_calls=2)
    for _ in range(2):
        h.feed(Uac().invite())
    assert statuses(h.feed(Uac().invite())) == [100, 503]


def test_invites_beyond_the_rate_per_source_get_a_stateless_503() -> None:
    h = make(rate_per_source=3.0)
    codes = [statuses(h.feed(Uac().invite())) for _ in range(5)]
    assert codes[:3] == [[100]] * 3 and codes[3:] == [[503]] * 2
    assert h.core.stats.rate_limited == 2


def test_sources_outside_the_allow_list_get_nothing_at_all() -> None:
    h = make(allow=AllowList.from_spec("10.0.0.0/8"))
    assert h.feed(Uac().invite()) == []
    assert h.core.stats.denied == 1 and h.core.footprint()["server_transactions"] == 0


def test_dtmf_over_sip_info_is_an_event(h: Harness) -> None:
    uac = Uac()
    call = h.answered_call(uac)
    h.feed(uac.ack())
    assert statuses(h.feed(uac.info_dtmf("5"))) == [200]
    assert DtmfReceived(call.key, "5") in h.events


def test_an_invite_without_sdp_is_offered_in_the_200_and_answered_in_the_ack(h: Harness) -> None:
    uac = Uac()
    h.feed(uac.invite(b""))
    call = h.incoming()
    assert call.remote is None
    (ok,) = h._answer(call)
    uac.learn(ok)
    assert "m=audio 20000 RTP/AVP 0 101" in ok.text
    h.feed(uac.ack(sdp_offer(formats="0 101", port=42000)))
    update = [e for e in h.events if isinstance(e, MediaUpdated)][-1]
    assert update.remote.address == ("127.0.0.1", 42000)


def test_a_scanner_burst_leaves_no_state_once_the_timers_ran() -> None:
    h = make(rate_per_source=1000.0)
    for n in range(300):
        uac = Uac(ip=f"127.0.{n // 250}.{n % 250 + 1}")
        h.feed(uac.invite(), Flow("udp", (uac.ip, 5060)))
    events = [e for e in h.events if isinstance(e, IncomingCall)]
    for event in events:
        h.core.reject(event.key, 486, h.now)
    h._collect()
    h.advance(64 * T1 + 10)
    assert h.core.footprint() == dict.fromkeys(h.core.footprint(), 0)


def test_a_rejection_without_ack_is_retransmitted_until_timer_h_then_forgotten(
    h: Harness,
) -> None:
    uac = Uac()
    h.feed(uac.invite(sdp_offer(formats="18")))  # 488
    start = h.now
    at: list[float] = []
    while h.now - start < 40:
        if statuses(h.advance(0.25)):
            at.append(round(h.now - start, 2))
    assert at[:4] == [0.5, 1.5, 3.5, 7.5] and at[-1] <= 32
    assert h.core.footprint()["server_transactions"] == 0  # timer H at 64*T1


def test_over_tcp_nothing_is_retransmitted_and_transactions_end_at_once(h: Harness) -> None:
    flow = Flow("tcp", ("127.0.0.1", 40999), conn_id=3)
    uac = Uac(transport="TCP")
    h.feed(uac.invite(sdp_offer(formats="18")), flow)
    assert statuses(h.advance(10)) == []  # no timer G on a reliable transport
    h.feed(uac.ack(non_2xx=True), flow)
    assert h.core.footprint()["server_transactions"] == 0  # timer I is 0 over TCP
    h.feed(Uac(transport="TCP").options(), flow)
    assert h.core.footprint()["server_transactions"] == 0  # timer J is 0 over TCP


def test_a_retransmitted_bye_within_timer_j_gets_the_same_200_then_the_state_is_gone(
    h: Harness,
) -> None:
    uac = Uac()
    h.answered_call(uac)
    h.feed(uac.ack())
    bye = uac.bye()
    h.feed(bye)
    h.advance(30)
    assert statuses(h.feed(bye)) == [200]  # still within 64*T1: replayed, not 481
    h.advance(3)
    assert h.core.footprint()["server_transactions"] == 0


def test_our_bye_unanswered_gives_up_after_timer_f_and_forgets_the_call(h: Harness) -> None:
    uac = Uac()
    call = h.answered_call(uac)
    h.feed(uac.ack())
    h.core.hangup(call.key, h.now)
    h._collect()
    out = h.advance(64 * T1 + 1)
    byes = [m for m in out if isinstance(m, SipRequest) and m.method == "BYE"]
    assert 5 <= len(byes) <= 11  # timer E: T1 doubling to T2 until timer F
    assert h.core.footprint() == dict.fromkeys(h.core.footprint(), 0)


def test_a_second_reinvite_before_the_ack_of_the_first_gets_500_with_retry_after(
    h: Harness,
) -> None:
    uac = Uac()
    h.answered_call(uac)
    h.feed(uac.ack())
    h.feed(uac.reinvite(sdp_offer(direction="sendonly", formats="0")))
    out = h.feed(uac.reinvite(sdp_offer(formats="0")))
    assert statuses(out) == [500] and out[0].headers.get_first("retry-after")
