"""REFER (RFC 3515) in the sans-I/O SIP core with a fake clock: the request, its answer, the
NOTIFYs of its subscription, and what is refused."""

from __future__ import annotations

import pytest
from aiosipua import SipRequest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from telephony.legs.sip.refer import refer_to_uri, sipfrag_status
from telephony.legs.sip.uas import ALLOW, CallEnded, ReferAnswered, ReferNotified
from tests.sip_support import Uac
from tests.test_sip_core import T1, Harness, make, statuses

DESK = "+15550100009"


def confirmed(h: Harness) -> tuple[Uac, object]:
    uac = Uac()
    call = h.answered_call(uac)
    h.feed(uac.ack())
    return uac, call.key


def sent_refer(h: Harness, uac: Uac, key: object, destination: str = DESK) -> SipRequest:
    assert h.core.refer(key, destination, h.now)  # type: ignore[arg-type]
    (refer,) = h._collect()
    assert isinstance(refer, SipRequest) and refer.method == "REFER"
    return refer


def refer_events(h: Harness) -> list[object]:
    return [e for e in h.events if isinstance(e, ReferAnswered | ReferNotified)]


def test_a_refer_names_the_target_and_us_and_is_retransmitted_until_answered() -> None:
    h = make()
    uac, key = confirmed(h)
    refer = sent_refer(h, uac, key)
    assert refer.headers.get_first("refer-to") == f"<sip:{DESK}@127.0.0.1;user=phone>"
    assert refer.headers.get_first("referred-by") == "<sip:agent@127.0.0.1>"
    assert (refer.headers.get_first("cseq") or "").endswith(" REFER")
    assert "REFER" in ALLOW and "NOTIFY" in ALLOW
    again = h.advance(T1)
    assert [m.method for m in again if isinstance(m, SipRequest)] == ["REFER"]
    h.feed(Uac.reply_to(bytes(refer), 202))
    assert refer_events(h) == [ReferAnswered(key, 202)]  # type: ignore[arg-type]
    assert h.advance(10) == []


def test_progress_then_a_200_sipfrag_report_the_transfer_and_each_notify_gets_200() -> None:
    h = make()
    uac, key = confirmed(h)
    h.feed(Uac.reply_to(bytes(sent_refer(h, uac, key)), 202))
    assert statuses(h.feed(uac.notify(b"SIP/2.0 100 Trying\r\n"))) == [200]
    assert statuses(h.feed(uac.notify(b"SIP/2.0 180 Ringing\r\n"))) == [200]
    assert statuses(h.feed(uac.notify(b"SIP/2.0 200 OK\r\n", terminated=True))) == [200]
    assert refer_events(h)[1:] == [
        ReferNotified(key, 100, "Trying", False),  # type: ignore[arg-type]
        ReferNotified(key, 180, "Ringing", False),  # type: ignore[arg-type]
        ReferNotified(key, 200, "OK", True),  # type: ignore[arg-type]
    ]
    # The subscription is over: another NOTIFY of it is refused; the call is not ended by
    # the core (the application ends it with BYE).
    assert statuses(h.feed(uac.notify(b"SIP/2.0 200 OK\r\n", terminated=True))) == [481]
    assert not any(isinstance(e, CallEnded) for e in h.events)
    h.core.hangup(key, h.now, "transferred to front_desk")  # type: ignore[arg-type]
    assert [m.method for m in h._collect() if isinstance(m, SipRequest)] == ["BYE"]


@pytest.mark.parametrize("status", [403, 405, 501, 603])
def test_a_refused_refer_is_reported_and_the_call_goes_on(status: int) -> None:
    h = make()
    uac, key = confirmed(h)
    h.feed(Uac.reply_to(bytes(sent_refer(h, uac, key)), status))
    assert refer_events(h) == [ReferAnswered(key, status)]  # type: ignore[arg-type]
    assert h.core.call_state(key).value == "confirmed"  # type: ignore[arg-type, union-attr]
    # A NOTIFY for a REFER that was refused names no subscription.
    assert statuses(h.feed(uac.notify(b"SIP/2.0 100 Trying\r\n"))) == [481]
    # It may be tried again.
    sent_refer(h, uac, key)


