"""Agent handoffs end to end over real sockets: fake caller -> service -> Realtime simulator,
with the restaurant's system of record and its agents file (a host and a manager).

The host admits a booking; the caller asks for the manager while the booking is still at the
system of record; the session goes on with the manager's instructions and tools (one
`session.update`, of the SDK's own shape), the manager is told the conversation and the booking
still open, and the timeline shows the handoff. What becomes of the booking that commits after
the handoff is the race `handoff_before_async_tool_completes` (tests/races/).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import yaml
from openai.types.realtime import SessionUpdateEvent
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.domains import RestaurantBackend
from tests.e2e_support import CONSOLE, wait_until
from tests.handoff_support import (
    AGENTS,
    CONTROL,
    hand_off_while_booking,
    handoff_stack,
    session_updates,
)
from tests.sor_support import start_sor
from tests.test_e2e_booking import wait_for_delivery, wait_for_operation
from tools.restaurant.sor import SystemOfRecord


@pytest.fixture
async def sor(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    sor = await start_sor(clean_db)
    try:
        yield sor
    finally:
        await sor.stop()


async def test_a_handoff_updates_the_session_with_the_new_agents_instructions_and_tools(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    backend = RestaurantBackend(sor)
    async with handoff_stack(engine, clean_db, sor, AGENTS) as stack:
        caller, call_id = await hand_off_while_booking(stack, backend)
        backend.release()
        op = await wait_for_operation(engine, call_id, "committed")
        await wait_for_delivery(engine, op["operation_id"], "heard")
        await caller.hangup()
        events = await stack.events(caller)
        async with httpx.AsyncClient(base_url=stack.service.url) as http:
            response = await http.get(f"/api/calls/{call_id}/timeline", auth=CONSOLE)
        updates = session_updates(stack)
        errors = stack.sim.sessions[-1].sent_events("error")
        notes = [
            e["item"]["content"][0]["text"]
            for e in stack.sim.sessions[-1].received_events("conversation.item.create")
            if e["item"].get("type") == "message"
        ]
    manager = yaml.safe_load(AGENTS.read_text())["agents"][1]
    first, handoff = updates[0], updates[-1]
    # Every session.update is a valid client event of the SDK's own types.
    for update in updates:
        SessionUpdateEvent.model_validate(update)
    # The call starts with the host, and goes on with the manager on the same session.
    assert {t["name"] for t in first["session"]["tools"]} == {
        "check_availability", "book_table", "get_booking", *CONTROL,
    }  # fmt: skip
    assert {t["name"] for t in handoff["session"]["tools"]} == {*manager["tools"], *CONTROL}
    # Each agent's handoff tool names exactly whom that agent may hand the caller to.
    host = yaml.safe_load(AGENTS.read_text())["agents"][0]
    for update, agent in ((first, host), (handoff, manager)):
        [tool] = [t for t in update["session"]["tools"] if t["name"] == "handoff_to_agent"]
        assert tool["parameters"]["properties"]["agent"]["enum"] == agent["handoffs"]
    assert handoff["session"]["instructions"].startswith(manager["instructions"])
    assert "audio" not in handoff["session"]  # the audio path stays as it is
    # The host speaks with its own voice; the Realtime API refuses a voice change once the
    # session has spoken, so the manager keeps it on this session and the timeline says so.
    assert first["session"]["audio"]["output"]["voice"] == host["voice"] == "marin"
    assert not errors, errors
    assert len(stack.sim.sessions) == 1  # not a new connection: the call was not dropped
    # The manager is told the conversation so far and the booking still open.
    (note,) = [n for n in notes if "take over this phone call as the manager" in n]
    assert "Caller: Please book it for tomorrow." in note
    assert "book" in note and "running" in note and str(op["operation_id"]) in note
    # The timeline has the handoff.
    (handed,) = [e for e in events if e["kind"] == "agent_handoff"]
    assert handed["data"]["from_agent"] == "host"
    assert handed["data"]["to_agent"] == "manager"
    assert handed["data"]["reason"] == "a deposit question"
    assert handed["data"]["voice"] == "marin"
    assert handed["data"]["voice_from_next_session"] == manager["voice"] == "cedar"
    shown = [e for e in response.json()["events"] if e["kind"] == "agent_handoff"]
    assert [(e["data"]["from_agent"], e["data"]["to_agent"]) for e in shown] == [
        ("host", "manager")
    ]


async def test_a_call_whose_stream_is_lost_after_a_handoff_resumes_with_the_agent_then_talking(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    backend = RestaurantBackend(sor)
    async with handoff_stack(engine, clean_db, sor, AGENTS) as stack:
        caller, call_id = await hand_off_while_booking(stack, backend)
        caller.drop_stream()  # the network between Twilio and us breaks; the call is up
        await caller.wait_for(lambda c: len(c.stream_sids) == 2, 15)
        await wait_until(lambda: len(stack.sim.sessions) == 2, 15, "the resumed session")
        resumed = stack.sim.sessions[1]
        await wait_until(
            lambda: bool(resumed.received_events("session.update")), 15, "its session.update"
        )
        first = resumed.received_events("session.update")[0]
        backend.release()
        await wait_for_operation(engine, call_id, "committed")
        await caller.hangup()

    manager = yaml.safe_load(AGENTS.read_text())["agents"][1]
    # The new session goes on with the manager (who had the caller), not the first agent.
    assert {t["name"] for t in first["session"]["tools"]} == {*manager["tools"], *CONTROL}
    assert first["session"]["instructions"].startswith(manager["instructions"])
    # A new session: the manager speaks with its own voice from its start.
    assert first["session"]["audio"]["output"]["voice"] == manager["voice"]
    assert "The line to this caller dropped for a moment" in first["session"]["instructions"]
