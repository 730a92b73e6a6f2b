"""Late results by a callback call (LATE_RESULT_CHANNEL=call|auto), over real sockets: the
service and its worker, the fake Twilio REST API (which places the call, plays the callee and
sends the AMD result), the Realtime simulator and PostgreSQL.

A result that lands after the caller hung up is told by calling them back: a person hears it
(`called`, by the in-call announcement's heard accounting), a machine gets a message without
details (`voicemail`); an unanswered call is tried again after a backoff, then the result goes
by SMS; a delivery job run twice, or a worker that dies after asking for the call, never makes
two calls for one attempt; a callback due in quiet hours waits for their end.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.ops.callback import CallbackChannel, CallbackConfig, sms_refused
from app.ops.delivery_jobs import DeliveryConfig, DeliveryDriver
from telephony.sim.fake_caller import CallerState
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.scenario import Scenario
from tests.delivery_support import booked, delivery_of, make_call, moves, sms_channel, trail
from tests.e2e_support import call_stack, event_kinds, make_settings, wait_until
from tests.test_e2e_booking import heard_text
from tools.executor import make_app, make_enqueue
from tools.quiet_hours import QuietHours
from tools.restaurant.catalog import restaurant_catalog

CALLEE = "+15557654321"
WAIT_S = 25.0


def scenario() -> Scenario:
    # The opening is the service's own line; the scripted model then says the result it is
    # given (`{note}`: the announcement's text); the callee says nothing.
    return Scenario.model_validate(
        {
            "name": "callback",
            "steps": [{"reply": {"text": "{note}", "audio_ms": 900}}],
            "fallback": {"text": "Anything else?", "audio_ms": 600},
        }
    )


def callback_stack(engine: AsyncEngine, clean_db: str, **overrides: Any) -> Any:
    return call_stack(
        engine,
        scenario(),
        with_worker=True,
        database_url=clean_db,
        sweep_interval_s=0.5,
        late_result_channel="call",
        **overrides,
    )


async def late_result(engine: AsyncEngine) -> uuid.UUID:
    """A booking that committed after its caller (CALLEE) hung up."""
    call_id = await make_call(engine, ended=True, from_number=CALLEE)
    return await booked(engine, call_id, caller=CALLEE)


async def state_of(engine: AsyncEngine, op_id: uuid.UUID) -> str:
    return (await delivery_of(engine, op_id)).state.value


async def wait_state(engine: AsyncEngine, op_id: uuid.UUID, state: str) -> None:
    async def reached() -> bool:
        return await state_of(engine, op_id) == state

    await wait_until(reached, WAIT_S, f"the delivery is {state}")


async def callback_rows(engine: AsyncEngine) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            sa.text(
                "SELECT c.id, c.status, c.outbound, o.idempotency_key, o.status AS op_status "
                "FROM calls c JOIN operations o "
                "ON o.operation_id = (c.outbound->>'placing_operation_id')::uuid "
                "WHERE c.direction = 'outbound' ORDER BY c.created_at"
            )
        )
        return [dict(r._mapping) for r in rows]


def driver_for(
    engine: AsyncEngine, clean_db: str, api: FakeTwilioApi, channel: str = "call", **config: Any
) -> DeliveryDriver:
    """A worker's delivery driver with the call channel, whose place_call jobs go to the
    queue (a worker that dies before running them, or another that runs them)."""
    settings = make_settings(9, late_result_channel="call")
    sms = sms_channel(engine, api)
    callback = CallbackChannel(
        settings,
        CallbackConfig(channel=channel, **config),
        sms,
        make_enqueue(make_app(clean_db, max_pool_size=1)),
    )
    return DeliveryDriver(engine, restaurant_catalog(), sms, DeliveryConfig(), callback=callback)


# --- quiet hours, pure --------------------------------------------------------------------------


def test_quiet_hours_end_across_midnight_in_the_windows_time_zone() -> None:
    quiet = QuietHours.parse("21:00-08:00", "Europe/Paris")  # UTC+1 in December
    evening = datetime(2026, 12, 5, 21, 30, tzinfo=UTC)  # 22:30 in Paris
    night = datetime(2026, 12, 6, 3, 0, tzinfo=UTC)  # 04:00
    morning = datetime(2026, 12, 6, 7, 0, tzinfo=UTC)  # 08:00: over
    assert quiet.end_if_quiet(evening) == datetime(2026, 12, 6, 7, 0, tzinfo=UTC)
    assert quiet.end_if_quiet(night) == datetime(2026, 12, 6, 7, 0, tzinfo=UTC)
    assert quiet.end_if_quiet(morning) is None
    lunch = QuietHours.parse("12:00-14:00")
    assert lunch.end_if_quiet(datetime(2026, 12, 6, 13, 0, tzinfo=UTC)) == datetime(
        2026, 12, 6, 14, 0, tzinfo=UTC
    )
    assert lunch.end_if_quiet(datetime(2026, 12, 6, 14, 0, tzinfo=UTC)) is None


@pytest.mark.parametrize(
    ("window", "tz", "says"),
    [("21-08", "UTC", "time of day"), ("21:00", "UTC", "21:00-08:00"),
     ("25:00-08:00", "UTC", "time of day"), ("08:00-08:00", "UTC", "same time"),
     ("21:00-08:00", "Mars/Olympus", "time zone")],
)  # fmt: skip
def test_bad_quiet_hours_are_refused_at_start_with_what_to_write(
    window: str, tz: str, says: str
) -> None:
    with pytest.raises(ValidationError, match=says):
        make_settings(9, quiet_hours=window, quiet_hours_tz=tz)


# --- through the service ------------------------------------------------------------------------


async def test_a_person_who_answers_the_callback_hears_the_result_and_it_is_called(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with callback_stack(engine, clean_db) as stack:
        op_id = await late_result(engine)
        await wait_state(engine, op_id, "called")
        [placed] = stack.api.created_calls(CALLEE)
        callee = stack.api.outbound_callers[placed.sid]
        await callee.hangup()
        await stack.events(callee)  # the timeline is written
        [row] = await callback_rows(engine)
        said = await heard_text(engine, str(row["id"]))
        kinds = await event_kinds(engine, str(row["id"]))
        creates = stack.api.requests_to("/Calls.json")
        delivery = await delivery_of(engine, op_id)
        path = moves(await trail(engine, op_id))
    # One call, placed once, as the first attempt of this delivery.
    assert len(creates) == 1
    assert row["idempotency_key"] == f"outbound:callback:{delivery.id}:1"
    assert row["outbound"]["delivery_id"] == str(delivery.id) and row["op_status"] == "committed"
    # The person heard who calls, then the result itself (its reference), to its end.
    assert "an update on your recent request" in said[0], said
    assert len(said) == 2 and "BK7QX2MHN4" in said[1], said
    assert path == ["pending", "calling", "called"], path
    assert kinds[:2] == ["call_started", "outbound_requested"], kinds
    assert "amd_result" in kinds and kinds[-1] == "call_ended", kinds
    assert delivery.channel == "call" and delivery.heard_at is not None
    assert not stack.api.messages_to(CALLEE)  # no SMS besides


async def test_a_machine_gets_a_message_without_details_and_it_is_recorded_voicemail(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with callback_stack(engine, clean_db) as stack:
        stack.api.call_outcome = "machine_end_beep"
        op_id = await late_result(engine)
        await wait_state(engine, op_id, "voicemail")
        [callee] = stack.api.outbound_callers.values()
        await callee.wait_for(lambda c: c.state is CallerState.ENDED, WAIT_S)
        await stack.events(callee)  # the timeline is written
        [row] = await callback_rows(engine)
        said = await heard_text(engine, str(row["id"]))
        creates = stack.api.requests_to("/Calls.json")
        events = await trail(engine, op_id)
    assert len(creates) == 1
    assert len(said) == 1 and "call us back" in said[0], said
    assert "BK7QX2MHN4" not in said[0] and "table" not in said[0], said
    assert moves(events) == ["pending", "calling", "voicemail"]
    assert events[-1].data["answered_by"] == "machine_end_beep"


async def test_an_unanswered_callback_is_tried_again_then_the_result_goes_by_sms(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with callback_stack(
        engine, clean_db, callback_max_attempts=2, callback_retry_s=0.3
    ) as stack:
        stack.api.call_outcome = "no-answer"
        op_id = await late_result(engine)
        await wait_state(engine, op_id, "texted")
        creates = stack.api.requests_to("/Calls.json")
        texts = stack.api.messages_to(CALLEE)
        rows = await callback_rows(engine)
        events = await trail(engine, op_id)
    assert [r.form["To"] for r in creates] == [CALLEE, CALLEE]
    assert [r["outbound"]["attempt"] for r in rows] == [1, 2]
    assert len(texts) == 1
    path = moves(events)
    assert path == ["pending", "calling", "pending", "calling", "pending", "texting", "texted"]
    reasons = [e.reason or "" for e in events if e.kind == "transition"]
    assert "calling again at" in reasons[2], reasons
    assert "by SMS instead" in reasons[5], reasons


async def test_a_job_run_twice_or_a_worker_dead_after_asking_never_makes_a_second_call(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with FakeTwilioApi() as idle_api:
        op_id = await late_result(engine)
        delivery = await delivery_of(engine, op_id)
        dying = driver_for(engine, clean_db, idle_api)
        try:
            # The delivery job runs twice at once, then once more; its worker then dies
            # before running the place_call job it queued.
            first = await asyncio.gather(dying.deliver(delivery.id), dying.deliver(delivery.id))
            again = await dying.deliver(delivery.id)
        finally:
            await dying.aclose()
    # One run decided; the other found it locked (skipped) or already calling.
    assert sorted(str(a) for a in first) in (["None", "text"], ["text", "waiting"]), first
    assert again == "waiting"
    assert len(await callback_rows(engine)) == 1
    # Another worker takes the queued jobs over: the one call is placed, once (the line is
    # busy: the attempt ends, the next one waits for CALLBACK_RETRY_S).
    async with callback_stack(engine, clean_db) as stack:
        stack.api.call_outcome = "busy"

        async def attempt_over() -> bool:
            return moves(await trail(engine, op_id)) == ["pending", "calling", "pending"]

        await wait_until(attempt_over, WAIT_S, "the first attempt is over")
        creates = stack.api.requests_to("/Calls.json")
        rows = await callback_rows(engine)
        retry_at = (await delivery_of(engine, op_id)).next_attempt_at
    assert len(creates) == 1 and len(rows) == 1
    assert rows[0]["op_status"] == "committed" and rows[0]["status"] == "busy"
    assert retry_at is not None and retry_at > datetime.now(UTC) + timedelta(seconds=200)


async def test_a_callback_due_in_quiet_hours_is_scheduled_for_their_end(
    engine: AsyncEngine, clean_db: str
) -> None:
    night = datetime(2026, 12, 5, 22, 30, tzinfo=UTC)
    quiet = QuietHours.parse("21:00-08:00", "UTC")
    async with FakeTwilioApi() as api:
        op_id = await late_result(engine)
        delivery = await delivery_of(engine, op_id)
        at_night = driver_for(engine, clean_db, api, quiet=quiet, clock=lambda: night)
        try:
            assert await at_night.deliver(delivery.id) == "text"
        finally:
            await at_night.aclose()
        waiting = await delivery_of(engine, op_id)
        async with engine.connect() as conn:
            scheduled = await conn.scalar(
                sa.text(
                    "SELECT max(scheduled_at) FROM procrastinate_jobs "
                    "WHERE task_name = 'deliver_outcome' AND args->>'delivery_id' = :d"
                ),
                {"d": str(delivery.id)},
            )
        events = await trail(engine, op_id)
        # At the end of the window the job calls.
        morning = night + timedelta(hours=9, minutes=30)
        later = driver_for(engine, clean_db, api, quiet=quiet, clock=lambda: morning)
        try:
            await later.deliver(delivery.id)
        finally:
            await later.aclose()
    end = datetime(2026, 12, 6, 8, 0, tzinfo=UTC)
    assert waiting.state.value == "pending" and waiting.next_attempt_at == end
    assert scheduled == end
    assert any("quiet hours" in (e.reason or "") for e in events)
    assert not api.requests_to("/Calls.json")
    assert await state_of(engine, op_id) == "calling"
    assert len(await callback_rows(engine)) == 1


async def test_auto_calls_a_number_whose_sms_came_back_as_a_landline(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with FakeTwilioApi() as api:
        op_id = await late_result(engine)
        delivery = await delivery_of(engine, op_id)
        auto = driver_for(engine, clean_db, api, channel="auto")
        api.sms_outcomes_by_to[CALLEE] = "undelivered"
        api.sms_error_codes_by_to[CALLEE] = 30006  # the carrier says: a landline
        try:
            async with engine.connect() as conn:
                before = await sms_refused(conn, CALLEE)
            assert await auto.deliver(delivery.id) == "text"  # SMS first
            [message] = api.messages_to(CALLEE)
            await api.wait_for(lambda _: message.status == "undelivered", WAIT_S)
            # Its status callback went nowhere: the worker's poll learns it.
            sent = (await delivery_of(engine, op_id)).message_id
            assert sent is not None
            await auto.sms.drive(sent, now=datetime.now(UTC) + timedelta(hours=1))
            await auto.deliver(delivery.id)
        finally:
            await auto.aclose()
        async with engine.connect() as conn:
            after = await sms_refused(conn, CALLEE)
    assert not before and after
    assert moves(await trail(engine, op_id)) == [
        "pending", "texting", "not_deliverable", "calling"
    ]  # fmt: skip
    assert len(await callback_rows(engine)) == 1
