"""A SIP call in set-up (INVITE in, Realtime opening, 200 not yet out) while the heartbeat
runs, and a 200 whose ACK never comes: seen by a scripted caller over real UDP, the rows in
real Postgres."""

from __future__ import annotations

import sqlalchemy as sa
from aiosipua import SipRequest, SipResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.liveness import end_unstreamed_calls
from tests.e2e_support import event_rows, wait_until
from tests.openai_sip_support import interconnect
from tests.sip_support import Uac, UdpPeer, sdp_offer
from tests.sipp_support import sip_stack

# The heartbeat runs twenty times while the Realtime handshake of 1 s is held.
HEARTBEAT_S = 0.05
HANDSHAKE_S = 1.0


async def _sip_row(engine: AsyncEngine) -> dict[str, object]:
    async with engine.connect() as conn:
        row = (await conn.execute(sa.text("SELECT * FROM calls WHERE leg = 'sip'"))).mappings()
        return dict(row.one())


def _final(msg: object) -> bool:
    return isinstance(msg, SipResponse) and msg.status_code >= 200


async def test_a_call_whose_realtime_opens_slowly_is_answered_and_stays_live_under_heartbeats(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, call_heartbeat_s=HEARTBEAT_S) as stack:
        stack.sim.handshake_delay_s = HANDSHAKE_S
        runtime = stack.service.runtime
        server = ("127.0.0.1", runtime.sip.port)
        sip_peer, rtp_peer = await UdpPeer.open(), await UdpPeer.open()
        uac = Uac(port=sip_peer.port)
        try:
            sip_peer.send(uac.invite(sdp_offer(port=rtp_peer.port, formats="0 101")), server)
            final = await sip_peer.message(_final, within=15)
            assert isinstance(final, SipResponse)
            assert final.status_code == 200, f"answered {final.status_code} {final.reason_phrase}"
            uac.learn(final)
            sip_peer.send(uac.ack(), server)
            # The agent's greeting flows, and the call outlives many more heartbeats.
            await wait_until(lambda: len(rtp_peer.got) > 25, 15, "agent audio flowing")
            row = await _sip_row(engine)
            assert row["status"] == "in_progress" and row["holder"] == runtime.holder
            first_beat = row["heartbeat_at"]

            async def beaten() -> bool:
                now = await _sip_row(engine)
                assert now["status"] == "in_progress", now["end_reason"]
                return bool(now["heartbeat_at"] != first_beat)

            await wait_until(beaten, 10, "the live call heartbeated")
            events = await event_rows(engine, row["id"])
            assert not [e for e in events if e["kind"] == "call_ended"]
            assert not [m for _, m in sip_peer.got if m.startswith(b"BYE ")], (
                "the call was hung up while live"
            )
            start = len(sip_peer.got)
            sip_peer.send(uac.bye(), server)
            await sip_peer.response(200, start=start)
        finally:
            sip_peer.close()
            rtp_peer.close()
        await wait_until(lambda: runtime.sip.live_calls() == 0, 15, "call over")
        await runtime.events.flush()
    row = await _sip_row(engine)
    assert row["status"] == "completed" and "bye" in str(row["end_reason"]), row["end_reason"]


async def test_a_200_never_acked_ends_the_call_with_a_bye_and_its_row_says_no_ack(
    engine: AsyncEngine,
) -> None:
    # 64*T1 = 3.2 s; Realtime opens slowly and the heartbeat runs all along, as in a busy run.
    async with sip_stack(engine, sip_t1_s=0.05, call_heartbeat_s=HEARTBEAT_S) as stack:
        stack.sim.handshake_delay_s = 0.5
        runtime = stack.service.runtime
        server = ("127.0.0.1", runtime.sip.port)
        sip_peer, rtp_peer = await UdpPeer.open(), await UdpPeer.open()
        uac = Uac(port=sip_peer.port)
        try:
            sip_peer.send(uac.invite(sdp_offer(port=rtp_peer.port, formats="0 101")), server)
            final = await sip_peer.message(_final, within=15)
            assert isinstance(final, SipResponse) and final.status_code == 200
            # No ACK: the 200 comes again, then a BYE after 64*T1.
            bye = await sip_peer.message(
                lambda m: isinstance(m, SipRequest) and m.method == "BYE", within=20
            )
            sip_peer.send(Uac.reply_to(bytes(bye), 200), server)
        finally:
            sip_peer.close()
            rtp_peer.close()

        async def row_ended() -> bool:
            return (await _sip_row(engine))["status"] != "in_progress"

        await wait_until(row_ended, 15, "the row ended")
        await wait_until(lambda: runtime.sip.live_calls() == 0, 15, "call over")
        await wait_until(lambda: runtime.registry.live_count() == 0, 15, "registry empty")
        await runtime.events.flush()
    row = await _sip_row(engine)
    assert row["status"] == "completed", row
    assert "no ACK" in str(row["end_reason"]), row["end_reason"]
    events = await event_rows(engine, row["id"])
    ended = [e for e in events if e["kind"] == "call_ended"]
    assert len(ended) == 1 and "no ACK" in ended[0]["data"]["reason"]


