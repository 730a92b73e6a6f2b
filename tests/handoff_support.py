"""What the handoff tests share: the restaurant's agents file (a host and a manager), a call
script in which the host admits a booking and hands the caller to the manager, and the stack
and steps that bring a call to the moment the manager has taken over with the booking still
held at the system of record."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.scenario import Scenario
from tests.domains import RESTAURANT, RestaurantBackend, restaurant_catalog
from tests.e2e_support import Stack, call_stack, wait_until
from tests.test_e2e_booking import (
    CONFIRM,
    GREETING_MS,
    PREAMBLE_MS,
    READBACK_MS,
    REQUESTED,
    WAIT_S,
    ask_to_book_and_confirm,
    hear,
    wait_for_operation,
)
from tools.restaurant import plugin
from tools.restaurant.sor import SystemOfRecord

AGENTS = Path(plugin.__file__).with_name("agents.yaml")
MANAGER_HELLO = "Hello, this is the manager. How can I help with the deposit?"
# The engine's control tools come along with every agent.
CONTROL = ("confirm_operation", "verify_pin", "resolve_conflict", "handoff_to_agent")
HANDOFF_PREAMBLE = "Let me get the manager for you."


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


def agents_where_the_manager_discloses(tmp_path: Path, disclose: list[str]) -> Path:
    """The restaurant's agents file with the manager allowed to disclose only `disclose`."""
    data = yaml.safe_load(AGENTS.read_text())
    data["agents"][1]["disclose"] = disclose
    agents_file = tmp_path / "agents.yaml"
    agents_file.write_text(yaml.safe_dump(data))
    return agents_file


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


async def hand_off_while_booking(
    stack: Stack, backend: RestaurantBackend
) -> tuple[FakeTwilioCaller, str]:
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
