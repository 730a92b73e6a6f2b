"""late_result_after_intent_change: the caller changes the time ("make it half past eight")
while the first booking runs. The first result is told as what happened, not as the current
request, with the change named as not done; the caller decides (move it), the first booking is
cancelled by compensation and the second made: one booking remains."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.scenario import Scenario
from tests.e2e_support import wait_until
from tests.race_report import Race
from tests.races.support import heard, quoted
from tests.test_e2e_booking import (
    WAIT_S,
    delivery_trail,
    hear,
    operations_of,
    wait_for_delivery,
    wait_for_operation,
)
from tests.test_e2e_delivery import (
    BOOK,
    announcement_audio,
    book_and_confirm,
    kinds,
    notes,
    scenario,
    stack_for,
)
from tools.restaurant.sor import Faults, SystemOfRecord

pytestmark = pytest.mark.races


async def test_late_result_after_intent_change(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, race: Race
) -> None:
    # The restaurant books the first table, and its answer is held until the test says so.
    sor.set_faults(Faults(lose_response=1))
    later = {**BOOK, "arguments": {**BOOK["arguments"], "time": "20:30"}}
    change = {
        "caller_transcript": "Actually, make it half past eight.",
        "function_call": {**later, "preamble": {"text": "Let me see.", "audio_ms": 600}},
    }
    held_reply = {"reply": {"text": "{output[message]}", "audio_ms": 1500}}
    move = {
        "caller_transcript": "Move it, please.",
        "function_call": {
            "name": "resolve_conflict",
            "arguments": {"operation_id": "{output[operation_id]}", "choice": "move"},
        },
    }
    moved_reply = {"reply": {"text": "I'm moving it now.", "audio_ms": 900}}
    sc = scenario(change, held_reply)
    sc = Scenario.model_validate(
        {**sc.model_dump(), "steps": [*sc.model_dump()["steps"], move, moved_reply]}
    )
    async with stack_for(engine, clean_db, sor, sc) as stack:
        caller = stack.caller()
        call_id = await book_and_confirm(stack, caller)
        first = await wait_for_operation(engine, call_id, "running")
        before = caller.heard_ms
        await caller.play_speech(600)  # "actually, make it half past eight"
        await hear(caller, before + 600 + 1500)

        async def second_held() -> bool:
            ops = await operations_of(engine, call_id)
            return len(ops) == 2 and ops[1]["held_by_operation_id"] == first["operation_id"]

        await wait_until(second_held, WAIT_S, "the second booking held")
        # Nothing of the second reached the restaurant while the first is unsettled.
        assert (await sor.side_effects()).bookings_inserted == 1
        ops = await operations_of(engine, call_id)
        second = ops[1]
        assert second["status"] == "awaiting_confirmation"
        sor.release()
        await wait_for_delivery(engine, first["operation_id"], "heard")
        # The caller answers the question the update asked: move it.
        before = caller.heard_ms
        await caller.play_speech(500)

        async def moved() -> bool:
            rows = await operations_of(engine, call_id)
            return len(rows) == 3 and all(r["status"] == "committed" for r in rows)

        await wait_until(moved, WAIT_S, "moved: cancelled and booked again")
        await caller.hangup()
        events = await stack.events(caller)
        said = notes(stack.sim.sessions[0])
        heard_audio = caller.heard_audio()
        effects = await sor.side_effects()
        trail = await delivery_trail(engine, first["operation_id"])
        ops = await operations_of(engine, call_id)
        spoken = await heard(engine, call_id)

    # The update told the truth about the first booking, and named the change as not done.
    update = said[0]
    assert "Done and confirmed by the restaurant" in update and "at 20:00" in update
    assert "Meanwhile the caller asked for" in update and "at 20:30" in update
    assert "that has not been done" in update and "move it" in update
    assert announcement_audio(update) in heard_audio
    decided = next(e for e in trail if e["kind"] == "decision")
    assert decided["data"]["contradicted"] is True
    assert decided["data"]["current"].startswith("contradicted by")
    # The caller decided: the first was cancelled (compensation) and the second booked.
    by_tool = {o["tool"]: o for o in ops}
    assert by_tool["cancel_booking"]["compensates_operation_id"] == first["operation_id"]
    assert {o["status"] for o in ops} == {"committed"}
    assert effects.bookings_inserted == 2 and effects.cancellations == 1
    k = kinds(events)
    assert k.count("result_announced") >= 1
    assert [t for t in spoken if "Meanwhile" in t], spoken
    remaining = effects.bookings_inserted - effects.cancellations
    assert remaining == 1
    assert k.index("result_announced") < k.index("result_heard")
    race.report(
        state="first committed, told as contradicted; compensated (cancelled), second committed",
        effects=(
            f"{effects.bookings_inserted} bookings, {effects.cancellations} cancellation, "
            f"{remaining} remains"
        ),
        order="first running < change held behind it < first committed < told, not as current "
        "< caller chose move < cancel + rebook",
        heard=quoted([t for t in spoken if "Meanwhile" in t]),
    )