def test_an_unanswered_refer_times_out_after_64_t1_as_status_0() -> None:
    h = make()
    uac, key = confirmed(h)
    sent_refer(h, uac, key)
    h.advance(64 * T1 + 0.1)
    assert refer_events(h) == [ReferAnswered(key, 0)]  # type: ignore[arg-type]


def test_a_failed_sipfrag_is_final_and_a_notify_may_overtake_the_202() -> None:
    h = make()
    uac, key = confirmed(h)
    refer = sent_refer(h, uac, key)
    assert statuses(h.feed(uac.notify(b"SIP/2.0 100 Trying\r\n"))) == [200]
    h.feed(Uac.reply_to(bytes(refer), 202))  # late: already accepted by the NOTIFY
    h.feed(uac.notify(b"SIP/2.0 486 Busy Here\r\n", terminated=True))
    assert refer_events(h) == [
        ReferNotified(key, 100, "Trying", False),  # type: ignore[arg-type]
        ReferNotified(key, 486, "Busy Here", True),  # type: ignore[arg-type]
    ]
    # Over: the call can be referred again.
    sent_refer(h, uac, key)


def test_garbage_notifies_get_a_clean_4xx_and_change_nothing() -> None:
    h = make()
    uac, key = confirmed(h)
    assert statuses(h.feed(uac.notify(b"SIP/2.0 200 OK\r\n"))) == [481]  # no REFER yet
    h.feed(Uac.reply_to(bytes(sent_refer(h, uac, key)), 202))
    assert statuses(h.feed(uac.notify(b"SIP/2.0 200 OK\r\n", event="presence"))) == [489]
    assert statuses(h.feed(uac.notify(b"SIP/2.0 200 OK\r\n", event="refer;id=1"))) == [481]
    assert statuses(h.feed(uac.notify(b"<xml/>", content_type="text/plain"))) == [415]
    for body in (b"INVITE sip:x@y SIP/2.0\r\n", b"SIP/2.0 999 What\r\n", b"\xff\xfe", b"SIP/2.0"):
        assert statuses(h.feed(uac.notify(body))) == [400], body
    assert statuses(h.feed(uac.notify(b""))) == [415]  # no body, no Content-Type
    assert refer_events(h) == [ReferAnswered(key, 202)]  # type: ignore[arg-type]
    assert h.core.stats.internal_errors == 0
    assert statuses(h.feed(Uac(to_tag="nosuch").notify(b"SIP/2.0 200 OK\r\n"))) == [481]


def test_a_refer_from_the_caller_is_refused_and_one_outside_a_call_gets_481() -> None:
    h = make()
    uac, _ = confirmed(h)
    uac.cseq += 1
    assert statuses(h.feed(uac._request("REFER", headers=["Refer-To: <sip:x@y>"]))) == [403]
    assert statuses(h.feed(Uac()._request("REFER", to_tag=""))) == [481]


def test_given_up_refer_refuses_late_notifies_and_a_call_being_set_up_cannot_be_referred() -> None:
    h = make()
    uac = Uac()
    call = h.answered_call(uac)
    assert not h.core.refer(call.key, DESK, h.now)  # not confirmed (no ACK yet)
    h.feed(uac.ack())
    h.feed(Uac.reply_to(bytes(sent_refer(h, uac, call.key)), 202))
    assert not h.core.refer(call.key, DESK, h.now)  # one at a time
    h.core.give_up_refer(call.key)
    assert statuses(h.feed(uac.notify(b"SIP/2.0 200 OK\r\n", terminated=True))) == [481]
    assert not h.core.refer(call.key, "12345", h.now)  # neither a number nor a URI
    sip = sent_refer(h, uac, call.key, "sip:billing@pbx.example")
    assert sip.headers.get_first("refer-to") == "<sip:billing@pbx.example>"


def test_refer_to_uris_and_sipfrag_status_lines() -> None:
    assert refer_to_uri(DESK, "trunk.example:5080") == f"sip:{DESK}@trunk.example:5080;user=phone"
    assert refer_to_uri("sips:desk@pbx.example", "x") == "sips:desk@pbx.example"
    with pytest.raises(ValueError):
        refer_to_uri(DESK, "bad host>")
    assert sipfrag_status(b"SIP/2.0 603 Declined\r\nContent-Length: 0\r\n") == (603, "Declined")
    assert sipfrag_status(b"SIP/2.0 200\n") == (200, "")
    assert sipfrag_status(b"HTTP/1.1 200 OK") is None