async def test_a_call_in_set_up_is_held_by_its_heartbeat_until_its_row_is_ended_elsewhere(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, call_heartbeat_s=HEARTBEAT_S, sip_answer_timeout_s=30) as stack:
        stack.sim.handshake_delay_s = 10.0  # set-up lasts as long as the test needs
        runtime = stack.service.runtime
        server = ("127.0.0.1", runtime.sip.port)
        sip_peer, rtp_peer = await UdpPeer.open(), await UdpPeer.open()
        uac = Uac(port=sip_peer.port)
        try:
            sip_peer.send(uac.invite(sdp_offer(port=rtp_peer.port, formats="0 101")), server)
            await sip_peer.response(180)

            async def held() -> bool:
                async with engine.connect() as conn:
                    n = await conn.scalar(
                        sa.text(
                            "SELECT count(*) FROM calls WHERE leg = 'sip' AND status = 'ringing' "
                            "AND holder = :h AND heartbeat_at IS NOT NULL"
                        ),
                        {"h": runtime.holder},
                    )
                return bool(n)

            await wait_until(held, 10, "the ringing row held by its heartbeat")
            # Old enough for the unstreamed sweep, but held: the sweep leaves it alone.
            async with engine.begin() as conn:
                await conn.execute(
                    sa.text(
                        "UPDATE calls SET created_at = now() - interval '10 minutes' "
                        "WHERE leg = 'sip'"
                    )
                )
            assert await end_unstreamed_calls(engine, stream_wait_s=90) == []
            # Ended elsewhere (staff) while still in set-up: the heartbeat ends it here too.
            async with engine.begin() as conn:
                await conn.execute(
                    sa.text(
                        "UPDATE calls SET status = 'failed', ended_at = now(), "
                        "end_reason = 'ended by staff' WHERE leg = 'sip'"
                    )
                )
            final = await sip_peer.message(_final, within=10)
            assert isinstance(final, SipResponse) and final.status_code == 480
            sip_peer.send(uac.ack(non_2xx=True), server)
        finally:
            sip_peer.close()
            rtp_peer.close()
        await wait_until(lambda: runtime.sip.live_calls() == 0, 40, "call over")
    row = await _sip_row(engine)
    assert row["status"] == "failed" and row["end_reason"] == "ended by staff"


async def test_an_interconnect_call_accepted_under_a_busy_heartbeat_stays_live(
    engine: AsyncEngine,
) -> None:
    # The OpenAI SIP leg attaches once the accept is through, then moves its row: a beat
    # between the two must not end it.
    async with interconnect(engine, call_heartbeat_s=0.01) as ic:
        call = await ic.sim.place_call(from_number="+15551230000", to_number="+15557654321")
        await ic.sim.wait_for_state(call.call_id, "accepted")
        row = await ic.wait_row(call.call_id, "in_progress")
        first_beat = row["heartbeat_at"]

        async def beaten() -> bool:
            now = await ic.row(call.call_id)
            assert now is not None and now["status"] == "in_progress", now
            return bool(now["heartbeat_at"] != first_beat)

        await wait_until(beaten, 10, "the live call heartbeated")
        assert ic.sim.requests_for(call.call_id, "hangup") == []
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.call_id)
        final = await ic.row(call.call_id)
    assert final is not None and final["status"] == "completed"
    assert "caller hung up" in final["end_reason"]
