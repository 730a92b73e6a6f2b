"""A Twilio call survives the loss of its stream: `<Connect action>` asks us what next, and a
call whose stream was lost (its replica killed, or its socket dropped without `stop`) resumes
on a new stream, maybe on another replica, from a summary of the call so far; a call ended on
purpose gets `<Hangup/>`."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import takeover
from app.calls.holders import HolderLock, holder_alive
from app.calls.liveness import end_dead_calls
from app.errors import WS_POLICY_VIOLATION
from app.legs.twilio.resume import resume_context
from app.ops.delivery import call_state_of
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import RealtimeSimulator
from tests.delivery_support import make_call
from tests.domains import RESTAURANT
from tests.e2e_support import CONSOLE, call_row, call_stack, post_signed, wait_until
from tests.server_proc import ServerProcess
from tests.sor_support import start_sor
from tests.test_delivery_crash import book_and_confirm, server_env
from tests.test_e2e_booking import (
    booking_scenario,
    delivery_trail,
    heard_text,
    operations_of,
    trail,
    wait_for_delivery,
    wait_for_operation,
)
from tests.test_e2e_call import hear_greeting, scenario
from tools import ledger
from tools.relevance import CallState
from tools.restaurant.sor import Faults
from tools.states import OperationStatus

WAIT_S = 45.0
APOLOGY = "Sorry, I lost you for a moment"
PUBLIC = "http://voice.example"  # both replicas behind one public URL, as behind a proxy


@pytest.fixture
async def api() -> AsyncIterator[FakeTwilioApi]:
    async with FakeTwilioApi(sms_step_delay_s=0.01) as fake:
        yield fake


@pytest.mark.parametrize("how", ["killed", "drained"])
async def test_a_killed_or_drained_replica_s_call_resumes_on_another_its_booking_told_once(
    engine: AsyncEngine, clean_db: str, api: FakeTwilioApi, tmp_path: Path, how: str
) -> None:
    # Killed: SIGKILL, nothing of A's runs. Drained: SIGTERM with a drain limit the call
    # outlives, and A hands the call over on purpose (released, not ended) before it stops.
    # The restaurant books the table and never answers: the booking is running when A dies.
    sor = await start_sor(clean_db, Faults(lose_response=1))
    # Each replica talks to its own scripted model; B's says what it is asked to say.
    told = Scenario.model_validate(
        {"name": "resumed", "steps": [{"reply": {"text": "{note}", "audio_ms": 1200}}]}
    )
    async with (
        RealtimeSimulator(booking_scenario(RESTAURANT, requested_ms=800)) as sim_a,
        RealtimeSimulator(told) as sim_b,
    ):
        a_env = {"DRAIN_TIMEOUT_S": "0.5", "LOG_LEVEL": "INFO"} if how == "drained" else {}
        a = ServerProcess(
            server_env(clean_db, sim_a, api, sor.url, PUBLIC_BASE_URL=PUBLIC, **a_env)
        )
        a.stderr_path = tmp_path / "a.log"
        b = ServerProcess(server_env(clean_db, sim_b, api, sor.url, PUBLIC_BASE_URL=PUBLIC))
        if os.environ.get("RESUME_TEST_LOGS"):
            a.stderr_path = Path(os.environ["RESUME_TEST_LOGS"] + ".a")
            b.stderr_path = Path(os.environ["RESUME_TEST_LOGS"] + ".b")
        try:
            await a.start()
            await b.start()
            caller = FakeTwilioCaller(a.url, public_url=PUBLIC, failover_urls=(b.url,))
            api.attach(caller)
            await book_and_confirm(caller)
            call_id = str((await call_row(engine, caller.call_sid) or {})["id"])
            op = await wait_for_operation(engine, call_id, "running", within=WAIT_S)
            await wait_until(lambda: _inserted(sor), WAIT_S, "the SOR holds the booking")
            heard_on_a = caller.heard_ms

            if how == "killed":
                await a.kill()  # SIGKILL: no shutdown code runs on A
            else:
                a.terminate()  # past its 0.5 s drain limit A closes the stream on purpose
            # Twilio asks the action URL; the proxy sends it (and the new stream) to B.
            await caller.wait_for(lambda c: len(c.stream_sids) == 2, WAIT_S)
            assert a.proc is not None
            a_exit = await asyncio.wait_for(a.proc.wait(), WAIT_S)
            await wait_until(lambda: _said(engine, call_id, APOLOGY), WAIT_S, "the apology")
            committed = await wait_for_operation(engine, call_id, "committed", within=WAIT_S)
            delivery = await wait_for_delivery(engine, op["operation_id"], "heard", within=WAIT_S)
            row = await call_row(engine, caller.call_sid)
            instructions = _instructions(sim_b.sessions[0])
            async with httpx.AsyncClient(base_url=b.url, auth=CONSOLE) as http:
                timeline = (await http.get(f"/api/calls/{call_id}/timeline")).json()
            rest_hangups = api.requests_to(f"/Calls/{caller.call_sid}.json")
            await caller.hangup()
            ops = await operations_of(engine, call_id)
            op_events = await trail(engine, op["operation_id"])
            told_trail = await delivery_trail(engine, op["operation_id"])
            effects = await sor.side_effects()
        finally:
            await a.stop()
            await b.stop()
            sor.release()
            await sor.stop()

    assert [o.kind for o in caller.action_outcomes] == ["stream"]
    assert caller.heard_ms > heard_on_a
    kinds = [e["kind"] for e in timeline["events"]]
    a_log = a.stderr_path.read_text()
    if how == "drained":
        # A stopped cleanly, and its timeline shows the hand-over, not an end or a loss.
        # (Procrastinate stops a stopping worker's heartbeat before its running job ends, so
        # B may take that job as stalled and A's own finish of it is then refused: its log,
        # not ours. The booking still commits once, asserted below.)
        assert a_exit == 0 and not [line for line in a_log.splitlines() if " app." in line
                                    and (" ERROR " in line or " CRITICAL " in line)]  # fmt: skip
        assert "ending 0 call(s), handing 1 over to another replica" in a_log
        released = next(e for e in timeline["events"] if e["kind"] == "released_for_drain")
        resumed = next(e for e in timeline["events"] if e["kind"] == "stream_resumed")
        assert kinds.index("released_for_drain") < kinds.index("stream_resumed")
        assert released["data"]["holder"] != resumed["data"]["holder"] == row["holder"]
        assert "stream_lost" not in kinds and "call_ended" not in kinds
        assert rest_hangups == []  # no REST hang-up: the call was let go, not ended
    else:
        assert a_exit == -signal.SIGKILL
        assert "released_for_drain" not in kinds
    # B took the row over: in progress, held by B, the new stream's.
    assert row is not None and row["status"] == "in_progress"
    assert row["stream_sid"] == caller.stream_sids[1] and row["holder"] != ""
    # B's session starts from the summary: what was said, and the booking still open.
    assert "Please book it for tomorrow." in instructions
    assert "Requests of this call still open" in instructions and ": running" in instructions
    # One booking, committed once, told once in the new session, no SMS.
    assert effects.bookings_inserted == 1
    assert len(ops) == 1
    assert [e["to_status"] for e in op_events if e["kind"] == "transition"].count("committed") == 1
    assert delivery["channel"] == "call"
    assert [e["to_state"] for e in told_trail if e["kind"] == "transition"].count("heard") == 1
    assert api.messages_to(caller.from_number) == []
    assert "stream_resumed" in kinds and kinds.count("result_heard") == 1
    said = await heard_text(engine, call_id)
    # On B the caller heard the apology first (naming the open booking), then the result.
    apology = next(i for i, t in enumerate(said) if t.startswith(APOLOGY))
    assert "is still being confirmed" in said[apology]
    assert any(committed["provider_ref"] in t for t in said[apology + 1 :])


async def test_a_call_ended_on_purpose_gets_hangup_from_the_action_url(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, scenario()) as stack:
        caller = stack.caller()
        outcome = await caller.dial()
        await hear_greeting(caller)
        # Staff (or a goodbye) end the call here: our side closes the stream on purpose.
        await stack.service.runtime.registry.end(caller.call_sid, "ended by staff")
        await caller.wait_closed(15)
        row = await call_row(engine, caller.call_sid)

    assert outcome.action_url == stack.service.settings.public_base_url + "/twilio/stream-ended"
    # Twilio asked what next, and was told to hang up: no second stream.
    assert [o.kind for o in caller.action_outcomes] == ["hangup"]
    assert len(caller.stream_sids) == 1
    assert row is not None and row["status"] == "completed"


async def test_a_socket_dropped_without_stop_resumes_the_call_and_its_token_works_once(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, scenario()) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        before = caller.heard_ms
        caller.drop_stream()  # the network between Twilio and us breaks; the call is up
        await caller.wait_for(lambda c: len(c.stream_sids) == 2, 15)
        resumed = caller.action_outcomes[0]
        # The new session says sorry first (as asked in its first response's instructions).
        await caller.wait_for(lambda c: c.heard_ms >= before + 600 and c.buffered_ms == 0, 15)
        call_id = await stack.call_id(caller)
        await wait_until(lambda: _said(engine, call_id, APOLOGY), 15, "the apology heard")
        second = stack.sim.sessions[1]
        instructions = _instructions(second)
        row = await call_row(engine, caller.call_sid)

        # The same resume token again (a replay) takes nothing over.
        replay = FakeTwilioCaller(stack.service.url, call_sid=caller.call_sid, idle_audio=False)
        opened = await replay.open_stream(resumed.stream_url, resumed.parameters)
        await replay.wait_closed(10)
        await caller.hangup()
        kinds = [e["kind"] for e in await stack.events(caller)]
        ended = await call_row(engine, caller.call_sid)

    assert resumed.kind == "stream" and resumed.action_url is not None
    assert caller.closed_by == "caller"
    # The new Realtime session carries what was said before.
    assert "Hello, how can I help?" in instructions
    assert "Do not greet the caller again." in instructions
    assert row is not None and row["status"] == "in_progress"
    assert row["stream_sid"] == caller.stream_sids[1] and row["released_at"] is None
    assert not opened or replay.close_code == WS_POLICY_VIOLATION
    assert replay.close_code == WS_POLICY_VIOLATION
    assert "stream_lost" in kinds and "stream_resumed" in kinds
    assert kinds.count("call_ended") == 1
    assert ended is not None and ended["status"] == "completed"


async def test_an_unsigned_or_missigned_action_request_is_refused(engine: AsyncEngine) -> None:
    async with call_stack(engine, scenario()) as stack:
        caller = stack.caller()
        await caller.dial(open_stream=False)
        params = {"CallSid": caller.call_sid, "CallStatus": "in-progress"}
        async with httpx.AsyncClient(timeout=10) as http:
            unsigned = await http.post(stack.service.url + "/twilio/stream-ended", data=params)
        forged = await post_signed(
            stack.service, "/twilio/stream-ended", params, signature="bm90IGEgc2lnbmF0dXJl"
        )
        signed = await post_signed(stack.service, "/twilio/stream-ended", params)

    assert unsigned.status_code == 403
    assert forged.status_code == 403
    # Signed, for a call whose stream never started: nothing to resume.
    assert signed.status_code == 200 and "<Hangup" in signed.text


async def _inserted(sor: Any) -> bool:
    return bool((await sor.side_effects()).bookings_inserted == 1)


async def _said(engine: AsyncEngine, call_id: str, text: str) -> bool:
    return text in " ".join(await heard_text(engine, call_id))


def _instructions(session: Any) -> str:
    for _t, event in session.received:
        if event.get("type") == "session.update":
            return str(event["session"].get("instructions") or "")
    return ""


async def test_a_released_call_is_left_alone_by_the_sweep_and_the_delivery_path_within_its_window(
    engine: AsyncEngine,
) -> None:
    # Its holder last beat 25 s ago, then lost the stream and released the call.
    call_id = await make_call(engine, heartbeat_at=datetime.now(UTC) - timedelta(seconds=25))
    assert await takeover.release(engine, call_id, "test-holder")
    assert not await takeover.release(engine, call_id, "test-holder")  # once
    ended = await end_dead_calls(engine, dead_after_s=30)
    async with engine.connect() as conn:
        state, _row = await call_state_of(conn, call_id, dead_after_s=30)
    # Only the nonce claimed last takes it over, once, and then it is the new holder's.
    assert await takeover.claim(engine, call_id, holder="test-holder", nonce="n1")
    assert await takeover.take_over(
        engine, call_id, nonce="wrong", holder="b", stream_sid="MZ1"
    ) is None  # fmt: skip
    taken = await takeover.take_over(engine, call_id, nonce="n1", holder="b", stream_sid="MZ1")
    again = await takeover.take_over(engine, call_id, nonce="n1", holder="c", stream_sid="MZ2")

    assert ended == []
    assert state is CallState.LIVE_ELSEWHERE
    assert taken is not None and taken.holder == "b" and taken.released_at is None
    assert again is None


async def test_a_holder_is_alive_while_its_lock_is_held_and_dead_at_once_after(
    engine: AsyncEngine,
) -> None:
    name = f"replica-under-test-{uuid.uuid4().hex[:8]}"
    lock = HolderLock(engine, name)
    await lock.start()
    alive = await holder_alive(engine, name)
    await lock.stop()
    gone = await holder_alive(engine, name)

    assert alive is True
    assert gone is False
    assert await holder_alive(engine, "never-started") is False


async def test_a_resumed_call_asks_again_for_a_yes_it_never_got_and_says_nothing_is_under_way(
    engine: AsyncEngine,
) -> None:
    # Found by bench/soak.py: a replica killed between the readback and the caller's yes; the
    # new stream's first line said the booking "is still being confirmed", the caller hung up
    # believing so, and the unconfirmed operation was cancelled with the call, untold.
    unconfirmed_call = await make_call(engine)
    running_call = await make_call(engine)
    for call_id, status in (
        (unconfirmed_call, OperationStatus.AWAITING_CONFIRMATION),
        (running_call, OperationStatus.ADMITTED),
    ):
        async with engine.begin() as conn:
            await ledger.admit_operation(
                conn,
                tenant_id="default",
                tool="book_table",
                args={"date": "2027-01-05", "time": "20:00", "party_size": 4, "name": "Alex"},
                idempotency_key=f"resume-{call_id}",
                call_id=call_id,
                caller="+15550001111",
                status=status,
                enqueue=_no_job,
            )
    async with call_stack(engine, scenario()) as stack:
        unconfirmed = await resume_context(stack.service.runtime, unconfirmed_call)
        running = await resume_context(stack.service.runtime, running_call)

    assert "still being confirmed" not in unconfirmed.first_line
    assert "needs your yes" in unconfirmed.first_line and "Alex" in unconfirmed.first_line
    assert "awaiting confirmation" in unconfirmed.note and "ask again" in unconfirmed.note
    assert "is still being confirmed" in running.first_line


async def _no_job(conn: Any, operation_id: Any) -> None:
    return None  # nothing runs it: the test reads what a resumed stream would say