@given(st.binary(max_size=300))
def test_any_sipfrag_body_is_parsed_or_refused_without_raising(body: bytes) -> None:
    status = sipfrag_status(body)
    assert status is None or 100 <= status[0] <= 699


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    event=st.sampled_from(["refer", "refer;id=", "REFER", "presence", "", "refer;id=x;id=y"]),
    state=st.sampled_from(["active;expires=60", "terminated", "pending", "", "\x01", "Terminated"]),
    content_type=st.sampled_from(["message/sipfrag", "message/sipfrag;version=2.0", "text/plain"]),
    body=st.one_of(
        st.binary(max_size=120),
        st.sampled_from([b"SIP/2.0 100 Trying", b"SIP/2.0 200 OK\r\n", b"SIP/2.0 486 Busy"]),
    ),
)
def test_any_notify_during_a_refer_gets_a_final_answer_and_never_an_internal_error(
    event: str, state: str, content_type: str, body: bytes
) -> None:
    h = make()
    uac, key = confirmed(h)
    h.feed(Uac.reply_to(bytes(sent_refer(h, uac, key)), 202))
    uac.cseq += 1
    notify = uac._request(
        "NOTIFY",
        body=body,
        headers=[f"Event: {event}", f"Subscription-State: {state}"],
        content_type=content_type,
    )
    out = h.feed(notify)
    assert h.core.stats.internal_errors == 0
    assert all(200 <= s < 500 for s in statuses(out)), statuses(out)
    notified = [e for e in h.events if isinstance(e, ReferNotified)]
    assert len(notified) <= 1
    if notified and notified[0].final:
        assert statuses(h.feed(uac.notify(b"SIP/2.0 200 OK\r\n", terminated=True))) == [481]


def test_a_warm_transfers_refer_replaces_our_dialog_with_the_person_and_needs_it_up() -> None:
    """RFC 3891: the Refer-To is the person's Contact with `?Replaces=` naming our dialog with
    them, the tags as the person sees them (to-tag theirs, from-tag ours), escaped; a person
    still ringing cannot be replaced, and nothing is sent."""
    from telephony.legs.sip.message import Flow
    from telephony.legs.sip.sdp import LocalMedia
    from tests.test_sip_uac_core import ANSWER, FAR, _response

    h = make()
    _, key = confirmed(h)
    person = h.core.invite("sip:desk@127.0.0.1:5099", LocalMedia("127.0.0.1", 40000, 1), h.now)
    (invite,) = h._collect()
    assert not h.core.refer(key, "", h.now, replacing=person)  # type: ignore[arg-type]
    assert h._collect() == []
    h.feed(_response(bytes(invite), "200 OK", tag="p3rs0n", body=ANSWER), Flow("udp", FAR))
    assert h.core.refer(key, "", h.now, replacing=person)  # type: ignore[arg-type]
    (refer,) = [m for m in h._collect() if isinstance(m, SipRequest) and m.method == "REFER"]
    escaped = person.call_id.replace("@", "%40")
    assert refer.headers.get_first("refer-to") == (
        f"<sip:far@127.0.0.1:5099?Replaces={escaped}%3Bto-tag%3Dp3rs0n"
        f"%3Bfrom-tag%3D{person.local_tag}>"
    )


def test_replaces_uris_escape_the_dialog_and_refuse_what_is_no_sip_contact() -> None:
    from telephony.legs.sip.refer import replaces_uri

    assert replaces_uri("sip:bob@pbx.example;transport=udp", "a@b", "t", "f") == (
        "sip:bob@pbx.example;transport=udp?Replaces=a%40b%3Bto-tag%3Dt%3Bfrom-tag%3Df"
    )
    assert replaces_uri("sip:pbx.example?X-A=1", "c", "t", "f").endswith(
        "&Replaces=c%3Bto-tag%3Dt%3Bfrom-tag%3Df"
    )
    for contact, tags in [("tel:+1555", ("t", "f")), ("sip:a b@x", ("t", "f")),
                          ("sip:b@x", ("", "f"))]:  # fmt: skip
        with pytest.raises(ValueError):
            replaces_uri(contact, "c", *tags)
