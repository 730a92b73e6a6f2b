"""Heard, not sent: the bridge follows each late result from its response to the caller's ear
(a scripted Realtime server over a real socket, a fake leg that plays out in real time and
confirms what was played the way Twilio's marks do)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from openai import AsyncOpenAI

from telephony.bridge import Bridge, BridgeConfig
from telephony.call_events import CallEventKind, MemorySink
from telephony.tool_gateway import AnnouncementReport, AnnouncementStatus, LateResult
from tests.test_bridge import (
    CTX,
    Call,
    FakeGateway,
    FakeLeg,
    ScriptedConnection,
    ScriptedRealtime,
    wait_until,
)

A = AnnouncementStatus


@dataclass
class Reports:
    """The call's AnnouncementSink: what the bridge said became of each late result."""

    reports: list[AnnouncementReport] = field(default_factory=list)

    def report(self, report: AnnouncementReport) -> None:
        self.reports.append(report)

    def statuses(self, operation_id: str = "op-1") -> list[AnnouncementStatus]:
        return [r.status for r in self.reports if r.operation_id == operation_id]

    def last(self, operation_id: str = "op-1") -> AnnouncementReport:
        return [r for r in self.reports if r.operation_id == operation_id][-1]


@dataclass
class AnnouncingCall:
    call: Call
    reports: Reports

    @property
    def bridge(self) -> Bridge:
        return self.call.bridge


@pytest.fixture
async def make_call() -> AsyncIterator[Callable[..., Awaitable[AnnouncingCall]]]:
    started: list[AnnouncingCall] = []
    servers: list[ScriptedRealtime] = []

    async def make(**config: Any) -> AnnouncingCall:
        log: list[tuple[str, Any]] = []
        server = ScriptedRealtime(log)
        await server.start()
        servers.append(server)
        leg = FakeLeg(log)
        sink = MemorySink()
        gateway = FakeGateway()
        reports = Reports()
        client = AsyncOpenAI(api_key="test-key", base_url=server.base_url)
        settings = {"greeting": False, "reconnect_budget_s": 2.0, **config}
        bridge = Bridge(
            leg, CTX, gateway, sink, BridgeConfig(**settings), client, announcements=reports
        )
        run = asyncio.create_task(bridge.run())
        call = AnnouncingCall(Call(bridge, leg, server, sink, gateway, log, run, []), reports)
        started.append(call)
        return call

    yield make
    for c in started:
        if not c.call.run.done():
            await c.bridge.end("test over")
        await asyncio.wait_for(c.call.run, 5)
        await c.call.leg.close("test over")
    for server in servers:
        await server.stop()


RESULT = LateResult("op-1", "Your table at 21:00 is booked.", delivery_id="d-1")


async def _announce(c: AnnouncingCall, conn: ScriptedConnection, response_id: str, ms: int) -> None:
    """The server answers our create with a response carrying `ms` of audio."""
    await conn.wait_for("response.create")
    await conn.response_created(response_id)
    await wait_until(
        lambda: any(r.response_id == response_id for r in c.reports.reports), 5, "spoken"
    )
    await conn.audio(response_id, f"item_{response_id}", ms)


async def test_an_outcome_while_the_caller_speaks_is_held_then_spoken_then_heard(make_call):
    c = await make_call()
    conn = await c.call.server.connection()
    await c.call.event(CallEventKind.REALTIME_CONNECTED)
    await conn.speech_started("item_user_1")
    await c.call.event(CallEventKind.SPEECH_STARTED)
    assert await c.bridge.deliver_result(RESULT)
    assert c.reports.statuses() == [A.HELD]
    assert c.reports.last().reason == "the caller is speaking"
    assert not conn.of_type("response.create")  # never over the caller
    await conn.speech_stopped("item_user_1")
    # The server's own answer to the caller comes first, then ours.
    await conn.response_created("resp_server")
    await conn.audio("resp_server", "item_server", 200)
    await conn.response_done("resp_server")
    await _announce(c, conn, "resp_late", 400)
    assert c.reports.statuses() == [A.HELD, A.SPOKEN]
    assert c.reports.last().response_id == "resp_late"
    await conn.response_done("resp_late")
    assert A.HEARD not in c.reports.statuses()  # handed over is not heard
    await wait_until(lambda: A.HEARD in c.reports.statuses(), 5, "heard")
    heard = c.reports.last()
    assert heard.audio_ms == 400 and heard.heard_ms == 400 and heard.delivery_id == "d-1"
    # The leg had confirmed every millisecond of it before it counted as heard.
    assert c.call.leg.playback.confirmed_ms("item_resp_late") == 400
    kinds = [e.kind for e in c.call.sink.events]
    assert kinds.index(CallEventKind.RESULT_HELD) < kinds.index(CallEventKind.RESULT_ANNOUNCED)
    assert kinds.index(CallEventKind.RESULT_ANNOUNCED) < kinds.index(CallEventKind.RESULT_HEARD)


