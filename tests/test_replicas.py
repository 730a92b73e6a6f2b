"""Two replicas of the service on one database: whichever hears about a call acts on it."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import (
    call_row,
    call_stack,
    event_rows,
    post_signed,
    running_service,
    wait_until,
)
from tests.test_e2e_call import hear_greeting, scenario


async def test_status_callback_on_another_replica_ends_the_call_where_its_stream_runs(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, scenario()) as stack:
        settings = stack.service.settings
        async with running_service(
            engine,
            openai_base_url=settings.openai_base_url,
            twilio_api_base_url=settings.twilio_api_base_url,
        ) as other:
            caller = stack.caller()
            await caller.dial()
            await hear_greeting(caller)
            assert stack.service.runtime.registry.get(caller.call_sid) is not None
            assert other.runtime.registry.get(caller.call_sid) is None

            # Twilio's callback lands on the replica that does not hold the stream.
            response = await post_signed(
                other, "/twilio/status", {"CallSid": caller.call_sid, "CallStatus": "completed"}
            )
            await caller.wait_closed(10)
            await wait_until(lambda: stack.sim.sessions[0].closed.is_set(), 10, "realtime closed")
            events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)

    assert response.status_code == 204
    assert caller.closed_by == "server"
    assert row is not None and row["status"] == "completed"
    assert row["end_reason"] == "twilio status completed"
    ended = [e for e in events if e["kind"] == "call_ended"]
    # One writer per call: the replica running the stream records the end, once.
    assert len(ended) == 1
    assert ended[0]["data"]["reason"] == "twilio status completed"
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)


async def test_status_callback_for_a_call_that_never_streamed_is_recorded_by_the_receiver(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, scenario()) as stack:
        caller = stack.caller()
        await caller.dial(open_stream=False)
        response = await post_signed(
            stack.service, "/twilio/status", {"CallSid": caller.call_sid, "CallStatus": "no-answer"}
        )
        await stack.service.runtime.events.flush()
        row = await call_row(engine, caller.call_sid)
        assert row is not None
        events = await event_rows(engine, row["id"])
    assert response.status_code == 204
    assert row["status"] == "no_answer"
    assert [e["kind"] for e in events].count("call_ended") == 1
