"""One call on each leg (a fake Twilio caller over a real media socket, a SIP caller over real
UDP, OpenAI's interconnect stand-in over a real webhook and sideband), its row and events in
real Postgres: every leg goes through the same CallSession steps in the same order and ends
its call once, with one `call_ended` of the one shape and the reason its row got."""

from __future__ import annotations

from typing import Any

from aiosipua import SipResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import call_row, call_stack, event_rows, wait_until
from tests.openai_sip_support import interconnect
from tests.sip_support import Uac, UdpPeer, sdp_offer
from tests.sipp_support import sip_stack

# The session's steps as the timeline shows them: admit, live, end.
LIFECYCLE = ("call_started", "stream_started", "call_ended")


def _final(msg: object) -> bool:
    return isinstance(msg, SipResponse) and msg.status_code >= 200


async def _twilio_call(engine: AsyncEngine) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    async with call_stack(engine) as stack:
        caller = stack.caller()
        await caller.dial()
        await caller.wait_for(lambda c: c.media_received_ms >= 200, 15)
        await caller.hangup()
        events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)
    assert row is not None
    return row, events


async def _sip_call(engine: AsyncEngine) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    async with sip_stack(engine) as stack:
        runtime = stack.service.runtime
        server = ("127.0.0.1", runtime.sip.port)
        sip_peer, rtp_peer = await UdpPeer.open(), await UdpPeer.open()
        uac = Uac(port=sip_peer.port)
        try:
            sip_peer.send(uac.invite(sdp_offer(port=rtp_peer.port, formats="0 101")), server)
            final = await sip_peer.message(_final, within=15)
            assert isinstance(final, SipResponse) and final.status_code == 200
            uac.learn(final)
            sip_peer.send(uac.ack(), server)
            await wait_until(lambda: len(rtp_peer.got) > 5, 15, "agent audio flowing")
            start = len(sip_peer.got)
            sip_peer.send(uac.bye(), server)
            await sip_peer.response(200, start=start)
        finally:
            sip_peer.close()
            rtp_peer.close()
        await wait_until(lambda: runtime.sip.live_calls() == 0, 15, "call over")
        await runtime.events.flush()
        row = await call_row(engine, uac.call_id)
    assert row is not None
    return row, await event_rows(engine, row["id"])


async def _interconnect_call(engine: AsyncEngine) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    async with interconnect(engine) as ic:
        call = await ic.sim.place_call(from_number="+15551230000", to_number="+15557654321")
        await ic.wait_row(call.call_id, "in_progress")
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.call_id)
        row = await ic.row(call.call_id)
    assert row is not None
    return row, await event_rows(engine, row["id"])


async def test_every_leg_admits_goes_live_and_ends_once_through_the_same_steps(
    engine: AsyncEngine,
) -> None:
    calls = {
        "twilio": await _twilio_call(engine),
        "sip": await _sip_call(engine),
        "openai_sip": await _interconnect_call(engine),
    }
    shapes = set()
    for leg, (row, events) in calls.items():
        kinds = [e["kind"] for e in events]
        # The same steps, once each, in the same order, and the end is the last word.
        assert [k for k in kinds if k in LIFECYCLE] == list(LIFECYCLE), (leg, kinds)
        assert kinds[0] == "call_started" and kinds[-1] == "call_ended", (leg, kinds)
        by_kind = {e["kind"]: e["data"] for e in events if e["kind"] in LIFECYCLE}
        assert by_kind["call_started"]["leg"] == leg == row["leg"]
        assert by_kind["call_started"]["call_sid"] == row["call_sid"], leg
        assert by_kind["stream_started"]["leg"] == leg
        assert by_kind["stream_started"]["call_sid"] == row["call_sid"], leg
        # The row ended once, and its one end event says what the row says.
        assert row["status"] == "completed" and row["ended_at"] is not None, (leg, row)
        ended = by_kind["call_ended"]
        assert ended["reason"] == row["end_reason"], (leg, ended, row["end_reason"])
        assert ended["source"] == "call", leg
        assert isinstance(ended["duration_ms"], int) and ended["duration_ms"] >= 0, leg
        # Only the leg that receives the media itself measures it (RTP loss and jitter).
        media = ended.pop("media", None)
        assert (media is not None) == (leg == "sip"), (leg, media)
        shapes.add(frozenset(ended))
    assert shapes == {frozenset({"reason", "source", "duration_ms"})}


async def test_an_invite_refused_busy_by_one_replica_rings_on_the_next_one_its_proxy_tries(
    engine: AsyncEngine,
) -> None:
    """A dispatcher fails a call over with the same Call-ID: the replica that refused it
    wrote its row `busy`; the next replica takes it (the row rings again, not 482), and the
    timeline keeps the refusal before the call."""
    async with sip_stack(engine) as full, sip_stack(engine) as other:
        full.service.runtime.registry.stop_accepting()  # this replica is stopping
        peer, rtp_peer = await UdpPeer.open(), await UdpPeer.open()
        uac = Uac(port=peer.port)
        try:
            offer = sdp_offer(port=rtp_peer.port, formats="0 101")
            peer.send(uac.invite(offer), ("127.0.0.1", full.service.runtime.sip.port))
            refused = await peer.message(_final, within=15)
            assert isinstance(refused, SipResponse) and refused.status_code == 503
            start = len(peer.got)
            peer.send(uac.invite(offer), ("127.0.0.1", other.service.runtime.sip.port))
            answered = await peer.message(_final, within=15, start=start)
            assert isinstance(answered, SipResponse) and answered.status_code == 200
            uac.learn(answered)
            peer.send(uac.ack(), ("127.0.0.1", other.service.runtime.sip.port))
            await wait_until(lambda: len(rtp_peer.got) > 5, 15, "agent audio flowing")
            row = await call_row(engine, uac.call_id)
            start = len(peer.got)
            peer.send(uac.bye(), ("127.0.0.1", other.service.runtime.sip.port))
            await peer.response(200, start=start)
        finally:
            peer.close()
            rtp_peer.close()
        await wait_until(lambda: other.service.runtime.sip.live_calls() == 0, 15, "call over")
        await other.service.runtime.events.flush()
        await full.service.runtime.events.flush()
        assert row is not None
        kinds = [e["kind"] for e in await event_rows(engine, row["id"])]
    assert row["status"] == "in_progress"
    assert kinds.index("call_rejected") < kinds.index("stream_started")
    assert kinds.count("call_ended") == 1
