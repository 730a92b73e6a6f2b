"""Our SIP UAC (telephony/legs/sip/uac.py) against sipp over real UDP: an answered call hung
up by the far end, 486, a digest challenge answered once, and a ring timeout's CANCEL."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiosipua import SipDigestAuth

from telephony.legs.sip.sdp import LocalMedia
from telephony.legs.sip.timers import TimerConfig
from telephony.legs.sip.transport import SipTransport
from telephony.legs.sip.uac import OutgoingAnswered, OutgoingFailed, OutgoingProgress, outcome_of
from telephony.legs.sip.uas import CallEnded, SipEvent, UasConfig, UserAgentServer
from tests.sipp_support import needs_sipp
from tests.sipp_uas import sipp_uas

pytestmark = needs_sipp


class Agent:
    """Our core on a real UDP socket, recording its events."""

    def __init__(self) -> None:
        self.core = UserAgentServer(UasConfig(host="127.0.0.1", port=0, timers=TimerConfig(t1=0.1)))
        self.events: list[SipEvent] = []
        self.changed = asyncio.Event()
        self.transport = SipTransport(self.core, "127.0.0.1", 0, self._on_event)

    def _on_event(self, event: SipEvent) -> None:
        self.events.append(event)
        self.changed.set()

    async def until(self, kind: type, timeout_s: float = 10.0) -> SipEvent:
        async with asyncio.timeout(timeout_s):
            while True:
                for event in self.events:
                    if isinstance(event, kind):
                        return event
                self.changed.clear()
                await self.changed.wait()

    def invite(self, port: int, **kw: object) -> object:
        local = LocalMedia("127.0.0.1", 40000, random.randint(1, 2**31))
        uri = f"sip:far@127.0.0.1:{port}"
        return self.transport.act(lambda now: self.core.invite(uri, local, now, **kw))  # type: ignore[arg-type]


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    a = Agent()
    assert asyncio.get_running_loop()
    _, port = await a.transport.start()
    a.core.config = replace(a.core.config, port=port)
    yield a
    await a.transport.stop()


def _rtp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_answered_call_is_acked_and_their_bye_ends_it(agent: Agent, tmp_path: Path) -> None:
    rtp = _rtp_port()
    async with sipp_uas("uac_answer.xml", tmp_path, rtp_port=rtp) as far:
        agent.invite(far.port)
        ringing = await agent.until(OutgoingProgress)
        answered = await agent.until(OutgoingAnswered)
        ended = await agent.until(CallEnded)
        run = await far.finish()
    assert run.returncode == 0, run.explain()
    assert isinstance(ringing, OutgoingProgress) and ringing.status == 180
    assert isinstance(answered, OutgoingAnswered)
    assert answered.remote.address == ("127.0.0.1", rtp)
    assert isinstance(ended, CallEnded) and ended.reason == "bye"
    seen = far.seen()
    ack = seen[seen.index("ACK sip:") :]
    # The ACK of the 2xx goes to the Contact, through the route set (the Record-Route).
    assert ack.startswith("ACK sip:far@127.0.0.1:")
    assert "Route: <sip:127.0.0.1:" in ack.split("\n\n")[0]
    assert agent.core.footprint()["calls"] == 0


async def test_busy_is_acked_and_reported(agent: Agent, tmp_path: Path) -> None:
    async with sipp_uas("uac_busy.xml", tmp_path) as far:
        agent.invite(far.port)
        failed = await agent.until(OutgoingFailed)
        run = await far.finish()
    assert run.returncode == 0, run.explain()
    assert isinstance(failed, OutgoingFailed) and failed.status == 486
    assert outcome_of(failed.status) == "busy"
    assert agent.core.footprint()["calls"] == 0


async def test_digest_challenge_answered_once_with_credentials(
    agent: Agent, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    password = "s3cret-Pa55"
    rtp = _rtp_port()
    async with sipp_uas(
        "uac_digest.xml", tmp_path, rtp_port=rtp, auth_user="alice", auth_password=password
    ) as far:
        key = agent.invite(far.port, credentials=SipDigestAuth("alice", password))
        await agent.until(OutgoingAnswered)
        # We end it: BYE, which sipp waits for.
        agent.transport.act(lambda now: agent.core.hangup(key, now, "done"))  # type: ignore[arg-type]
        run = await far.finish()
    assert run.returncode == 0, run.explain()  # sipp's verifyauth accepted our Authorization
    seen = far.seen()
    invites = [m for m in seen.split("INVITE sip:")[1:]]
    assert len(invites) == 2
    assert "Authorization: Digest" not in invites[0]
    assert 'Authorization: Digest username="alice"' in invites[1]
    assert 'realm="far.example"' in invites[1] and "qop=auth" in invites[1]
    assert "BYE sip:far@" in seen
    assert password not in caplog.text


async def test_ring_timeout_cancels_and_the_487_is_acked(agent: Agent, tmp_path: Path) -> None:
    async with sipp_uas("uac_cancel.xml", tmp_path) as far:
        agent.invite(far.port, ring_timeout_s=1.0)
        failed = await agent.until(OutgoingFailed)
        run = await far.finish()
    assert run.returncode == 0, run.explain()
    assert isinstance(failed, OutgoingFailed) and failed.status == 487
    assert failed.reason.startswith("ring timeout")
    assert outcome_of(failed.status) == "no_answer"
    seen = far.seen()
    assert "CANCEL sip:far@" in seen
    assert agent.core.footprint()["calls"] == 0
