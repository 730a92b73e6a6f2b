"""The simulator's GPT-Live mode, driven through the official `openai` SDK over a real socket,
and the MODEL_API / LIVE_MODEL settings."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import typing
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.resources.live.live import AsyncLiveConnection
from openai.types.live import ServerEvent
from pydantic import SecretStr

from app.main import bridge_config_from
from app.realtime_check import plan_realtime
from app.settings import Settings
from telephony.sim.live_session import (
    LiveEventError,
    LiveSimulatedSession,
    parse_live_client_event,
)
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import RealtimeSimulator, synthesize_speech

_SERVER_EVENT_CLASSES: dict[str, Any] = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ServerEvent)[0])
}

BOOK_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "book_table",
    "description": "Book a table.",
    "parameters": {"type": "object", "properties": {"time": {"type": "string"}}},
}
RESPONSES_DELEGATION: dict[str, Any] = {
    "type": "responses",
    "responses": {"model": "gpt-5.4-mini", "tools": [BOOK_TOOL]},
}
PCMU = {"type": "audio/pcmu", "rate": 8000}

BOOKING: dict[str, Any] = {
    "name": "live-booking",
    "greeting": {"text": "Thanks for calling. How can I help?", "audio_ms": 600},
    "steps": [
        {
            "caller_transcript": "A table at nine tonight, please.",
            "function_call": {
                "name": "book_table",
                "arguments": {"time": "21:00"},
                "preamble": "One moment.",
            },
        },
        {"reply": "That is {output[status]}, reference {output[ref]}."},
    ],
}


def _speech(ms: int) -> bytes:
    return synthesize_speech(ms, 7, "pcmu")


def _silence(ms: int) -> bytes:
    return b"\xff" * (8 * ms)  # mu-law zero


@pytest.fixture
async def stack() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as exit_stack:
        yield exit_stack


async def _start(
    stack: contextlib.AsyncExitStack, scenario: dict[str, Any], factor: float = 0.0
) -> RealtimeSimulator:
    loaded = Scenario.model_validate(scenario)
    return await stack.enter_async_context(RealtimeSimulator(loaded, realtime_factor=factor))


async def _connect(
    stack: contextlib.AsyncExitStack, sim: RealtimeSimulator
) -> tuple[AsyncLiveConnection, LiveSimulatedSession]:
    index = len(sim.live_sessions)
    client = AsyncOpenAI(api_key="sk-test", base_url=sim.base_url)
    conn = await stack.enter_async_context(client.live.connect())
    return conn, await sim.wait_for_live_session(index)


async def _started(
    conn: AsyncLiveConnection, *, delegation: dict[str, Any] | None, audio: Any = PCMU
) -> Any:
    session: dict[str, Any] = {"model": "gpt-live-1", "instructions": "Be brief."}
    if audio is not None:
        session["audio"] = {"format": audio}
    if delegation is not None:
        session["delegation"] = delegation
    await conn.send({"type": "session.start", "event_id": "start_1", "session": session})  # type: ignore[arg-type]
    started = await conn.recv()
    assert started.type == "session.started", started
    return started


async def _recv_until(conn: AsyncLiveConnection, type_: str, within: float = 10.0) -> list[Any]:
    """Receive (SDK-parsed) events up to and including the first of `type_`."""
    events: list[Any] = []
    async with asyncio.timeout(within):
        while True:
            event = await conn.recv()
            events.append(event)
            if event.type == type_:
                return events


async def _say(conn: AsyncLiveConnection, audio: bytes, frame_ms: int = 20) -> None:
    step = 8 * frame_ms
    for start in range(0, len(audio), step):
        chunk = base64.b64encode(audio[start : start + step]).decode()
        await conn.session.input_audio.append(audio=chunk)


def _assert_sdk_shapes(session: LiveSimulatedSession) -> None:
    """Every event the simulator sent validates as the SDK's server type for it."""
    assert session.sent
    for _, event in session.sent:
        _SERVER_EVENT_CLASSES[event["type"]].model_validate(event)


def _audio(events: list[Any]) -> bytes:
    return b"".join(
        base64.b64decode(e.delta) for e in events if e.type == "session.output_audio.delta"
    )


