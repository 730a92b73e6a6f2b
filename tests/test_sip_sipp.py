"""The SIP listener judged by the real sipp, with the Realtime simulator behind the bridge."""

from __future__ import annotations

import asyncio
import itertools
import socket
from pathlib import Path

import pytest
from aiortc.rtp import RtpPacket
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.legs.sip.dialog import CallState
from telephony.sim.simulator import synthesize_speech
from tests.e2e_support import Stack, call_row, event_rows, wait_until
from tests.sip_support import Uac, UdpPeer
from tests.sipp_support import (
    RecordingGateway,
    count_in_trace,
    free_udp_port,
    needs_sipp,
    pcap_dir,
    run_sipp,
    sip_stack,
    write_rtp_pcap,
)

pytestmark = needs_sipp


def speech_pcap(tmp: Path) -> None:
    """2 s of speech-like PCMU, then 1 s of silence: one turn for the simulator's VAD."""
    audio = synthesize_speech(2000, 7, "pcmu") + b"\xff" * 8000
    write_rtp_pcap(tmp / "pcmu.pcap", audio, 0)


async def settled(stack: Stack) -> None:
    """Every SIP call of the service is over and its events are written."""
    sip = stack.service.runtime.sip
    await wait_until(lambda: sip.live_calls() == 0, 15, "SIP calls over")
    await wait_until(lambda: sip.core.footprint()["calls"] == 0, 15, "core calls gone")
    await stack.service.runtime.events.flush()


async def sip_rows(engine: AsyncEngine) -> list[dict[str, object]]:
    import sqlalchemy as sa

    async with engine.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT * FROM calls WHERE leg = 'sip'"))).mappings()
        return [dict(r) for r in rows.all()]


