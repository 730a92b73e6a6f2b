"""Booking calls end to end over real sockets: fake caller -> service (pipeline, in-process
worker, late-result delivery) -> Realtime simulator, with a system of record.

The model proposes (scripted function calls), policy admits, the worker commits at the SOR,
and the conversation communicates (the late result is announced and heard, or texted after
hang-up).
Every flow runs for both domains through the same engine: the restaurant (a Python plugin on
the demo SOR) and the clinic's appointments (declared in a tools file, on its own REST API).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.scenario import Scenario
from tests.domains import DOMAINS, Backend, Domain
from tests.e2e_support import CONSOLE, Stack, call_stack, wait_until
from tests.sor_support import start_sor
from tools.restaurant.client import SorClient
from tools.restaurant.protocol import BookingRequest
from tools.restaurant.sor import SystemOfRecord

GREETING_MS = 800
PREAMBLE_MS = 600
READBACK_MS = 1500
FRAME_MS = 20
# How long a wait for a state may take before the test fails (not a speed asserted): a booking
# call's delivery heard took 14-17 s of a test's 15-17 on a slow machine, alone, and failed
# `test_metrics` at 15 s under CI's four workers.
WAIT_S = 30.0

CONFIRM = {
    "name": "confirm_operation",
    "arguments": {"operation_id": "{output[operation_id]}", "confirmed": True},
}
REQUESTED = "I've requested it; it is not confirmed yet."


def booking_scenario(
    domain: Domain,
    *,
    duplicate: bool = False,
    requested_ms: int = 1200,
    after_requested: list[dict[str, Any]] | None = None,
) -> Scenario:
    """Book -> readback -> yes -> confirm -> "requested" -> (more) -> late "confirmed"."""
    book_call = {"name": domain.book_tool, "arguments": domain.book_args}
    book: dict[str, Any] = {
        **book_call,
        "preamble": {"text": "One moment.", "audio_ms": PREAMBLE_MS},
    }
    steps: list[dict[str, Any]] = [
        {
            "caller_transcript": "Please book it for tomorrow.",
            "function_call": book,
        }
    ]
    if duplicate:
        steps.append({"function_call": book_call})  # the model asks again for the same intent
    steps += [
        {"reply": {"text": "{output[readback]}", "audio_ms": READBACK_MS}},
        {"caller_transcript": "Yes.", "function_call": CONFIRM},
    ]
    if duplicate:
        steps.append({"function_call": CONFIRM})  # and confirms twice
    steps.append({"reply": {"text": REQUESTED, "audio_ms": requested_ms}})
    steps += after_requested or []
    steps.append({"reply": {"text": domain.confirmed_text, "audio_ms": 1200}})
    return Scenario.model_validate(
        {
            "name": f"e2e-booking-{domain.name}",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": GREETING_MS},
            "steps": steps,
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )


@pytest.fixture(params=DOMAINS, ids=str)
def domain(request: pytest.FixtureRequest) -> Domain:
    found: Domain = request.param
    return found


@pytest.fixture
async def backend(domain: Domain, clean_db: str) -> AsyncIterator[Backend]:
    async with domain.start(clean_db) as running:
        yield running


@pytest.fixture
async def sor(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    sor = await start_sor(clean_db)
    try:
        yield sor
    finally:
        await sor.stop()


@asynccontextmanager
async def booking_stack(
    engine: AsyncEngine,
    db: str,
    backend: Backend,
    scenario: Scenario,
    *,
    deadline_s: float | None = None,
) -> AsyncIterator[Stack]:
    """The service with its in-process worker, running `backend`'s domain and the simulator."""
    catalog = backend.catalog(deadline_s=deadline_s)
    try:
        async with call_stack(
            engine,
            scenario,
            with_worker=True,
            catalog=catalog,
            database_url=db,
            sweep_interval_s=1.0,
        ) as stack:
            yield stack
    finally:
        await catalog.aclose()


# --- observing the database -----------------------------------------------------------------


async def rows(engine: AsyncEngine, sql: str, **params: Any) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        result = await conn.execute(sa.text(sql), params)
        return [dict(r) for r in result.mappings().all()]


