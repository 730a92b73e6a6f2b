"""handoff_before_async_tool_completes: the host admits a booking and hands the caller to the
manager; the booking commits after the handoff. The operation belongs to the call, not to the
agent that admitted it: the manager (the active agent) tells it when the manager may disclose
bookings, and when the manager may not it goes by SMS and nothing is said; either way the
host's pending update is delivered once, and the ledger shows who admitted it (the host) and who
was talking when it was delivered (the manager)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.domains import RESTAURANT, RestaurantBackend
from tests.handoff_support import (
    AGENTS,
    MANAGER_HELLO,
    agents_where_the_manager_discloses,
    hand_off_while_booking,
    handoff_stack,
)
from tests.race_report import Race
from tests.races.support import heard, quoted, statuses, steady
from tests.test_e2e_booking import (
    call_events_at,
    delivery_trail,
    operations_of,
    rows,
    wait_for_delivery,
    wait_for_operation,
    wait_spoken,
)
from tools.restaurant.sor import SystemOfRecord

pytestmark = pytest.mark.races


async def handed_off_then_committed(
    engine: AsyncEngine, db: str, sor: SystemOfRecord, agents_file: Path, outcome: str
) -> dict[str, Any]:
    """One call: the host admits, hands off, the booking commits; what the ledger, the
    timeline, the caller and the caller's phone show once the delivery is `outcome`."""
    backend = RestaurantBackend(sor)
    async with handoff_stack(engine, db, sor, agents_file) as stack:
        caller, call_id = await hand_off_while_booking(stack, backend)
        at_handoff = await statuses(engine, call_id)
        backend.release()
        op = await wait_for_operation(engine, call_id, "committed")
        await wait_for_delivery(engine, op["operation_id"], outcome)
        if outcome == "heard":
            await wait_spoken(engine, call_id, RESTAURANT.confirmed_text)
        texts = [m.body for m in stack.api.messages_to(caller.from_number)]
        await caller.hangup()
        await stack.events(caller)
        return {
            "at_handoff": at_handoff,
            "ops": await operations_of(engine, call_id),
            "deliveries": await rows(
                engine, "SELECT * FROM deliveries WHERE operation_id = :o", o=op["operation_id"]
            ),
            "told": await delivery_trail(engine, op["operation_id"]),
            "kinds": [e["kind"] for e in await call_events_at(engine, call_id)],
            "spoken": await heard(engine, call_id),
            "texts": texts,
        }


async def test_handoff_before_async_tool_completes(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, race: Race, tmp_path: Path
) -> None:
    told = await handed_off_then_committed(engine, clean_db, sor, AGENTS, "heard")
    booked_after_one = (await sor.side_effects()).bookings_inserted
    discreet = agents_where_the_manager_discloses(tmp_path, ["check_availability", "get_booking"])
    texted = await handed_off_then_committed(engine, clean_db, sor, discreet, "texted")
    booked = (await sor.side_effects()).bookings_inserted

    assert booked_after_one == 1 and booked == 2  # one booking per call
    for run in (told, texted):
        # Admitted by the host, still running when the manager took over.
        assert run["at_handoff"] == ["running"]
        assert [(o["status"], o["agent"]) for o in run["ops"]] == [("committed", "host")]
        # The host's pending update is not dropped: one delivery, decided for the manager.
        (delivery,) = run["deliveries"]
        assert delivery["agent"] == "manager"
        (decision,) = [e for e in run["told"] if e["kind"] == "decision"]
        assert decision["data"]["agent"] == "manager"
        assert MANAGER_HELLO in run["spoken"]
    # A manager who may disclose bookings says it in the call, after the handoff.
    assert told["deliveries"][0]["channel"] == "call"
    assert [e["data"]["action"] for e in told["told"] if e["kind"] == "decision"] == ["announce"]
    k = told["kinds"]
    assert k.count("agent_handoff") == 1 and k.count("result_announced") == 1
    assert k.index("agent_handoff") < k.index("result_announced") < k.index("result_heard")
    assert told["spoken"][-2:] == [MANAGER_HELLO, RESTAURANT.confirmed_text]
    assert told["texts"] == []
    # One who may not: one SMS, and nothing said about it in the call.
    assert texted["deliveries"][0]["channel"] == "sms"
    (decision,) = [e for e in texted["told"] if e["kind"] == "decision"]
    assert decision["reason"] == "the active agent (manager) may not disclose it: by SMS"
    assert "result_announced" not in texted["kinds"]
    assert RESTAURANT.confirmed_text not in texted["spoken"]
    assert len(texted["texts"]) == 1 and "Ref BK" in texted["texts"][0]
    race.report(
        state="committed after the handoff; admitted by host, delivered by manager (x2)",
        effects=f"{booked} bookings (one a call), 1 delivery a call",
        order="admitted (host) < handoff < committed < told by manager < heard",
        heard=quoted(told["spoken"][-2:]) + f" | undisclosed: sms {steady(texted['texts'][0])!r}",
    )
