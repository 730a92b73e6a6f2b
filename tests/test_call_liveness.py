"""Call liveness on real Postgres: no call row stays in progress (or ringing) forever, and an
ended call hands its outcomes to out-of-call delivery."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.liveness import CallHeartbeat, end_dead_calls, end_unstreamed_calls
from app.ops.delivery_jobs import DeliveryConfig, DeliveryDriver, DeliverySweeper
from telephony.sim.fake_twilio_api import FakeTwilioApi
from tests.delivery_support import booked, delivery_of, make_call, trail, waiting_jobs
from tests.e2e_support import (
    call_row,
    call_stack,
    event_rows,
    post_signed,
    running_service,
)
from tests.test_e2e_call import hear_greeting, scenario
from tools.delivery_states import DeliveryState
from tools.restaurant.catalog import restaurant_catalog

D = DeliveryState


@pytest.fixture
async def api() -> AsyncIterator[FakeTwilioApi]:
    async with FakeTwilioApi(sms_step_delay_s=0.01) as fake:
        yield fake


async def test_a_live_call_is_held_and_heartbeated_by_the_process_running_its_stream(
    engine: AsyncEngine,
) -> None:
    async with call_stack(
        engine, scenario(), call_heartbeat_s=3600, call_dead_after_s=7200
    ) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        runtime = stack.service.runtime
        first = await call_row(engine, caller.call_sid)
        assert first is not None and first["holder"] == runtime.holder
        heartbeat = first["heartbeat_at"]
        assert heartbeat is not None
        # (the service's own heartbeat loop waits an hour: this beat is the test's)
        await CallHeartbeat(
            engine, runtime.registry, holder=runtime.holder, interval_s=1
        ).beat_once()
        second = await call_row(engine, caller.call_sid)
        assert second is not None and second["heartbeat_at"] > heartbeat
        await caller.hangup()
        await stack.events(caller)


async def test_a_call_whose_holder_stopped_is_ended_with_the_reason_and_its_outcome_re_driven(
    engine: AsyncEngine,
) -> None:
    stale = datetime.now(UTC) - timedelta(seconds=45)
    call_id = await make_call(engine, heartbeat_at=stale, holder="host-a:123:ff")
    fresh = await make_call(engine)
    op_id = await booked(engine, call_id)
    delivery = await delivery_of(engine, op_id)
    before = await waiting_jobs(engine, delivery.id)
    ended = await end_dead_calls(engine, dead_after_s=30)
    assert [c.call_id for c in ended] == [call_id]
    async with engine.connect() as conn:
        rows = {
            str(r.id): r
            for r in await conn.execute(sa.text("SELECT id, status, end_reason FROM calls"))
        }
    assert rows[call_id].status == "completed"
    assert rows[call_id].end_reason == "its process stopped (host-a:123:ff): no heartbeat for 30 s"
    assert rows[fresh].status == "in_progress"  # a fresh heartbeat is left alone
    events = await event_rows(engine, call_id)
    assert [e["kind"] for e in events] == ["call_ended"]
    assert events[0]["data"] == {
        "reason": rows[call_id].end_reason,
        "source": "call-liveness",
        "duration_ms": None,  # the sweep did not hold the call
    }
    assert await waiting_jobs(engine, delivery.id) == before + 1
    assert await end_dead_calls(engine, dead_after_s=30) == []  # once


async def test_rows_whose_stream_was_rejected_or_never_came_are_ended(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        for sid, rejected in (("CAnever", False), ("CArejected", True), ("CAyoung", False)):
            call_id = uuid.uuid4()
            age = timedelta(seconds=5 if sid == "CAyoung" else 600)
            await conn.execute(
                sa.text(
                    "INSERT INTO calls (id, call_sid, status, created_at) "
                    "VALUES (:id, :sid, 'ringing', :at)"
                ),
                {"id": call_id, "sid": sid, "at": datetime.now(UTC) - age},
            )
            if rejected:
                await conn.execute(
                    sa.text(
                        "INSERT INTO call_events (call_id, seq, kind, data, mono_ns, at) "
                        "VALUES (:id, 1, 'call_rejected', '{}', 0, now())"
                    ),
                    {"id": call_id},
                )
    ended = await end_unstreamed_calls(engine, stream_wait_s=90)
    assert sorted((c.call_sid, c.status.value, c.reason) for c in ended) == [
        ("CAnever", "failed", "its media stream never came"),
        ("CArejected", "rejected", "its media stream was rejected"),
    ]
    young = await call_row(engine, "CAyoung")
    assert young is not None and young["status"] == "ringing"


async def test_a_holder_ends_its_call_when_another_process_ended_the_row(
    engine: AsyncEngine,
) -> None:
    async with call_stack(
        engine, scenario(), call_heartbeat_s=3600, call_dead_after_s=7200
    ) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        async with engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "UPDATE calls SET status = 'completed', ended_at = now() WHERE call_sid = :s"
                ),
                {"s": caller.call_sid},
            )
        runtime = stack.service.runtime
        gone = await CallHeartbeat(
            engine, runtime.registry, holder=runtime.holder, interval_s=1
        ).beat_once()
        assert gone == [caller.call_sid]
        await caller.wait_closed(10)
        events = await stack.events(caller)
    assert events[-1]["kind"] == "call_ended"
    assert events[-1]["data"]["reason"] == "the call was ended by another process"


async def test_a_call_ending_here_whose_row_ended_before_the_beat_is_not_ended_elsewhere(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    # The race of a mass hang-up: the heartbeat took its list of live calls, then a caller hung
    # up and its session ended the row before the heartbeat's update ran.
    async with call_stack(
        engine, scenario(), call_heartbeat_s=3600, call_dead_after_s=7200
    ) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        runtime = stack.service.runtime
        [entry] = runtime.registry.live_entries()
        entry.ending_here = True  # what CallSession.end marks before it ends the row
        async with engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "UPDATE calls SET status = 'completed', ended_at = now() WHERE call_sid = :s"
                ),
                {"s": caller.call_sid},
            )
        gone = await CallHeartbeat(
            engine, runtime.registry, holder=runtime.holder, interval_s=1
        ).beat_once()
        assert gone == []
        assert "ended elsewhere" not in caplog.text
        assert runtime.registry.get(caller.call_sid) is entry  # not ended by the heartbeat
        await caller.hangup()


async def test_a_status_callback_for_a_call_held_by_a_dead_process_hands_its_outcome_to_sms(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    call_id = await make_call(engine, holder="dead-host:1:aa")  # its stream ran elsewhere
    op_id = await booked(engine, call_id)  # finished; nobody announced it
    async with running_service(engine, twilio_api_base_url=api.base_url) as service:
        sid = "CA" + uuid.UUID(call_id).hex
        response = await post_signed(
            service, "/twilio/status", {"CallSid": sid, "CallStatus": "completed"}
        )
        assert response.status_code == 204
        delivery = await delivery_of(engine, op_id)
        driver = DeliveryDriver(engine, restaurant_catalog(), service.runtime.sms)
        assert await driver.deliver(delivery.id) == "text"
        await api.wait_for(lambda a: len(a.created_messages()) == 1)
    row = await call_row(engine, sid)
    assert row is not None and row["status"] == "completed"
    events = await trail(engine, op_id)
    notes = [e.reason or "" for e in events if e.kind == "note"]
    assert notes and notes[0].startswith("the call ended")
    assert api.created_messages()[0].to_number == "+15551230000"


async def test_the_sweep_of_a_worker_ends_dead_calls_within_the_limit(
    engine: AsyncEngine,
) -> None:
    stale = datetime.now(UTC) - timedelta(seconds=3)
    call_id = await make_call(engine, heartbeat_at=stale)
    sweeper = DeliverySweeper(engine, DeliveryConfig(dead_after_s=2.0), interval_s=0.1)
    report = await sweeper.sweep_once()
    assert report["dead_calls"] == 1
    row = await call_row(engine, "CA" + uuid.UUID(call_id).hex)
    assert row is not None and row["status"] == "completed"