async def test_session_start_is_answered_with_its_format_and_the_server_speaks_the_greeting(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, BOOKING)
    conn, session = await _connect(stack, sim)
    started = await _started(conn, delegation=RESPONSES_DELEGATION)
    assert started.client_event_id == "start_1"
    assert started.session.model == "gpt-live-1" and started.session.id == session.id
    assert started.session.audio.format.type == "audio/pcmu"
    assert started.session.audio.format.rate == 8000
    assert started.session.delegation.type == "responses"
    # Nobody asked for it: the server takes the first turn itself.
    events = await _recv_until(conn, "session.output_audio.delta")
    transcript = next(e for e in events if e.type == "session.output_transcript.delta")
    assert transcript.delta == BOOKING["greeting"]["text"]
    await session.wait_for_sent("session.output_audio.delta", count=4)
    # 600 ms of mu-law at 8 kHz, in 150 ms chunks.
    assert len(b"".join(base64.b64decode(e["delta"]) for e in session.sent_events(
        "session.output_audio.delta"))) == 600 * 8  # fmt: skip
    assert session.encoding == "pcmu" and session.received_events("response.create") == []
    _assert_sdk_shapes(session)


async def test_without_a_format_the_default_pcm_24k_is_resolved_and_recorded(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, {"greeting": "Hello."})
    conn, session = await _connect(stack, sim)
    started = await _started(conn, delegation=None, audio=None)
    assert started.session.audio.format.type == "audio/pcm"
    assert started.session.audio.format.rate == 24000
    await session.wait_for_sent("session.output_audio.delta")
    assert session.encoding == "pcm16"


async def test_every_client_event_is_checked_against_the_sdk_union_and_refusals_name_why(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, BOOKING)
    conn, session = await _connect(stack, sim)
    # Before session.start nothing else is taken.
    await conn.session.input_audio.append(audio=base64.b64encode(_silence(20)).decode())
    error = (await _recv_until(conn, "error"))[-1]
    assert error.error.code == "session_not_started"
    # A field the union does not know, a type it does not know, a wrong shape.
    await conn.send({"type": "session.start", "session": {"model": "gpt-live-1"}, "voice": "x"})  # type: ignore[arg-type]
    error = (await _recv_until(conn, "error"))[-1]
    assert (error.error.code, error.error.param) == ("unknown_parameter", "voice")
    await conn.send({"type": "response.cancel"})  # type: ignore[arg-type]
    error = (await _recv_until(conn, "error"))[-1]
    assert (error.error.code, error.error.param) == ("invalid_value", "type")
    await conn.send({"type": "session.start", "session": {"audio": {}}})  # type: ignore[arg-type]
    error = (await _recv_until(conn, "error"))[-1]
    assert error.error.code == "invalid_value" and "model" in (error.error.param or "")
    assert len(session.refused) == 4
    # The same check, without a socket, as tests of our own client use it.
    with pytest.raises(LiveEventError) as err:
        parse_live_client_event({"type": "response.create", "response": {}})
    assert (err.value.code, err.value.param) == ("unknown_parameter", "response")
    parse_live_client_event({"type": "response.create", "event_id": "e1"})


async def test_caller_speech_stops_the_agent_and_its_end_is_answered_without_a_response_create(
    stack: contextlib.AsyncExitStack,
) -> None:
    scenario = {
        "greeting": {"text": "Welcome to a very long greeting.", "audio_ms": 20_000},
        "steps": [{"caller_transcript": "Hello there.", "reply": "Hi, how can I help?"}],
    }
    sim = await _start(stack, scenario, factor=1.0)
    conn, session = await _connect(stack, sim)
    await _started(conn, delegation=None)
    await session.wait_for_sent("session.output_audio.delta")
    await _say(conn, _speech(400))
    # The caller's first word is transcribed as they start: the model has stopped by then.
    await session.wait_for_sent("session.input_transcript.delta")
    assert session.interruptions == 1
    deltas_at_barge_in = len(session.sent_events("session.output_audio.delta"))
    # 20 s of greeting would be ~27 chunks: it stopped well before.
    assert deltas_at_barge_in < 10 and not session.speaking
    await _say(conn, _silence(700))
    await session.wait_for_sent("session.input_transcript.delta", count=2)
    heard = session.sent_events("session.input_transcript.delta")
    assert [e["delta"] for e in heard] == ["Hello", " there."]
    reply = await session.wait_for_sent("session.output_transcript.delta", count=2)
    assert reply["delta"] == "Hi, how can I help?"
    assert session.received_events("response.create") == []
    _assert_sdk_shapes(session)


