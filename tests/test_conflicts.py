"""Conflicting requests on real Postgres: a second booking by the same caller for the same day
waits while the first is in flight, and the caller decides once it is settled."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.ops.delivery import evaluate
from tests.test_gateway import BOOK, Harness, ctx
from tools import deliveries, ledger
from tools.relevance import Action, CallState
from tools.restaurant.catalog import restaurant_catalog
from tools.results import announcement_text, sms_text
from tools.states import OperationStatus

S = OperationStatus
LATER = {**BOOK, "time": "21:30"}


@pytest.fixture
async def h(engine: AsyncEngine) -> Harness:
    async with engine.begin() as conn:
        await conn.execute(
            sa.text("CREATE TABLE IF NOT EXISTS test_jobs (operation_id uuid NOT NULL)")
        )
        await conn.execute(sa.text("TRUNCATE test_jobs"))
    return Harness(engine)


async def _booked_and_running(h: Harness, call: str = "call-1") -> uuid.UUID:
    c = ctx(call)
    first = await h.call(c, "book_table", BOOK)
    assert first.output["status"] == "awaiting_confirmation"
    admitted = await h.confirm(c, first)
    assert admitted.output["status"] == "admitted"
    op_id = uuid.UUID(first.output["operation_id"])
    async with h.engine.begin() as conn:
        await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="worker:t", reason="go")
    return op_id


async def _settle(h: Harness, op_id: uuid.UUID, final: S = S.COMMITTED) -> None:
    async with h.engine.begin() as conn:
        extra = {"provider_ref": "BKFIRST234"} if final is S.COMMITTED else {"error": "full"}
        await ledger.transition(
            conn, op_id, S.RUNNING, final, actor="worker:t", reason="provider", **extra
        )


async def test_a_second_booking_for_the_same_day_waits_while_the_first_is_in_flight(
    h: Harness,
) -> None:
    first = await _booked_and_running(h)
    reply = await h.call(ctx(), "book_table", LATER)
    assert reply.output["status"] == "held"
    assert "still being processed" in reply.output["message"]
    second = await h.op(reply)
    assert second.status is S.AWAITING_CONFIRMATION
    assert second.held_by_operation_id == first
    assert second.conflict_key == "booking-day:2026-12-05"
    # Confirming it while the first is unsettled changes nothing: it stays held, unqueued.
    confirm = await h.confirm(ctx(), reply)
    assert confirm.output["status"] == "held"
    assert (await h.op(reply)).status is S.AWAITING_CONFIRMATION
    assert await h.jobs() == [first]  # only the first was ever queued
    tc = await h.tool_call(ctx(), "fc_4")
    assert tc.decision == "held"


async def test_another_day_or_another_caller_is_no_conflict(h: Harness) -> None:
    await _booked_and_running(h)
    other_day = await h.call(ctx(), "book_table", {**LATER, "date": "2026-12-06"})
    assert other_day.output["status"] == "awaiting_confirmation"
    other_caller = await h.call(ctx("call-2", phone="+15550003"), "book_table", LATER)
    assert other_caller.output["status"] == "awaiting_confirmation"


async def test_the_first_outcome_is_told_with_the_conflict_not_as_the_answer_to_the_second(
    h: Harness, engine: AsyncEngine
) -> None:
    first = await _booked_and_running(h)
    await h.call(ctx(), "book_table", LATER)
    await _settle(h, first)
    registry = restaurant_catalog()
    async with engine.connect() as conn:
        delivery = await deliveries.for_operation(conn, first)
        assert delivery is not None
        op = await ledger.get_operation(conn, first)
        assert op is not None
        found = await evaluate(
            conn, registry, delivery, op, CallState.LIVE_HERE, live_caller="+15550001"
        )
    assert found.gate.action is Action.ANNOUNCE and found.gate.contradicted
    assert "contradicted by" in found.gate.checks["current"]
    text = announcement_text(registry.get("book_table"), op, newer=found.newer)
    assert "at 21:00" in text and "Done and confirmed" in text
    asked = "a table for 4 people on Saturday 05 December 2026 at 21:30 under the name Ada"
    assert f"Meanwhile the caller asked for {asked} instead; that has not been done" in text
    assert "move it" in text and "keep both" in text
    sms = sms_text(registry.get("book_table"), op, newer=found.newer)
    assert sms.startswith("Confirmed: a table for 4 people on Saturday 05 December 2026 at 21:00")
    assert f"You also asked for {asked}; that was not done." in sms


async def test_once_settled_keep_both_admits_the_second_on_an_explicit_yes(h: Harness) -> None:
    first = await _booked_and_running(h)
    held = await h.call(ctx(), "book_table", LATER)
    await _settle(h, first)
    reply = await h.call(
        ctx(),
        "resolve_conflict",
        {"operation_id": held.output["operation_id"], "choice": "keep_both"},
    )
    assert reply.output["status"] == "admitted"
    second = await h.op(held)
    assert second.status is S.ADMITTED
    events = await h.events(second.operation_id)
    assert events[-1].reason == "the caller explicitly chose to keep both"
    assert set(await h.jobs()) == {first, second.operation_id}
    async with h.engine.connect() as conn:
        assert (await ledger.get_operation(conn, first)).status is S.COMMITTED  # type: ignore[union-attr]


async def test_once_settled_move_compensates_the_first_and_admits_the_second_together(
    h: Harness,
) -> None:
    first = await _booked_and_running(h)
    held = await h.call(ctx(), "book_table", LATER)
    await _settle(h, first)
    reply = await h.call(
        ctx(), "resolve_conflict", {"operation_id": held.output["operation_id"], "choice": "move"}
    )
    assert reply.output["status"] == "admitted"
    assert "being cancelled" in reply.output["message"]
    compensation = await h.op(reply.output["compensation_operation_id"])
    assert compensation.tool == "cancel_booking"
    assert compensation.args == {"booking_id": "BKFIRST234"}
    assert compensation.compensates_operation_id == first
    assert compensation.status is S.ADMITTED
    second = await h.op(held)
    assert second.status is S.ADMITTED
    assert set(await h.jobs()) == {first, compensation.operation_id, second.operation_id}


async def test_drop_keeps_the_first_and_cancels_the_second(h: Harness) -> None:
    first = await _booked_and_running(h)
    held = await h.call(ctx(), "book_table", LATER)
    too_early = await h.call(
        ctx(), "resolve_conflict", {"operation_id": held.output["operation_id"], "choice": "drop"}
    )
    assert too_early.output["status"] == "held"  # nothing is decided before it settles
    await _settle(h, first)
    reply = await h.call(
        ctx(), "resolve_conflict", {"operation_id": held.output["operation_id"], "choice": "drop"}
    )
    assert reply.output["status"] == "cancelled"
    assert (await h.op(held)).status is S.CANCELLED
    assert await h.jobs() == [first]


async def test_after_the_first_went_through_a_new_same_day_booking_asks_to_keep_both(
    h: Harness,
) -> None:
    first = await _booked_and_running(h)
    await _settle(h, first)
    reply = await h.call(ctx(), "book_table", LATER)
    assert reply.output["status"] == "awaiting_confirmation"
    readback = reply.output["readback"]
    assert "already has a table for 4 people" in readback and "BKFIRST234" in readback
    assert "Say yes to keep both" in readback
    # Its confirmation is the explicit yes to keep both.
    assert (await h.confirm(ctx(), reply)).output["status"] == "admitted"


async def test_a_held_request_is_cancelled_with_the_call_and_the_sms_still_mentions_it(
    h: Harness, engine: AsyncEngine
) -> None:
    first = await _booked_and_running(h)
    held = await h.call(ctx(), "book_table", LATER)
    await h.pipe.on_call_end(ctx())
    assert (await h.op(held)).status is S.CANCELLED
    await _settle(h, first)
    registry = restaurant_catalog()
    async with engine.connect() as conn:
        delivery = await deliveries.for_operation(conn, first)
        op = await ledger.get_operation(conn, first)
        assert delivery is not None and op is not None
        found = await evaluate(conn, registry, delivery, op, CallState.ENDED)
        count = await conn.scalar(sa.text("SELECT count(*) FROM operations"))
    assert count == 2
    assert found.gate.action is Action.TEXT
    assert found.newer and "21:30" in found.newer[0]
