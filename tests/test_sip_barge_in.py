"""Barge-in on a SIP call, heard from the caller's side of the RTP stream."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiortc.rtp import RtpPacket
from aiosipua import SipMessage, SipResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.simulator import synthesize_speech
from tests.e2e_support import event_rows, wait_until
from tests.sip_support import Uac, sdp_offer
from tests.sipp_support import sip_stack

SILENCE = b"\xff" * 160


@dataclass
class Heard:
    """One RTP packet the caller received."""

    at: float
    packet: RtpPacket

    @property
    def agent(self) -> bool:
        return self.packet.payload != SILENCE


@dataclass
class Caller(asyncio.DatagramProtocol):
    """A UDP socket of the test caller, keeping what arrives."""

    got: list[tuple[float, bytes]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.got.append((asyncio.get_running_loop().time(), data))
        self.arrived.set()


async def _socket(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.DatagramTransport, Caller, int]:
    transport, protocol = await loop.create_datagram_endpoint(Caller, local_addr=("127.0.0.1", 0))
    return transport, protocol, int(transport.get_extra_info("sockname")[1])


async def _response(sip: Caller, status: int, start: int = 0) -> SipResponse:
    async with asyncio.timeout(10):
        while True:
            for _, data in sip.got[start:]:
                msg = SipMessage.parse(data)
                if isinstance(msg, SipResponse) and msg.status_code == status:
                    return msg
            sip.arrived.clear()
            await sip.arrived.wait()


async def test_barge_in_stops_agent_rtp_within_a_packet_and_truncates_at_what_was_sent(
    engine: AsyncEngine,
) -> None:
    loop = asyncio.get_running_loop()
    async with sip_stack(engine) as stack:
        sip_port = stack.service.runtime.sip.port
        sip_t, sip_in, my_sip = await _socket(loop)
        rtp_t, rtp_in, my_rtp = await _socket(loop)
        uac = Uac(port=my_sip)
        server = ("127.0.0.1", sip_port)
        try:
            sip_t.sendto(uac.invite(sdp_offer(port=my_rtp, formats="0 101")), server)
            ok = await _response(sip_in, 200)
            uac.learn(ok)
            sip_t.sendto(uac.ack(), server)

            heard: list[Heard] = []

            def agent_frames() -> int:
                heard[:] = [Heard(at, RtpPacket.parse(d)) for at, d in rtp_in.got]
                return sum(h.agent for h in heard)

            # The caller listens (sending silence, as phones do) until 600 ms of the greeting
            # played, then talks over it for a second.
            speech = synthesize_speech(1000, 3, "pcmu")
            session = await stack.sim.wait_for_session(0)
            send = _rtp_sender(rtp_t, ok)

            while agent_frames() < 30:
                await send(SILENCE)
            for offset in range(0, len(speech), 160):
                await send(speech[offset : offset + 160])
            truncate = await session.wait_for_received("conversation.item.truncate", within=10)
            # Silence until the simulator's VAD ends the caller's turn (500 ms of it).
            for _ in range(200):
                if session.sent_events("input_audio_buffer.speech_stopped"):
                    break
                await send(SILENCE)
            stopped = session.sent_events("input_audio_buffer.speech_stopped")[0]
            for _ in range(10):
                await send(SILENCE)
            agent_frames()
            sip_t.sendto(uac.bye(), server)
            await _response(sip_in, 200, start=len(sip_in.got))
        finally:
            sip_t.close()
            rtp_t.close()
        sip = stack.service.runtime.sip
        await wait_until(lambda: sip.live_calls() == 0, 10, "call over")
        await stack.service.runtime.events.flush()
    rows = await _call_events(engine)
    barge = next(r for r in rows if r["kind"] == "barge_in")
    barge_at = barge["mono_ns"] / 1e9
    stopped_at = next(t for t, e in session.sent if e is stopped)
    # After the barge-in, not one more frame of agent audio until the caller stopped talking.
    late = [h for h in heard if barge_at + 0.02 < h.at < stopped_at and h.agent]
    assert late == []
    # The truncate is at exactly the audio the caller received of the greeting.
    before = [h for h in heard if h.at <= barge_at + 0.02]
    assert truncate["audio_end_ms"] == 20 * sum(h.agent for h in before)
    assert barge["data"]["audio_end_ms"] == truncate["audio_end_ms"]
    # One stream throughout: same SSRC, no sequence gap, timestamps 20 ms apart.
    packets = [h.packet for h in heard]
    assert len({p.ssrc for p in packets}) == 1
    for a, b in itertools.pairwise(packets):
        assert (b.sequence_number - a.sequence_number) & 0xFFFF == 1
        assert (b.timestamp - a.timestamp) & 0xFFFFFFFF == 160


def _rtp_sender(
    transport: asyncio.DatagramTransport, ok: SipResponse
) -> Callable[[bytes], Awaitable[None]]:
    """Sends one 20 ms caller frame to the service's RTP port (as a phone would: paced)."""
    seq = itertools.count(1)

    async def send(payload: bytes) -> None:
        n = next(seq)
        packet = RtpPacket(0, 0, n & 0xFFFF, n * 160, 0x1234, payload)
        transport.sendto(packet.serialize(), ("127.0.0.1", _their_rtp_port(ok)))
        await asyncio.sleep(0.02)

    return send