async def test_a_scripted_call_is_a_responses_delegation_answered_by_its_output_then_create(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, BOOKING)
    conn, session = await _connect(stack, sim)
    await _started(conn, delegation=RESPONSES_DELEGATION)
    await session.wait_for_sent("session.output_audio.delta")
    await _say(conn, _speech(400) + _silence(700))
    events = await _recv_until(conn, "response.event")
    created = next(e for e in events if e.type == "session.delegation.created")
    assert created.delegation.target == "responses" and created.delegation.response_id
    envelope = events[-1]
    assert envelope.delegation_id == created.delegation.id
    item = envelope.event["item"]
    assert envelope.event["type"] == "response.output_item.done"
    assert (item["type"], item["name"], json.loads(item["arguments"])) == (
        "function_call",
        "book_table",
        {"time": "21:00"},
    )
    # The preamble was spoken before the delegation, as the scenario says.
    spoken = [e.delta for e in events if e.type == "session.output_transcript.delta"]
    assert spoken[-1] == "One moment."
    # An output for a call nobody delegated is refused; the right one is taken.
    await conn.response.item.create(
        item={"type": "function_call_output", "call_id": "call_nope", "output": "{}"}
    )
    error = (await _recv_until(conn, "error"))[-1]
    assert error.error.param == "item.call_id"
    output = json.dumps({"status": "committed", "ref": "R-7"})
    await conn.response.item.create(
        item={"type": "function_call_output", "call_id": item["call_id"], "output": output}
    )
    await conn.response.create()
    said = await session.wait_for_sent("session.output_transcript.delta", count=3)
    assert said["delta"] == "That is committed, reference R-7."
    assert session.function_outputs == [(item["call_id"], output)]
    _assert_sdk_shapes(session)


async def test_under_client_delegation_the_answer_is_commentary_naming_the_delegation(
    stack: contextlib.AsyncExitStack,
) -> None:
    scenario = {
        "greeting": "Hello.",
        "steps": [
            {"caller_transcript": "Book nine.", "function_call": {"name": "book_table"}},
            {"reply": "{note}"},
        ],
    }
    sim = await _start(stack, scenario)
    conn, session = await _connect(stack, sim)
    await _started(conn, delegation={"type": "client"})
    await session.wait_for_sent("session.output_audio.delta")
    await _say(conn, _speech(400) + _silence(700))
    created = (await _recv_until(conn, "session.delegation.created"))[-1]
    assert created.delegation.target == "client" and created.delegation.response_id is None
    await conn.session.commentary.append(content="Booked.", delegation_id="dlg_unknown")
    assert (await _recv_until(conn, "error"))[-1].error.param == "delegation_id"
    await conn.session.commentary.append(
        content="Your table at nine is booked.", delegation_id=created.delegation.id
    )
    await _recv_until(conn, "session.commentary.appended")
    said = await session.wait_for_sent("session.output_transcript.delta", count=2)
    assert said["delta"] == "Your table at nine is booked."
    assert session.commentary == [(created.delegation.id, "Your table at nine is booked.")]
    _assert_sdk_shapes(session)


def test_model_api_defaults_to_realtime_and_live_also_runs_the_sip_interconnect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(openai_api_key=None, openai_base_url=None)
    assert (settings.model_api, settings.live_model) == ("realtime", "gpt-live-1")
    assert bridge_config_from(settings).model_api == "realtime"
    monkeypatch.setenv("MODEL_API", "live")
    monkeypatch.setenv("LIVE_MODEL", "gpt-live-1.1")
    live = Settings(openai_api_key=None, openai_base_url=None)
    assert (live.model_api, live.live_model) == ("live", "gpt-live-1.1")
    config = bridge_config_from(live)
    assert (config.model_api, config.live_model) == ("live", "gpt-live-1.1")
    plan_realtime(live)
    # OpenAI's SIP interconnect takes GPT-Live calls too (live.transport.incoming).
    sip = {"openai_webhook_secret": SecretStr("whsec_x"), "openai_api_key": SecretStr("sk-x")}
    assert plan_realtime(live.model_copy(update=sip)).check_key
    monkeypatch.setenv("MODEL_API", "gpt-live")
    with pytest.raises(ValueError, match="model_api"):
        Settings()
