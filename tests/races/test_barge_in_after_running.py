"""barge_in_after_running: the caller interrupts while the mutation is running. The barge-in
stops speech, not the action: the operation commits once, and its result is offered after
the response that was active, not lost."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import wait_until
from tests.race_report import Race
from tests.races.support import (
    REQUESTED,
    ask_and_confirm,
    booking,
    cut,
    heard,
    quoted,
    stack_for,
    statuses,
    to_statuses,
)
from tests.test_e2e_booking import WAIT_S, hear, wait_for_delivery, wait_for_operation
from tests.test_e2e_delivery import kinds, notes
from tools import faults
from tools.restaurant.sor import SystemOfRecord

pytestmark = pytest.mark.races

ANSWER = "Yes, as soon as it is confirmed."


async def test_barge_in_after_running(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, race: Race
) -> None:
    ask = {
        "caller_transcript": "Will you let me know?",
        "reply": {"text": ANSWER, "audio_ms": 1500},
    }
    # The worker holds the running operation until the caller has cut in.
    running = faults.Gate()
    with faults.armed("executor.claimed", running):
        async with stack_for(engine, clean_db, sor, booking(ask, requested_ms=4000)) as stack:
            caller = stack.caller()
            call_id = await ask_and_confirm(stack, caller)
            await wait_until(running.reached.is_set, WAIT_S, "the operation running")
            await wait_for_operation(engine, call_id, "running")
            # Well into "requested, not confirmed yet", the caller cuts in.
            before = caller.heard_ms
            await caller.wait_for(lambda c: c.heard_ms >= before + 800, WAIT_S)
            await caller.play_speech(600)
            await caller.wait_for(lambda c: len(c.clears) == 1, WAIT_S)
            at_barge_in = await statuses(engine, call_id)
            # The commit lands while the answer to the interruption is being said.
            answering = caller.heard_ms
            await caller.wait_for(lambda c: c.heard_ms >= answering + 300, WAIT_S)
            running.open()
            op = await wait_for_operation(engine, call_id, "committed")
            await wait_for_delivery(engine, op["operation_id"], "heard")
            await hear(caller, caller.heard_ms)
            await caller.hangup()
            events = await stack.events(caller)
            said = notes(stack.sim.sessions[0])
            spoken = await heard(engine, call_id)
            moved = await to_statuses(engine, op["operation_id"])
            ops = await statuses(engine, call_id)
            effects = await sor.side_effects()

    assert at_barge_in == ["running"]
    assert ops == ["committed"]
    assert moved == ["awaiting_confirmation", "admitted", "running", "committed"]
    assert effects.bookings_inserted == 1
    k = kinds(events)
    assert k.count("barge_in") == 1 and k.count("result_announced") == 1
    assert k.index("barge_in") < k.index("result_announced") < k.index("result_heard")
    # Heard: "requested" cut short, the whole answer to the interruption, then the result.
    assert len(said) == 1 and "Done and confirmed by the restaurant" in said[0]
    assert spoken[-2:] == [ANSWER, spoken[-1]] and "confirmed" in spoken[-1]
    cut_short = cut(spoken[-3], REQUESTED)
    race.report(
        state="committed (running at the barge-in)",
        effects=f"{effects.bookings_inserted} booking",
        order="running < barge_in < committed < announced after the answer < heard",
        heard=quoted([cut_short, *spoken[-2:]]),
    )
