"""The caller's yes at the edges of the readback, over real sockets (fake Twilio caller, the
service, the Realtime simulator, the system of record): a yes that begins while the readback's
last words still play is an interruption, not a confirmation; a prompt yes right after its
end is one, whatever the readback's length in bytes (issue 36).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.scenario import Scenario
from tests.domains import RESTAURANT, Backend
from tests.test_e2e_booking import (
    CONFIRM,
    GREETING_MS,
    PREAMBLE_MS,
    REQUESTED,
    WAIT_S,
    booking_stack,
    hear,
    operations_of,
    wait_for_operation,
)
from tests.test_e2e_confirmation import refusals, wait_for_decisions

READBACK_MS = 1500
ASK_AGAIN = "Sorry, I need your yes to go ahead. Shall I book it?"


@pytest.fixture
async def backend(clean_db: str) -> AsyncIterator[Backend]:
    async with RESTAURANT.start(clean_db) as running:
        yield running


def scenario(name: str, readback: dict[str, Any]) -> Scenario:
    return Scenario.model_validate(
        {
            "name": f"prompt-yes-{name}",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Please book it for tomorrow.",
                    "function_call": {
                        "name": RESTAURANT.book_tool,
                        "arguments": RESTAURANT.book_args,
                        "preamble": {"text": "One moment.", "audio_ms": PREAMBLE_MS},
                    },
                },
                {"reply": {"text": "{output[readback]}", **readback}},
                {"caller_transcript": "Yes.", "function_call": CONFIRM},
                {"reply": {"text": REQUESTED, "audio_ms": 900}},
            ],
            "fallback": {"text": ASK_AGAIN, "audio_ms": 900},
        }
    )


async def test_a_yes_that_begins_in_the_readbacks_last_200_ms_is_refused(
    engine: AsyncEngine, clean_db: str, backend: Backend
) -> None:
    readback = {"audio_ms": READBACK_MS}
    async with booking_stack(engine, clean_db, backend, scenario("early", readback)) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        before = caller.heard_ms
        await caller.play_speech(700)
        end = before + PREAMBLE_MS + READBACK_MS
        await caller.wait_for(lambda c: c.heard_ms >= end - 200, WAIT_S)
        assert caller.heard_ms < end  # the readback's last words are still playing
        await caller.play_speech(500)
        call_id = await stack.call_id(caller)
        assert await wait_for_decisions(engine, call_id, 2) == [
            (RESTAURANT.book_tool, "needs_confirmation"),
            ("confirm_operation", "needs_caller"),
        ]
        [op] = await operations_of(engine, call_id)
        [why] = await refusals(engine, op["operation_id"])
        await caller.hangup()

    assert op["status"] == "awaiting_confirmation"
    assert await backend.booked() == 0
    assert "not heard to its end" in why["reason"], why["reason"]
    evidence = why["data"]["evidence"]
    assert READBACK_MS - 300 < evidence["readback_heard_ms"] < evidence["readback_audio_ms"]
    print(f"a yes in the readback's last 200 ms: refused ({evidence})")


@pytest.mark.parametrize("tail_samples", range(8))
async def test_a_prompt_yes_after_a_readback_of_any_byte_count_books_once(
    engine: AsyncEngine, clean_db: str, backend: Backend, tail_samples: int
) -> None:
    """A readback of 900 ms and 0-7 bytes (G.711: an eighth of a millisecond each), the
    caller's yes 0.1 s after its last audio: the readback was heard to its end, the yes counts
    and one booking is made (a mark rounded to a whole millisecond refused 1-3 and 5 of them)."""
    readback = {"audio_ms": 900, "tail_samples": tail_samples}
    name = f"prompt-{tail_samples}"
    async with booking_stack(engine, clean_db, backend, scenario(name, readback)) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        before = caller.heard_ms
        await caller.play_speech(700)
        await hear(caller, before + PREAMBLE_MS + 900)
        await asyncio.sleep(0.1)
        await caller.play_speech(500)
        call_id = await stack.call_id(caller)
        committed = await wait_for_operation(engine, call_id, "committed")
        decided = await wait_for_decisions(engine, call_id, 2)
        await caller.hangup()

    assert decided == [
        (RESTAURANT.book_tool, "needs_confirmation"),
        ("confirm_operation", "allow"),
    ]
    assert await backend.booked() == 1
    evidence = committed["confirmation"]
    assert evidence["confirmed_by"] == "caller"
    assert evidence["readback_heard_ms"] == evidence["readback_audio_ms"] == 900
    print(f"readback of 900 ms + {tail_samples} bytes, yes 0.1 s after: booked once")
