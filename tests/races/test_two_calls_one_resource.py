"""two_calls_one_resource: two calls book the last table of a slot at the same moment. One
booking; the other caller is told it is taken, never "booked"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import FakeTwilioCaller
from tests.e2e_support import Stack, wait_until
from tests.race_report import Race
from tests.races.support import ask_and_confirm, booking, heard, quoted, stack_for
from tests.sor_support import CALLBACK_SECRET
from tests.test_e2e_booking import (
    WAIT_S,
    hear,
    operations_of,
    trail,
    wait_for_delivery,
)
from tools import faults
from tools.restaurant.sor import SystemOfRecord

pytestmark = pytest.mark.races


@pytest.fixture
async def last_table(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    """A restaurant with room for one party of four per slot."""
    sor = SystemOfRecord(clean_db, seats_per_slot=4, callback_secret=CALLBACK_SECRET)
    await sor.start()
    try:
        yield sor
    finally:
        await sor.stop()


async def test_two_calls_one_resource(
    engine: AsyncEngine, clean_db: str, last_table: SystemOfRecord, race: Race
) -> None:
    sor = last_table
    # Both operations are running before either reaches the restaurant.
    running = faults.Gate()
    with faults.armed("executor.claimed", running):
        async with stack_for(engine, clean_db, sor, booking()) as stack:
            callers = [stack.caller(from_number=n) for n in ("+15550000001", "+15550000002")]
            call_ids = await asyncio.gather(*(ask_and_confirm(stack, c) for c in callers))
            await wait_until(lambda: len(running.arrivals) == 2, WAIT_S, "both running")
            running.open()
            outcomes = await asyncio.gather(
                *(told(stack, c, i) for c, i in zip(callers, call_ids, strict=True))
            )
            effects = await sor.side_effects()

    by_status = {o["status"]: o for o in outcomes}
    assert sorted(by_status) == ["committed", "failed_final"]
    assert effects.bookings_inserted == 1
    won, lost = by_status["committed"], by_status["failed_final"]
    assert won["moves"][-2:] == ["running", "committed"]
    assert lost["moves"][-2:] == ["running", "failed_final"]
    assert lost["error"] == "no_availability"
    # Each caller heard their own outcome; the one who lost never heard "booked"/"confirmed".
    assert "Done and confirmed by the restaurant" in won["heard"][-1]
    assert all("confirmed by" not in t and "booked" not in t.lower() for t in lost["heard"])
    assert "could not be done" in lost["heard"][-1] and "Nothing was changed" in lost["heard"][-1]
    race.report(
        state="committed + failed_final (no availability)",
        effects=f"{effects.bookings_inserted} booking",
        order="both running < one commits, the other refused < each told its own",
        heard=f"won {quoted(won['heard'][-1:])}; lost {quoted(lost['heard'][-1:])}",
    )


async def told(stack: Stack, caller: FakeTwilioCaller, call_id: str) -> dict[str, object]:
    """Once the caller has heard the outcome and hung up: its operation and what was said."""
    engine = stack.engine
    op = (await operations_of(engine, call_id))[0]

    async def settled() -> bool:
        return (await operations_of(engine, call_id))[0]["status"] in ("committed", "failed_final")

    await wait_until(settled, WAIT_S, "settled")
    await wait_for_delivery(engine, op["operation_id"], "heard")
    await hear(caller, caller.heard_ms)
    await caller.hangup()
    await stack.events(caller)
    op = (await operations_of(engine, call_id))[0]
    moves = [e["to_status"] for e in await trail(engine, op["operation_id"])]
    return {
        "status": op["status"],
        "error": op["error"],
        "moves": [m for m in moves if m],
        "heard": await heard(engine, call_id),
    }
