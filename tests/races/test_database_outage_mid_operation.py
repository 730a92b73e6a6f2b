"""database_outage_mid_operation: PostgreSQL goes away while a booking runs, and the system of
record commits during the outage. Media keeps flowing (the caller is answered meanwhile), the
provider's answer is recorded within moments of the database's return (not left for a sweep
and a reconciliation), one booking, told once, no call event lost, and the outage is logged
as one warning when it starts and one when it ends: no traceback, no ERROR line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import make_engine
from tests.db_link import DatabaseLink
from tests.e2e_support import wait_until
from tests.race_report import Race
from tests.races.support import (
    REQUESTED,
    ask_and_confirm,
    booking,
    heard,
    quoted,
    stack_for,
    statuses,
    to_statuses,
)
from tests.test_e2e_booking import (
    WAIT_S,
    hear,
    wait_for_delivery,
    wait_for_operation,
    wait_spoken,
)
from tests.test_e2e_delivery import kinds
from tools import faults
from tools.outage import DATABASE
from tools.restaurant.sor import SystemOfRecord

pytestmark = pytest.mark.races

OUTAGE_S = 4.0
ANSWER = "Yes, I'm still here; it is on its way."


@pytest.fixture
async def link(clean_db: str) -> AsyncIterator[DatabaseLink]:
    link = await DatabaseLink(clean_db).start()
    try:
        yield link
    finally:
        await link.stop()


@pytest.fixture
async def service_engine(link: DatabaseLink) -> AsyncIterator[AsyncEngine]:
    """The service's own engine, through the link (the test observes on its own)."""
    engine = make_engine(link.url)
    try:
        yield engine
    finally:
        await engine.dispose()


async def test_database_outage_mid_operation(
    engine: AsyncEngine,
    service_engine: AsyncEngine,
    sor: SystemOfRecord,
    link: DatabaseLink,
    race: Race,
    caplog: pytest.LogCaptureFixture,
) -> None:
    DATABASE.down_since = None  # this process's view starts healthy
    ask = {"caller_transcript": "Are you still there?", "reply": {"text": ANSWER, "audio_ms": 900}}
    answered = faults.Gate()
    caplog.set_level(logging.INFO)
    with faults.armed("executor.answered", answered):
        async with stack_for(service_engine, link.url, sor, booking(ask)) as stack:
            caller = stack.caller()
            call_id = await ask_and_confirm(stack, caller)
            # The restaurant has booked the table; its answer is not recorded yet.
            await wait_until(answered.reached.is_set, WAIT_S, "the provider's answer")
            await wait_spoken(engine, call_id, REQUESTED)
            await hear(caller, caller.heard_ms)
            mark = len(caplog.records)
            link.cut()
            cut_at = time.monotonic()
            answered.open()  # the worker now tries to record it, with no database
            # The call goes on: the caller speaks and is answered, all during the outage.
            before = caller.heard_ms
            await caller.play_speech(600)
            await caller.wait_for(lambda c: c.heard_ms >= before + 800, WAIT_S)
            talked_ms = caller.heard_ms - before
            await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - cut_at)))
            assert await statuses(engine, call_id) == ["running"]  # nothing recorded meanwhile
            link.restore()
            back_at = time.monotonic()
            op = await wait_for_operation(engine, call_id, "committed", within=WAIT_S)
            recorded_s = time.monotonic() - back_at
            await wait_for_delivery(engine, op["operation_id"], "heard", within=WAIT_S)
            await hear(caller, caller.heard_ms)
            await caller.hangup()
            events = await stack.events(caller)
            dropped = stack.service.runtime.events.dropped
            spoken = await heard(engine, call_id)
            moved = await to_statuses(engine, op["operation_id"])
            effects = await sor.side_effects()
            outage = caplog.records[mark:]

    assert link.refused > 0  # the service did try the database during the outage
    assert talked_ms >= 800  # media flowed: the caller was answered while it was away
    assert ANSWER in spoken
    assert moved == ["awaiting_confirmation", "admitted", "running", "committed"]
    assert effects.bookings_inserted == 1
    assert recorded_s < 3.0, f"recorded {recorded_s:.1f} s after the database came back"
    k = kinds(events)
    assert k.count("result_announced") == 1 and k.count("result_heard") == 1
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))  # none lost
    assert dropped == 0
    assert REQUESTED in spoken and "confirmed" in spoken[-1]
    assert stack.api.created_messages() == []
    # One warning when it went, one when it came back; no traceback, no error.
    said = [r.getMessage() for r in outage if r.name == "tools.outage"]
    assert len(said) == 2, said
    assert said[0].startswith("database unreachable")
    assert said[1].startswith("database answering again")
    noisy = [r for r in outage if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [(r.name, r.getMessage()) for r in noisy]
    race.report(
        state=f"running through a {OUTAGE_S:.0f} s outage > committed (recorded on the "
        "database's return, no sweep)",
        effects=f"{effects.bookings_inserted} booking, 0 events lost, 2 log lines",
        order="provider answered < database cut < caller answered < database back < "
        "recorded < announced once < heard",
        heard=quoted(spoken[-2:]),
    )
