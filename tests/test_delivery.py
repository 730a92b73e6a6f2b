"""Late results on real Postgres and a real (fake) Twilio API over sockets: every outcome is
decided once, told in the call that holds it or by SMS, and the trail says why."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.ops.delivery_jobs import ready_out_of_call
from app.ops.worker import OperationWorker
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.tool_gateway import AnnouncementStatus
from tests.delivery_support import (
    CALLER,
    FakeLiveCall,
    admitted,
    booked,
    decisions,
    delivery_of,
    driver,
    make_call,
    moves,
    replica,
    sms_channel,
    sms_of,
    trail,
    waiting_jobs,
)
from tests.e2e_support import wait_until
from tools import deliveries, ledger
from tools.delivery_states import DeliveryState
from tools.relevance import CallState
from tools.restaurant.catalog import restaurant_catalog
from tools.restaurant.client import SorClient
from tools.restaurant.provider import SorProvider
from tools.states import OperationStatus

S = OperationStatus
D = DeliveryState


@pytest.fixture
async def api() -> AsyncIterator[FakeTwilioApi]:
    async with FakeTwilioApi(sms_step_delay_s=0.01) as fake:
        yield fake


async def _state(engine: AsyncEngine, op_id: uuid.UUID) -> D:
    return (await delivery_of(engine, op_id)).state


async def test_the_delivery_is_opened_in_the_transaction_that_makes_the_outcome_final(
    engine: AsyncEngine,
) -> None:
    call_id = await make_call(engine)
    op_id = await admitted(engine, call_id)
    async with engine.begin() as conn:
        await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="w", reason="run")

    class Abort(Exception):
        pass

    with pytest.raises(Abort):
        async with engine.begin() as conn:
            await ledger.transition(
                conn, op_id, S.RUNNING, S.COMMITTED, actor="w", reason="ok", provider_ref="BK1"
            )
            assert await deliveries.for_operation(conn, op_id) is not None
            raise Abort
    async with engine.connect() as conn:
        assert await deliveries.for_operation(conn, op_id) is None  # rolled back together
        jobs = await conn.scalar(
            sa.text("SELECT count(*) FROM procrastinate_jobs WHERE task_name = 'deliver_outcome'")
        )
    assert jobs == 0
    async with engine.begin() as conn:
        await ledger.transition(
            conn, op_id, S.RUNNING, S.COMMITTED, actor="w", reason="ok", provider_ref="BK1"
        )
    delivery = await delivery_of(engine, op_id)
    assert delivery.state is D.PENDING and delivery.outcome is S.COMMITTED
    async with engine.connect() as conn:
        queued = await conn.scalar(
            sa.text(
                "SELECT count(*) FROM procrastinate_jobs WHERE task_name = 'deliver_outcome' "
                "AND args->>'delivery_id' = :d"
            ),
            {"d": str(delivery.id)},
        )
    assert queued == 1


async def test_a_withdrawn_request_needs_no_delivery_and_a_call_less_one_gets_none(
    engine: AsyncEngine,
) -> None:
    call_id = await make_call(engine)
    op_id = await admitted(engine, call_id)
    async with engine.begin() as conn:
        await ledger.request_cancel(conn, op_id, actor="model", reason="caller changed mind")
    assert await _state(engine, op_id) is D.NOT_NEEDED
    orphan = await booked(engine, None)
    async with engine.connect() as conn:
        assert await deliveries.for_operation(conn, orphan) is None


async def test_committed_booking_is_announced_once_by_the_replica_holding_the_call(
    engine: AsyncEngine, clean_db: str
) -> None:
    call_id = await make_call(engine)
    here = FakeLiveCall()
    async with (
        replica(engine, clean_db, {call_id: here}, holder="here"),
        replica(engine, clean_db, {}, holder="elsewhere"),  # hears the same notification
    ):
        op_id = await booked(engine, call_id)
        await wait_until(lambda: len(here.results) == 1, 10, "announcement")
        assert await _state(engine, op_id) is D.OFFERED  # handed over, not heard yet
        here.report(AnnouncementStatus.SPOKEN, response_id="resp_9")
        here.report(AnnouncementStatus.HEARD, response_id="resp_9", heard_ms=1800, audio_ms=1800)

        async def heard() -> bool:
            return await _state(engine, op_id) is D.HEARD

        await wait_until(heard, 10, "heard")
    result = here.results[0]
    assert result.operation_id == str(op_id)
    assert result.text.startswith("Done and confirmed by the restaurant")
    assert "BK7QX2MHN4" in result.text
    delivery = await delivery_of(engine, op_id)
    assert result.delivery_id == str(delivery.id)
    assert delivery.response_id == "resp_9" and delivery.offers == 1
    events = await trail(engine, op_id)
    assert moves(events) == ["pending", "offered", "heard"]
    decided = [e for e in events if e.kind == "decision"]
    assert len(decided) == 1 and decided[0].actor == "replica:here"
    assert decided[0].data["action"] == "announce"
    for check in ("same_call", "already_communicated", "current", "disclosure"):
        assert check in decided[0].data


async def test_a_failure_is_announced_truthfully_not_as_done(
    engine: AsyncEngine, clean_db: str
) -> None:
    call_id = await make_call(engine)
    here = FakeLiveCall()
    async with replica(engine, clean_db, {call_id: here}):
        await booked(engine, call_id, S.FAILED_FINAL)
        await wait_until(lambda: len(here.results) == 1, 10, "announcement")
    text = here.results[0].text
    assert text.startswith("That could not be done") and "no tables" in text
    assert "confirmed" not in text


async def test_outcome_after_the_call_ended_goes_by_exactly_one_sms_whoever_runs_the_job(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    call_id = await make_call(engine, ended=True)
    op_id = await booked(engine, call_id)
    delivery = await delivery_of(engine, op_id)
    one, two = sms_channel(engine, api), sms_channel(engine, api)
    try:
        # Two workers run the delivery's job at once (a duplicate job, two processes).
        results = await asyncio.gather(
            driver(engine, one).deliver(delivery.id), driver(engine, two).deliver(delivery.id)
        )
        assert sorted(r or "" for r in results) == ["", "text"]
        await api.wait_for(lambda a: len(a.created_messages()) == 1)
        # Whatever looks at it again sends nothing more.
        assert await driver(engine, one).deliver(delivery.id) is None
        for message in await sms_of(engine, op_id):
            await one.drive(message.id)
    finally:
        await one.aclose()
        await two.aclose()
    creates = api.requests_to("/Messages.json")
    assert len(creates) == 1 and len(api.created_messages()) == 1
    sent = api.created_messages()[0]
    assert sent.to_number == CALLER
    assert sent.body.startswith("Luigi's: Confirmed: a table for 4 people")
    assert "Ref BK7QX2MHN4." in sent.body
    assert str(op_id) not in sent.body and str(delivery.id) not in sent.body
    assert f"message_id={(await sms_of(engine, op_id))[0].id}" in (sent.status_callback or "")
    events = await trail(engine, op_id)
    assert moves(events)[:2] == ["pending", "texting"]
    assert decisions(events) == ["the call has ended: by SMS"]


async def test_a_call_that_is_ending_gets_the_outcome_by_sms_instead(
    engine: AsyncEngine, clean_db: str, api: FakeTwilioApi
) -> None:
    call_id = await make_call(engine)
    ending = FakeLiveCall(accepts=False)
    async with replica(engine, clean_db, {call_id: ending}):
        op_id = await booked(engine, call_id)

        async def back() -> bool:
            events = await trail(engine, op_id)
            return moves(events) == ["pending", "offered", "pending"]

        await wait_until(back, 10, "offer taken back")
    # The call row ends; the job (on any worker) now finds the call over and texts.
    async with engine.begin() as conn:
        await conn.execute(
            sa.text("UPDATE calls SET status = 'completed', ended_at = now() WHERE id = :c"),
            {"c": uuid.UUID(call_id)},
        )
    sms = sms_channel(engine, api)
    try:
        assert await driver(engine, sms).deliver((await delivery_of(engine, op_id)).id) == "text"
    finally:
        await sms.aclose()
    assert ending.results == []
    assert len(api.created_messages()) == 1


async def test_outcome_missed_while_not_listening_is_caught_up_on_listen(
    engine: AsyncEngine, clean_db: str
) -> None:
    call_id = await make_call(engine)
    op_id = await booked(engine, call_id)  # nobody listening yet
    here = FakeLiveCall()
    async with replica(engine, clean_db, {call_id: here}):
        await wait_until(lambda: len(here.results) == 1, 10, "caught-up announcement")
    assert here.results[0].operation_id == str(op_id)
    assert await _state(engine, op_id) is D.OFFERED


async def test_a_cut_announcement_is_offered_again_then_goes_by_sms(
    engine: AsyncEngine, clean_db: str, api: FakeTwilioApi
) -> None:
    call_id = await make_call(engine)
    here = FakeLiveCall()
    sms = sms_channel(engine, api)
    try:
        async with replica(engine, clean_db, {call_id: here}, sms=sms, max_reoffers=1):
            op_id = await booked(engine, call_id)
            await wait_until(lambda: len(here.results) == 1, 10, "first offer")
            here.report(AnnouncementStatus.CUT, heard_ms=400, audio_ms=2000, reason="barge-in")
            await wait_until(lambda: len(here.results) == 2, 10, "offered again")
            assert "interrupted the last update" in here.results[1].text
            here.report(AnnouncementStatus.CUT, heard_ms=300, audio_ms=2000, reason="barge-in")
            await api.wait_for(lambda a: len(a.created_messages()) == 1)
    finally:
        await sms.aclose()
    assert len(here.results) == 2  # never a third time in the call
    delivery = await delivery_of(engine, op_id)
    assert delivery.cuts == 2 and delivery.offers == 2
    events = await trail(engine, op_id)
    assert moves(events)[:6] == ["pending", "offered", "pending", "offered", "pending", "texting"]
    assert decisions(events)[-1] == "cut 2 times in the call: by SMS"


async def test_an_anonymous_caller_is_recorded_not_deliverable_not_retried(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    call_id = await make_call(engine, ended=True, from_number="anonymous")
    op_id = await booked(engine, call_id, caller="anonymous")
    sms = sms_channel(engine, api)
    try:
        assert await driver(engine, sms).deliver((await delivery_of(engine, op_id)).id) == (
            "not_deliverable"
        )
    finally:
        await sms.aclose()
    delivery = await delivery_of(engine, op_id)
    assert delivery.state is D.NOT_DELIVERABLE and delivery.finished_at is not None
    assert delivery.reason == "no SMS-capable number to text"
    assert api.created_messages() == []


async def test_an_outcome_the_tool_reply_already_carried_is_not_told_again(
    engine: AsyncEngine, clean_db: str
) -> None:
    call_id = await make_call(engine)
    op_id = await booked(engine, call_id)
    async with engine.begin() as conn:
        tc, _ = await ledger.record_tool_call(
            conn,
            call_id=call_id,
            function_call_id="call_dup",
            tenant_id="default",
            tool="confirm_operation",
            raw_arguments="{}",
        )
        await ledger.complete_tool_call(
            conn,
            tc.id,
            decision="duplicate",
            operation_id=op_id,
            output={"status": "committed", "message": "Done and confirmed"},
        )
    here = FakeLiveCall()
    async with replica(engine, clean_db, {call_id: here}) as delivery:
        await delivery.catch_up()

        async def settled() -> bool:
            return await _state(engine, op_id) is D.NOT_NEEDED

        await wait_until(settled, 10, "not needed")
    assert here.results == []
    assert decisions(await trail(engine, op_id)) == [
        "already told: the tool reply carried this outcome"
    ]


async def test_a_call_whose_holder_stopped_heartbeating_is_ended_by_the_job_and_texted(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    stale = datetime.now(UTC) - timedelta(seconds=120)
    call_id = await make_call(engine, heartbeat_at=stale, holder="host:42:abc")
    op_id = await booked(engine, call_id)
    sms = sms_channel(engine, api)
    try:
        assert (
            await driver(engine, sms, dead_after_s=30).deliver(
                (await delivery_of(engine, op_id)).id
            )
            == "text"
        )
    finally:
        await sms.aclose()
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                sa.text("SELECT status, end_reason FROM calls WHERE id = :c"),
                {"c": uuid.UUID(call_id)},
            )
        ).one()
        ended = (
            (
                await conn.execute(
                    sa.text(
                        "SELECT data FROM call_events WHERE call_id = :c AND kind = 'call_ended'"
                    ),
                    {"c": uuid.UUID(call_id)},
                )
            )
            .scalars()
            .all()
        )
    assert row.status == "completed"
    assert row.end_reason == "its process stopped (host:42:abc): no heartbeat for 30 s"
    assert [e["reason"] for e in ended] == [row.end_reason]
    assert len(api.created_messages()) == 1


async def test_a_call_live_on_another_process_is_left_to_it_and_looked_at_again(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    call_id = await make_call(engine)  # fresh heartbeat, held by another process
    op_id = await booked(engine, call_id)
    delivery = await delivery_of(engine, op_id)
    sms = sms_channel(engine, api)
    try:
        assert await driver(engine, sms).deliver(delivery.id) == "wait"
    finally:
        await sms.aclose()
    assert await _state(engine, op_id) is D.PENDING
    assert api.created_messages() == []
    async with engine.connect() as conn:
        later = await conn.scalar(
            sa.text(
                "SELECT count(*) FROM procrastinate_jobs WHERE task_name = 'deliver_outcome' "
                "AND args->>'delivery_id' = :d AND scheduled_at > now()"
            ),
            {"d": str(delivery.id)},
        )
    assert later == 1


async def test_an_outcome_being_undone_waits_for_its_compensation_and_is_told_with_it(
    engine: AsyncEngine, clean_db: str
) -> None:
    from tools.compensation import admit_compensation

    call_id = await make_call(engine)
    op_id = await admitted(engine, call_id)
    async with engine.begin() as conn:
        await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="w", reason="go")
    async with engine.begin() as conn:
        await ledger.request_cancel(conn, op_id, actor="model", reason="the caller cancelled")
    async with engine.begin() as conn:
        # It went through anyway; as the executor does, its cancel is admitted with it.
        done = await ledger.transition(
            conn, op_id, S.RUNNING, S.COMMITTED, actor="w", reason="ok", provider_ref="BK7QX2MHN4"
        )
        assert done is not None
        comp = await admit_compensation(
            conn,
            done,
            "cancel_booking",
            {"booking_id": "BK7QX2MHN4"},
            enqueue=_no_job,
            actor="w",
            reason="cancel requested while running",
        )
    here = FakeLiveCall()
    async with replica(engine, clean_db, {call_id: here}) as delivery:
        await delivery.catch_up()

        async def held() -> bool:
            return any(
                e.kind == "decision" and e.data.get("action") == "hold"
                for e in await trail(engine, op_id)
            )

        await wait_until(held, 10, "held for the compensation")
        assert here.results == []  # "booked" is not said while it is being undone
        await finish_compensation(engine, comp.operation_id)
        await wait_until(lambda: len(here.results) == 1, 10, "told once the cancel settled")
    text = here.results[0].text
    assert "Done and confirmed" in text
    assert "It has since been undone: the cancellation of booking BK7QX2MHN4 went through." in text
    assert (await delivery_of(engine, comp.operation_id)).state is D.NOT_NEEDED
    assert decisions(await trail(engine, comp.operation_id)) == [
        "told together with the outcome it undoes"
    ]
    assert restaurant_catalog().get("cancel_booking").name == "cancel_booking"


async def _no_job(conn: object, operation_id: uuid.UUID) -> None:
    return None


async def finish_compensation(engine: AsyncEngine, op_id: uuid.UUID) -> None:
    async with engine.begin() as conn:
        await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="w", reason="go")
    async with engine.begin() as conn:
        await ledger.transition(conn, op_id, S.RUNNING, S.COMMITTED, actor="w", reason="ok")


async def test_a_notification_the_holder_missed_is_repeated_by_the_job(
    engine: AsyncEngine, clean_db: str, api: FakeTwilioApi
) -> None:
    from app.ops.delivery import CHANNEL, ResultDelivery
    from app.pg_listener import PgListener
    from tests.delivery_support import LiveCallEntry

    call_id = await make_call(engine)
    op_id = await booked(engine, call_id)  # its NOTIFY went out with nobody listening
    here = FakeLiveCall()
    delivery = ResultDelivery(
        engine,
        restaurant_catalog(),
        lambda c: LiveCallEntry("CA1", c, here, from_number=CALLER) if c == call_id else None,
        lambda: [call_id],
    )
    listener = PgListener(clean_db)
    listener.subscribe(CHANNEL, delivery._on_notify)  # listening now, and no catch-up
    await listener.start()
    sms = sms_channel(engine, api)
    try:
        assert here.results == []
        # The job finds the call live elsewhere and, past the nudge interval, says so again.
        assert (
            await driver(engine, sms, nudge_s=0).deliver((await delivery_of(engine, op_id)).id)
            == "wait"
        )
        await wait_until(lambda: len(here.results) == 1, 10, "offered after the nudge")
    finally:
        await listener.stop()
        await delivery.stop()
        await sms.aclose()
    assert api.created_messages() == []


async def test_one_delivery_job_texts_every_outcome_whose_call_is_over_each_exactly_once(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    ended = [await booked(engine, await make_call(engine, ended=True)) for _ in range(3)]
    live = await booked(engine, await make_call(engine))  # its holder decides it
    first, *others = [await delivery_of(engine, op) for op in ended]
    sms = sms_channel(engine, api)
    try:
        assert await driver(engine, sms).deliver(first.id) == "text"
        await api.wait_for(lambda a: len(a.created_messages()) == 3)
        # The others' own jobs were dropped with their decision; run late, they do nothing.
        assert [await waiting_jobs(engine, d.id) for d in others] == [0, 0]
        for d in others:
            assert await driver(engine, sms).deliver(d.id) is None
    finally:
        await sms.aclose()
    assert len(api.requests_to("/Messages.json")) == 3
    for op_id in ended:
        assert moves(await trail(engine, op_id))[:2] == ["pending", "texting"]
        assert decisions(await trail(engine, op_id)) == ["the call has ended: by SMS"]
        assert [m.attempts for m in await sms_of(engine, op_id)] == [1]
    assert await _state(engine, live) is D.PENDING
    assert await waiting_jobs(engine, (await delivery_of(engine, live)).id) == 1


async def test_a_delivery_batch_leaves_out_one_another_transaction_holds_and_one_held_back(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    first, locked, later = [
        await booked(engine, await make_call(engine, ended=True)) for _ in "abc"
    ]
    held = await delivery_of(engine, later)
    async with engine.begin() as conn:
        await deliveries.defer_until(conn, held.id, datetime.now(UTC) + timedelta(hours=1))
    sms = sms_channel(engine, api)
    try:
        async with engine.begin() as conn:
            # Another worker is deciding `locked` right now.
            await deliveries.get(conn, (await delivery_of(engine, locked)).id, for_update=True)
            assert await driver(engine, sms).deliver((await delivery_of(engine, first)).id)
        await api.wait_for(lambda a: len(a.created_messages()) == 1)
    finally:
        await sms.aclose()
    assert [await _state(engine, op) for op in (first, locked, later)] == [
        D.TEXTING,
        D.PENDING,
        D.PENDING,
    ]
    assert await waiting_jobs(engine, (await delivery_of(engine, locked)).id) == 1
    assert await waiting_jobs(engine, held.id) == 1


async def test_ready_out_of_call_locks_the_due_deliveries_of_calls_over_first_one_first(
    engine: AsyncEngine,
) -> None:
    oldest, older, newest = [
        await booked(engine, await make_call(engine, ended=True)) for _ in "abc"
    ]
    held = await booked(engine, await make_call(engine, ended=True))
    await booked(engine, await make_call(engine))  # a live call's: its holder decides it
    later = await booked(engine, await make_call(engine, ended=True))
    async with engine.begin() as conn:
        await deliveries.defer_until(
            conn, (await delivery_of(engine, later)).id, datetime.now(UTC) + timedelta(hours=1)
        )
    odd = await booked(engine, "not-a-uuid")  # no call row to read: unknown
    gone = await booked(engine, str(uuid.uuid4()))
    newest_id = (await delivery_of(engine, newest)).id
    async with engine.begin() as other:
        # Another worker is deciding `held` right now: skipped, not waited for.
        await deliveries.get(other, (await delivery_of(engine, held)).id, for_update=True)
        async with engine.begin() as conn:
            two = await ready_out_of_call(conn, 2, first=newest_id)
            assert [(d.operation_id, c) for d, _, c in two] == [
                (newest, CallState.ENDED),
                (oldest, CallState.ENDED),
            ]
        async with engine.begin() as conn:
            every = await ready_out_of_call(conn, 50)
            # Locked: another transaction asking for them skips them.
            async with engine.begin() as third:
                assert await ready_out_of_call(third, 50) == []
    assert [(d.operation_id, c) for d, _, c in every] == [
        (oldest, CallState.ENDED),
        (older, CallState.ENDED),
        (newest, CallState.ENDED),
        (odd, CallState.UNKNOWN),
        (gone, CallState.UNKNOWN),
    ]
    async with engine.connect() as conn:
        for delivery, op, _ in every:
            assert delivery == await deliveries.get(conn, delivery.id)
            assert op == await ledger.get_operation(conn, delivery.operation_id)


async def test_ready_out_of_call_leaves_out_a_call_opened_again_after_its_lock_look(
    engine: AsyncEngine, clean_db: str
) -> None:
    reopened_call = await make_call(engine, ended=True)
    reopened = await booked(engine, reopened_call)
    ended = await booked(engine, await make_call(engine, ended=True))

    def reopen(conn: object, cursor: object, statement: str, *rest: object) -> None:
        # Committed by another session once the deliveries are locked, before the re-read.
        if "SKIP LOCKED" in statement:
            with psycopg.connect(clean_db, autocommit=True) as other:
                other.execute(
                    "UPDATE calls SET status = 'ringing', ended_at = NULL WHERE id = %s",
                    (reopened_call,),
                )

    sa.event.listen(engine.sync_engine, "after_cursor_execute", reopen)
    try:
        async with engine.begin() as conn:
            ready = await ready_out_of_call(conn, 50)
    finally:
        sa.event.remove(engine.sync_engine, "after_cursor_execute", reopen)
    assert [(d.operation_id, c) for d, _, c in ready] == [(ended, CallState.ENDED)]
    assert await _state(engine, reopened) is D.PENDING


async def test_a_batch_reads_the_same_ledger_facts_as_each_outcome_alone(
    engine: AsyncEngine,
) -> None:
    from tools.compensation import admit_compensation

    # A booking a newer request of the same caller contradicts (an older one does not); one
    # of a caller who opted out of SMS; one being undone; a plain one.
    await admitted(engine, await make_call(engine, ended=True), conflict_key="slot")
    contradicted = await booked(engine, await make_call(engine, ended=True), conflict_key="slot")
    await admitted(engine, await make_call(engine, ended=True), conflict_key="slot")
    opted = await booked(engine, await make_call(engine, ended=True), caller="+15550001111")
    undone = await booked(engine, await make_call(engine, ended=True), caller="+15550002222")
    plain = await booked(engine, await make_call(engine, ended=True), caller="+15550003333")
    async with engine.begin() as conn:
        await deliveries.set_opt_out(conn, "+15550001111", opted_out=True, source="test")
        done = await ledger.get_operation(conn, undone)
        assert done is not None
        await admit_compensation(
            conn,
            done,
            "cancel_booking",
            {"booking_id": "BK7QX2MHN4"},
            enqueue=_no_job,
            actor="w",
            reason="the caller cancelled",
        )
    async with engine.connect() as conn:
        ops = [await ledger.get_operation(conn, i) for i in (contradicted, opted, undone, plain)]
        together = await deliveries.ledger_contexts(conn, [op for op in ops if op is not None])
        alone = {
            op.operation_id: await deliveries.ledger_context(conn, op)
            for op in ops
            if op is not None
        }
    assert together == alone
    assert [len(together[contradicted].conflicts), len(together[undone].compensations)] == [1, 1]
    assert [together[i].opted_out for i in (contradicted, opted)] == [False, True]


async def test_a_delivery_decided_in_a_batch_leaves_the_trail_sms_and_job_of_one_alone(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    one, two, three = [await booked(engine, await make_call(engine, ended=True)) for _ in "abc"]
    sms = sms_channel(engine, api)
    try:
        assert await driver(engine, sms, batch=0).deliver((await delivery_of(engine, one)).id)
        assert await driver(engine, sms).deliver((await delivery_of(engine, two)).id) == "text"
        await api.wait_for(lambda a: len(a.created_messages()) == 3)
    finally:
        await sms.aclose()

    def shape(events: list[deliveries.DeliveryEvent]) -> list[tuple[object, ...]]:
        return [
            (e.kind, e.from_state, e.to_state, e.actor, e.reason, sorted(e.data))
            for e in events
            if e.kind != "sms" or e.data.get("status") == "pending"
        ]

    alone, batched = await trail(engine, one), await trail(engine, two)
    assert shape(batched) == shape(alone) == shape(await trail(engine, three))
    assert [s[0] for s in shape(alone)][:4] == ["transition", "decision", "transition", "sms"]
    for op_id in (one, two, three):
        (message,) = await sms_of(engine, op_id)
        assert (message.body, message.to_number, message.requested_by, message.attempts) == (
            (await sms_of(engine, one))[0].body,
            CALLER,
            "delivery-worker",
            1,
        )
        assert (await delivery_of(engine, op_id)).message_id == message.id
        async with engine.connect() as conn:
            jobs_of_it = await conn.scalar(
                sa.text(
                    "SELECT count(*) FROM procrastinate_jobs WHERE task_name = 'drive_sms' "
                    "AND args->>'message_id' = :m"
                ),
                {"m": str(message.id)},
            )
        assert jobs_of_it == 1


async def test_a_delivery_job_frees_its_slot_once_decided_and_a_stop_waits_for_its_send(
    clean_db: str, engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    """The real worker with one job slot: Twilio holds the answer to the first outcome's
    create, yet the second outcome's job runs and its SMS goes out; stopping the worker
    waits for the first send's answer and records it. Each number texted once."""
    api.lose_message_answers(1)
    sor = SorClient("http://127.0.0.1:9")
    worker = OperationWorker(
        database_url=clean_db,
        engine=engine,
        registry=restaurant_catalog(),
        provider=SorProvider(sor),
        concurrency=1,
        poll_interval_s=0.2,
        shutdown_grace_s=10.0,
        sweep=False,
        # Generous send timeouts: the first create's answer is held on purpose, and must not
        # be given up on while the rest of the test runs on a slow machine.
        delivery=driver(engine, sms_channel(engine, api, timeout=60.0, send_timeout_s=60.0)),
    )
    await worker.start()
    stopping: asyncio.Task[None] | None = None
    try:
        first = await booked(engine, await make_call(engine, ended=True))
        await api.wait_for(lambda a: len(a.created_messages()) == 1)
        other = "+15551239999"
        call = await make_call(engine, ended=True, from_number=other)
        second = await booked(engine, call, caller=other)
        await api.wait_for(lambda a: len(a.messages_to(other)) == 1)

        async def answered() -> bool:
            return (await sms_of(engine, second))[0].message_sid is not None

        await wait_until(answered, 10, "the second create's answer recorded")
        # The first create's answer is still held: claimed, its MessageSid unknown.
        held = (await sms_of(engine, first))[0]
        assert (held.status.value, held.message_sid) == ("requesting", None)
        stopping = asyncio.create_task(worker.stop())
        await asyncio.sleep(0.5)
        assert not stopping.done()  # a graceful stop waits for the send it handed over
        api.release_answers()
        await asyncio.wait_for(stopping, 10)
    finally:
        api.release_answers()
        if stopping is None:
            await worker.stop()
        await sor.aclose()
    recorded = (await sms_of(engine, first))[0]
    assert recorded.message_sid == api.messages_to(CALLER)[0].sid
    assert recorded.status.value != "requesting"
    assert len(api.messages_to(CALLER)) == len(api.messages_to(other)) == 1