async def test_sipp_uac_pcap_call_reaches_the_model_as_pcma_and_its_digit_the_tool_layer(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    (tmp_path / "pcap").symlink_to(pcap_dir())
    gateway = RecordingGateway()
    async with sip_stack(engine, gateway=gateway) as stack:
        sip = stack.service.runtime.sip
        run = await run_sipp(sip.port, "uac_pcap", tmp_path, timeout_s=40)
        assert run.returncode == 0, run.explain()
        session = await stack.sim.wait_for_session(0)
        assert session.input_format == "audio/pcma" and session.output_format == "audio/pcma"
        assert session.received_events("input_audio_buffer.append")
        await wait_until(lambda: gateway.digits, 10, "digit at the tool layer")
        assert [d for _, d in gateway.digits] == ["1"]
        await settled(stack)
        row = await call_row(engine, gateway.digits[0][0])
        assert row is not None and row["leg"] == "sip" and row["status"] == "completed"
        events = await event_rows(engine, row["id"])
        kinds = [r["kind"] for r in events]
        assert kinds.count("dtmf") == 1 and kinds[-1] == "call_ended"
        # The caller's media as received, as an RTCP receiver report would put it.
        media = events[-1]["data"]["media"]
        assert media["packets_received"] > 100 and media["packets_expected"] >= 100
        assert media["packets_lost"] == 0 and media["loss_ratio"] == 0.0, media
        assert 0 <= media["jitter_ms"] < 40, media
        assert media["rtcp_sent"] >= 1  # our reports went out during the call


@pytest.mark.parametrize("transport", ["u1", "t1"])
async def test_a_pcmu_call_is_answered_in_pcmu_and_its_speech_gets_an_answer(
    engine: AsyncEngine, tmp_path: Path, transport: str
) -> None:
    speech_pcap(tmp_path)
    async with sip_stack(engine) as stack:
        sip = stack.service.runtime.sip
        run = await run_sipp(
            sip.port, "pcmu_call.xml", tmp_path, transport=transport, extra=["-trace_msg"]
        )
        assert run.returncode == 0, run.explain()
        session = await stack.sim.wait_for_session(0)
        assert session.input_format == "audio/pcmu" and session.output_format == "audio/pcmu"
        # The caller's speech was heard as a turn, and the agent answered it.
        assert session.sent_events("input_audio_buffer.speech_started")
        assert len(session.sent_events("response.created")) >= 2  # greeting, then the reply
        if transport == "t1":
            assert count_in_trace(tmp_path, "Contact: <sip:voice-agent@127.0.0.1:") >= 1
            assert count_in_trace(tmp_path, "transport=tcp", anywhere=True) >= 1
        await settled(stack)
        (row,) = await sip_rows(engine)
        assert row["status"] == "completed" and row["end_reason"]


async def test_cancel_before_the_answer_gets_487_and_no_call_goes_live(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine) as stack:
        stack.sim.fail_next_connects(1000)  # the session never opens: only CANCEL can end it
        sip = stack.service.runtime.sip
        run = await run_sipp(sip.port, "cancel.xml", tmp_path, extra=["-trace_msg"])
        assert run.returncode == 0, run.explain()
        assert count_in_trace(tmp_path, "SIP/2.0 487") == 1  # once: our ACK stopped timer G
        assert count_in_trace(tmp_path, "SIP/2.0 200") == 1  # the CANCEL's, never the INVITE's
        await settled(stack)
        (row,) = await sip_rows(engine)
        assert row["status"] == "canceled"
        assert stack.service.runtime.registry.live_count() == 0


async def test_an_invite_retransmitted_before_and_after_the_200_makes_one_call(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine) as stack:
        stack.sim.fail_next_connects(2)  # the answer takes a moment: the resend comes before it
        sip = stack.service.runtime.sip
        run = await run_sipp(sip.port, "invite_retransmit.xml", tmp_path)
        assert run.returncode == 0, run.explain()
        await settled(stack)
        rows = await sip_rows(engine)
        assert len(rows) == 1 and rows[0]["status"] == "completed"
        assert len(stack.sim.sessions) == 1
        assert sip.core.stats.offered == 1


async def test_no_ack_gets_the_200_again_and_again_then_a_bye(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine, sip_t1_s=0.1) as stack:  # 64*T1 = 6.4 s
        sip = stack.service.runtime.sip
        run = await run_sipp(sip.port, "no_ack.xml", tmp_path, extra=["-trace_msg"])
        assert run.returncode == 0, run.explain()
        # 200 at 0, then T1, 2T1, 4T1 ... capped at T2: at least 4 copies within 6.4 s.
        assert count_in_trace(tmp_path, "SIP/2.0 200 OK") >= 4
        assert count_in_trace(tmp_path, "BYE sip:") == 1
        await settled(stack)
        (row,) = await sip_rows(engine)
        assert row["status"] == "completed" and "no ACK" in (row["end_reason"] or "")


async def test_options_is_answered_200_with_what_we_allow(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine) as stack:
        run = await run_sipp(stack.service.runtime.sip.port, "options.xml", tmp_path)
        assert run.returncode == 0, run.explain()


async def test_hold_is_answered_recvonly_and_resume_moves_our_rtp_to_the_new_port(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    resume_port = free_udp_port()
    seen: list[RtpPacket] = []

    class Catch(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            seen.append(RtpPacket.parse(data))

    loop = asyncio.get_running_loop()
    catcher, _ = await loop.create_datagram_endpoint(
        Catch, local_addr=("127.0.0.1", resume_port), family=socket.AF_INET
    )
    try:
        async with sip_stack(engine) as stack:
            sip = stack.service.runtime.sip
            run = await run_sipp(
                sip.port,
                "hold_resume.xml",
                tmp_path,
                extra=["-key", "resume_port", str(resume_port)],
            )
            assert run.returncode == 0, run.explain()
            await settled(stack)
    finally:
        catcher.close()
    # After the resume our RTP went to the new port, one stream: same SSRC, no sequence gap.
    assert len(seen) >= 25
    assert len({p.ssrc for p in seen}) == 1
    seqs = [p.sequence_number for p in seen]
    assert all((b - a) & 0xFFFF == 1 for a, b in itertools.pairwise(seqs))


@pytest.mark.parametrize("ender", ["staff", "shutdown"])
async def test_ending_the_call_from_our_side_sends_a_bye(
    engine: AsyncEngine, tmp_path: Path, ender: str
) -> None:
    async with sip_stack(engine) as stack:
        sip = stack.service.runtime.sip
        runtime = stack.service.runtime
        sipp = asyncio.create_task(run_sipp(sip.port, "bye_by_us.xml", tmp_path))
        # Answered and acknowledged; then the staff (as a tool would) or a drain ends it.
        await wait_until(
            lambda: [sip.core.call_state(k) for k in sip._calls] == [CallState.CONFIRMED],
            15,
            "call confirmed",
        )
        if ender == "staff":
            (call_id,) = [entry.call_sid for entry in runtime.registry._live.values()]
            await runtime.registry.end(call_id, "ended by staff")
            run = await sipp
            await settled(stack)
    if ender == "shutdown":
        run = await sipp
    assert run.returncode == 0, run.explain()
    (row,) = await sip_rows(engine)
    reason = "ended by staff" if ender == "staff" else "server shutdown"
    assert row["status"] == "completed" and row["end_reason"] == reason


async def test_digest_auth_challenges_and_admits_the_right_password(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine, sip_digest_users="alice:s3cret") as stack:
        sip = stack.service.runtime.sip
        run = await run_sipp(sip.port, "digest.xml", tmp_path, timeout_s=10, extra=["-trace_msg"])
        assert run.returncode == 0, run.explain()
        await settled(stack)
        (row,) = await sip_rows(engine)
        assert row["status"] == "completed"


async def test_beyond_sip_max_calls_an_invite_gets_503(engine: AsyncEngine, tmp_path: Path) -> None:
    async with sip_stack(engine, sip_max_calls=2) as stack:
        sip = stack.service.runtime.sip
        run = await run_sipp(
            sip.port, "cap.xml", tmp_path, calls=3, limit=3, rate=20, extra=["-trace_msg"]
        )
        assert run.returncode == 0, run.explain()
        assert count_in_trace(tmp_path, "SIP/2.0 503") >= 1
        assert sip.core.stats.overloaded == 1
        await settled(stack)
        rows = await sip_rows(engine)
        assert sorted(r["status"] for r in rows) == ["completed", "completed"]


async def test_beyond_max_live_calls_of_the_process_an_invite_gets_486_and_a_busy_row(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine, max_live_calls=2, sip_max_calls=5) as stack:
        sip = stack.service.runtime.sip
        run = await run_sipp(
            sip.port, "cap.xml", tmp_path, calls=3, limit=3, rate=20, extra=["-trace_msg"]
        )
        assert run.returncode == 0, run.explain()
        assert count_in_trace(tmp_path, "SIP/2.0 486") >= 1
        await settled(stack)
        rows = await sip_rows(engine)
        assert sorted(r["status"] for r in rows) == ["busy", "completed", "completed"]


async def test_while_overloaded_options_get_503_and_an_invite_486_then_200_again(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine) as stack:
        registry = stack.service.runtime.registry
        sip = stack.service.runtime.sip
        registry.overloaded = lambda: 0.25  # the loop watch's verdict (BUSY_LOOP_LAG_MS)
        peer = await UdpPeer.open()
        try:
            peer.send(Uac(port=peer.port).options(), ("127.0.0.1", sip.port))
            probe = await peer.response(503, within=5.0)
            assert probe.headers.get_first("retry-after") == "5"
            run = await run_sipp(
                sip.port, "cap.xml", tmp_path, calls=1, limit=1, extra=["-trace_msg"]
            )
            assert run.returncode == 0, run.explain()
            assert count_in_trace(tmp_path, "SIP/2.0 486") >= 1
            registry.overloaded = lambda: None  # keeping up again
            peer.send(Uac(port=peer.port).options(), ("127.0.0.1", sip.port))
            await peer.response(200, within=5.0)
        finally:
            peer.close()
        await settled(stack)
        (row,) = await sip_rows(engine)
        assert row["status"] == "busy"
        assert registry.rejected_overloaded_total == 1


async def test_while_draining_an_invite_gets_503_with_retry_after_and_a_draining_row(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    import sqlalchemy as sa

    async with sip_stack(engine) as stack:
        stack.service.runtime.registry.stop_accepting()  # what SIGTERM does first
        sip = stack.service.runtime.sip
        # A dispatcher's health probe hears it too, and takes this replica out.
        peer = await UdpPeer.open()
        try:
            peer.send(Uac(port=peer.port).options(), ("127.0.0.1", sip.port))
            probe = await peer.response(503, within=5.0)
            assert probe.headers.get_first("retry-after") == "5"
        finally:
            peer.close()
        run = await run_sipp(sip.port, "cap.xml", tmp_path, calls=1, limit=1, extra=["-trace_msg"])
        assert run.returncode == 0, run.explain()
        # Every copy of the INVITE gets the 503: sipp resends the INVITE when the answer
        # takes over 500 ms (a loaded machine), and the server transaction answers each
        # retransmission with its final response again (RFC 3261 17.2.1).
        invites = count_in_trace(tmp_path, "INVITE sip:")
        assert invites >= 1
        assert count_in_trace(tmp_path, "SIP/2.0 503") >= invites
        assert count_in_trace(tmp_path, "SIP/2.0 486") == 0
        assert count_in_trace(tmp_path, "Retry-After:") >= 1
        await settled(stack)
        (row,) = await sip_rows(engine)
        assert row["status"] == "busy"
        async with engine.connect() as conn:
            reasons = (
                (
                    await conn.execute(
                        sa.text(
                            "SELECT data->>'reason' FROM call_events "
                            "WHERE call_id = :c AND kind = 'call_rejected'"
                        ),
                        {"c": row["id"]},
                    )
                )
                .scalars()
                .all()
            )
        assert reasons == ["draining"]


async def test_twenty_concurrent_calls_all_complete(engine: AsyncEngine, tmp_path: Path) -> None:
    speech_pcap(tmp_path)
    async with sip_stack(engine, sip_rate_per_source=50) as stack:
        sip = stack.service.runtime.sip
        run = await run_sipp(
            sip.port, "pcmu_call.xml", tmp_path, calls=20, limit=20, rate=20, timeout_s=90
        )
        assert run.returncode == 0, run.explain()
        await settled(stack)
        rows = await sip_rows(engine)
        assert len(rows) == 20 and {r["status"] for r in rows} == {"completed"}
        assert len(stack.sim.sessions) == 20