async def operations_of(engine: AsyncEngine, call_id: str) -> list[dict[str, Any]]:
    return await rows(
        engine, "SELECT * FROM operations WHERE call_id = :c ORDER BY created_at", c=call_id
    )


async def tool_calls_of(engine: AsyncEngine, call_id: str) -> list[dict[str, Any]]:
    return await rows(engine, "SELECT * FROM tool_calls WHERE call_id = :c ORDER BY id", c=call_id)


async def trail(engine: AsyncEngine, operation_id: uuid.UUID) -> list[dict[str, Any]]:
    return await rows(
        engine,
        "SELECT * FROM operation_events WHERE operation_id = :o ORDER BY id",
        o=operation_id,
    )


async def call_events_at(engine: AsyncEngine, call_id: str) -> list[dict[str, Any]]:
    return await rows(
        engine,
        "SELECT seq, kind, at, data FROM call_events WHERE call_id = :c ORDER BY seq",
        c=uuid.UUID(call_id),
    )


async def wait_for_operation(
    engine: AsyncEngine, call_id: str, status: str, within: float = WAIT_S
) -> dict[str, Any]:
    """Until the call's (only) operation has `status`; returns its row."""
    found: list[dict[str, Any]] = []

    async def reached() -> bool:
        ops = await operations_of(engine, call_id)
        found[:] = ops
        return bool(ops) and ops[-1]["status"] == status

    await wait_until(reached, within, f"operation {status}")
    return found[-1]


async def delivery_row(engine: AsyncEngine, operation_id: uuid.UUID) -> dict[str, Any] | None:
    found = await rows(engine, "SELECT * FROM deliveries WHERE operation_id = :o", o=operation_id)
    return found[0] if found else None


async def wait_for_delivery(
    engine: AsyncEngine, operation_id: uuid.UUID, state: str, within: float = WAIT_S
) -> dict[str, Any]:
    """Until the outcome's delivery reaches `state`; returns its row."""

    async def reached() -> bool:
        row = await delivery_row(engine, operation_id)
        return row is not None and row["state"] == state

    await wait_until(reached, within, f"delivery {state}")
    row = await delivery_row(engine, operation_id)
    assert row is not None
    return row


async def delivery_trail(engine: AsyncEngine, operation_id: uuid.UUID) -> list[dict[str, Any]]:
    return await rows(
        engine,
        "SELECT e.* FROM delivery_events e JOIN deliveries d ON d.id = e.delivery_id "
        "WHERE d.operation_id = :o ORDER BY e.id",
        o=operation_id,
    )


def to_statuses(events: list[dict[str, Any]]) -> list[str]:
    return [e["to_status"] for e in events if e["kind"] == "transition"]


# --- driving the caller ---------------------------------------------------------------------


async def hear(caller: FakeTwilioCaller, at_least_ms: float) -> None:
    """Until the caller has heard `at_least_ms` of agent audio and nothing more is queued."""
    await caller.wait_for(
        lambda c: c.heard_ms >= at_least_ms - 2 * FRAME_MS and c.buffered_ms == 0, WAIT_S
    )


async def ask_to_book_and_confirm(stack: Stack, caller: FakeTwilioCaller) -> str:
    """Greeting, "book it", the readback, "yes". Returns the call's id."""
    await caller.dial()
    await hear(caller, GREETING_MS)
    before = caller.heard_ms
    await caller.play_speech(700)
    await hear(caller, before + PREAMBLE_MS + READBACK_MS)
    call_id = await stack.call_id(caller)
    ops = await operations_of(stack.engine, call_id)
    assert [op["status"] for op in ops] == ["awaiting_confirmation"]  # nothing runs unconfirmed
    await caller.play_speech(500)
    return call_id


async def heard_text(engine: AsyncEngine, call_id: str) -> list[str]:
    """What the agent said, as recorded once played (cut to what was heard)."""
    return [
        e["data"]["text"]
        for e in await call_events_at(engine, call_id)
        if e["kind"] == "agent_transcript"
    ]


