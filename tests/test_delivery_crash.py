"""Late results across crashes of real `voice-agent serve` processes on one database: SIGKILL
while the system of record holds a committed answer, two server processes with duplicate
provider callbacks, restarts between the commit and the send. The caller gets exactly one
SMS each time, and the timeline says why."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.simulator import RealtimeSimulator
from tests.domains import RESTAURANT
from tests.e2e_support import AUTH_TOKEN, CONSOLE, call_row, wait_until
from tests.server_proc import ServerProcess
from tests.sor_support import CALLBACK_SECRET, start_sor
from tests.test_e2e_booking import (
    GREETING_MS,
    PREAMBLE_MS,
    READBACK_MS,
    booking_scenario,
    delivery_trail,
    hear,
    operations_of,
    rows,
    trail,
    wait_for_delivery,
    wait_for_operation,
)
from tools import deliveries
from tools.callback import CallbackReport, signed_headers
from tools.restaurant.sor import Faults

WAIT_S = 45.0  # process starts and stalled-job detection take a moment on a loaded machine


@pytest.fixture
async def sim() -> AsyncIterator[RealtimeSimulator]:
    async with RealtimeSimulator(booking_scenario(RESTAURANT, requested_ms=800)) as simulator:
        yield simulator


@pytest.fixture
async def api() -> AsyncIterator[FakeTwilioApi]:
    async with FakeTwilioApi(sms_step_delay_s=0.01) as fake:
        yield fake


def server_env(db: str, sim: RealtimeSimulator, api: FakeTwilioApi, sor_url: str, **kw: str) -> Any:
    return {
        "DATABASE_URL": db,
        "OPENAI_API_KEY": "test-key",
        "OPENAI_BASE_URL": sim.base_url,
        "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
        "TWILIO_API_BASE_URL": api.base_url,
        "SOR_BASE_URL": sor_url,
        "SOR_CALLBACK_SECRET": CALLBACK_SECRET,
        "STREAM_TOKEN_SECRET": "stream-secret-for-tests",
        "CONSOLE_USER": CONSOLE[0],
        "CONSOLE_PASSWORD": CONSOLE[1],
        "CONSOLE_HTTP_BASIC": "true",
        "LOG_LEVEL": "WARNING",
        # Fast enough for a test: a dead process is noticed within ~2 s.
        "CALL_HEARTBEAT_S": "0.3",
        "CALL_DEAD_AFTER_S": "2",
        "WORKER_HEARTBEAT_S": "0.3",
        "WORKER_STALLED_AFTER_S": "2",
        "SWEEP_INTERVAL_S": "0.3",
        **kw,
    }


async def book_and_confirm(caller: FakeTwilioCaller) -> None:
    await caller.dial()
    await hear(caller, GREETING_MS)
    before = caller.heard_ms
    await caller.play_speech(700)
    await hear(caller, before + PREAMBLE_MS + READBACK_MS)
    await caller.play_speech(500)


async def call_id_of(engine: AsyncEngine, caller: FakeTwilioCaller) -> str:
    row = await call_row(engine, caller.call_sid)
    assert row is not None
    return str(row["id"])


async def test_sigkill_while_the_sor_holds_a_committed_answer_ends_the_call_and_texts_once(
    engine: AsyncEngine,
    clean_db: str,
    sim: RealtimeSimulator,
    api: FakeTwilioApi,
) -> None:
    # The restaurant books the table and then never answers: the worker waits on it.
    sor = await start_sor(clean_db, Faults(lose_response=1))
    first = ServerProcess(server_env(clean_db, sim, api, sor.url))
    second: ServerProcess | None = None
    try:
        await first.start()
        caller = FakeTwilioCaller(first.url)
        api.attach(caller)  # Twilio knows the call; its status callback will never come
        await book_and_confirm(caller)
        call_id = await call_id_of(engine, caller)
        op = await wait_for_operation(engine, call_id, "running", within=WAIT_S)
        await wait_until(
            lambda: _inserted(sor), WAIT_S, "the SOR committed the booking and holds the answer"
        )

        await first.kill()  # SIGKILL the server's process group
        await caller.wait_closed(10)
        stranded = await call_row(engine, caller.call_sid)
        assert stranded is not None and stranded["status"] == "in_progress"
        assert (await operations_of(engine, call_id))[0]["status"] == "running"

        # Restarted on the same database; Twilio's status callback is never delivered.
        second = ServerProcess(server_env(clean_db, sim, api, sor.url))
        await second.start()
        committed = await wait_for_operation(engine, call_id, "committed", within=WAIT_S)
        delivery = await wait_for_delivery(engine, op["operation_id"], "texted", within=WAIT_S)
        async with httpx.AsyncClient(base_url=second.url, auth=CONSOLE) as http:
            timeline = (await http.get(f"/api/calls/{call_id}/timeline")).json()
        ended = await call_row(engine, caller.call_sid)
        op_events = await trail(engine, op["operation_id"])
        told = await delivery_trail(engine, op["operation_id"])
        effects = await sor.side_effects()
    finally:
        await first.stop()
        if second is not None:
            await second.stop()
        sor.release()
        await sor.stop()

    assert effects.bookings_inserted == 1  # recovered by asking, never by booking again
    assert [e["to_status"] for e in op_events if e["kind"] == "transition"] == [
        "awaiting_confirmation",
        "admitted",
        "running",
        "unknown",
        "committed",
    ]
    # The server ended the call itself, and said why on the timeline.
    assert ended is not None and ended["status"] == "completed"
    assert ended["end_reason"].startswith("its process stopped")
    assert "no heartbeat for 2 s" in ended["end_reason"]
    call_ended = [e for e in timeline["events"] if e["kind"] == "call_ended"]
    assert call_ended[-1]["data"]["reason"] == ended["end_reason"]
    # Exactly one SMS, with the reference, once the call was known to be over.
    messages = api.messages_to(caller.from_number)
    assert len(messages) == 1
    assert f"Ref {committed['provider_ref']}." in messages[0].body
    assert [e["to_state"] for e in told if e["kind"] == "transition"] == [
        "pending",
        "texting",
        "texted",
    ]
    assert delivery["channel"] == "sms"
    # What the caller heard before the crash: the greeting, the readback, "requested".
    assert caller.heard_ms >= GREETING_MS + PREAMBLE_MS + READBACK_MS


async def _inserted(sor: Any) -> bool:
    return bool((await sor.side_effects()).bookings_inserted == 1)


async def test_hang_up_before_the_commit_two_servers_duplicate_callbacks_and_a_restart_one_sms(
    engine: AsyncEngine,
    clean_db: str,
    sim: RealtimeSimulator,
    api: FakeTwilioApi,
) -> None:
    # The restaurant accepts and answers "pending"; it applies and reports (twice) when told.
    sor = await start_sor(clean_db, Faults(async_mode=True, async_hold=True, duplicate_callbacks=1))
    # First run: two servers, neither takes delivery jobs yet (only operations).
    only_ops = {"WORKER_QUEUES": "operations"}
    one = ServerProcess(server_env(clean_db, sim, api, sor.url, **only_ops))
    two = ServerProcess(server_env(clean_db, sim, api, sor.url, **only_ops))
    restarted: list[ServerProcess] = []
    try:
        await one.start()
        await two.start()
        caller = FakeTwilioCaller(one.url)
        api.attach(caller)
        await book_and_confirm(caller)
        call_id = await call_id_of(engine, caller)
        op = await wait_for_operation(engine, call_id, "running", within=WAIT_S)
        await caller.hangup()  # before the commit
        await wait_until(lambda: _call_over(engine, caller.call_sid), WAIT_S, "call ended")

        sor.release()  # applied now; the report goes to the server that ran it, twice
        committed = await wait_for_operation(engine, call_id, "committed", within=WAIT_S)
        # ... and a copy of the same signed report reaches the other server too.
        report = CallbackReport(
            idempotency_key=committed["idempotency_key"],
            status="committed",
            sequence=1,
            reference=committed["provider_ref"],
            result=committed["result"],
        )
        body = report.model_dump_json().encode()
        for server in (one, two):
            async with httpx.AsyncClient() as http:
                answer = await http.post(
                    f"{server.url}/operations/{op['operation_id']}/callback",
                    content=body,
                    headers={
                        "content-type": "application/json",
                        **signed_headers(CALLBACK_SECRET, body, report.message_id()),
                    },
                )
            assert answer.status_code == 200 and answer.json()["applied"] is False
        pending = await wait_for_delivery(engine, op["operation_id"], "pending")
        assert api.created_messages() == []  # nothing sent before the restart
        # A duplicate delivery job, as a retried deferral would leave behind.
        async with engine.begin() as conn:
            await deliveries.enqueue(conn, pending["id"])

        # Restart between the commit and the send: both servers now take delivery jobs.
        await one.stop()
        await two.stop()
        for _ in range(2):
            server = ServerProcess(server_env(clean_db, sim, api, sor.url))
            restarted.append(await server.start())
        delivery = await wait_for_delivery(engine, op["operation_id"], "texted", within=WAIT_S)
        op_events = await trail(engine, op["operation_id"])
        told = await delivery_trail(engine, op["operation_id"])
        messages = await rows(
            engine, "SELECT * FROM sms_messages WHERE delivery_id = :d", d=delivery["id"]
        )
        effects = await sor.side_effects()
    finally:
        for server in (one, two, *restarted):
            await server.stop()
        sor.release()
        await sor.stop()

    assert effects.bookings_inserted == 1
    assert [e["to_status"] for e in op_events if e["kind"] == "transition"].count("committed") == 1
    at_twilio = api.messages_to(caller.from_number)
    assert len(at_twilio) == 1 and len(api.requests_to("/Messages.json", "POST")) == 1
    assert len(messages) == 1 and messages[0]["attempts"] == 1
    assert messages[0]["message_sid"] == at_twilio[0].sid
    assert f"Ref {committed['provider_ref']}." in at_twilio[0].body
    assert [e["to_state"] for e in told if e["kind"] == "transition"] == [
        "pending",
        "texting",
        "texted",
    ]


async def _call_over(engine: AsyncEngine, call_sid: str) -> bool:
    row = await call_row(engine, call_sid)
    return row is not None and row["status"] == "completed"
