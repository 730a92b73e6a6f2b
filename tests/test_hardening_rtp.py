"""Issue 22, over real sockets: RTP timestamps that once stalled a replica, and RTP from hosts
the signalling never named.

A SIP call whose timestamps regress, wrap past 2**32, restart with a new SSRC on a new port and
jump by hours; a Twilio stream whose `timestamp` does the same: each recording stays within the
call's own length and the server keeps answering. A sprayer on another host sends RTP to an
answered call's port before and after the caller: the caller gets every agent packet, the
sprayer none, the model hears only the caller, and the drop is counted and on the timeline.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import sqlalchemy as sa
from aiortc.rtp import RtpPacket
from aiosipua import SipResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.recording_store import RecordingInfo, get_recording
from tests.e2e_support import Stack, event_rows, wait_until
from tests.metrics_support import samples as metric_samples
from tests.sip_support import Uac, UdpPeer, rtp_port_of, sdp_offer
from tests.sipp_support import sip_stack
from tests.test_e2e_call import hear_greeting, scenario

CALLER_VOICE = b"\xfe" * 160  # near silence in mu-law: what the real caller sends
SPRAYER_VOICE = b"\x42" * 160  # what the sprayer sends; never appears in caller audio
SILENCE = b"\xff" * 160


def rtp(seq: int, ts: int, ssrc: int, payload: bytes = CALLER_VOICE) -> bytes:
    return RtpPacket(0, 0, seq & 0xFFFF, ts & 0xFFFFFFFF, ssrc, payload).serialize()


async def _sip_call_id(engine: AsyncEngine) -> str:
    async with engine.connect() as conn:
        row = await conn.execute(sa.text("SELECT id FROM calls WHERE leg = 'sip'"))
        return str(row.scalar_one())


async def _still_answering(stack: Stack, server: tuple[str, int]) -> None:
    """/healthz and SIP OPTIONS both answer, promptly."""
    async with httpx.AsyncClient(base_url=stack.service.url, timeout=2.0) as http:
        assert (await http.get("/healthz")).status_code == 200
    peer = await UdpPeer.open()
    try:
        peer.send(Uac(port=peer.port).options(), server)
        await peer.response(200, within=2.0)
    finally:
        peer.close()


@asynccontextmanager
async def answered(
    stack: Stack, rtp_peer: UdpPeer
) -> AsyncIterator[tuple[UdpPeer, Uac, tuple[str, int], SipResponse]]:
    """A SIP call from 127.0.0.1 answered with RTP to `rtp_peer`; hung up at the end."""
    server = ("127.0.0.1", stack.service.runtime.sip.port)
    sip_peer = await UdpPeer.open()
    uac = Uac(port=sip_peer.port)
    try:
        sip_peer.send(uac.invite(sdp_offer(port=rtp_peer.port, formats="0 101")), server)
        ok = await sip_peer.response(200)
        uac.learn(ok)
        sip_peer.send(uac.ack(), server)
        yield sip_peer, uac, server, ok
        start = len(sip_peer.got)
        sip_peer.send(uac.bye(), server)
        await sip_peer.response(200, start=start)
    finally:
        sip_peer.close()


async def test_regressing_wrapping_restarting_and_jumping_rtp_timestamps_keep_a_sip_recording_within_the_call(  # noqa: E501
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, scenario(reply_ms=800)) as stack:
        rtp_peer, moved = await UdpPeer.open(), await UdpPeer.open()
        try:
            began = time.monotonic()
            async with answered(stack, rtp_peer) as (sip_peer, uac, server, ok):
                media = ("127.0.0.1", rtp_port_of(ok.text))
                first = 0xFFFF_F000  # wraps past 2**32 after 26 packets
                stamps = [first, first - 160]  # the second is below the first
                stamps += [first + 160 * n for n in range(1, 60)]
                for seq, ts in enumerate(stamps):
                    rtp_peer.send(rtp(seq, ts, 0x1111), media)
                    await asyncio.sleep(0.02)  # a phone's pacing
                # Hold and resume to a new port; the stream restarts there with a new SSRC.
                start = len(sip_peer.got)
                sip_peer.send(uac.reinvite(sdp_offer(port=moved.port, formats="0 101")), server)
                await sip_peer.response(200, start=start)
                sip_peer.send(uac.ack(), server)
                hours = 8000 * 3600 * 5
                stamps = [7, 7 + 160, 7 + hours, 7 + hours + 160, 7 - hours, 7 + 2**31]
                stamps += [7 + 2**31 + 160 * n for n in range(1, 40)]
                for seq, ts in enumerate(stamps, start=100):
                    moved.send(rtp(seq, ts, 0x2222), media)
                    await asyncio.sleep(0.02)
            lasted_ms = (time.monotonic() - began) * 1000
            sip = stack.service.runtime.sip
            await wait_until(lambda: sip.live_calls() == 0, 15, "call over")
            call_id = await _sip_call_id(engine)
            await wait_until(lambda: get_recording(engine, call_id), 20, "recording stored")
            await _still_answering(stack, server)
            session = await stack.sim.wait_for_session(0)
            heard = len(session.received_events("input_audio_buffer.append"))
        finally:
            rtp_peer.close()
            moved.close()
    info = await get_recording(engine, call_id)
    assert isinstance(info, RecordingInfo)
    # The recorder's buffer: no more samples than the call lasted, plus its 1 s margin.
    assert info.duration_ms <= lasted_ms + 1000, (info.duration_ms, lasted_ms)
    assert info.bytes <= 44 + 2 * 2 * 8 * (lasted_ms + 1000)
    assert heard > 0  # the caller was heard on both streams


async def test_jumping_and_regressing_twilio_timestamps_keep_the_recording_within_the_call(
    engine: AsyncEngine,
) -> None:
    from tests.e2e_support import call_stack

    async with call_stack(engine, scenario(reply_ms=800)) as stack:
        caller = stack.caller()
        began = time.monotonic()
        await caller.dial()
        await hear_greeting(caller)
        payload = base64.b64encode(CALLER_VOICE).decode()
        stamps = ["100", "20", "4294967296000", "120", "-5", str(10**30), "9" * 4000, "140"]
        stamps += [str(5 * 3600 * 1000 + 20 * n) for n in range(20)]
        for n, stamp in enumerate(stamps):
            frame = {
                "event": "media",
                "sequenceNumber": str(10_000 + n),
                "streamSid": caller.stream_sid,
                "media": {"track": "inbound", "chunk": str(10_000 + n), "timestamp": stamp,
                          "payload": payload},
            }  # fmt: skip
            await caller.send_raw(json.dumps(frame))
            await asyncio.sleep(0.02)
        await caller.hangup()
        await stack.events(caller)
        lasted_ms = (time.monotonic() - began) * 1000
        call_id = await stack.call_id(caller)
        await wait_until(lambda: get_recording(engine, call_id), 20, "recording stored")
        async with httpx.AsyncClient(base_url=stack.service.url, timeout=2.0) as http:
            assert (await http.get("/healthz")).status_code == 200
    info = await get_recording(engine, call_id)
    assert isinstance(info, RecordingInfo)
    assert info.duration_ms <= lasted_ms + 1000, (info.duration_ms, lasted_ms)
    assert info.bytes <= 44 + 2 * 2 * 8 * (lasted_ms + 1000)


async def test_a_sprayer_on_another_host_gets_no_agent_audio_and_the_model_hears_only_the_caller(
    engine: AsyncEngine,
) -> None:
    loop = asyncio.get_running_loop()
    async with sip_stack(engine, scenario(reply_ms=800), sip_allow_from="127.0.0.1/32") as stack:
        rtp_peer = await UdpPeer.open()
        sprayed: list[bytes] = []

        class _Sprayer(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                sprayed.append(data)

        # Another host (that SIP_ALLOW_FROM refuses) that never saw the signalling.
        sprayer, _ = await loop.create_datagram_endpoint(_Sprayer, local_addr=("127.0.0.2", 0))
        sprayer_at = sprayer.get_extra_info("sockname")
        sent_by_sprayer = 0
        try:
            async with answered(stack, rtp_peer) as (_, _, server, ok):
                media = ("127.0.0.1", rtp_port_of(ok.text))

                def spray(n: int) -> None:
                    nonlocal sent_by_sprayer
                    for k in range(n):  # in sequence, as a learning attack would
                        sprayer.sendto(rtp(k, k * 160, 0xBAD, SPRAYER_VOICE), media)
                    sent_by_sprayer += n

                spray(20)  # before the caller's first packet
                session = await stack.sim.wait_for_session(0)
                seq = 0
                for _ in range(150):  # 3 s from the caller, sprayed all along
                    rtp_peer.send(rtp(seq, seq * 160, 0x1234), media)
                    seq += 1
                    spray(2)
                    await asyncio.sleep(0.02)
                await wait_until(lambda: len(rtp_peer.got) >= 100, 10, "agent RTP at the caller")
                async with httpx.AsyncClient(base_url=stack.service.url) as http:
                    metrics = (await http.get("/metrics")).text
        finally:
            rtp_peer.close()
            sprayer.close()
        sip = stack.service.runtime.sip
        await wait_until(lambda: sip.live_calls() == 0, 15, "call over")
        await stack.service.runtime.events.flush()
        appended = b"".join(
            base64.b64decode(e["audio"])
            for e in session.received_events("input_audio_buffer.append")
        )
        await _still_answering(stack, server)
    call_id = await _sip_call_id(engine)
    events = await event_rows(engine, call_id)
    to_caller = [RtpPacket.parse(d) for _, d in rtp_peer.got]
    assert sprayed == []  # not one agent packet reached the sprayer
    assert sum(p.payload != SILENCE for p in to_caller) > 0  # the caller heard the agent
    assert SPRAYER_VOICE[:1] not in appended  # the model never heard the sprayer
    assert CALLER_VOICE * 2 in appended  # …and heard the caller
    assert metric_samples(metrics)["voice_agent_sip_rtp_foreign_dropped_total"] == sent_by_sprayer
    dropped = [e["data"] for e in events if e["kind"] == "foreign_media_dropped"]
    assert dropped == [{"source": f"{sprayer_at[0]}:{sprayer_at[1]}"}]
