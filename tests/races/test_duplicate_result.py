"""duplicate_result: the provider's answer and two signed callbacks report the same commit.
One terminal transition, one delivery: the caller is told once."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import wait_until
from tests.race_report import Race
from tests.races.support import ask_and_confirm, booking, heard, quoted, stack_for, statuses
from tests.sor_support import CALLBACK_SECRET
from tests.test_e2e_booking import (
    WAIT_S,
    delivery_trail,
    hear,
    operations_of,
    rows,
    trail,
    wait_for_delivery,
    wait_for_operation,
)
from tests.test_e2e_delivery import kinds, notes
from tools import faults
from tools.callback import CallbackReport, signed_headers
from tools.restaurant.sor import SystemOfRecord

pytestmark = pytest.mark.races


async def test_duplicate_result(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, race: Race
) -> None:
    # The worker holds the provider's answer while its callback arrives, twice.
    answered = faults.Gate()
    with faults.armed("executor.answered", answered):
        async with stack_for(engine, clean_db, sor, booking()) as stack:
            caller = stack.caller()
            call_id = await ask_and_confirm(stack, caller)
            await wait_until(answered.reached.is_set, WAIT_S, "the provider's answer")
            op = (await operations_of(engine, call_id))[0]
            report = CallbackReport(
                idempotency_key=op["idempotency_key"],
                status="committed",
                sequence=1,
                reference=answered.arrivals[0]["reference"],
                result=answered.arrivals[0]["result"],
            )
            body = report.model_dump_json().encode()
            headers = {
                "content-type": "application/json",
                **signed_headers(CALLBACK_SECRET, body, report.message_id()),
            }
            url = f"{stack.service.url}/operations/{op['operation_id']}/callback"
            async with httpx.AsyncClient(timeout=10) as http:
                answers = await asyncio.gather(
                    *(http.post(url, content=body, headers=headers) for _ in range(2))
                )
            answered.open()  # and now the answer itself is recorded
            await wait_for_operation(engine, call_id, "committed")
            await wait_for_delivery(engine, op["operation_id"], "heard")
            await hear(caller, caller.heard_ms)
            await caller.hangup()
            events = await stack.events(caller)
            said = notes(stack.sim.sessions[0])
            spoken = await heard(engine, call_id)
            ops = await statuses(engine, call_id)
            moves = await trail(engine, op["operation_id"])
            told = await delivery_trail(engine, op["operation_id"])
            deliveries = await rows(
                engine, "SELECT * FROM deliveries WHERE operation_id = :o", o=op["operation_id"]
            )
            effects = await sor.side_effects()

    assert [a.status_code for a in answers] == [200, 200]
    assert sorted(a.json()["applied"] for a in answers) == [False, True]
    assert ops == ["committed"]
    assert effects.bookings_inserted == 1
    committed = [e for e in moves if e["kind"] == "transition" and e["to_status"] == "committed"]
    assert len(committed) == 1 and not committed[0]["actor"].startswith("worker:")
    ignored = [e for e in moves if (e["reason"] or "").startswith("late outcome of attempt")]
    assert len(ignored) == 1  # the provider's own answer came last and changed nothing
    assert len(deliveries) == 1
    assert [e["to_state"] for e in told if e["kind"] == "transition"] == [
        "pending",
        "offered",
        "heard",
    ]
    assert kinds(events).count("result_announced") == 1 and len(said) == 1
    assert stack.api.created_messages() == []
    race.report(
        state="committed once (by the first callback; the answer and the second ignored)",
        effects=f"{effects.bookings_inserted} booking, {len(deliveries)} delivery",
        order="answer held < callback x2 (one applied) < answer recorded as late < heard",
        heard=quoted(spoken[-1:]),
    )
