"""Helpers for delivery tests: calls and finished operations on the ledger, a fake live call,
the SMS channel pointed at the fake Twilio API, and readers of the durable state."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.calls.registry import LiveCallEntry
from app.ops.delivery import ResultDelivery
from app.ops.delivery_jobs import DeliveryConfig, DeliveryDriver
from app.ops.sms import SmsChannel, SmsConfig
from app.ops.twilio_rest import make_twilio_client
from app.pg_listener import PgListener
from telephony.sim.fake_caller import DEFAULT_ACCOUNT_SID, DEFAULT_AUTH_TOKEN
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.tool_gateway import AnnouncementReport, AnnouncementStatus, LateResult
from tools import deliveries, ledger
from tools.registry import Registry
from tools.restaurant.catalog import restaurant_catalog
from tools.states import OperationStatus

S = OperationStatus
CALLER = "+15551230000"
OUR_NUMBER = "+15550000000"
ARGS = {"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada"}


class FakeLiveCall:
    """A live call that records what it was asked to say (stands in for the bridge), and
    reports back what the test says happened to each announcement."""

    def __init__(self, accepts: bool = True) -> None:
        self.accepts = accepts
        self.results: list[LateResult] = []
        self.turn_id = 1
        self.sink: ResultDelivery | None = None

    async def deliver_result(self, result: LateResult) -> bool:
        if self.accepts:
            self.results.append(result)
        return self.accepts

    async def end(self, reason: str) -> None:
        self.accepts = False

    def report(self, status: AnnouncementStatus, index: int = -1, **kw: Any) -> None:
        assert self.sink is not None
        result = self.results[index]
        self.sink.report(
            AnnouncementReport(
                operation_id=result.operation_id,
                delivery_id=result.delivery_id,
                status=status,
                response_id=kw.pop("response_id", f"resp_{len(self.results)}"),
                **kw,
            )
        )


async def make_call(
    engine: AsyncEngine,
    *,
    ended: bool = False,
    from_number: str | None = CALLER,
    heartbeat_at: datetime | None = None,
    holder: str | None = "test-holder",
) -> str:
    call_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO calls (id, call_sid, status, from_number, ended_at, answered_at, "
                "heartbeat_at, holder) VALUES (:id, :sid, :st, :from, :end, now(), :beat, :h)"
            ),
            {
                "id": call_id,
                "sid": "CA" + call_id.hex,
                "st": "completed" if ended else "in_progress",
                "from": from_number,
                "end": datetime.now(UTC) if ended else None,
                "beat": heartbeat_at or datetime.now(UTC),
                "h": holder,
            },
        )
    return str(call_id)


async def _test_plays_the_worker(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
    """No operation worker here: the test moves the operation itself, as a worker would."""


async def admitted(
    engine: AsyncEngine,
    call_id: str | None,
    *,
    args: dict[str, Any] | None = None,
    caller: str | None = CALLER,
    turn_id: int = 1,
    conflict_key: str | None = None,
) -> uuid.UUID:
    async with engine.begin() as conn:
        adm = await ledger.admit_operation(
            conn,
            tenant_id="default",
            tool="book_table",
            args=args or ARGS,
            idempotency_key=f"k-{uuid.uuid4()}",
            call_id=call_id,
            caller=caller,
            turn_id=turn_id,
            conflict_key=conflict_key,
            enqueue=_test_plays_the_worker,
        )
    return adm.operation.operation_id


async def finish(
    engine: AsyncEngine, op_id: uuid.UUID, final: OperationStatus = S.COMMITTED
) -> None:
    """Run an admitted operation to `final`, as a worker would."""
    async with engine.begin() as conn:
        await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="worker:t", reason="run")
    async with engine.begin() as conn:
        fields = {"provider_ref": "BK7QX2MHN4"} if final is S.COMMITTED else {"error": "no tables"}
        await ledger.transition(
            conn, op_id, S.RUNNING, final, actor="worker:t", reason="provider said", **fields
        )


async def booked(
    engine: AsyncEngine,
    call_id: str | None,
    final: OperationStatus = S.COMMITTED,
    **kw: Any,
) -> uuid.UUID:
    op_id = await admitted(engine, call_id, **kw)
    await finish(engine, op_id, final)
    return op_id


async def delivery_of(engine: AsyncEngine, op_id: uuid.UUID) -> deliveries.DeliveryRecord:
    async with engine.connect() as conn:
        found = await deliveries.for_operation(conn, op_id)
    assert found is not None, "no delivery"
    return found


async def trail(engine: AsyncEngine, op_id: uuid.UUID) -> list[deliveries.DeliveryEvent]:
    delivery = await delivery_of(engine, op_id)
    async with engine.connect() as conn:
        return await deliveries.events(conn, delivery.id)


async def sms_of(engine: AsyncEngine, op_id: uuid.UUID) -> list[deliveries.SmsRecord]:
    delivery = await delivery_of(engine, op_id)
    async with engine.connect() as conn:
        return await deliveries.sms_for_delivery(conn, delivery.id)


async def waiting_jobs(engine: AsyncEngine, delivery_id: uuid.UUID) -> int:
    """The delivery's `deliver_outcome` jobs waiting to run."""
    async with engine.connect() as conn:
        return int(
            await conn.scalar(
                sa.text(
                    "SELECT count(*) FROM procrastinate_jobs WHERE task_name = 'deliver_outcome' "
                    "AND status = 'todo' AND args->>'delivery_id' = :d"
                ),
                {"d": str(delivery_id)},
            )
            or 0
        )


