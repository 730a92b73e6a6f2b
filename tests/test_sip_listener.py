"""The SIP listener seen by a scripted caller over real UDP: answers, refusals, addresses and
hang-ups that sipp's scenarios do not reach."""

from __future__ import annotations

import itertools

import sqlalchemy as sa
from aiosipua import SipRequest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import event_rows, wait_until
from tests.sip_support import Uac, UdpPeer, sdp_offer
from tests.sipp_support import sip_stack


async def _sip_row(engine: AsyncEngine) -> dict[str, object]:
    async with engine.connect() as conn:
        row = (await conn.execute(sa.text("SELECT * FROM calls WHERE leg = 'sip'"))).mappings()
        return dict(row.one())


async def test_an_invite_gets_503_when_the_realtime_session_cannot_open(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, sip_answer_timeout_s=1.0) as stack:
        stack.sim.fail_next_connects(1000)
        server = ("127.0.0.1", stack.service.runtime.sip.port)
        peer = await UdpPeer.open()
        uac = Uac(port=peer.port)
        try:
            peer.send(uac.invite(), server)
            await peer.response(100)
            await peer.response(180)
            refused = await peer.response(503)
            assert refused.headers.get_first("retry-after")
            peer.send(uac.ack(non_2xx=True), server)
        finally:
            peer.close()
        sip = stack.service.runtime.sip
        await wait_until(lambda: sip.live_calls() == 0, 15, "call over")
        await stack.service.runtime.events.flush()
    row = await _sip_row(engine)
    assert row["status"] == "failed" and "did not open" in str(row["end_reason"])


async def test_sdp_and_contact_carry_the_advertised_address(engine: AsyncEngine) -> None:
    async with sip_stack(engine, sip_advertised_address="192.0.2.50") as stack:
        server = ("127.0.0.1", stack.service.runtime.sip.port)
        peer = await UdpPeer.open()
        uac = Uac(port=peer.port)
        try:
            peer.send(uac.invite(), server)
            ok = await peer.response(200)
            uac.learn(ok)
            peer.send(uac.ack(), server)
            assert "c=IN IP4 192.0.2.50" in ok.text and "o=- " in ok.text
            assert "@192.0.2.50:" in (ok.headers.get_first("contact") or "")
            start = len(peer.got)
            peer.send(uac.bye(), server)
            await peer.response(200, start=start)
        finally:
            peer.close()


async def test_realtime_lost_mid_call_apologises_then_hangs_up_with_a_bye(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, realtime_reconnect_budget_s=1.0) as stack:
        server = ("127.0.0.1", stack.service.runtime.sip.port)
        sip_peer, rtp_peer = await UdpPeer.open(), await UdpPeer.open()
        uac = Uac(port=sip_peer.port)
        try:
            sip_peer.send(uac.invite(sdp_offer(port=rtp_peer.port, formats="0 101")), server)
            ok = await sip_peer.response(200)
            uac.learn(ok)
            sip_peer.send(uac.ack(), server)
            await wait_until(lambda: len(rtp_peer.got) > 10, 10, "our RTP flowing")
            stack.sim.fail_next_connects(1000)
            await stack.sim.drop_all()
            bye = await sip_peer.message(
                lambda m: isinstance(m, SipRequest) and m.method == "BYE", within=20
            )
            sip_peer.send(Uac.reply_to(bytes(bye), 200), server)
        finally:
            sip_peer.close()
            rtp_peer.close()
        sip = stack.service.runtime.sip
        await wait_until(lambda: sip.live_calls() == 0, 15, "call over")
        await stack.service.runtime.events.flush()
    row = await _sip_row(engine)
    assert row["status"] == "completed" and "realtime failed" in str(row["end_reason"])
    events = await event_rows(engine, row["id"])
    apology = next(e for e in events if e["kind"] == "apology_played")
    assert apology["data"]["heard_ms"] > 0  # the caller heard the chime before the BYE


async def test_an_offer_of_30_ms_packets_gets_them_and_keeps_them_through_a_reinvite(
    engine: AsyncEngine,
) -> None:
    from aiortc.rtp import RtpPacket

    offer = sdp_offer(formats="0 101").replace(b"a=ptime:20", b"a=ptime:30")
    async with sip_stack(engine) as stack:
        server = ("127.0.0.1", stack.service.runtime.sip.port)
        sip_peer, rtp_peer = await UdpPeer.open(), await UdpPeer.open()
        uac = Uac(port=sip_peer.port)
        try:
            sip_peer.send(uac.invite(offer.replace(b"40000", str(rtp_peer.port).encode())), server)
            ok = await sip_peer.response(200)
            uac.learn(ok)
            sip_peer.send(uac.ack(), server)
            await wait_until(lambda: len(rtp_peer.got) > 20, 10, "our RTP flowing")
            start = len(sip_peer.got)
            again = sdp_offer(port=rtp_peer.port, formats="0 101")  # a re-offer of 20 ms
            sip_peer.send(uac.reinvite(again), server)
            reanswered = await sip_peer.response(200, start=start)
            sip_peer.send(uac.ack(), server)
            seen = len(rtp_peer.got)
            await wait_until(lambda: len(rtp_peer.got) > seen + 10, 10, "RTP after re-INVITE")
            start = len(sip_peer.got)
            sip_peer.send(uac.bye(), server)
            await sip_peer.response(200, start=start)
        finally:
            sip_peer.close()
            rtp_peer.close()
    packets = [RtpPacket.parse(data) for _, data in rtp_peer.got if 0 <= data[1] & 0x7F < 96]
    audio = [p for p in packets if p.payload_type == 0]
    assert "a=ptime:30\r\n" in ok.text and "a=ptime:30\r\n" in reanswered.text
    assert len(audio) > 30 and {len(p.payload) for p in audio} == {240}
    steps = {(b.timestamp - a.timestamp) & 0xFFFFFFFF for a, b in itertools.pairwise(audio)}
    assert steps == {240}
