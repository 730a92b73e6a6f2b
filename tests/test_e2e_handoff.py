"""Agent handoffs end to end over real sockets: fake caller -> service -> Realtime simulator,
with the restaurant's system of record and its agents file (a host and a manager).

The host admits a booking; the caller asks for the manager while the booking is still at the
system of record; the session goes on with the manager's instructions and tools (one
`session.update`, of the SDK's own shape); the booking commits after the handoff and reaches
the manager, who tells it, or, when the manager may not disclose bookings, it goes by SMS and
nothing is spoken.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai.types.realtime import SessionUpdateEvent
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.scenario import Scenario
from tests.domains import RESTAURANT, RestaurantBackend, restaurant_catalog
from tests.e2e_support import CONSOLE, Stack, call_stack, wait_until
from tests.sor_support import start_sor
from tests.test_e2e_booking import (
    CONFIRM,
    GREETING_MS,
    PREAMBLE_MS,
    READBACK_MS,
    REQUESTED,
    WAIT_S,
    ask_to_book_and_confirm,
    call_events_at,
    delivery_trail,
    hear,
    heard_text,
    operations_of,
    rows,
    wait_for_delivery,
    wait_for_operation,
    wait_spoken,
)
from tools.restaurant import plugin
from tools.restaurant.sor import SystemOfRecord

AGENTS = Path(plugin.__file__).with_name("agents.yaml")
MANAGER_HELLO = "Hello, this is the manager. How can I help with the deposit?"
# The engine's control tools come along with every agent.
CONTROL = ("confirm_operation", "verify_pin", "resolve_conflict", "handoff_to_agent")
HANDOFF_PREAMBLE = "Let me get the manager for you."


@pytest.fixture
async def sor(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    sor = await start_sor(clean_db)
    try:
        yield sor
    finally:
        await sor.stop()


def handoff_scenario() -> Scenario:
    """Book (host) -> readback -> yes -> "requested" -> hand off -> manager -> late result."""
    return Scenario.model_validate(
        {
            "name": "e2e-handoff",
            "greeting": {"text": "Hello, Luigi's, how can I help?", "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Please book it for tomorrow.",
                    "function_call": {
                        "name": RESTAURANT.book_tool,
                        "arguments": RESTAURANT.book_args,
                        "preamble": {"text": "One moment.", "audio_ms": PREAMBLE_MS},
                    },
                },
                {"reply": {"text": "{output[readback]}", "audio_ms": READBACK_MS}},
                {"caller_transcript": "Yes.", "function_call": CONFIRM},
                {"reply": {"text": REQUESTED, "audio_ms": 1200}},
                {
                    "caller_transcript": "Can I ask the manager about a deposit?",
                    "function_call": {
                        "name": "handoff_to_agent",
                        "arguments": {"agent": "manager", "reason": "a deposit question"},
                        "preamble": {"text": HANDOFF_PREAMBLE, "audio_ms": 900},
                    },
                },
                {"reply": {"text": MANAGER_HELLO, "audio_ms": 1500}},
                {"reply": {"text": RESTAURANT.confirmed_text, "audio_ms": 1200}},
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )


@asynccontextmanager
async def handoff_stack(
    engine: AsyncEngine, db: str, sor: SystemOfRecord, agents_file: Path
) -> AsyncIterator[Stack]:
    catalog = restaurant_catalog(sor.url)
    try:
        async with call_stack(
            engine,
            handoff_scenario(),
            with_worker=True,
            catalog=catalog,
            database_url=db,
            sweep_interval_s=1.0,
            agents_file=agents_file,
        ) as stack:
            yield stack
    finally:
        await catalog.aclose()


def session_updates(stack: Stack) -> list[dict[str, Any]]:
    return stack.sim.sessions[-1].received_events("session.update")


async def hand_off_while_booking(stack: Stack, backend: RestaurantBackend) -> tuple[Any, str]:
    """The host admits a booking (held at the SOR), the caller asks for the manager; returns
    the caller and the call id once the manager's session is set."""
    backend.set_faults(hang=1)  # the booking waits at the SOR until the test releases it
    caller = stack.caller()
    call_id = await ask_to_book_and_confirm(stack, caller)
    await wait_for_operation(stack.engine, call_id, "running")
    await hear(caller, caller.heard_ms + 1200)
    before = caller.heard_ms
    await caller.play_speech(600)
    await wait_until(lambda: len(session_updates(stack)) >= 2, WAIT_S, "handoff session.update")
    await hear(caller, before + 900 + 1500)
    return caller, call_id


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
    assert handoff["session"]["instructions"].startswith(manager["instructions"])
    assert "audio" not in handoff["session"]  # the audio path stays as it is
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
    shown = [e for e in response.json()["events"] if e["kind"] == "agent_handoff"]
    assert [(e["data"]["from_agent"], e["data"]["to_agent"]) for e in shown] == [
        ("host", "manager")
    ]