def moves(events: list[deliveries.DeliveryEvent]) -> list[str | None]:
    return [e.to_state for e in events if e.kind == "transition"]


def decisions(events: list[deliveries.DeliveryEvent]) -> list[str | None]:
    return [e.reason for e in events if e.kind == "decision"]


def sms_statuses(events: list[deliveries.DeliveryEvent]) -> list[str]:
    return [str(e.data.get("status")) for e in events if e.kind == "sms"]


def sms_channel(
    engine: AsyncEngine,
    api: FakeTwilioApi,
    *,
    public_base_url: str = "http://127.0.0.1:9",
    registry: Registry | None = None,
    **config: Any,
) -> SmsChannel:
    client = make_twilio_client(
        DEFAULT_ACCOUNT_SID, DEFAULT_AUTH_TOKEN, api.base_url, timeout=config.pop("timeout", 5.0)
    )
    values: dict[str, Any] = {
        "public_base_url": public_base_url,
        "from_number": OUR_NUMBER,
        "sender_name": "Luigi's",
        "send_timeout_s": 5.0,
        "reconcile_grace_s": 0.5,
        "retry_s": 0.2,
        **config,
    }
    return SmsChannel(
        engine, client, registry or restaurant_catalog(), SmsConfig(**values), owns_client=True
    )


def driver(engine: AsyncEngine, sms: SmsChannel, **config: Any) -> DeliveryDriver:
    return DeliveryDriver(engine, restaurant_catalog(), sms, DeliveryConfig(**config))


@asynccontextmanager
async def replica(
    engine: AsyncEngine,
    database_url: str,
    live: dict[str, FakeLiveCall],
    *,
    sms: SmsChannel | None = None,
    max_reoffers: int = 2,
    holder: str = "replica-1",
) -> AsyncIterator[ResultDelivery]:
    """One replica's in-call delivery: its own LISTEN connection and its own live calls."""

    def find(call_id: str) -> LiveCallEntry | None:
        call = live.get(call_id)
        if call is None:
            return None
        return LiveCallEntry(
            call_sid="CA" + call_id, call_id=call_id, live=call, from_number=CALLER
        )

    delivery = ResultDelivery(
        engine,
        restaurant_catalog(),
        find,
        lambda: list(live),
        holder=holder,
        max_reoffers=max_reoffers,
        sms=sms,
    )
    for call in live.values():
        call.sink = delivery
    listener = PgListener(database_url)
    delivery.subscribe(listener)
    await listener.start()
    try:
        yield delivery
    finally:
        await listener.stop()
        await delivery.stop()