async def test_an_announcement_cut_by_a_barge_in_is_reported_cut_not_heard(make_call):
    c = await make_call()
    conn = await c.call.server.connection()
    await c.call.event(CallEventKind.REALTIME_CONNECTED)
    assert await c.bridge.deliver_result(RESULT)
    await _announce(c, conn, "resp_late", 2000)
    await wait_until(lambda: c.call.leg.playback.confirmed_ms("item_resp_late") >= 300, 5, "play")
    await conn.speech_started("item_user_2")
    await wait_until(lambda: A.CUT in c.reports.statuses(), 5, "cut")
    cut = c.reports.last()
    assert 300 <= cut.heard_ms < 2000 and cut.audio_ms == 2000
    assert cut.reason == "barge-in"
    await conn.response_done("resp_late", status="cancelled")
    assert c.reports.statuses() == [A.SPOKEN, A.CUT]  # reported once, never heard


async def test_a_response_that_ends_without_completing_is_not_heard(make_call):
    c = await make_call()
    conn = await c.call.server.connection()
    await c.call.event(CallEventKind.REALTIME_CONNECTED)
    assert await c.bridge.deliver_result(RESULT)
    await _announce(c, conn, "resp_late", 200)
    await conn.response_done("resp_late", status="incomplete")
    await wait_until(lambda: len(c.reports.statuses()) == 2, 5, "resolved")
    assert c.reports.statuses() == [A.SPOKEN, A.CUT]
    assert c.reports.last().reason == "response incomplete"


async def test_an_outcome_still_queued_when_the_call_ends_is_reported_not_spoken(make_call):
    c = await make_call()
    conn = await c.call.server.connection()
    await c.call.event(CallEventKind.REALTIME_CONNECTED)
    await conn.response_created("resp_busy")
    await c.call.event(CallEventKind.RESPONSE_CREATED)
    assert await c.bridge.deliver_result(RESULT)
    assert c.reports.statuses() == [A.HELD]
    assert c.reports.last().reason == "a response is under way"
    await c.call.hang_up()
    assert c.reports.statuses() == [A.HELD, A.NOT_SPOKEN]
    assert c.reports.last().reason.startswith("call ended")


async def test_hanging_up_mid_announcement_is_cut_at_what_was_played(make_call):
    c = await make_call()
    conn = await c.call.server.connection()
    await c.call.event(CallEventKind.REALTIME_CONNECTED)
    assert await c.bridge.deliver_result(RESULT)
    await _announce(c, conn, "resp_late", 2000)
    await wait_until(lambda: c.call.leg.playback.confirmed_ms("item_resp_late") >= 200, 5, "play")
    await c.call.hang_up()
    cut = c.reports.last()
    assert cut.status is A.CUT and 200 <= cut.heard_ms < 2000


async def test_a_dropped_session_offers_a_queued_announcement_again_to_the_next(make_call):
    c = await make_call()
    conn = await c.call.server.connection()
    await c.call.event(CallEventKind.REALTIME_CONNECTED)
    await conn.response_created("resp_busy")
    await c.call.event(CallEventKind.RESPONSE_CREATED)
    assert await c.bridge.deliver_result(RESULT)
    await conn.ws.close()  # the Realtime socket drops before our turn came
    again = await c.call.server.connection(1)
    note = await again.wait_for("conversation.item.create")
    assert "21:00 is booked" in note["item"]["content"][0]["text"]
    await _announce(c, again, "resp_new", 200)
    await again.response_done("resp_new")
    await wait_until(lambda: A.HEARD in c.reports.statuses(), 5, "heard after reconnect")
    assert c.reports.statuses()[-2:] == [A.SPOKEN, A.HEARD]


async def test_the_same_delivery_offered_twice_while_queued_is_said_once(make_call):
    c = await make_call()
    conn = await c.call.server.connection()
    await c.call.event(CallEventKind.REALTIME_CONNECTED)
    await conn.response_created("resp_busy")
    await c.call.event(CallEventKind.RESPONSE_CREATED)
    assert await c.bridge.deliver_result(RESULT)
    again = LateResult("op-1", "Your table at 21:00 is booked.", delivery_id="d-1")
    assert await c.bridge.deliver_result(again)  # taken back and offered again meanwhile
    await conn.response_done("resp_busy")
    await _announce(c, conn, "resp_late", 200)
    await conn.response_done("resp_late")
    await wait_until(lambda: A.HEARD in c.reports.statuses(), 5, "heard")
    assert len(conn.of_type("conversation.item.create")) == 1
    assert c.reports.statuses() == [A.HELD, A.SPOKEN, A.HEARD]