async def wait_spoken(engine: AsyncEngine, call_id: str, text: str) -> None:
    """Until the agent has said `text` in full and the caller has heard it."""

    async def spoken() -> bool:
        return text in await heard_text(engine, call_id)

    await wait_until(spoken, WAIT_S, f"agent saying {text!r}")


# --- tests ----------------------------------------------------------------------------------


async def test_caller_books_and_the_timeline_shows_request_policy_admission_execution_commit(
    engine: AsyncEngine, clean_db: str, domain: Domain, backend: Backend
) -> None:
    # A provider that takes a moment: the commit comes after "requested, not confirmed yet".
    backend.set_faults(latency_s=0.5)
    confirmed = domain.confirmed_text
    async with booking_stack(engine, clean_db, backend, booking_scenario(domain)) as stack:
        caller = stack.caller()
        call_id = await ask_to_book_and_confirm(stack, caller)
        op = await wait_for_operation(engine, call_id, "committed")
        await wait_for_delivery(engine, op["operation_id"], "heard")
        await wait_spoken(engine, call_id, confirmed)
        await caller.hangup()
        events = await stack.events(caller)
        async with httpx.AsyncClient(base_url=stack.service.url) as http:
            response = await http.get(f"/api/calls/{call_id}/timeline", auth=CONSOLE)
        booked = await backend.booked()
        ops = await operations_of(engine, call_id)
        calls = await tool_calls_of(engine, call_id)
        op_events = await trail(engine, op["operation_id"])
        at_events = await call_events_at(engine, call_id)
        spoken = await heard_text(engine, call_id)

    operation_id = op["operation_id"]
    # Exactly one booking at the system of record, owned by one committed operation.
    assert booked == 1
    assert [o["status"] for o in ops] == ["committed"]
    assert ops[0]["provider_ref"].startswith(domain.reference_prefix)
    assert ops[0]["caller"] == caller.from_number
    # The trail in causal order: requested (awaiting the caller), admitted, run, committed.
    assert to_statuses(op_events) == ["awaiting_confirmation", "admitted", "running", "committed"]
    actors = [e["actor"] for e in op_events if e["kind"] == "transition"]
    # The application admits (after its policy decision), never the model.
    assert actors[:2] == ["policy", "policy"]
    assert all(a.startswith("worker:") for a in actors[2:]), actors
    # The outcome's delivery: decided, handed to the call, and heard there.
    told = await delivery_trail(engine, operation_id)
    assert [e["to_state"] for e in told if e["kind"] == "transition"] == [
        "pending",
        "offered",
        "heard",
    ]
    assert [e["data"]["action"] for e in told if e["kind"] == "decision"] == ["announce"]
    assert told[0]["at"] >= op_events[3]["at"]  # opened with the commit
    # Both function calls are on record and map to the one operation.
    assert [(c["tool"], c["decision"]) for c in calls] == [
        (domain.book_tool, "needs_confirmation"),
        ("confirm_operation", "allow"),
    ]
    assert {c["operation_id"] for c in calls} == {operation_id}
    # The call announced the result after the commit, and the caller heard it.
    committed_at = next(e["at"] for e in op_events if e["to_status"] == "committed")
    announced = [e for e in at_events if e["kind"] == "result_announced"]
    assert len(announced) == 1
    assert announced[0]["data"]["operation_ids"] == [str(operation_id)]
    assert announced[0]["at"] >= committed_at
    assert REQUESTED in spoken and confirmed in spoken
    assert spoken.index(REQUESTED) < spoken.index(confirmed)
    assert [e["kind"] for e in events][-1] == "call_ended"

    # The timeline API tells the same story, merged in order.
    assert response.status_code == 200
    timeline = response.json()
    entries = timeline["events"]
    assert {e["source"] for e in entries} == {"call", "tool_call", "operation", "delivery"}
    shown = [e["kind"] for e in entries if e["source"] == "call"]
    recorded = [e["kind"] for e in events]
    # Agent speech is placed where it began (it is recorded once played); the rest keeps
    # its recorded order.
    assert sorted(shown) == sorted(recorded)
    speech = "agent_transcript"
    assert [k for k in shown if k != speech] == [k for k in recorded if k != speech]
    story = [
        (
            e["source"],
            e["kind"],
            e["data"].get("tool") or e["data"].get("name"),
            e["data"].get("to"),
        )
        for e in entries
        if e["source"] in ("tool_call", "operation")
        or e["kind"] in ("function_call", "result_announced")
    ]
    book = domain.book_tool
    assert story == [
        ("call", "function_call", book, None),
        ("tool_call", "tool_call", book, None),
        ("operation", "op_transition", book, "awaiting_confirmation"),
        ("call", "function_call", "confirm_operation", None),
        ("tool_call", "tool_call", "confirm_operation", None),
        ("operation", "op_transition", book, "admitted"),
        ("operation", "op_transition", book, "running"),
        ("operation", "op_transition", book, "committed"),
        ("call", "result_announced", None, None),
    ], story
    told_entries = [(e["kind"], e["data"].get("to")) for e in entries if e["source"] == "delivery"]
    assert told_entries[0] == ("delivery_transition", "pending")
    assert ("delivery_transition", "heard") == told_entries[-1]
    assert [d["state"] for d in timeline["deliveries"]] == ["heard"]
    committed = next(e for e in entries if e["data"].get("to") == "committed")
    assert committed["data"]["operation_id"] == str(operation_id)
    assert committed["data"]["reference"] == ops[0]["provider_ref"]
    assert committed["data"]["actor"].startswith("worker:")
    assert [e["t_ms"] for e in entries] == sorted(e["t_ms"] for e in entries)
    assert [o["status"] for o in timeline["operations"]] == ["committed"]


