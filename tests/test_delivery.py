"""Late results on real Postgres: the replica holding the call announces, once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.delivery import ANNOUNCED, DEFERRED, ResultDelivery
from app.pg_listener import PgListener
from telephony.tool_gateway import LateResult
from tests.e2e_support import wait_until
from tools import ledger
from tools.restaurant.catalog import restaurant_catalog
from tools.states import OperationStatus

S = OperationStatus
ARGS = {"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada"}


class FakeLiveCall:
    """A live call that records what it was asked to say (stands in for the bridge)."""

    def __init__(self, accepts: bool = True) -> None:
        self.accepts = accepts
        self.results: list[LateResult] = []

    async def deliver_result(self, result: LateResult) -> bool:
        if self.accepts:
            self.results.append(result)
        return self.accepts

    async def end(self, reason: str) -> None:
        self.accepts = False


async def _call(engine: AsyncEngine, *, ended: bool = False) -> str:
    call_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO calls (id, call_sid, status, ended_at) VALUES (:id, :sid, :st, :end)"
            ),
            {
                "id": call_id,
                "sid": "CA" + call_id.hex,
                "st": "completed" if ended else "in_progress",
                "end": datetime.now(UTC) if ended else None,
            },
        )
    return str(call_id)


async def _test_plays_the_worker(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
    """No job queue here: the test moves the operation itself, as a worker would."""


async def _finish(engine: AsyncEngine, call_id: str, final: OperationStatus) -> uuid.UUID:
    """An admitted booking of `call_id` that runs and ends in `final`."""
    async with engine.begin() as conn:
        adm = await ledger.admit_operation(
            conn,
            tenant_id="default",
            tool="book_table",
            args=ARGS,
            idempotency_key=f"k-{uuid.uuid4()}",
            call_id=call_id,
            caller="+15551230000",
            enqueue=_test_plays_the_worker,
        )
    op_id = adm.operation.operation_id
    async with engine.begin() as conn:
        await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="worker:t", reason="run")
    async with engine.begin() as conn:
        fields = {"provider_ref": "BK1"} if final is S.COMMITTED else {"error": "no tables"}
        await ledger.transition(
            conn, op_id, S.RUNNING, final, actor="worker:t", reason="provider said", **fields
        )
    return op_id


async def _decisions(engine: AsyncEngine, op_id: uuid.UUID) -> list[str]:
    async with engine.connect() as conn:
        events = await ledger.get_events(conn, op_id)
    return [e.reason for e in events if e.kind == "decision" and e.actor == "delivery"]


@asynccontextmanager
async def replica(
    engine: AsyncEngine, database_url: str, live: dict[str, FakeLiveCall]
) -> AsyncIterator[ResultDelivery]:
    """One replica's delivery step: its own LISTEN connection and its own live calls."""
    delivery = ResultDelivery(engine, restaurant_catalog(), live.get, lambda: list(live))
    listener = PgListener(database_url)
    delivery.subscribe(listener)
    await listener.start()
    try:
        yield delivery
    finally:
        await listener.stop()
        await delivery.stop()


async def test_committed_booking_is_announced_once_by_the_replica_holding_the_call(
    engine: AsyncEngine, clean_db: str
) -> None:
    call_id = await _call(engine)
    here = FakeLiveCall()
    async with (
        replica(engine, clean_db, {call_id: here}),
        replica(engine, clean_db, {}),  # another replica hears the same notification
    ):
        op_id = await _finish(engine, call_id, S.COMMITTED)
        await wait_until(lambda: len(here.results) == 1, 10, "announcement")
        await wait_until(lambda: _decided(engine, op_id), 10, "decision recorded")
    assert here.results[0].operation_id == str(op_id)
    assert here.results[0].text.startswith("Done and confirmed by the restaurant")
    assert "BK1" in here.results[0].text
    assert await _decisions(engine, op_id) == [ANNOUNCED]


async def _decided(engine: AsyncEngine, op_id: uuid.UUID) -> bool:
    return bool(await _decisions(engine, op_id))


async def test_a_failure_is_announced_truthfully_not_as_done(
    engine: AsyncEngine, clean_db: str
) -> None:
    call_id = await _call(engine)
    here = FakeLiveCall()
    async with replica(engine, clean_db, {call_id: here}):
        await _finish(engine, call_id, S.FAILED_FINAL)
        await wait_until(lambda: len(here.results) == 1, 10, "announcement")
    text = here.results[0].text
    assert text.startswith("That could not be done") and "no tables" in text
    assert "confirmed" not in text


async def test_outcome_after_the_call_ended_is_deferred_once_across_replicas(
    engine: AsyncEngine, clean_db: str
) -> None:
    call_id = await _call(engine, ended=True)
    async with replica(engine, clean_db, {}) as one, replica(engine, clean_db, {}) as two:
        op_id = await _finish(engine, call_id, S.COMMITTED)
        await wait_until(lambda: _decided(engine, op_id), 10, "decision recorded")
        # However often and wherever it is looked at again, the decision stands alone.
        assert await one.deliver(op_id) is None
        assert await two.deliver(op_id) is None
    assert await _decisions(engine, op_id) == [DEFERRED]


async def test_a_call_that_is_ending_gets_the_outcome_deferred(
    engine: AsyncEngine, clean_db: str
) -> None:
    call_id = await _call(engine)
    ending = FakeLiveCall(accepts=False)
    async with replica(engine, clean_db, {call_id: ending}) as delivery:
        op_id = await _finish(engine, call_id, S.COMMITTED)
        await wait_until(lambda: _decided(engine, op_id), 10, "decision recorded")
        assert await delivery.deliver(op_id) is None  # decided already: never twice
    async with engine.connect() as conn:
        events = await ledger.get_events(conn, op_id)
    notes = [e.reason for e in events if e.actor == "delivery"]
    assert notes == [ANNOUNCED, DEFERRED]
    assert ending.results == []


async def test_outcome_missed_while_not_listening_is_caught_up_on_listen(
    engine: AsyncEngine, clean_db: str
) -> None:
    call_id = await _call(engine)
    op_id = await _finish(engine, call_id, S.COMMITTED)  # nobody listening yet
    here = FakeLiveCall()
    async with replica(engine, clean_db, {call_id: here}):
        await wait_until(lambda: len(here.results) == 1, 10, "caught-up announcement")
    assert here.results[0].operation_id == str(op_id)
    assert await _decisions(engine, op_id) == [ANNOUNCED]