async def test_a_booking_admitted_by_the_host_commits_after_the_handoff_and_the_manager_tells_it(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    backend = RestaurantBackend(sor)
    async with handoff_stack(engine, clean_db, sor, AGENTS) as stack:
        caller, call_id = await hand_off_while_booking(stack, backend)
        backend.release()
        op = await wait_for_operation(engine, call_id, "committed")
        await wait_for_delivery(engine, op["operation_id"], "heard")
        await wait_spoken(engine, call_id, RESTAURANT.confirmed_text)
        await caller.hangup()
        await stack.events(caller)
        ops = await operations_of(engine, call_id)
        (delivery,) = await rows(
            engine, "SELECT * FROM deliveries WHERE operation_id = :o", o=op["operation_id"]
        )
        told = await delivery_trail(engine, op["operation_id"])
        kinds = [e["kind"] for e in await call_events_at(engine, call_id)]
    assert [o["status"] for o in ops] == ["committed"]
    assert ops[0]["agent"] == "host"  # admitted by the host
    assert delivery["agent"] == "manager"  # told while the manager was talking
    assert delivery["channel"] == "call"
    (decision,) = [e for e in told if e["kind"] == "decision"]
    assert decision["data"]["action"] == "announce" and decision["data"]["agent"] == "manager"
    assert kinds.index("agent_handoff") < kinds.index("result_heard")


async def test_a_result_the_active_agent_may_not_disclose_is_texted_and_never_spoken(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, tmp_path: Path
) -> None:
    data = yaml.safe_load(AGENTS.read_text())
    data["agents"][1]["disclose"] = ["check_availability", "get_booking"]  # not bookings
    agents_file = tmp_path / "agents.yaml"
    agents_file.write_text(yaml.safe_dump(data))
    backend = RestaurantBackend(sor)
    async with handoff_stack(engine, clean_db, sor, agents_file) as stack:
        caller, call_id = await hand_off_while_booking(stack, backend)
        backend.release()
        op = await wait_for_operation(engine, call_id, "committed")
        delivery = await wait_for_delivery(engine, op["operation_id"], "texted")
        messages = stack.api.messages_to(caller.from_number)
        await caller.hangup()
        events = await stack.events(caller)
        told = await delivery_trail(engine, op["operation_id"])
        spoken = await heard_text(engine, call_id)
    assert delivery["agent"] == "manager" and delivery["channel"] == "sms"
    (decision,) = [e for e in told if e["kind"] == "decision"]
    assert decision["reason"] == "the active agent (manager) may not disclose it: by SMS"
    assert len(messages) == 1 and "Ref BK" in messages[0].body
    kinds = [e["kind"] for e in events]
    assert "result_announced" not in kinds  # nothing was spoken about it in the call
    assert RESTAURANT.confirmed_text not in spoken
    assert MANAGER_HELLO in spoken