async def test_duplicate_function_calls_in_one_call_make_one_booking(
    engine: AsyncEngine, clean_db: str, domain: Domain, backend: Backend
) -> None:
    # The commit lands after the model's repeated calls (so the script stays in step).
    backend.set_faults(latency_s=1.0)
    scenario = booking_scenario(domain, duplicate=True)
    async with booking_stack(engine, clean_db, backend, scenario) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        before = caller.heard_ms
        await caller.play_speech(700)
        await hear(caller, before + PREAMBLE_MS + READBACK_MS)
        call_id = await stack.call_id(caller)
        await caller.play_speech(500)
        op = await wait_for_operation(engine, call_id, "committed")
        await wait_for_delivery(engine, op["operation_id"], "heard")
        await wait_spoken(engine, call_id, domain.confirmed_text)
        await caller.hangup()
        await stack.events(caller)
        ops = await operations_of(engine, call_id)
        calls = await tool_calls_of(engine, call_id)
        booked = await backend.booked()
        op_events = await trail(engine, op["operation_id"])

    assert len(ops) == 1
    assert [(c["tool"], c["decision"]) for c in calls] == [
        (domain.book_tool, "needs_confirmation"),
        (domain.book_tool, "duplicate"),
        ("confirm_operation", "allow"),
        ("confirm_operation", "duplicate"),
    ]
    assert len({c["provider_call_id"] for c in calls}) == 4  # four distinct function calls
    assert {c["operation_id"] for c in calls} == {ops[0]["operation_id"]}
    assert booked == 1
    assert to_statuses(op_events).count("running") == 1
    assert ops[0]["attempts"] == 1


