"""A Twilio call on GPT-Live end to end over real sockets: fake caller -> service (MODEL_API=live,
in-process worker) -> the simulator's GPT-Live mode, with the restaurant's system of record.

The model is GPT-Live (server-driven turns, tools delegated); the engine is the same: the
delegated booking meets policy, confirmation (with the caller's evidence), the ledger and the
worker exactly as a Realtime function call does, and its answer goes back to the model only as
the engine allows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.bridge.live_backend import NOTHING_DONE
from telephony.sim.live_session import parse_live_client_event
from telephony.sim.responses_backend import ResponsesStandIn
from telephony.sim.scenario import Scenario
from tests.domains import RESTAURANT
from tests.e2e_support import call_stack
from tests.test_e2e_booking import (
    delivery_trail,
    hear,
    heard_text,
    operations_of,
    tool_calls_of,
    trail,
    wait_for_delivery,
    wait_for_operation,
)

GREETING = "Hello, how can I help?"
GREETING_MS = 800
PREAMBLE_MS = 600
READBACK_MS = 1500
REQUESTED = "I've requested it; it is not confirmed yet."
REQUESTED_MS = 1200


def live_booking(announced: str | None = None) -> Scenario:
    """Book -> readback -> yes -> confirm -> "requested", as the Realtime booking scenario;
    `announced`: what the model says when the commit's note arrives (else its fallback)."""
    after = [{"reply": {"text": announced, "audio_ms": 1500}}] if announced else []
    return Scenario.model_validate(
        {
            "name": "e2e-live-booking",
            "greeting": {"text": GREETING, "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Please book it for tomorrow.",
                    "function_call": {
                        "name": RESTAURANT.book_tool,
                        "arguments": RESTAURANT.book_args,
                        "preamble": {"text": "One moment.", "audio_ms": PREAMBLE_MS},
                    },
                },
                {"reply": {"text": "{output[readback]}", "audio_ms": READBACK_MS}},
                {
                    "caller_transcript": "Yes.",
                    "function_call": {
                        "name": "confirm_operation",
                        "arguments": {
                            "operation_id": "{output[operation_id]}",
                            "confirmed": True,
                        },
                    },
                },
                {"reply": {"text": REQUESTED, "audio_ms": REQUESTED_MS}},
                *after,
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )


async def test_a_twilio_call_on_gpt_live_books_through_the_engine_with_sdk_valid_events(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with RESTAURANT.start(clean_db) as backend:
        catalog = backend.catalog()
        try:
            async with call_stack(
                engine,
                live_booking(),
                with_worker=True,
                catalog=catalog,
                database_url=clean_db,
                sweep_interval_s=1.0,
                model_api="live",
            ) as stack:
                caller = stack.caller()
                await caller.dial()
                await hear(caller, GREETING_MS)  # the server spoke first, unasked
                live = await stack.sim.wait_for_live_session()
                before = caller.heard_ms
                await caller.play_speech(700)
                await hear(caller, before + PREAMBLE_MS + READBACK_MS)
                call_id = await stack.call_id(caller)
                ops = await operations_of(engine, call_id)
                # Delegated, admitted by nobody yet: the engine waits for the caller's yes.
                assert [op["status"] for op in ops] == ["awaiting_confirmation"]
                before = caller.heard_ms
                await caller.play_speech(500)
                op = await wait_for_operation(engine, call_id, "committed")
                # The model's last words are closed by the end of the call: heard in full.
                await hear(caller, before + REQUESTED_MS)
                # The commit is a late result: offered to the model as commentary, not forced.
                note = await live.wait_for_received("session.commentary.append", within=15)
                # The model answers the note with "Anything else?": that does not say it.
                await _says(live, "Anything else?")
                await caller.wait_for(lambda c: c.buffered_ms == 0, 10)
                await caller.hangup()
                unsaid = await wait_for_delivery(engine, op["operation_id"], "texted", 30)
                events = await stack.events(caller)
                calls = await tool_calls_of(engine, call_id)
                op_events = await trail(engine, op["operation_id"])
                spoken = await heard_text(engine, call_id)
                booked = await backend.booked()
        finally:
            await catalog.aclose()

    # The call talked GPT-Live only, and every client event we sent fits the SDK's union.
    assert stack.sim.sessions == [] and live.refused == []
    received = [event for _, event in live.received]
    for event in received:
        parse_live_client_event(event)
    start = received[0]
    assert start["type"] == "session.start"
    assert start["session"]["model"] == "gpt-live-1"
    assert start["session"]["audio"]["format"] == {"type": "audio/pcmu", "rate": 8000}
    delegation = start["session"]["delegation"]
    assert delegation["type"] == "responses"
    assert RESTAURANT.book_tool in {t["name"] for t in delegation["responses"]["tools"]}
    assert "response.cancel" not in {e["type"] for e in received}
    # The booking went through the engine: one operation, confirmed by the caller's yes.
    assert booked == 1
    assert [e["to_status"] for e in op_events if e["kind"] == "transition"][:2] == [
        "awaiting_confirmation",
        "admitted",
    ]
    assert [(c["tool"], c["decision"]) for c in calls] == [
        (RESTAURANT.book_tool, "needs_confirmation"),
        ("confirm_operation", "allow"),
    ]
    # Each answer went back as a function_call_output, then a response.create after it.
    kinds = [e["type"] for e in received if e["type"] != "session.input_audio.append"]
    assert kinds == [
        "session.start",
        "response.item.create",
        "response.create",
        "response.item.create",
        "response.create",
        "session.commentary.append",
    ], kinds
    assert note["delegation_id"] is None and "confirmed" in note["content"].lower()
    # Offered as a note the model never said: not "told"; the caller gets it by SMS instead.
    assert unsaid["state"] == "texted"
    assert "result_heard" not in [e["kind"] for e in events]
    outputs = [json.loads(output) for _, output in live.function_outputs]
    assert outputs[0]["status"] == "awaiting_confirmation" and outputs[0]["readback"]
    assert outputs[1]["operation_id"] == str(op["operation_id"])
    # What the caller heard, from our own playback: the greeting and the readback in full.
    readback: Any = outputs[0]["readback"]
    # (Speech the model chains without a turn between is one utterance: nothing marks it.)
    assert spoken[:4] == [GREETING, "One moment.", readback, spoken[3]], spoken
    assert spoken[3].startswith(REQUESTED)
    assert [e["kind"] for e in events][-1] == "call_ended"


async def test_on_gpt_live_the_caller_cutting_in_clears_the_leg_and_counts_only_what_was_heard(
    engine: AsyncEngine,
) -> None:
    scenario = Scenario.model_validate(
        {
            "greeting": {"text": "Welcome to a long list of tonight's specials.", "audio_ms": 8000},
            "steps": [{"caller_transcript": "Just a table, please.", "reply": "Sure."}],
        }
    )
    async with call_stack(engine, scenario, model_api="live") as stack:
        caller = stack.caller()
        await caller.dial()
        await caller.wait_for(lambda c: c.heard_ms >= 1000, 10)
        await caller.play_speech(600)
        # The model stopped talking over the caller; the leg stops playing what it queued.
        await caller.wait_for(lambda c: len(c.clears) == 1, 10)
        live = stack.sim.live_sessions[0]
        await live.wait_for_sent("session.output_transcript.delta", count=2, within=10)
        await caller.hangup()
        events = await stack.events(caller)
    assert live.interruptions == 1 and live.refused == []
    # No truncate, no cancel: on GPT-Live the model decides where it stopped.
    assert {e["type"] for _, e in live.received} == {"session.start", "session.input_audio.append"}
    barge_ins = [e["data"] for e in events if e["kind"] == "barge_in"]
    assert len(barge_ins) == 1 and barge_ins[0]["truncated"] is False
    greeting = next(e["data"] for e in events if e["kind"] == "agent_transcript")
    # Cut where the caller stopped hearing it, from our own playback position.
    assert greeting["cut"] is True
    assert 1000 <= greeting["heard_ms"] < 8000 and greeting["audio_ms"] > greeting["heard_ms"]
    assert caller.clears[0].dropped_ms > 0


async def test_a_dropped_gpt_live_session_comes_back_with_the_conversation_so_far(
    engine: AsyncEngine,
) -> None:
    scenario = Scenario.model_validate(
        {
            "greeting": {"text": GREETING, "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Just a table, please.",
                    "reply": {"text": "Sure, for when?", "audio_ms": 900},
                },
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )
    async with call_stack(engine, scenario, model_api="live") as stack:
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        await caller.play_speech(600)
        await hear(caller, GREETING_MS + 900)
        first = stack.sim.live_sessions[0]
        await stack.sim.drop_all()
        second = await stack.sim.wait_for_live_session(1, within=10)
        start = await second.wait_for_received("session.start", within=10)
        heard_at_reconnect = caller.heard_ms
        await second.wait_for_sent("session.started")
        # Back from the drop the model does not greet again: nothing is said until the caller.
        await caller.play_speech(600)
        await hear(caller, heard_at_reconnect + 900)
        await caller.hangup()
        events = await stack.events(caller)
    assert first.refused == [] and second.refused == []
    for _, event in second.received:
        parse_live_client_event(event)
    # The conversation so far, as text-only history: who said what, in order.
    assert start["session"]["input"] == [
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": GREETING}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Just a table, please."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Sure, for when?"}]},
    ]  # fmt: skip
    assert "do not greet the caller again" in start["session"]["instructions"]
    assert second.sent_events("session.output_transcript.delta")[0]["delta"] == "Sure, for when?"
    kinds = [e["kind"] for e in events]
    assert "realtime_dropped" in kinds and "realtime_reconnected" in kinds


async def test_a_handoff_on_gpt_live_gives_the_backend_the_new_agents_tools_and_persona(
    engine: AsyncEngine,
) -> None:
    from tests.handoff_support import AGENTS, MANAGER_HELLO

    scenario = Scenario.model_validate(
        {
            "greeting": {"text": GREETING, "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Can I ask the manager about a deposit?",
                    "function_call": {
                        "name": "handoff_to_agent",
                        "arguments": {"agent": "manager", "reason": "a deposit question"},
                    },
                },
                {"reply": {"text": MANAGER_HELLO, "audio_ms": 1500}},
            ],
        }
    )
    async with call_stack(engine, scenario, model_api="live", agents_file=AGENTS) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        live = await stack.sim.wait_for_live_session()
        started_with = list(live.delegation_tools)
        await caller.play_speech(600)
        update = await live.wait_for_received("session.update", within=15)
        await live.wait_for_sent("session.updated", within=5)
        await hear(caller, GREETING_MS + 1500)
        await caller.hangup()
        events = await stack.events(caller)
    assert live.refused == []
    for _, event in live.received:
        parse_live_client_event(event)
    assert "cancel_booking" not in started_with  # the host's tools
    responses = update["session"]["delegation"]["responses"]
    assert "You are the manager of Luigi's" in responses["instructions"]
    assert {"cancel_booking", "handoff_to_agent"} <= set(live.delegation_tools)
    [appended] = live.appended_instructions
    assert "You are the manager of Luigi's" in appended and len(appended) <= 1500
    [handoff] = [e["data"] for e in events if e["kind"] == "agent_handoff"]
    assert handoff["to_agent"] == "manager" and handoff["session_updated"] is True
    assert MANAGER_HELLO in await heard_text(engine, await _call_id_of(engine, caller))


async def _call_id_of(engine: AsyncEngine, caller: Any) -> str:
    from tests.e2e_support import call_row

    row = await call_row(engine, caller.call_sid)
    assert row is not None
    return str(row["id"])


async def test_on_gpt_live_a_late_result_is_told_only_by_an_utterance_that_says_it_heard_in_full(
    engine: AsyncEngine, clean_db: str
) -> None:
    """GPT-Live says a note when it sees fit: the result counts as told by the first utterance
    begun after the note that says how it ended ("...isn't confirmed yet", said before, does
    not), and only once that utterance was heard to its end; then no SMS."""
    told = "Good news: the restaurant has confirmed your table."
    async with RESTAURANT.start(clean_db) as backend:
        catalog = backend.catalog()
        try:
            async with call_stack(
                engine, live_booking(told), with_worker=True, catalog=catalog,
                database_url=clean_db, sweep_interval_s=1.0, model_api="live",
            ) as stack:  # fmt: skip
                caller = stack.caller()
                await caller.dial()
                await hear(caller, GREETING_MS)
                live = await stack.sim.wait_for_live_session()
                before = caller.heard_ms
                await caller.play_speech(700)
                await hear(caller, before + PREAMBLE_MS + READBACK_MS)
                before = caller.heard_ms
                await caller.play_speech(500)
                call_id = await stack.call_id(caller)
                op = await wait_for_operation(engine, call_id, "committed")
                await live.wait_for_received("session.commentary.append", within=15)
                await _says(live, told)
                await hear(caller, before + REQUESTED_MS + 1500)
                # Live marks no utterance's end: once its audio played and none came for a
                # moment, it is over and what it said counts as heard (no need to wait for
                # the caller's next words or the call's end).
                heard = await wait_for_delivery(engine, op["operation_id"], "heard", 15)
                await caller.hangup()
                events = await stack.events(caller)
                steps = await delivery_trail(engine, op["operation_id"])
                texts = list(stack.api.messages.values())
        finally:
            await catalog.aclose()
    assert heard["state"] == "heard" and texts == []
    [announced] = [e["data"] for e in events if e["kind"] == "result_announced"]
    [said] = [e["data"] for e in events if e["kind"] == "agent_transcript" and
              told in e["data"]["text"]]  # fmt: skip
    # The utterance that said it (never one under way before the note went up).
    assert announced["response_id"] == said["response_id"]
    [result] = [e["data"] for e in events if e["kind"] == "result_heard"]
    assert result["heard_ms"] == result["audio_ms"] > 0
    assert "texting" not in [e.get("to_state") for e in steps]


async def _says(live: Any, text: str, within: float = 15.0) -> None:
    """Until the simulated model has begun saying `text`."""
    from tests.e2e_support import wait_until

    async def began() -> bool:
        return any(
            e.get("delta") == text for e in live.sent_events("session.output_transcript.delta")
        )

    await wait_until(began, within, f"the model says {text!r}")


@asynccontextmanager
async def client_delegation(engine: AsyncEngine, clean_db: str) -> AsyncIterator[Any]:
    """A GPT-Live booking stack on LIVE_DELEGATION=client, its backend agent's Responses API
    the stand-in serving the simulator's Live sessions: (stack, stand-in, restaurant)."""
    sims: list[Any] = []
    async with (
        ResponsesStandIn(lambda: [s for sim in sims for s in sim.live_sessions]) as responses,
        RESTAURANT.start(clean_db) as backend,
    ):
        catalog = backend.catalog()
        try:
            async with call_stack(
                engine,
                live_booking(),
                with_worker=True,
                catalog=catalog,
                database_url=clean_db,
                sweep_interval_s=1.0,
                model_api="live",
                live_delegation="client",
                live_backend_base_url=responses.base_url,
            ) as stack:
                sims.append(stack.sim)
                yield stack, responses, backend
        finally:
            await catalog.aclose()


async def test_on_client_delegation_our_backend_agent_picks_the_function_and_the_engine_admits_it(
    engine: AsyncEngine, clean_db: str
) -> None:
    # LIVE_DELEGATION=client: the Live model hands work off with an id only; our backend agent
    # asks a Responses model (the stand-in, playing it from the same scenario) what to do.
    async with client_delegation(engine, clean_db) as (stack, responses, backend):
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        live = await stack.sim.wait_for_live_session()
        before = caller.heard_ms
        await caller.play_speech(700)
        await hear(caller, before + PREAMBLE_MS + READBACK_MS)
        call_id = await stack.call_id(caller)
        waiting = [op["status"] for op in await operations_of(engine, call_id)]
        before = caller.heard_ms
        await caller.play_speech(500)
        op = await wait_for_operation(engine, call_id, "committed")
        await hear(caller, before + REQUESTED_MS)
        await caller.hangup()
        await stack.events(caller)  # the call wound down here, its events written
        calls = await tool_calls_of(engine, call_id)
        spoken = await heard_text(engine, call_id)
        booked = await backend.booked()

    assert live.refused == [] and responses.refused == []
    received = [event for _, event in live.received]
    for event in received:
        parse_live_client_event(event)
    # The Live session was started with client delegation: no backend model of OpenAI's.
    assert received[0]["session"]["delegation"] == {"type": "client"}
    # The engine admitted exactly what the backend asked for: the booking waited for the
    # caller's yes, then one confirmed booking.
    assert waiting == ["awaiting_confirmation"]
    assert [(c["tool"], c["decision"]) for c in calls] == [
        (RESTAURANT.book_tool, "needs_confirmation"),
        ("confirm_operation", "allow"),
    ]
    assert booked == 1
    # Each delegation: the backend's function call, then the engine's output back to it
    # (previous_response_id), with the catalog's tools and the conversation as input.
    assert len(responses.requests) == 4
    first, second = responses.requests[:2]
    assert RESTAURANT.book_tool in {t["name"] for t in first["tools"]}
    assert any(i.get("role") == "user" for i in first["input"]), first["input"]
    assert first["metadata"]["delegation_id"] == second["metadata"]["delegation_id"]
    assert second["previous_response_id"] and second["input"][0]["type"] == "function_call_output"
    # Nothing went to the Live socket as a function output: each answer is the delegation's
    # commentary, naming it, carrying what the engine said.
    kinds = [e["type"] for e in received if e["type"] != "session.input_audio.append"]
    assert "response.item.create" not in kinds and "response.create" not in kinds
    answers = [e for e in received if e["type"] == "session.commentary.append"]
    delegations = [e["delegation"]["id"] for e in live.sent_events("session.delegation.created")]
    assert [a["delegation_id"] for a in answers[:2]] == delegations[:2]
    readback = json.loads(answers[0]["content"])
    assert readback["status"] == "awaiting_confirmation" and readback["readback"]
    assert json.loads(answers[1]["content"])["operation_id"] == str(op["operation_id"])
    # The caller heard the engine's readback in full, then "requested, not yet confirmed".
    # (Utterances the model chains without a pause are recorded as one.)
    assert any(readback["readback"] in s for s in spoken), spoken
    assert any(REQUESTED in s for s in spoken), spoken


async def test_on_client_delegation_a_failing_backend_is_told_as_nothing_done_and_does_nothing(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with client_delegation(engine, clean_db) as (stack, responses, backend):
        responses.failing = 10  # every backend call fails
        caller = stack.caller()
        await caller.dial()
        await hear(caller, GREETING_MS)
        live = await stack.sim.wait_for_live_session()
        await caller.play_speech(700)
        answer = await live.wait_for_received("session.commentary.append", within=15)
        call_id = await stack.call_id(caller)
        ops = await operations_of(engine, call_id)
        await caller.hangup()
        events = await stack.events(caller)
        booked = await backend.booked()

    [delegation] = live.sent_events("session.delegation.created")
    assert answer["delegation_id"] == delegation["delegation"]["id"]
    assert answer["content"] == NOTHING_DONE
    assert ops == [] and booked == 0 and live.function_outputs == []
    errors = [e["data"] for e in events if e["kind"] == "error"]
    assert [e["where"] for e in errors] == ["live:client-delegation"], errors
    assert "500" in errors[0]["error"]
