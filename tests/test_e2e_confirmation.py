"""The model's word is not the caller's yes, over real sockets: a scripted model that confirms
without the caller's answer (or after the caller cut the readback off) admits nothing and
sends nothing to the system of record; the caller's own answer after a readback heard in full
admits it, with that evidence on the operation. And a model that fans out into dozens of
function calls in one response reaches the provider at most as often as the caps allow.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.session_config import BridgeConfig
from telephony.sim.scenario import Scenario
from tests.domains import APPOINTMENTS, DOMAINS, AppointmentsBackend, Backend, Domain
from tests.e2e_support import Stack, call_stack, event_rows, wait_until
from tests.openai_sip_support import interconnect
from tests.test_e2e_booking import (
    CONFIRM,
    GREETING_MS,
    PREAMBLE_MS,
    REQUESTED,
    WAIT_S,
    booking_stack,
    hear,
    operations_of,
    tool_calls_of,
    trail,
    wait_for_operation,
    wait_spoken,
)
from tools.appointments.api import Faults

ASK_AGAIN = "Shall I go ahead with that?"


@pytest.fixture(params=DOMAINS, ids=str)
def domain(request: pytest.FixtureRequest) -> Domain:
    found: Domain = request.param
    return found


@pytest.fixture
async def backend(domain: Domain, clean_db: str) -> AsyncIterator[Backend]:
    async with domain.start(clean_db) as running:
        yield running


async def call_events(stack: Stack, call_id: str) -> list[dict[str, Any]]:
    await stack.service.runtime.events.flush()
    return await event_rows(stack.engine, call_id)


def scenario(domain: Domain, name: str, steps: list[dict[str, Any]]) -> Scenario:
    return Scenario.model_validate(
        {
            "name": f"confirmation-{name}-{domain.name}",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Please book it for tomorrow.",
                    "function_call": {
                        "name": domain.book_tool,
                        "arguments": domain.book_args,
                        "preamble": {"text": "One moment.", "audio_ms": PREAMBLE_MS},
                    },
                },
                *steps,
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )


async def decisions(engine: AsyncEngine, call_id: str) -> list[tuple[str, str]]:
    return [(c["tool"], c["decision"]) for c in await tool_calls_of(engine, call_id)]


async def wait_for_decisions(engine: AsyncEngine, call_id: str, n: int) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []

    async def recorded() -> bool:
        found[:] = [d for d in await decisions(engine, call_id) if d[1] != "pending"]
        return len(found) >= n

    await wait_until(recorded, WAIT_S, f"{n} tool calls decided")
    return found


async def refusals(engine: AsyncEngine, operation_id: Any) -> list[dict[str, Any]]:
    return [
        e
        for e in await trail(engine, operation_id)
        if e["kind"] == "decision" and e["data"].get("rule") == "caller_evidence"
    ]


async def test_a_model_confirming_right_after_the_readback_admits_nothing_until_the_caller_answers(
    engine: AsyncEngine, clean_db: str, domain: Domain, backend: Backend
) -> None:
    # The readback and confirm_operation in one response: no caller speech at all.
    steps: list[dict[str, Any]] = [
        {"reply": {"text": "{output[readback]}", "audio_ms": 1200}, "function_call": CONFIRM},
        {"reply": {"text": ASK_AGAIN, "audio_ms": 900}},
        {"caller_transcript": "Yes.", "function_call": CONFIRM},
        {"reply": {"text": REQUESTED, "audio_ms": 900}},
    ]
    async with booking_stack(engine, clean_db, backend, scenario(domain, "eager", steps)) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        before = caller.heard_ms
        await caller.play_speech(700)
        call_id = await stack.call_id(caller)
        assert await wait_for_decisions(engine, call_id, 2) == [
            (domain.book_tool, "needs_confirmation"),
            ("confirm_operation", "needs_caller"),
        ]
        # The model was told to ask; the caller hears the question in full.
        await hear(caller, before + PREAMBLE_MS + 1200 + 900)
        [op] = await operations_of(engine, call_id)
        assert op["status"] == "awaiting_confirmation"
        assert op["confirmed_by"] is None
        assert await backend.booked() == 0  # nothing reached the system of record
        [refused] = await refusals(engine, op["operation_id"])
        assert refused["data"]["requested_by"] == "model"
        assert refused["data"]["evidence"]["confirmed_by"] is None
        assert "not answered" in refused["reason"]
        # Now the caller answers: that yes counts, and the evidence is on the operation.
        await caller.play_speech(500)
        committed = await wait_for_operation(engine, call_id, "committed")
        await caller.hangup()

    assert await backend.booked() == 1
    assert committed["confirmed_by"] == "caller"
    evidence = committed["confirmation"]
    assert evidence["confirmed_by"] == "caller"
    assert evidence["caller_item_id"].startswith("item")
    assert evidence["readback_item_id"].startswith("item")
    assert evidence["readback_heard_ms"] >= evidence["readback_audio_ms"] - 20 > 0
    admitted = [
        e for e in await trail(engine, committed["operation_id"]) if e["to_status"] == "admitted"
    ]
    assert admitted[0]["data"]["evidence"] == evidence
    print(f"refused confirm without speech, then admitted on the caller's yes: {evidence}")


async def test_a_confirmation_after_the_caller_cut_the_readback_off_admits_nothing(
    engine: AsyncEngine, clean_db: str, domain: Domain, backend: Backend
) -> None:
    steps: list[dict[str, Any]] = [
        {"reply": {"text": "{output[readback]}", "audio_ms": 4000}},
        # The caller's barge-in makes the server answer: the model confirms at once.
        {"caller_transcript": "Yes.", "function_call": CONFIRM},
        {"reply": {"text": ASK_AGAIN, "audio_ms": 900}},
    ]
    async with booking_stack(engine, clean_db, backend, scenario(domain, "barge", steps)) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        before = caller.heard_ms
        await caller.play_speech(700)
        # A little of the readback, then the caller talks over it.
        await caller.wait_for(lambda c: c.heard_ms >= before + PREAMBLE_MS + 600, WAIT_S)
        await caller.play_speech(500)
        call_id = await stack.call_id(caller)
        assert await wait_for_decisions(engine, call_id, 2) == [
            (domain.book_tool, "needs_confirmation"),
            ("confirm_operation", "needs_caller"),
        ]
        [op] = await operations_of(engine, call_id)
        refused = await refusals(engine, op["operation_id"])
        await caller.hangup()

    assert op["status"] == "awaiting_confirmation"
    assert await backend.booked() == 0
    [why] = refused
    assert "not heard to its end" in why["reason"], why["reason"]
    evidence = why["data"]["evidence"]
    assert 0 < evidence["readback_heard_ms"] < evidence["readback_audio_ms"]
    print(f"barge-in on the readback, model confirmed: refused ({evidence})")


async def test_on_openai_sip_the_servers_playout_and_the_callers_turn_are_the_evidence(
    engine: AsyncEngine, clean_db: str, domain: Domain, backend: Backend
) -> None:
    # No local playback there: output_audio_buffer.stopped ends the readback, the caller's
    # speech_started and committed item after it are the answer.
    steps: list[dict[str, Any]] = [
        {"reply": {"text": "{output[readback]}", "audio_ms": 1200}, "function_call": CONFIRM},
        {"reply": {"text": ASK_AGAIN, "audio_ms": 900}},
        {"caller_transcript": "Yes.", "function_call": CONFIRM},
        {"reply": {"text": REQUESTED, "audio_ms": 900}},
    ]
    catalog = backend.catalog()
    try:
        async with interconnect(
            engine,
            scenario(domain, "sideband", steps),
            auto_caller=True,
            with_worker=True,
            catalog=catalog,
            database_url=clean_db,
        ) as ic:
            call = await ic.sim.place_call(from_number="+15551230000")
            row = await ic.wait_row(call.call_id, "in_progress")
            call_id = str(row["id"])
            op = await wait_for_operation(engine, call_id, "committed", within=30)
            found = await decisions(engine, call_id)
            refused = await refusals(engine, op["operation_id"])
    finally:
        await catalog.aclose()

    assert found == [
        (domain.book_tool, "needs_confirmation"),
        ("confirm_operation", "needs_caller"),
        ("confirm_operation", "allow"),
    ]
    assert len(refused) == 1
    assert await backend.booked() == 1
    assert op["confirmed_by"] == "caller"
    assert op["confirmation"]["caller_item_id"].startswith("item")
    assert op["confirmation"]["readback_heard_ms"] > 0


@pytest.mark.parametrize(
    ("per_response", "latency_s"),
    [
        pytest.param(None, 0.3, id="defaults"),  # 8 per response, 4 in flight
        pytest.param(40, 1.5, id="in-flight-cap"),  # only the in-flight cap holds them back
    ],
)
async def test_forty_function_calls_in_one_response_reach_the_provider_at_most_the_caps(
    engine: AsyncEngine, clean_db: str, per_response: int | None, latency_s: float
) -> None:
    find = {
        "name": "find_slots",
        "arguments": {"date": "{tomorrow}", "service": "checkup"},
        "repeat": 40,
    }
    steps: list[dict[str, Any]] = [
        {"caller_transcript": "When can I come in?", "function_call": find},
        {"reply": {"text": "We have some times tomorrow.", "audio_ms": 900}},
    ]
    sim = Scenario.model_validate(
        {"name": "fan-out", "greeting": {"text": "Hello.", "audio_ms": GREETING_MS}, "steps": steps}
    )
    config = BridgeConfig(max_tool_calls_per_response=per_response) if per_response else None
    async with APPOINTMENTS.start(clean_db) as backend:
        assert isinstance(backend, AppointmentsBackend)
        # A slow provider, so calls that were let through overlap there.
        backend.api.set_faults(Faults(latency_s=latency_s))
        catalog = backend.catalog()
        try:
            async with call_stack(
                engine, sim, bridge_config=config, catalog=catalog, database_url=clean_db
            ) as stack:
                caller = stack.caller()
                await caller.dial()
                await hear(caller, GREETING_MS)
                await caller.play_speech(700)
                call_id = await stack.call_id(caller)

                async def answered() -> bool:
                    events = await call_events(stack, call_id)
                    return sum(1 for e in events if e["kind"] == "function_output") >= 40

                await wait_until(answered, 30, "40 function outputs")
                effects = backend.api.effects()
                events = await call_events(stack, call_id)
                await caller.hangup()
        finally:
            await catalog.aclose()

    outputs = [e["data"] for e in events if e["kind"] == "function_output"]
    assert len(outputs) == 40  # every call was answered, most with a refusal
    limited = [o for o in outputs if o.get("limited")]
    assert len(limited) == 40 - effects.requests  # the rest were refused before the pipeline
    assert effects.most_concurrent <= 4, effects  # MAX_TOOL_CALLS_IN_FLIGHT
    if per_response is None:
        assert 1 <= effects.requests <= 8, effects  # MAX_TOOL_CALLS_PER_RESPONSE
    else:
        assert effects.requests < 40, effects  # the ones over 4 running were refused
    print(
        f"40 calls in one response ({per_response or 8} per response allowed): "
        f"{effects.requests} reached the provider, at most {effects.most_concurrent} at once"
    )


SENT = "I've sent your request. It isn't confirmed yet."
ASKED_AGAIN = "Sorry, I didn't hear your answer. "
# A line that tells the caller their request went anywhere.
CLAIMS_SUCCESS = re.compile(r"\b(sent|booked|confirmed)\b", re.IGNORECASE)


async def test_a_refused_yes_is_asked_again_and_the_second_yes_books_once_sent_only_after_it(
    engine: AsyncEngine, clean_db: str, domain: Domain, backend: Backend
) -> None:
    # The scripted model follows the function output: on a refusal it reads back again and
    # makes the confirmation again on the caller's next answer; "sent" only once admitted.
    steps: list[dict[str, Any]] = [
        {"reply": {"text": "{output[readback]}", "audio_ms": 4000}},
        {"id": "confirm", "caller_transcript": "Yes.", "function_call": CONFIRM},
        {
            "reply": {"text": "Let me check on that.", "audio_ms": 900},
            "on_output": [
                {"status": ["admitted", "running"], "reply": {"text": SENT, "audio_ms": 900}},
                {
                    "status": "awaiting_confirmation",
                    "at_most": 2,
                    "then": "confirm",
                    "reply": {"text": ASKED_AGAIN + "{output[readback]}", "audio_ms": 1500},
                },
            ],
        },
        {"reply": {"text": domain.confirmed_text, "audio_ms": 1200}},
    ]
    async with booking_stack(engine, clean_db, backend, scenario(domain, "again", steps)) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        before = caller.heard_ms
        await caller.play_speech(700)
        # The caller says yes over the end of the readback: that yes does not count.
        await caller.wait_for(lambda c: c.heard_ms >= before + PREAMBLE_MS + 600, WAIT_S)
        await caller.play_speech(500)
        call_id = await stack.call_id(caller)
        assert await wait_for_decisions(engine, call_id, 2) == [
            (domain.book_tool, "needs_confirmation"),
            ("confirm_operation", "needs_caller"),
        ]
        [op] = await operations_of(engine, call_id)
        # The agent asks again, reading the request back; the caller answers after it.
        await wait_spoken(engine, call_id, ASKED_AGAIN + op["readback"])
        assert await backend.booked() == 0
        await caller.play_speech(500)
        committed = await wait_for_operation(engine, call_id, "committed")
        await wait_spoken(engine, call_id, domain.confirmed_text)
        session = stack.sim.sessions[0]
        await caller.hangup()

    assert await decisions(engine, call_id) == [
        (domain.book_tool, "needs_confirmation"),
        ("confirm_operation", "needs_caller"),
        ("confirm_operation", "allow"),
    ]
    assert await backend.booked() == 1
    assert committed["confirmed_by"] == "caller"
    admitted_at = next(
        at
        for at, event in session.received
        if event["type"] == "conversation.item.create"
        and event["item"]["type"] == "function_call_output"
        and json.loads(event["item"]["output"]).get("status") == "admitted"
    )
    said = [
        (at, event["transcript"])
        for at, event in session.sent
        if event["type"] == "response.output_audio_transcript.done"
    ]
    claims = [(at, text) for at, text in said if CLAIMS_SUCCESS.search(text)]
    assert [text for _, text in claims] == [SENT, domain.confirmed_text], said
    assert all(at > admitted_at for at, _ in claims), said
    assert sum(1 for _, text in said if text.startswith(ASKED_AGAIN)) == 1
    print(f"refused yes, asked again, booked once; the agent said: {[t for _, t in said]}")
