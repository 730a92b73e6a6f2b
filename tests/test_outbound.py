"""Outbound calls with answering-machine detection, end to end over real sockets: the console
API (and `voice-agent dial`), the ledger and its worker, the fake Twilio REST API (which places
the call, plays the callee with a fake Twilio caller and sends the AMD result), the service,
the Realtime simulator and PostgreSQL.

A person hears the purpose first (and where the operation stands); a machine gets a short
message naming the purpose only, then the call is hung up; a create whose answer is lost is
reconciled to the one call Twilio placed; busy is recorded on the row and the operation.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from app.calls.liveness import end_unstreamed_calls
from app.calls.store import create_call
from app.cli.dial import run_dial_command
from app.errors import StartupError
from app.ops.outbound import request_call
from telephony.sim.fake_caller import CallerState
from telephony.sim.scenario import Scenario
from tests.console_support import bearer, seed_operation
from tests.e2e_support import Stack, call_stack, event_kinds, make_settings, wait_until
from tests.test_e2e_booking import heard_text
from tools.states import OperationStatus as S

CALLEE = "+15557654321"
PURPOSE = "your table booking for Friday"
WAIT_S = 20.0


def scenario() -> Scenario:
    # No greeting and no scripted steps: an outbound call's first words are the service's.
    return Scenario.model_validate(
        {"name": "outbound", "steps": [], "fallback": {"text": "Anything else?", "audio_ms": 600}}
    )


async def place(stack: Stack, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(f"{stack.service.url}/api/calls", json=body, headers=headers)


async def call_row(engine: AsyncEngine, call_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        row = (
            (await conn.execute(sa.text("SELECT * FROM calls WHERE id = :i"), {"i": call_id}))
            .mappings()
            .one()
        )
    return dict(row)


async def operation(engine: AsyncEngine, op_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    async with engine.connect() as conn:
        op = (
            (
                await conn.execute(
                    sa.text("SELECT * FROM operations WHERE operation_id = :o"), {"o": op_id}
                )
            )
            .mappings()
            .one()
        )
        events = (
            (
                await conn.execute(
                    sa.text(
                        "SELECT kind, actor, reason, to_status FROM operation_events "
                        "WHERE operation_id = :o ORDER BY id"
                    ),
                    {"o": op_id},
                )
            )
            .mappings()
            .all()
        )
    return dict(op), [dict(e) for e in events]


async def op_status(engine: AsyncEngine, op_id: str) -> str:
    op, _ = await operation(engine, op_id)
    return str(op["status"])


def outbound_stack(engine: AsyncEngine, clean_db: str, **overrides: Any) -> Any:
    return call_stack(
        engine,
        scenario(),
        with_worker=True,
        database_url=clean_db,
        sweep_interval_s=0.5,
        **overrides,
    )


async def test_a_person_who_answers_hears_the_purpose_and_the_operations_state_first(
    engine: AsyncEngine, clean_db: str
) -> None:
    booking = await seed_operation(engine, None, S.COMMITTED, reference="BK4242")
    async with outbound_stack(engine, clean_db) as stack:
        headers = await bearer(engine, Role.OPERATOR)
        answer = await place(
            stack, {"to": CALLEE, "purpose": PURPOSE, "operation_id": str(booking)}, headers
        )
        assert answer.status_code == 202, answer.text
        call_id, op_id = answer.json()["call_id"], answer.json()["operation_id"]

        async def first_words() -> bool:
            return bool(await heard_text(engine, call_id))

        await wait_until(first_words, WAIT_S, "the agent's first words")
        said = (await heard_text(engine, call_id))[0]
        [created] = stack.api.requests_to("/Calls.json")
        [placed] = stack.api.created_calls(CALLEE)
        callee = stack.api.outbound_callers[placed.sid]
        await callee.hangup()
        await stack.events(callee)
        kinds = await event_kinds(engine, call_id)
        row = await call_row(engine, call_id)
        op, _ = await operation(engine, op_id)
        async with httpx.AsyncClient(timeout=10) as client:
            seen = await client.get(f"{stack.service.url}/api/operations/{op_id}", headers=headers)
            listed = await client.get(f"{stack.service.url}/api/calls", headers=headers)
    # The agent named the purpose and where the booking stands, after Twilio said a person.
    assert PURPOSE in said, said
    assert "table for 2" in said, said
    order = ["call_started", "outbound_requested", "outbound_answered", "stream_started",
             "amd_result", "agent_transcript", "call_ended"]  # fmt: skip
    assert [k for k in kinds if k in order and k != "agent_transcript"] == [
        k for k in order if k != "agent_transcript"
    ], kinds
    assert kinds.index("amd_result") < kinds.index("agent_transcript"), kinds
    # Twilio was asked once, with answering-machine detection and our signed webhooks.
    form = created.form
    assert form["To"] == CALLEE and form["From"] == stack.service.settings.twilio_from_number
    assert form["MachineDetection"] == "DetectMessageEnd" and form["AsyncAmd"] == "true"
    answer_url = urlsplit(form["Url"])
    assert answer_url.path == "/twilio/outbound-answer"
    assert parse_qs(answer_url.query)["call_id"] == [call_id]
    assert urlsplit(form["AsyncAmdStatusCallback"]).path == "/twilio/amd"
    assert urlsplit(form["StatusCallback"]).path == "/twilio/status"
    # The row is the outbound call Twilio placed; placing it is a committed operation.
    assert row["direction"] == "outbound" and row["call_sid"] == placed.sid
    assert row["outbound"]["purpose"] == PURPOSE and row["outbound"]["amd"] == "human"
    assert op["tool"] == "place_call" and op["status"] == "committed"
    assert op["provider_ref"] == placed.sid and op["call_id"] is None
    # The console shows the placing operation like any other.
    assert seen.status_code == 200, seen.text
    assert seen.json()["operation"]["tool"] == "place_call"
    assert [c["direction"] for c in listed.json()["calls"]] == ["outbound"]


async def test_an_outbound_row_still_ringing_is_given_its_ring_time_before_the_sweep(
    engine: AsyncEngine,
) -> None:
    settings = make_settings(1)
    placed = await request_call(
        engine, settings, _no_enqueue, to=CALLEE, purpose=PURPOSE, about_operation_id=None, by="t"
    )
    inbound, _ = await create_call(
        engine, call_sid="CA" + "1" * 32, tenant_id="default", from_number=CALLEE, to_number=None
    )
    later = datetime.now(UTC) + timedelta(seconds=100)
    first = await end_unstreamed_calls(engine, stream_wait_s=90, now=later, outbound_wait_s=60)
    second = await end_unstreamed_calls(
        engine, stream_wait_s=90, now=later + timedelta(seconds=61), outbound_wait_s=60
    )
    assert [c.call_id for c in first] == [inbound.id]
    assert [c.call_id for c in second] == [placed.call_id]


async def _no_enqueue(conn: Any, operation_id: uuid.UUID) -> None:
    return None


async def test_a_machine_gets_a_short_message_after_the_beep_and_nothing_private(
    engine: AsyncEngine, clean_db: str
) -> None:
    booking = await seed_operation(engine, None, S.COMMITTED, reference="BK4242")
    async with outbound_stack(engine, clean_db) as stack:
        stack.api.call_outcome = "machine_end_beep"
        headers = await bearer(engine, Role.OPERATOR)
        answer = await place(
            stack, {"to": CALLEE, "purpose": PURPOSE, "operation_id": str(booking)}, headers
        )
        call_id, op_id = answer.json()["call_id"], answer.json()["operation_id"]
        await stack.api.wait_for(lambda api: bool(api.outbound_callers), WAIT_S)
        [callee] = stack.api.outbound_callers.values()
        await callee.wait_for(lambda c: c.state is CallerState.ENDED, WAIT_S)
        heard_ms = callee.heard_ms
        await stack.events(callee)
        said = await heard_text(engine, call_id)
        kinds = await event_kinds(engine, call_id)
        row = await call_row(engine, call_id)
        _, op_events = await operation(engine, op_id)
        hangups = stack.api.requests_to(f"/Calls/{callee.call_sid}.json")
    # One message, naming the purpose only: not the booking's details.
    assert len(said) == 1, said
    assert PURPOSE in said[0] and "call us back" in said[0], said
    assert "table for 2" not in said[0] and "BK4242" not in said[0], said
    # Heard to its end, then hung up through Twilio's API.
    assert heard_ms >= 2500, heard_ms
    assert [r.form.get("Status") for r in hangups] == ["completed"]
    assert callee.closed_by == "twilio-api"
    order = ["amd_result", "voicemail_left", "call_ended"]
    assert [k for k in kinds if k in order] == order, kinds
    # Nothing was said before Twilio told who answered (the greeting did not set it off).
    assert kinds.index("amd_result") < kinds.index("agent_transcript"), kinds
    assert "response_created" not in kinds[: kinds.index("amd_result")], kinds
    assert row["status"] == "completed" and row["end_reason"] == "voicemail left"
    assert row["outbound"]["amd"] == "machine_end_beep"
    notes = [e["reason"] for e in op_events if e["kind"] == "note"]
    assert "answered by machine_end_beep" in notes and "a voicemail message was left" in notes


async def test_a_lost_create_answer_is_reconciled_to_the_one_call_never_a_second(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with outbound_stack(engine, clean_db, outbound_create_timeout_s=1.0) as stack:
        stack.api.lose_call_answers(1)
        stack.api.ring_s = 4.0  # nobody has picked up yet when the worker asks Twilio
        headers = {**await bearer(engine, Role.OPERATOR), "Idempotency-Key": "crm-job-17"}
        answer = await place(stack, {"to": CALLEE, "purpose": PURPOSE}, headers)
        call_id, op_id = answer.json()["call_id"], answer.json()["operation_id"]

        async def settled() -> bool:
            return await op_status(engine, op_id) not in ("admitted", "running", "unknown")

        await wait_until(settled, WAIT_S, "the placing operation settles")
        op, events = await operation(engine, op_id)
        row = await call_row(engine, call_id)
        # The client retrying its request (same key) gets the same call, placed once.
        again = await place(stack, {"to": CALLEE, "purpose": PURPOSE}, headers)
        creates = stack.api.requests_to("/Calls.json")
        lists = stack.api.requests_to("/Calls.json", method="GET")
        stack.api.release_answers()
        placed = stack.api.created_calls()
    assert len(creates) == 1 and len(placed) == 1, (creates, placed)
    assert again.status_code == 202 and again.json() == answer.json()
    assert op["status"] == "committed" and op["provider_ref"] == placed[0].sid
    path = [e["to_status"] for e in events if e["kind"] == "transition"]
    assert path == ["admitted", "running", "unknown", "committed"], path
    assert events[-1]["actor"] == "reconciler"
    assert lists and lists[0].form["To"] == CALLEE
    assert row["call_sid"] == placed[0].sid


async def test_busy_is_recorded_on_the_row_the_timeline_and_the_operation(
    engine: AsyncEngine, clean_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with outbound_stack(engine, clean_db) as stack:
        stack.api.call_outcome = "busy"
        token = (await bearer(engine, Role.OPERATOR))["Authorization"].removeprefix("Bearer ")
        settings = stack.service.settings
        # Through the command line, as a person would.
        code = await asyncio.to_thread(
            run_dial_command, CALLEE, PURPOSE, None, stack.service.url, token, settings
        )
        printed = capsys.readouterr().out
        call_id = printed.split()[1]
        uuid.UUID(call_id)

        async def ended() -> bool:
            # The row turns busy first; the status callback then writes the timeline's end.
            await stack.service.runtime.events.flush()
            recorded = (await call_row(engine, call_id))["status"] == "busy"
            return recorded and "call_ended" in await event_kinds(engine, call_id)

        await wait_until(ended, WAIT_S, "the call is recorded busy and its end written")
        row = await call_row(engine, call_id)
        kinds = await event_kinds(engine, call_id)
        _, op_events = await operation(engine, str(row["outbound"]["placing_operation_id"]))
    assert code == 0
    assert row["end_reason"] == "twilio status busy" and row["answered_at"] is None
    assert not stack.api.outbound_callers  # nobody picked up: no stream
    assert [k for k in kinds if k.startswith(("outbound", "call_"))] == [
        "call_started", "outbound_requested", "outbound_unanswered", "call_ended"
    ], kinds  # fmt: skip
    assert "the call ended: busy" in [e["reason"] for e in op_events]


async def test_bad_requests_are_refused_clearly_and_place_nothing(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with outbound_stack(engine, clean_db) as stack:
        operator = await bearer(engine, Role.OPERATOR)
        viewer = await bearer(engine, Role.VIEWER)
        bad_number = await place(stack, {"to": "555-1234", "purpose": PURPOSE}, operator)
        no_purpose = await place(stack, {"to": CALLEE}, operator)
        blank = await place(stack, {"to": CALLEE, "purpose": "   "}, operator)
        no_op = await place(
            stack, {"to": CALLEE, "purpose": PURPOSE, "operation_id": "nope"}, operator
        )
        as_viewer = await place(stack, {"to": CALLEE, "purpose": PURPOSE}, viewer)
        with pytest.raises(StartupError, match=r"E\.164"):
            await asyncio.to_thread(
                run_dial_command,
                "12345",
                PURPOSE,
                None,
                stack.service.url,
                operator["Authorization"].removeprefix("Bearer "),
                stack.service.settings,
            )
        with pytest.raises(StartupError, match="no API token"):
            run_dial_command(CALLEE, PURPOSE, None, stack.service.url, "", stack.service.settings)
        async with engine.connect() as conn:
            count = await conn.scalar(sa.text("SELECT count(*) FROM calls"))
    assert bad_number.status_code == 400 and "E.164" in bad_number.json()["detail"]
    assert no_purpose.status_code == 400 and "purpose" in no_purpose.json()["detail"]
    assert blank.status_code == 400
    assert no_op.status_code == 400 and "operation_id" in no_op.json()["detail"]
    assert as_viewer.status_code == 403
    assert count == 0 and not stack.api.requests_to("/Calls.json")
