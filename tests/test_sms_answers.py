"""Create answers recorded together (`deliveries.report_answers`, written by the channel's one
writer a group at a time) record exactly what `record_sms` recorded one answer at a time under
the message's lock: the same message, delivery and trail rows, whatever the message went
through before its answer came (a callback first, another MessageSid, settled already), and
50 answers at once take a few statements, each message queued once with its own SID."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_twilio_api import FakeTwilioApi
from tests.delivery_support import sms_channel, sms_statuses, trail
from tests.test_sms_status_reports import World, _channel, cb
from tools import deliveries
from tools.delivery_states import SmsStatus

M = SmsStatus

# What a message went through before its create's answer, and that answer (status, SID).
BEFORE_THE_ANSWER: dict[str, tuple[list[tuple[str, ...]], SmsStatus, str]] = {
    "claimed": ([("claim",)], M.QUEUED, "1"),
    "claimed, answered sent": ([("claim",)], M.SENT, "1"),
    "never claimed": ([], M.QUEUED, "1"),
    "a callback came first with the SID": ([("claim",), cb("sent")], M.QUEUED, "1"),
    "a callback came first without a SID": ([("claim",), cb("sent", "")], M.QUEUED, "1"),
    "a sent callback without a SID, answered sent": ([("claim",), cb("sent", "")], M.SENT, "1"),
    "a queued callback first, answered sent": ([("claim",), cb("queued")], M.SENT, "1"),
    "another SID already": ([("claim",), cb("queued", "2")], M.QUEUED, "1"),
    "delivered already": ([("claim",), cb("delivered")], M.QUEUED, "1"),
    "failed already, no SID": ([("claim",), cb("failed", "")], M.SENT, "1"),
    "the same answer twice": ([("claim",), ("answer", "1")], M.QUEUED, "1"),
}  # fmt: skip


async def _one_by_one(world: World, status: SmsStatus, sid: str) -> bool | None:
    """The reference: the answer recorded alone, under the message's lock."""
    async with world.engine.begin() as conn:
        update = await deliveries.record_sms(
            conn, world.message_id, status, actor=world.sms.actor, source="send",
            message_sid=sid, next_check_at=datetime(2030, 1, 1).astimezone(),
        )  # fmt: skip
    return None if update is None else update.changed


async def test_answers_recorded_together_write_the_rows_of_one_by_one(
    engine: AsyncEngine,
) -> None:
    names = list(BEFORE_THE_ANSWER)
    sides: dict[str, list[Any]] = {}
    for label in ("a", "b"):
        async with engine.begin() as conn:
            await conn.execute(sa.text("DELETE FROM sms_opt_outs"))
        worlds = [World(engine, f"{label}{i}x", False) for i in range(len(names))]
        for world, name in zip(worlds, names, strict=True):
            await world.open()
            for step in BEFORE_THE_ANSWER[name][0]:
                await world.do(step)
            await world.snapshot()
        answers = [
            (status, world.sid(token))
            for world, (_, status, token) in zip(
                worlds, (BEFORE_THE_ANSWER[n] for n in names), strict=True
            )
        ]
        if label == "a":
            changed = [
                await _one_by_one(w, s, sid) for w, (s, sid) in zip(worlds, answers, strict=True)
            ]
            missing = await _one_by_one_missing(engine)
        else:
            sms = _channel(engine)
            pairs = zip(worlds, answers, strict=True)
            updates = await asyncio.gather(
                *(sms._answered(w.message_id, status, sid) for w, (status, sid) in pairs),
                sms._answered(uuid.uuid4(), M.QUEUED, "SMnobody"),
            )
            changed = [None if u is None else u.changed for u in updates[:-1]]
            missing = updates[-1]
            # Every answer arrived before the writer ran: one statement a status.
            assert sms.answer_statements == 2
        sides[label] = [
            (name, c, await w.snapshot()) for name, c, w in zip(names, changed, worlds, strict=True)
        ]
        assert missing is None
    for (name, changed_a, rows_a), (_, changed_b, rows_b) in zip(
        sides["a"], sides["b"], strict=True
    ):
        assert changed_b == changed_a, name
        assert rows_b == rows_a, name
        print(name, "->", changed_a, [e["kind"] + ":" + str(e["reason"]) for e in rows_a[2]])


async def _one_by_one_missing(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        update = await deliveries.record_sms(
            conn, uuid.uuid4(), M.QUEUED, actor="sms", source="send", message_sid="SMnobody"
        )
    assert update is None


async def test_a_statement_of_answers_refuses_a_final_status_and_a_message_twice(
    engine: AsyncEngine,
) -> None:
    answer = deliveries.SmsAnswer(uuid.uuid4(), "SM1", None)
    async with engine.connect() as conn:
        with pytest.raises(ValueError, match="settles"):
            await deliveries.report_answers(conn, M.DELIVERED, [answer], actor="t", source="t")
        with pytest.raises(ValueError, match="one answer per message"):
            await deliveries.report_answers(conn, M.QUEUED, [answer, answer], actor="t", source="t")


@pytest.fixture
async def api() -> AsyncIterator[FakeTwilioApi]:
    async with FakeTwilioApi() as fake:
        fake.drop_callbacks = True  # only the create answers move the messages
        yield fake
        fake.release_answers()


async def test_fifty_answers_at_once_are_recorded_in_a_few_statements_each_once(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    worlds = [World(engine, uuid.uuid4().hex[:6], False) for _ in range(50)]
    for world in worlds:
        await world.open()
    async with engine.connect() as conn:
        persisted = [await deliveries.get_sms(conn, w.message_id) for w in worlds]
    sms = sms_channel(engine, api)
    api.lose_message_answers(50)  # held, then all answered at once
    try:
        sending = asyncio.create_task(sms.send_many([m for m in persisted if m is not None]))
        await api.wait_for(lambda a: len(a.created_messages()) == 50, timeout=20)
        api.release_answers()
        await asyncio.wait_for(sending, 20)
    finally:
        await sms.aclose()
    assert 1 <= sms.answer_statements < 50
    sids = {m.sid for m in api.created_messages()}
    async with engine.connect() as conn:
        after = [await deliveries.get_sms(conn, w.message_id) for w in worlds]
    assert {m.message_sid for m in after if m is not None} == sids
    assert all(m is not None and m.status is M.QUEUED and m.attempts == 1 for m in after)
    for world, message in zip(worlds, after, strict=True):
        assert message is not None
        events = [e for e in await trail(engine, world.op_id) if e.kind == "sms"]
        assert sms_statuses(events) == ["pending", "queued"]
        assert events[-1].data["message_sid"] == message.message_sid
    print("50 answers in", sms.answer_statements, "statements")
