"""SMS status callbacks in one statement (`deliveries.report_sms`) record exactly what the
locked read-then-update (`record_sms` under SELECT ... FOR UPDATE) recorded: the same message,
delivery and trail rows, values and order for every sequence of statuses, and two callbacks
for one message at once still serialize."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.ops.sms import (
    NOT_DELIVERABLE_CODES,
    NOT_DELIVERABLE_DELIVERY_CODES,
    OPT_OUT_CODE,
    SmsChannel,
    SmsConfig,
    _int,
    _twilio_status,
)
from tests.delivery_support import CALLER, OUR_NUMBER, booked, delivery_of, make_call, trail
from tools import deliveries
from tools.deliveries import DeliveryRecord
from tools.delivery_models import deliveries_table as dl_t
from tools.delivery_models import delivery_events_table as dev_t
from tools.delivery_models import sms_messages_table as sms_t
from tools.delivery_states import SMS_FINAL, DeliveryState, SmsStatus
from tools.restaurant.catalog import restaurant_catalog

D = DeliveryState
M = SmsStatus


async def _locked_callback(
    engine: AsyncEngine, message_id: uuid.UUID, params: dict[str, str]
) -> deliveries.SmsUpdate | None:
    """What a status callback did before it was one statement (the reference)."""
    status = _twilio_status(params.get("MessageStatus"))
    if status is None:
        return None
    code = _int(params.get("ErrorCode"))
    async with engine.begin() as conn:
        message = await deliveries.get_sms(conn, message_id, for_update=True)
        if message is None:
            return None
        sid = params.get("MessageSid")
        if message.message_sid and sid and sid != message.message_sid:
            return None
        if code == OPT_OUT_CODE:
            await deliveries.set_opt_out(conn, message.to_number, opted_out=True, source="21610")
        return await deliveries.record_sms(
            conn,
            message_id,
            status,
            actor="twilio",
            source="status callback",
            message_sid=sid,
            error_code=code,
            next_check_at=None if status in SMS_FINAL else datetime(2030, 1, 1).astimezone(),
            not_deliverable=code == OPT_OUT_CODE
            or code in NOT_DELIVERABLE_CODES
            or code in NOT_DELIVERABLE_DELIVERY_CODES,
            locked=message,
        )


def _channel(engine: AsyncEngine) -> SmsChannel:
    return SmsChannel(
        engine,
        None,
        restaurant_catalog(),
        SmsConfig(public_base_url="http://127.0.0.1:9", from_number=OUR_NUMBER),
    )


class World:
    """One delivery texting one message, driven step by step; `snapshot` reads its rows with
    ids and the SIDs named by this world, and each timestamp as the step that wrote it."""

    def __init__(self, engine: AsyncEngine, name: str, one_statement: bool) -> None:
        self.engine = engine
        self.name = name
        self.one_statement = one_statement
        self.sms = _channel(engine)
        self.stamps: dict[datetime, str] = {}
        self.step = 0

    async def open(self) -> None:
        call_id = await make_call(self.engine, ended=True)
        self.op_id = await booked(self.engine, call_id)
        delivery = await delivery_of(self.engine, self.op_id)
        async with self.engine.begin() as conn:
            moved = await deliveries.move(
                conn, delivery.id, D.PENDING, D.TEXTING, actor="t", reason="by SMS", channel="sms"
            )
            assert moved is not None
            message = await deliveries.create_sms(
                conn,
                moved,
                to_number=CALLER,
                from_number=OUR_NUMBER,
                messaging_service_sid=None,
                body="Booked",
                reference=None,
                requested_by="delivery",
            )
        self.delivery_id, self.message_id = moved.id, message.id
        await self.snapshot()

    def sid(self, token: str) -> str:
        return f"SM{self.name}{token}"

    async def do(self, step: tuple[str, ...]) -> Any:
        kind, *rest = step
        if kind == "claim":
            async with self.engine.begin() as conn:
                await deliveries.claim_send(conn, self.message_id, check_after=timedelta(0))
            return None
        if kind == "answer":  # the create's answer: queued, with its SID
            if self.one_statement:
                update = await self.sms.record_answer(self.message_id, M.QUEUED, self.sid(rest[0]))
                return update is not None and update.changed
            async with self.engine.begin() as conn:
                update = await deliveries.record_sms(
                    conn, self.message_id, M.QUEUED, actor=self.sms.actor, source="send",
                    message_sid=self.sid(rest[0]), next_check_at=datetime(2030, 1, 1).astimezone(),
                )  # fmt: skip
            return update is not None and update.changed
        if kind == "settle_sent":
            async with self.engine.begin() as conn:
                message = await deliveries.get_sms(conn, self.message_id)
                assert message is not None
                await deliveries.settle_sent(conn, message, actor="sms", reason="no receipt")
            return None
        assert kind == "callback"
        status, token, code = rest
        params = {"MessageStatus": status}
        if token:
            params["MessageSid"] = self.sid(token)
        if code:
            params["ErrorCode"] = code
        message_id = self.message_id if token != "-unknown" else uuid.uuid4()
        if self.one_statement:
            update = await self.sms.apply_callback(message_id, params)
        else:
            update = await _locked_callback(self.engine, message_id, params)
        return None if update is None else update.changed

    async def snapshot(self) -> Any:
        self.step += 1
        async with self.engine.connect() as conn:
            message = (
                await conn.execute(sa.select(sms_t).where(sms_t.c.id == self.message_id))
            ).one()
            delivery = (
                await conn.execute(sa.select(dl_t).where(dl_t.c.id == self.delivery_id))
            ).one()
            trail_of = dev_t.c.delivery_id == self.delivery_id
            events = (
                await conn.execute(sa.select(dev_t).where(trail_of).order_by(dev_t.c.id))
            ).all()
            opted = await deliveries.is_opted_out(conn, CALLER)
        return (
            self._norm(dict(message._mapping), ("next_check_at",)),
            self._norm(dict(delivery._mapping), ("call_id",)),
            [self._norm(dict(e._mapping), ("id",)) for e in events],
            opted,
        )

    def _norm(self, row: dict[str, Any], drop: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in row.items():
            if key in drop:
                out[key] = value is not None
            elif isinstance(value, datetime):
                out[key] = self.stamps.setdefault(value, f"step {self.step}")
            else:
                out[key] = self._plain(value)
        return out

    def _plain(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._plain(v) for k, v in value.items()}
        if value in (self.message_id, str(self.message_id)):
            return "<message>"
        if value in (self.delivery_id, self.op_id):
            return "<delivery or operation>"
        if isinstance(value, str) and value.startswith(f"SM{self.name}"):
            return "SM" + value[len(f"SM{self.name}") :]
        return value


def cb(status: str, token: str = "1", code: str = "") -> tuple[str, ...]:
    return ("callback", status, token, code)


SCENARIOS: dict[str, list[tuple[str, ...]]] = {
    "in order": [("claim",), ("answer", "1"), cb("queued"), cb("sent"), cb("delivered")],
    "duplicates and a late sent": [
        ("claim",), ("answer", "1"), cb("delivered"), cb("delivered"), cb("sent"), cb("sent"),
    ],
    "callbacks before the create's answer": [
        ("claim",), cb("sent"), cb("delivered"), ("answer", "1"), cb("queued"),
    ],
    "undelivered with a code, then a late delivered": [
        ("claim",), ("answer", "1"), cb("sent"), cb("undelivered", "1", "30007"), cb("delivered"),
    ],
    "failed without a code": [("claim",), ("answer", "1"), cb("failed", "1")],
    "canceled, read": [("claim",), ("answer", "1"), cb("canceled"), cb("read")],
    "read": [("claim",), ("answer", "1"), cb("sending"), cb("read")],
    "a landline: not deliverable": [("claim",), ("answer", "1"), cb("undelivered", "1", "30006")],
    "a number that cannot take SMS": [("claim",), ("answer", "1"), cb("failed", "1", "21614")],
    "opted out at Twilio": [("claim",), ("answer", "1"), cb("failed", "1", "21610")],
    "a code on a delivered": [("claim",), ("answer", "1"), cb("delivered", "1", "30006")],
    "another message's SID": [("claim",), ("answer", "1"), cb("delivered", "2"), cb("sent", "1")],
    "no SID, then a stale one that teaches it": [
        ("claim",), cb("sent", ""), cb("queued", "1"), cb("delivered", ""), cb("sent", "2"),
    ],
    "a status Twilio does not send": [("claim",), ("answer", "1"), cb("bogus"), cb("sent")],
    "an unknown message": [("claim",), cb("delivered", "-unknown"), cb("sent")],
    "delivered after the delivery settled as sent": [
        ("claim",), ("answer", "1"), cb("sent"), ("settle_sent",), cb("delivered"),
    ],
    "pending, never claimed": [cb("queued"), cb("delivered")],
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_one_statement_records_the_rows_the_locked_callback_recorded(
    engine: AsyncEngine, name: str
) -> None:
    results = []
    for label, one_statement in (("a", False), ("b", True)):
        async with engine.begin() as conn:
            await conn.execute(sa.text("DELETE FROM sms_opt_outs"))
        world = World(engine, label, one_statement)
        await world.open()
        seen = []
        for step in SCENARIOS[name]:
            changed = await world.do(step)
            seen.append((step, changed, await world.snapshot()))
        results.append(seen)
    locked, one = results
    for (step, changed_a, rows_a), (_, changed_b, rows_b) in zip(locked, one, strict=True):
        assert changed_b == changed_a, step
        assert rows_b == rows_a, step
    print(name, "->", [e["kind"] + ":" + str(e["reason"]) for e in rows_a[2]])


async def test_callbacks_for_one_message_at_once_serialize(engine: AsyncEngine) -> None:
    sms = _channel(engine)
    for order in (["delivered", "sent"], ["sent", "delivered"], ["delivered"] * 3):
        world = World(engine, uuid.uuid4().hex[:6], True)
        await world.open()
        await world.do(("claim",))
        await world.do(("answer", "1"))
        params = [{"MessageStatus": s, "MessageSid": world.sid("1")} for s in order * 2]
        updates = await asyncio.gather(*(sms.apply_callback(world.message_id, p) for p in params))
        assert all(u is not None for u in updates)
        events = await trail(engine, world.op_id)
        statuses = [e.data["status"] for e in events if e.kind == "sms"]
        moves = [e.to_state for e in events if e.kind == "transition"]
        # Each status recorded once, only forward; the delivery settled once.
        assert statuses[-1] == "delivered" and len(statuses) == len(set(statuses))
        assert moves == ["pending", "texting", "texted"]
        assert sum(1 for u in updates if u is not None and u.changed) == len(statuses) - 2
        assert (await delivery_of(engine, world.op_id)).state is D.TEXTED


async def test_settling_a_sent_message_waits_for_a_receipt_being_recorded_and_never_deadlocks(
    engine: AsyncEngine,
) -> None:
    """The poller settles a message left `sent` while a receipt for it is being recorded under
    its lock (the callback's locked path: message, then delivery): one waits for the other."""
    world = World(engine, uuid.uuid4().hex[:6], True)
    await world.open()
    for step in (("claim",), ("answer", "1"), cb("sent")):
        await world.do(step)
    async with engine.begin() as conn:
        message = await deliveries.get_sms(conn, world.message_id)
    assert message is not None and message.status is M.SENT

    async def settle() -> DeliveryRecord | None:
        async with engine.begin() as conn:
            return await deliveries.settle_sent(conn, message, actor="sms", reason="no receipt")

    async with engine.begin() as conn:  # the receipt's transaction, as the callback runs it
        await conn.execute(sa.text("SET LOCAL deadlock_timeout = '100ms'"))
        locked = await deliveries.get_sms(conn, world.message_id, for_update=True)
        settling = asyncio.create_task(settle())
        await asyncio.sleep(0.5)  # the settle is under way, waiting for a lock
        update = await deliveries.record_sms(
            conn, world.message_id, M.DELIVERED, actor="twilio", source="status callback",
            message_sid=world.sid("1"), locked=locked,
        )  # fmt: skip
    settled = await asyncio.wait_for(settling, 10)
    assert update is not None and update.changed
    assert settled is None  # the receipt came first: the delivery is the receipt's to settle
    moves = [e.to_state for e in await trail(engine, world.op_id) if e.kind == "transition"]
    assert moves.count("texted") == 1
