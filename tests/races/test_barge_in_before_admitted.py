"""barge_in_before_admitted: the caller cuts in while the model is still streaming the booking
call's arguments. The cancelled call is no call: no operation row, nothing at the restaurant,
the model is told nothing was done (it is told nothing at all), and what the transcript keeps
of the cut sentence is what the caller heard of it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.scenario import Scenario
from tests.e2e_support import wait_until
from tests.race_report import Race
from tests.races.support import BOOK, cut, heard, quoted, stack_for, statuses
from tests.test_e2e_booking import GREETING_MS, WAIT_S, call_events_at, hear, rows
from tests.test_e2e_delivery import kinds, notes
from tools import faults
from tools.restaurant.sor import SystemOfRecord

pytestmark = pytest.mark.races

PREAMBLE = "One moment while I put that booking through for you."
PREAMBLE_MS = 3000
ANSWER = "Of course, take your time."


def scenario() -> Scenario:
    """ "Book it" -> a long preamble, then the call's arguments, slowly; "wait" -> an answer."""
    return Scenario.model_validate(
        {
            "name": "race",
            "greeting": {"text": "Luigi's, how can I help?", "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Please book a table for four tomorrow at eight.",
                    "function_call": {
                        **BOOK,
                        "preamble": {"text": PREAMBLE, "audio_ms": PREAMBLE_MS},
                        "arguments_ms": 4000,
                    },
                },
                {
                    "caller_transcript": "Wait, let me check with my wife first.",
                    "reply": {"text": ANSWER, "audio_ms": 1200},
                },
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )


async def test_barge_in_before_admitted(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, race: Race
) -> None:
    requested: list[Mapping[str, Any]] = []

    async def record(context: Mapping[str, Any]) -> None:
        requested.append(context)

    with faults.armed("gateway.requested", record):
        async with stack_for(engine, clean_db, sor, scenario()) as stack:
            caller = stack.caller()
            await caller.dial()
            await hear(caller, GREETING_MS)
            await caller.play_speech(700)
            session = stack.sim.sessions[0]
            # The preamble was sent ahead of playout; the arguments are streaming behind it.
            await session.wait_for_sent("response.function_call_arguments.delta", within=WAIT_S)
            streaming = caller.heard_ms
            assert streaming < GREETING_MS + PREAMBLE_MS  # still hearing the preamble
            await caller.play_speech(600)
            await caller.wait_for(lambda c: len(c.clears) == 1, WAIT_S)
            await session.wait_for_sent("response.done", count=2, within=WAIT_S)
            await hear(caller, caller.heard_ms + 1200)
            call_id = await stack.call_id(caller)
            await wait_until(
                lambda: _said(engine, call_id, ANSWER), WAIT_S, "the answer to the interruption"
            )
            await caller.hangup()
            events = await stack.events(caller)
            received = session.received_events()
            truncates = session.received_events("conversation.item.truncate")
            outputs = [
                e
                for e in session.received_events("conversation.item.create")
                if e.get("item", {}).get("type") == "function_call_output"
            ]
            said = notes(session)
            done = session.sent_events("response.done")
            spoken = await heard(engine, call_id)
            agent = [
                e for e in await call_events_at(engine, call_id) if e["kind"] == "agent_transcript"
            ]
            tool_calls = await rows(
                engine, "SELECT * FROM tool_calls WHERE call_id = :c", c=call_id
            )
            ops = await statuses(engine, call_id)
            effects = await sor.side_effects()

    # The cancelled response carried an unfinished call; nothing of it reached the engine.
    assert done[1]["response"]["status"] == "cancelled"
    assert requested == [] and tool_calls == [] and ops == []
    assert effects.bookings_inserted == 0
    # The model heard no function output and no update: it was told nothing was done.
    assert outputs == [] and said == []
    k = kinds(events)
    assert "barge_in" in k and "tool_requested" not in k
    # Truncated at what was heard of the preamble, then cancelled; the transcript keeps that.
    assert len(truncates) == 1
    got = [e["type"] for e in received]
    assert got.index("conversation.item.truncate") < got.index("response.cancel")
    preamble = next(e for e in agent if e["data"].get("full_text") == PREAMBLE)
    assert preamble["data"]["cut"] is True
    assert preamble["data"]["heard_ms"] == truncates[0]["audio_end_ms"]
    assert 0 < truncates[0]["audio_end_ms"] < preamble["data"]["audio_ms"] == PREAMBLE_MS
    assert spoken[-1] == ANSWER
    cut_short = cut(spoken[-2], PREAMBLE)
    race.report(
        state="no operation row, no tool call recorded",
        effects=f"{effects.bookings_inserted} bookings",
        order="arguments streaming < barge_in < truncate < cancel < cancelled, never requested",
        heard=quoted([cut_short, ANSWER]),
    )


async def _said(engine: AsyncEngine, call_id: str, text: str) -> bool:
    return text in await heard(engine, call_id)
