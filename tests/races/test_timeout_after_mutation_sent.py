"""timeout_after_mutation_sent: the provider commits, but its answer comes after the tool's
deadline. The operation is UNKNOWN, reconciled by its idempotency key (never re-sent), one
side effect, told once."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.domains import restaurant_catalog
from tests.race_report import Race
from tests.races.support import (
    REQUESTED,
    ask_and_confirm,
    booking,
    heard,
    quoted,
    stack_for,
    statuses,
)
from tests.test_e2e_booking import hear, trail, wait_for_delivery, wait_for_operation
from tests.test_e2e_delivery import kinds, notes
from tools.restaurant.sor import Faults, SystemOfRecord

pytestmark = pytest.mark.races


async def test_timeout_after_mutation_sent(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, race: Race
) -> None:
    # The restaurant books the table, then holds its answer past the 1 s deadline.
    sor.set_faults(Faults(lose_response=1))
    catalog = restaurant_catalog(sor.url, deadline_s=1.0)
    try:
        async with stack_for(engine, clean_db, sor, booking(), catalog=catalog) as stack:
            caller = stack.caller()
            call_id = await ask_and_confirm(stack, caller)
            op = await wait_for_operation(engine, call_id, "committed", within=30)
            sor.release()  # the late answer now arrives, to no one
            await wait_for_delivery(engine, op["operation_id"], "heard")
            await hear(caller, caller.heard_ms)
            await caller.hangup()
            events = await stack.events(caller)
            said = notes(stack.sim.sessions[0])
            spoken = await heard(engine, call_id)
            ops = await statuses(engine, call_id)
            rows = await trail(engine, op["operation_id"])
            effects = await sor.side_effects()
    finally:
        await catalog.aclose()

    assert ops == ["committed"]
    assert effects.bookings_inserted == 1  # applied once; never answered by sending again
    assert op["attempts"] == 1
    moves = [(e["to_status"], e["actor"]) for e in rows if e["kind"] == "transition"]
    assert [m[0] for m in moves] == [
        "awaiting_confirmation",
        "admitted",
        "running",
        "unknown",
        "committed",
    ]
    assert moves[-1][1] == "reconciler"
    assert op["provider_ref"].startswith("BK")
    # Told once, and nothing was phrased as done before the provider confirmed it.
    assert kinds(events).count("result_announced") == 1
    assert len(said) == 1 and "Done and confirmed by the restaurant" in said[0]
    assert REQUESTED in spoken and spoken.index(REQUESTED) < len(spoken) - 1
    assert stack.api.created_messages() == []
    race.report(
        state="running > unknown > committed (by the reconciler, on the key)",
        effects=f"{effects.bookings_inserted} booking, {op['attempts']} attempt",
        order="sent < deadline (unknown) < reconciled < announced once < heard",
        heard=quoted(spoken[-2:]),
    )
