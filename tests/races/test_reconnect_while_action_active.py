"""reconnect_while_action_active: the Realtime socket drops while the booking runs, and the
booking commits while the bridge is still reconnecting. The result reaches the new session
once (said and heard there); the old session gets nothing after the drop."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.scenario import Scenario
from tests.e2e_support import wait_until
from tests.race_report import Race
from tests.races.support import (
    NOTE_MS,
    REQUESTED,
    ask_and_confirm,
    booking,
    heard,
    quoted,
    stack_for,
    statuses,
    to_statuses,
)
from tests.test_e2e_booking import WAIT_S, hear, rows, wait_for_delivery, wait_for_operation
from tests.test_e2e_delivery import kinds, notes
from tools import faults
from tools.restaurant.sor import SystemOfRecord

pytestmark = pytest.mark.races

# A new connection is a new conversation: the scripted model there only says the update.
RESUMED = Scenario.model_validate(
    {
        "name": "race-resumed",
        "steps": [{"reply": {"text": "{note}", "audio_ms": NOTE_MS}}],
        "fallback": {"text": "Anything else?", "audio_ms": 800},
    }
)


async def test_reconnect_while_action_active(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, race: Race
) -> None:
    running = faults.Gate()
    with faults.armed("executor.claimed", running):
        async with stack_for(
            engine, clean_db, sor, booking(), realtime_reconnect_budget_s=30.0
        ) as stack:
            caller = stack.caller()
            call_id = await ask_and_confirm(stack, caller)
            await wait_until(running.reached.is_set, WAIT_S, "the operation running")
            await hear(caller, caller.heard_ms + 1200)  # "requested, not confirmed yet"
            old = stack.sim.sessions[0]
            # The socket drops; every reconnect is refused until the booking has committed.
            stack.sim.scenario = RESUMED
            stack.sim.fail_next_connects(10**6)
            await stack.sim.drop_all()
            await old.closed.wait()
            old_received = len(old.received)
            running.open()
            op = await wait_for_operation(engine, call_id, "committed")
            # Decided while the model is away: offered to the call, waiting for a session.
            offered = await wait_for_delivery(engine, op["operation_id"], "offered")
            sessions_at_commit = len(stack.sim.sessions)
            stack.sim.fail_next_connects(0)  # the API is back
            new = await stack.sim.wait_for_session(1, within=WAIT_S)
            await wait_for_delivery(engine, op["operation_id"], "heard")
            await hear(caller, caller.heard_ms)
            await caller.hangup()
            events = await stack.events(caller)
            spoken = await heard(engine, call_id)
            ops = await statuses(engine, call_id)
            moved = await to_statuses(engine, op["operation_id"])
            deliveries = await rows(
                engine, "SELECT * FROM deliveries WHERE operation_id = :o", o=op["operation_id"]
            )
            effects = await sor.side_effects()

    assert ops == ["committed"]
    assert moved == ["awaiting_confirmation", "admitted", "running", "committed"]
    assert effects.bookings_inserted == 1
    assert sessions_at_commit == 1  # committed while no session was up
    assert offered["channel"] == "call"
    # The old session got nothing after the drop; the new one got the update, once.
    assert len(old.received) == old_received
    assert notes(old) == []
    said = notes(new)
    assert len(said) == 1 and "Done and confirmed by the restaurant" in said[0]
    assert len(deliveries) == 1 and deliveries[0]["state"] == "heard"
    k = kinds(events)
    assert k.count("realtime_dropped") == 1 and k.count("realtime_reconnected") == 1
    assert k.count("result_announced") == 1
    assert (
        k.index("realtime_dropped")
        < k.index("realtime_reconnected")
        < k.index("result_announced")
        < k.index("result_heard")
    )
    assert stack.api.created_messages() == []
    assert spoken[-2] == REQUESTED and "confirmed" in spoken[-1]
    race.report(
        state="committed while reconnecting; 1 delivery, heard in the new session",
        effects=f"{effects.bookings_inserted} booking",
        order="running < drop < committed < reconnected < announced once < heard",
        heard=quoted(spoken[-2:]),
    )