async def test_caller_hangs_up_before_the_commit_and_the_outcome_goes_by_sms(
    engine: AsyncEngine, clean_db: str, domain: Domain, backend: Backend
) -> None:
    backend.set_faults(latency_s=2.0)
    async with booking_stack(engine, clean_db, backend, booking_scenario(domain)) as stack:
        caller = stack.caller()
        call_id = await ask_to_book_and_confirm(stack, caller)
        op = await wait_for_operation(engine, call_id, "running")
        await caller.hangup()
        events = await stack.events(caller)
        ended = next(e for e in await call_events_at(engine, call_id) if e["kind"] == "call_ended")
        committed = await wait_for_operation(engine, call_id, "committed")
        await wait_for_delivery(engine, op["operation_id"], "texted")
        booked = await backend.booked()
        op_events = await trail(engine, op["operation_id"])
        told = await delivery_trail(engine, op["operation_id"])
        messages = stack.api.messages_to(caller.from_number)

    assert booked == 1
    assert committed["provider_ref"].startswith(domain.reference_prefix)
    commit_event = next(e for e in op_events if e["to_status"] == "committed")
    assert commit_event["at"] > ended["at"]  # the commit landed after the hang-up
    assert [e["reason"] for e in op_events if e["actor"] == "delivery"] == [
        "call ended while in flight: the outcome will be delivered out of call",
    ]
    assert [e["to_state"] for e in told if e["kind"] == "transition"] == [
        "pending",
        "texting",
        "texted",
    ]
    assert told[0]["at"] >= commit_event["at"]
    assert [e["reason"] for e in told if e["kind"] == "decision"] == ["the call has ended: by SMS"]
    # Exactly one SMS, with the booking reference and nothing internal.
    assert len(messages) == 1
    assert f"Ref {committed['provider_ref']}." in messages[0].body
    assert str(op["operation_id"]) not in messages[0].body
    kinds = [e["kind"] for e in events]
    assert "result_announced" not in kinds  # nothing was spoken about it
    assert "late_result" not in [e["data"].get("reason") for e in events]
    assert kinds[-1] == "call_ended"


async def test_unverified_caller_cannot_cancel_someone_elses_booking(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    async with SorClient(sor.url) as client:
        day = dt.datetime.now(dt.UTC).date() + dt.timedelta(days=2)
        made = await client.book_table(
            f"other-{uuid.uuid4().hex}",
            BookingRequest(date=day, time="19:00", party_size=2, name="Someone Else"),
        )
    booking_id = made.reference
    assert booking_id is not None
    scenario = Scenario.model_validate(
        {
            "name": "e2e-cancel",
            "greeting": {"text": "Luigi's, how can I help?", "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": f"Please cancel booking {booking_id}.",
                    "function_call": {
                        "name": "cancel_booking",
                        "arguments": {"booking_id": booking_id},
                    },
                },
                {"reply": {"text": "{output[message]}", "audio_ms": 1000}},
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )
    refusals: dict[str, dict[str, Any]] = {}
    async with call_stack(
        engine, scenario, with_worker=True, database_url=clean_db, sor_base_url=sor.url
    ) as stack:
        for number in ("anonymous", "+15559990000"):  # withheld; a number that isn't the owner
            caller = stack.caller(from_number=number)
            await caller.dial()
            await hear(caller, GREETING_MS)
            await caller.play_speech(700)
            call_id = await stack.call_id(caller)

            async def answered(call_id: str = call_id) -> bool:
                calls = await tool_calls_of(engine, call_id)
                return bool(calls) and calls[0]["output"] is not None

            await wait_until(answered, WAIT_S, "cancel_booking answered")
            message = (await tool_calls_of(engine, call_id))[0]["output"]["message"]
            await wait_spoken(engine, call_id, message)
            await caller.hangup()
            await stack.events(caller)
            calls = await tool_calls_of(engine, call_id)
            assert await operations_of(engine, call_id) == []
            assert [(c["tool"], c["decision"]) for c in calls] == [("cancel_booking", "deny")]
            refusals[number] = {
                "output": calls[0]["output"],
                "spoken": await heard_text(engine, call_id),
            }
        effects = await sor.side_effects()
        async with SorClient(sor.url) as client:
            booking = await client.get_booking(booking_id)

    withheld, stranger = refusals["anonymous"], refusals["+15559990000"]
    assert withheld["output"]["status"] == "denied"
    assert "withheld number" in withheld["output"]["message"]
    assert stranger["output"]["status"] == "denied"
    assert "number the booking was made from" in stranger["output"]["message"]
    # The refusal is what the agent said (the reason is speakable), and nothing changed.
    for refusal in (withheld, stranger):
        assert refusal["output"]["message"] in refusal["spoken"]
    assert effects.cancellations == 0
    assert booking is not None and booking.status == "confirmed"