def _their_rtp_port(ok: SipResponse) -> int:
    for line in ok.text.splitlines():
        if line.startswith("m=audio "):
            return int(line.split()[1])
    raise AssertionError("no m=audio in the answer")


async def _call_events(engine: AsyncEngine) -> list[dict[str, object]]:
    import sqlalchemy as sa

    async with engine.connect() as conn:
        call_id = (
            await conn.execute(sa.text("SELECT id FROM calls WHERE leg = 'sip'"))
        ).scalar_one()
    return await event_rows(engine, call_id)


async def test_on_gpt_live_a_sip_caller_cutting_in_flushes_our_rtp_and_counts_what_was_sent(
    engine: AsyncEngine,
) -> None:
    """Our own SIP leg on GPT-Live: G.711 straight through (`session.start` names PCMU at 8 kHz),
    the model stops talking over the caller by itself, and the leg flushes what it queued;
    what counts as heard is what left in RTP, never a truncate (Live has none)."""
    from telephony.sim.scenario import Scenario

    scenario = Scenario.model_validate(
        {
            "greeting": {"text": "Welcome to a long list of tonight's specials.", "audio_ms": 8000},
            "steps": [{"caller_transcript": "Just a table, please.", "reply": "Sure."}],
        }
    )
    loop = asyncio.get_running_loop()
    async with sip_stack(engine, scenario, model_api="live") as stack:
        sip_t, sip_in, my_sip = await _socket(loop)
        rtp_t, rtp_in, my_rtp = await _socket(loop)
        uac = Uac(port=my_sip)
        server = ("127.0.0.1", stack.service.runtime.sip.port)
        heard: list[Heard] = []

        def agent_frames() -> int:
            heard[:] = [Heard(at, RtpPacket.parse(d)) for at, d in rtp_in.got]
            return sum(h.agent for h in heard)

        try:
            sip_t.sendto(uac.invite(sdp_offer(port=my_rtp, formats="0 101")), server)
            ok = await _response(sip_in, 200)
            uac.learn(ok)
            sip_t.sendto(uac.ack(), server)
            live = await stack.sim.wait_for_live_session()
            send = _rtp_sender(rtp_t, ok)

            while agent_frames() < 30:
                await send(SILENCE)
            speech = synthesize_speech(1000, 3, "pcmu")
            for offset in range(0, len(speech), 160):
                await send(speech[offset : offset + 160])
            for _ in range(40):
                await send(SILENCE)
            await live.wait_for_sent("session.output_transcript.delta", count=2, within=10)
            agent_frames()
            sip_t.sendto(uac.bye(), server)
            await _response(sip_in, 200, start=len(sip_in.got))
        finally:
            sip_t.close()
            rtp_t.close()
        sip = stack.service.runtime.sip
        await wait_until(lambda: sip.live_calls() == 0, 10, "call over")
        await stack.service.runtime.events.flush()
    rows = await _call_events(engine)
    start = next(e for _, e in live.received if e["type"] == "session.start")
    assert start["session"]["audio"]["format"] == {"type": "audio/pcmu", "rate": 8000}
    assert live.interruptions == 1 and live.refused == []
    assert {e["type"] for _, e in live.received} == {"session.start", "session.input_audio.append"}
    barge = next(r for r in rows if r["kind"] == "barge_in")
    assert barge["data"]["truncated"] is False
    greeting = next(r["data"] for r in rows if r["kind"] == "agent_transcript")
    barge_at = barge["mono_ns"] / 1e9
    sent_before = sum(h.agent for h in heard if h.at <= barge_at + 0.02)
    # Cut where the caller stopped hearing it: what left in RTP, not the 8 s generated.
    assert greeting["cut"] is True
    assert 600 <= greeting["heard_ms"] < 8000
    assert abs(greeting["heard_ms"] - 20 * sent_before) <= 40, (greeting, sent_before)
    # The greeting's queued rest never went out: not one agent frame while the caller talks.
    late = [h for h in heard if h.agent and barge_at + 0.04 < h.at < barge_at + 0.5]
    assert late == []
