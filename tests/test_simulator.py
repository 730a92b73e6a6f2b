"""The Realtime simulator, driven through the official `openai` SDK over a real socket."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import math
import re
import typing
import uuid
from array import array
from collections.abc import AsyncIterator
from typing import Any

import pytest
import websockets
from openai import AsyncOpenAI
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from openai.types.realtime.realtime_server_event import RealtimeServerEvent
from websockets.exceptions import ConnectionClosed, InvalidStatus

from telephony.sim.scenario import Scenario, load_scenario, render_reply_text
from telephony.sim.simulator import RealtimeSimulator, SimulatedSession, synthesize_speech
from telephony.sim.vad import EnergyVad, SpeechStarted, SpeechStopped, VadConfig
from tools.ledger_models import OperationRecord
from tools.registry import ToolSpec
from tools.restaurant.catalog import restaurant_tools
from tools.results import (
    awaiting_caller_output,
    cancelled_output,
    confirmation_output,
    denied_output,
    error_output,
    operation_output,
)
from tools.states import OperationStatus

PCMU_SESSION: dict[str, Any] = {
    "type": "realtime",
    "instructions": "Be brief.",
    "audio": {
        "input": {
            "format": {"type": "audio/pcmu"},
            "turn_detection": {"type": "semantic_vad", "eagerness": "auto"},
            "transcription": {"model": "gpt-4o-mini-transcribe"},
        },
        "output": {"format": {"type": "audio/pcmu"}, "voice": "marin"},
    },
    "tools": [
        {
            "type": "function",
            "name": "check_availability",
            "description": "Check table availability.",
            "parameters": {"type": "object", "properties": {}},
        }
    ],
}

_SERVER_EVENT_CLASSES: dict[str, Any] = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(RealtimeServerEvent)[0])
}


def _silence(ms: int) -> bytes:
    return b"\xff" * (8 * ms)  # mu-law zero


def _speech(ms: int) -> bytes:
    return synthesize_speech(ms, 7, "pcmu")


def _b64(audio: bytes) -> str:
    return base64.b64encode(audio).decode()


def _assert_sdk_shapes(session: SimulatedSession) -> None:
    """Every event the simulator sent validates strictly as the SDK's type for it."""
    assert session.sent
    for _, event in session.sent:
        _SERVER_EVENT_CLASSES[event["type"]].model_validate(event)
    ids = [event["event_id"] for _, event in session.sent]
    assert len(ids) == len(set(ids))


async def _recv_until(conn: AsyncRealtimeConnection, type_: str, within: float = 10.0) -> list[Any]:
    """Receive events up to and including the first of `type_`."""
    events: list[Any] = []
    async with asyncio.timeout(within):
        while True:
            event = await conn.recv()
            events.append(event)
            if event.type == type_:
                return events


async def _append(conn: AsyncRealtimeConnection, audio: bytes, frame_ms: int = 20) -> None:
    step = 8 * frame_ms
    for start in range(0, len(audio), step):
        await conn.input_audio_buffer.append(audio=_b64(audio[start : start + step]))


@pytest.fixture
async def stack() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as exit_stack:
        yield exit_stack


async def _start(
    stack: contextlib.AsyncExitStack, scenario: dict[str, Any] | None = None, factor: float = 0.0
) -> RealtimeSimulator:
    """A simulator for `scenario` (default: the built-in one); realtime_factor 0 is instant."""
    loaded = Scenario.model_validate(scenario) if scenario is not None else load_scenario()
    return await stack.enter_async_context(RealtimeSimulator(loaded, realtime_factor=factor))


async def _connect(
    stack: contextlib.AsyncExitStack, sim: RealtimeSimulator
) -> AsyncRealtimeConnection:
    """An SDK connection to `sim`, past its `session.created`."""
    client = AsyncOpenAI(api_key="sk-test", base_url=sim.base_url)
    connection = await stack.enter_async_context(client.realtime.connect(model="gpt-realtime"))
    created = await connection.recv()
    assert created.type == "session.created"
    return connection


@pytest.fixture
async def sim(stack: contextlib.AsyncExitStack) -> RealtimeSimulator:
    return await _start(stack)


@pytest.fixture
async def conn(stack: contextlib.AsyncExitStack, sim: RealtimeSimulator) -> AsyncRealtimeConnection:
    return await _connect(stack, sim)


async def _configure(conn: AsyncRealtimeConnection) -> None:
    await conn.session.update(session=PCMU_SESSION)  # type: ignore[arg-type]
    updated = await conn.recv()
    assert updated.type == "session.updated"


# ------------------------------------------------------------------------------------------
# Protocol through the SDK
# ------------------------------------------------------------------------------------------


async def test_session_created_is_ga_shaped_and_names_the_requested_model(
    sim: RealtimeSimulator, conn: AsyncRealtimeConnection
) -> None:
    session = await sim.wait_for_session()
    created = session.sent_events("session.created")[0]
    assert created["session"]["type"] == "realtime"
    assert created["session"]["model"] == "gpt-realtime"
    assert session.authorization == "Bearer sk-test"
    _assert_sdk_shapes(session)


async def test_session_update_round_trip_echoes_the_merged_config_with_vad_defaults(
    sim: RealtimeSimulator, conn: AsyncRealtimeConnection
) -> None:
    await conn.session.update(session=PCMU_SESSION)  # type: ignore[arg-type]
    updated = await conn.recv()
    assert updated.type == "session.updated"
    session = updated.session
    assert session.type == "realtime"
    assert session.instructions == "Be brief."
    assert session.audio is not None and session.audio.input and session.audio.output
    assert session.audio.input.format is not None
    assert session.audio.input.format.type == "audio/pcmu"
    assert session.audio.output.format is not None
    assert session.audio.output.format.type == "audio/pcmu"
    detection = session.audio.input.turn_detection
    assert detection is not None and detection.type == "semantic_vad"
    assert detection.create_response is True and detection.interrupt_response is True
    assert session.audio.input.transcription is not None
    assert [tool.name for tool in session.tools or []] == ["check_availability"]  # type: ignore[union-attr]

    # A later partial update merges: the formats stay, turn detection can be switched off.
    await conn.session.update(
        session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    )
    again = await conn.recv()
    assert again.type == "session.updated"
    merged = again.session.model_dump()
    assert merged["audio"]["input"]["turn_detection"] is None
    assert merged["audio"]["input"]["format"]["type"] == "audio/pcmu"
    assert merged["audio"]["output"]["format"]["type"] == "audio/pcmu"
    assert merged["instructions"] == "Be brief."


@pytest.mark.parametrize(
    ("session", "code", "param"),
    [
        ({"instructions": "x"}, "missing_required_parameter", "session.type"),
        ({"type": "transcription"}, "invalid_value", "session.type"),
        ({"type": "realtime", "voice": "x"}, "unknown_parameter", "session.voice"),
        (
            {"type": "realtime", "audio": {"input": {"format": {"type": "audio/g729"}}}},
            "invalid_value",
            "session.audio.input.format.type",
        ),
        (
            {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "push"}}}},
            "invalid_value",
            "session.audio.input.turn_detection.type",
        ),
    ],
)
async def test_session_update_of_wrong_shape_is_an_invalid_request_error_naming_the_param(
    conn: AsyncRealtimeConnection, session: dict[str, Any], code: str, param: str
) -> None:
    await conn.send({"type": "session.update", "session": session})  # type: ignore[arg-type]
    error = await conn.recv()
    assert error.type == "error"
    assert error.error.type == "invalid_request_error"
    assert (error.error.code, error.error.param) == (code, param)


async def test_the_voice_can_change_until_the_assistant_has_spoken_and_never_after(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, {"greeting": "Hello there.", "steps": []})
    conn = await _connect(stack, sim)
    await _configure(conn)
    voice = {"type": "realtime", "audio": {"output": {"voice": "cedar"}}}
    await conn.session.update(session=voice)  # type: ignore[arg-type]
    assert (await conn.recv()).type == "session.updated"  # nothing said yet: allowed
    await conn.response.create()
    await _recv_until(conn, "response.done")
    # Once the assistant has spoken, the API refuses a new voice (the session survives) and
    # takes an update that leaves the voice alone.
    await conn.session.update(session={**voice, "audio": {"output": {"voice": "marin"}}})  # type: ignore[dict-item]
    error = await conn.recv()
    assert error.type == "error"
    assert (error.error.type, error.error.code) == ("invalid_request_error", "cannot_update_voice")
    await conn.session.update(session=voice)  # type: ignore[arg-type]
    again = await conn.recv()
    assert again.type == "session.updated"
    assert again.session.audio.output.voice == "cedar"


TABLE_FOR_TWO: dict[str, Any] = {
    "greeting": "Hello there.",
    "steps": [
        {
            "caller_transcript": "Is there a table for two?",
            "reply": {"text": "Yes, there is a table for two tonight.", "audio_ms": 1234},
        }
    ],
}


async def test_speech_then_silence_gives_vad_events_at_stream_offsets_then_a_full_response(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, TABLE_FOR_TWO)
    conn = await _connect(stack, sim)
    await _configure(conn)
    await _append(conn, _silence(1000) + _speech(1500) + _silence(800))
    events = await _recv_until(conn, "response.done")
    types = [e.type for e in events]

    started = events[types.index("input_audio_buffer.speech_started")]
    stopped = events[types.index("input_audio_buffer.speech_stopped")]
    # Speech begins at 1000 ms; the start includes the 300 ms prefix padding, the stop
    # includes the 500 ms of silence that confirmed it.
    assert started.audio_start_ms == 700
    assert stopped.audio_end_ms == 3000
    assert started.item_id == stopped.item_id

    committed = events[types.index("input_audio_buffer.committed")]
    assert committed.item_id == started.item_id
    transcription = events[types.index("conversation.item.input_audio_transcription.completed")]
    assert transcription.item_id == started.item_id
    assert transcription.transcript == "Is there a table for two?"

    response_types = types[types.index("response.created") :]
    assert response_types[:4] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
    ]
    assert response_types[-6:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    deltas = [e for e in events if e.type == "response.output_audio.delta"]
    audio = b"".join(base64.b64decode(e.delta) for e in deltas)
    assert len(audio) / 8 == 1234  # ms of 8 kHz mu-law: the caller's greeting was skipped
    assert len(deltas) > 1
    assert set(audio) != {0xFF}  # not silence
    transcript = "".join(
        e.delta for e in events if e.type == "response.output_audio_transcript.delta"
    )
    assert transcript == "Yes, there is a table for two tonight."
    done = events[-1]
    assert done.response.status == "completed"
    assert done.response.usage is not None
    assert done.response.output[0].content[0].transcript == transcript
    _assert_sdk_shapes(await sim.wait_for_session())


COUNTING_REPLY: dict[str, Any] = {
    "steps": [{"reply": {"text": "one two three four five six seven eight", "audio_ms": 2000}}]
}


async def test_truncate_beyond_the_items_audio_is_an_error_and_within_cuts_the_transcript(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, COUNTING_REPLY)
    conn = await _connect(stack, sim)
    await _configure(conn)
    await conn.response.create()
    events = await _recv_until(conn, "response.done")
    item_id = next(e.item.id for e in events if e.type == "response.output_item.added")

    await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=2500)
    error = await conn.recv()
    assert error.type == "error"
    assert error.error.type == "invalid_request_error"
    assert error.error.param == "audio_end_ms"
    assert "2000ms is already shorter than 2500ms" in error.error.message

    await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=1000)
    truncated = await conn.recv()
    assert truncated.type == "conversation.item.truncated"
    assert (truncated.item_id, truncated.audio_end_ms) == (item_id, 1000)
    session = await sim.wait_for_session()
    assert session.items[item_id].transcript == "one two three four"

    await conn.conversation.item.truncate(item_id="item_nope", content_index=0, audio_end_ms=0)
    unknown = await conn.recv()
    assert unknown.type == "error" and unknown.error.param == "item_id"


async def test_cancel_with_nothing_active_reports_response_cancel_not_active(
    conn: AsyncRealtimeConnection,
) -> None:
    await conn.response.cancel()
    error = await conn.recv()
    assert error.type == "error"
    assert error.error.code == "response_cancel_not_active"


LONG_REPLY: dict[str, Any] = {
    "steps": [{"reply": {"text": "A very long answer.", "audio_ms": 30000}}]
}


async def test_create_while_active_is_refused_and_cancel_stops_the_deltas_at_once(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, LONG_REPLY, factor=1.0)
    conn = await _connect(stack, sim)
    await _configure(conn)
    await conn.response.create()
    await _recv_until(conn, "response.output_audio.delta")
    await conn.response.create()
    events = await _recv_until(conn, "error")
    assert events[-1].error.code == "conversation_already_has_active_response"

    await conn.response.cancel()
    events = await _recv_until(conn, "response.done")
    done = events[-1]
    assert done.response.status == "cancelled"
    assert done.response.status_details.reason == "client_cancelled"
    assert done.response.output[0].status == "incomplete"


AVAILABILITY_CALL: dict[str, Any] = {
    "steps": [
        {
            "caller_transcript": "A table for four tomorrow?",
            "function_call": {
                "name": "check_availability",
                "arguments": {"date": "{tomorrow}", "time": "20:00", "party_size": 4},
                "preamble": {"text": "Let me check that for you.", "audio_ms": 900},
            },
        },
        {"reply": {"text": "The system says: {output[summary]}", "audio_ms": 1500}},
    ]
}


async def test_function_call_step_streams_in_order_and_the_next_step_follows_its_output(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, AVAILABILITY_CALL)
    conn = await _connect(stack, sim)
    await _configure(conn)
    await conn.response.create()
    events = await _recv_until(conn, "response.done")
    types = [e.type for e in events]
    preamble_start, call_start = (
        i for i, t in enumerate(types) if t == "response.output_item.added"
    )
    assert types[call_start:] == [
        "response.output_item.added",
        "conversation.item.added",
        *["response.function_call_arguments.delta"]
        * types.count("response.function_call_arguments.delta"),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert types.count("response.function_call_arguments.delta") > 1
    # The spoken preamble comes first, in the same response.
    assert preamble_start < types.index("response.output_audio.delta") < call_start
    added = events[call_start]
    assert added.item.type == "function_call"
    assert added.item.name == "check_availability"
    args_done = events[types.index("response.function_call_arguments.done")]
    arguments = json.loads(args_done.arguments)
    assert arguments["time"] == "20:00" and arguments["party_size"] == 4
    done = events[-1]
    assert done.response.status == "completed"
    assert [item.type for item in done.response.output] == ["message", "function_call"]
    assert done.response.output[1].status == "completed"
    call_id = done.response.output[1].call_id

    await conn.conversation.item.create(
        item={
            "type": "function_call_output",
            "call_id": call_id,
            "output": json.dumps({"summary": "free at 20:00"}),
        }
    )
    added_output = await _recv_until(conn, "conversation.item.done")
    assert added_output[0].type == "conversation.item.added"
    await conn.response.create()
    events = await _recv_until(conn, "response.done")
    transcript_done = next(e for e in events if e.type == "response.output_audio_transcript.done")
    assert transcript_done.transcript == "The system says: free at 20:00"
    session = await sim.wait_for_session()
    assert session.function_outputs == [(call_id, json.dumps({"summary": "free at 20:00"}))]
    _assert_sdk_shapes(session)


async def test_function_call_output_for_an_unknown_call_is_an_error(
    conn: AsyncRealtimeConnection,
) -> None:
    await conn.conversation.item.create(
        item={"type": "function_call_output", "call_id": "call_nope", "output": "{}"}
    )
    error = await conn.recv()
    assert error.type == "error" and error.error.param == "item.call_id"


async def test_caller_speech_during_an_active_response_cancels_it_as_turn_detected(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, LONG_REPLY, factor=1.0)
    conn = await _connect(stack, sim)
    await _configure(conn)
    await conn.response.create()
    await _recv_until(conn, "response.output_audio.delta")
    await _append(conn, _speech(300))
    events = await _recv_until(conn, "response.done")
    types = [e.type for e in events]
    assert types.index("input_audio_buffer.speech_started") < types.index("response.done")
    done = events[-1]
    assert done.response.status == "cancelled"
    assert done.response.status_details.reason == "turn_detected"
    heard = sum(
        len(base64.b64decode(e.delta)) for e in events if e.type == "response.output_audio.delta"
    )
    assert heard < 8 * 30000


async def test_malformed_json_and_unknown_events_get_errors_and_the_session_survives(
    conn: AsyncRealtimeConnection,
) -> None:
    await conn.send_raw("{this is not json")
    error = await conn.recv()
    assert error.type == "error" and error.error.code == "invalid_json"
    await conn.send_raw(json.dumps({"type": "response.dance", "event_id": "evt_1"}))
    error = await conn.recv()
    assert error.type == "error"
    assert (error.error.param, error.error.event_id) == ("type", "evt_1")
    await conn.response.cancel()
    still_there = await conn.recv()
    assert still_there.type == "error" and still_there.error.code == "response_cancel_not_active"


async def test_buffer_and_item_housekeeping_events_are_answered(
    conn: AsyncRealtimeConnection,
) -> None:
    await _configure(conn)
    await conn.input_audio_buffer.commit()
    too_small = await conn.recv()
    assert too_small.type == "error"
    assert too_small.error.code == "input_audio_buffer_commit_empty"
    await conn.input_audio_buffer.clear()
    assert (await conn.recv()).type == "input_audio_buffer.cleared"
    await conn.output_audio_buffer.clear()
    assert (await conn.recv()).type == "output_audio_buffer.cleared"
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    )
    added = await _recv_until(conn, "conversation.item.done")
    item_id = added[-1].item.id
    await conn.conversation.item.delete(item_id=item_id)
    deleted = await conn.recv()
    assert deleted.type == "conversation.item.deleted" and deleted.item_id == item_id


async def test_greeting_plays_on_the_first_response_create_before_caller_speech(
    conn: AsyncRealtimeConnection,
) -> None:
    await _configure(conn)
    await conn.response.create()
    events = await _recv_until(conn, "response.done")
    transcript = next(e for e in events if e.type == "response.output_audio_transcript.done")
    assert transcript.transcript == load_scenario().greeting.text  # type: ignore[union-attr]


async def test_drop_all_closes_the_sdk_connection_abruptly(
    sim: RealtimeSimulator, conn: AsyncRealtimeConnection
) -> None:
    await sim.drop_all()
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(5):
            await conn.recv()


async def test_sdk_reconnects_after_a_drop_to_a_fresh_session(sim: RealtimeSimulator) -> None:
    client = AsyncOpenAI(api_key="sk-test", base_url=sim.base_url)
    attempts: list[int] = []
    async with client.realtime.connect(
        model="gpt-realtime",
        on_reconnecting=lambda event: attempts.append(event.close_code) or None,  # type: ignore[func-returns-value]
        max_retries=3,
        initial_delay=0.01,
    ) as connection:
        assert (await connection.recv()).type == "session.created"
        sim.fail_next_connects(1)
        await sim.drop_all()
        events = connection.__aiter__()
        async with asyncio.timeout(10):
            event = await anext(events)
        assert event.type == "session.created"
    assert attempts[0] == 1006
    assert len(sim.sessions) == 2
    assert sim.connect_attempts == 3  # first, one refused, the reconnect


async def test_refused_connects_fail_the_sdk_handshake(sim: RealtimeSimulator) -> None:
    sim.fail_next_connects(1)
    client = AsyncOpenAI(api_key="sk-test", base_url=sim.base_url)
    with pytest.raises(InvalidStatus) as refused:
        async with client.realtime.connect(model="gpt-realtime"):
            pass
    assert refused.value.response.status_code == 503
    async with client.realtime.connect(model="gpt-realtime") as connection:
        assert (await connection.recv()).type == "session.created"


async def test_only_the_realtime_path_is_served(sim: RealtimeSimulator) -> None:
    with pytest.raises(InvalidStatus) as missing:
        async with websockets.connect(
            f"ws://127.0.0.1:{sim.port}/v1/other",
            additional_headers={"Authorization": "Bearer x"},
        ):
            pass
    assert missing.value.response.status_code == 404
    async with websockets.connect(
        f"{sim.ws_url}?call_id=rtc_123", additional_headers={"Authorization": "Bearer x"}
    ) as ws:
        created = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert created["type"] == "session.created"
    assert sim.sessions[-1].call_id == "rtc_123"


# ------------------------------------------------------------------------------------------
# Pure parts: VAD and scenarios
# ------------------------------------------------------------------------------------------


def _sine16(ms: int, amplitude: int, rate: int = 24000) -> bytes:
    n = rate * ms // 1000
    return array(
        "h", (int(amplitude * math.sin(2 * math.pi * 200 * i / rate)) for i in range(n))
    ).tobytes()


def test_vad_reports_padded_start_and_silence_confirmed_stop() -> None:
    vad = EnergyVad(VadConfig(silence_ms=500, prefix_padding_ms=300), "pcmu")
    events = vad.feed(_silence(1000) + _speech(1500) + _silence(1000))
    assert events == [SpeechStarted(700), SpeechStopped(audio_end_ms=3000, speech_end_ms=2500)]


def test_vad_events_do_not_depend_on_chunking() -> None:
    audio = _silence(400) + _speech(700) + _silence(300) + _speech(200) + _silence(900)
    whole = EnergyVad(encoding="pcmu").feed(audio)
    pieces = EnergyVad(encoding="pcmu")
    chunked = [e for i in range(0, len(audio), 33) for e in pieces.feed(audio[i : i + 33])]
    assert chunked == whole
    # The 300 ms pause is shorter than the 500 ms hangover: one utterance.
    assert whole == [SpeechStarted(100), SpeechStopped(audio_end_ms=2100, speech_end_ms=1600)]


def test_vad_ignores_blips_shorter_than_the_activation_time() -> None:
    vad = EnergyVad(VadConfig(activation_ms=60), "pcmu")
    assert vad.feed(_silence(200) + _speech(40) + _silence(600)) == []
    assert not vad.in_speech


def test_vad_threshold_separates_quiet_from_loud_linear_audio() -> None:
    quiet = EnergyVad(VadConfig(threshold_dbfs=-40.0), "pcm16")
    assert quiet.feed(_sine16(500, amplitude=100)) == []  # about -50 dBFS
    loud = EnergyVad(VadConfig(threshold_dbfs=-40.0, prefix_padding_ms=0), "pcm16")
    assert loud.feed(_sine16(500, amplitude=8000)) == [SpeechStarted(0)]
    assert loud.position_ms == 500


def test_vad_offset_keeps_counting_across_a_retune() -> None:
    vad = EnergyVad(VadConfig(prefix_padding_ms=0), "pcma", offset_ms=5000)
    events = vad.feed(synthesize_speech(200, 3, "pcma"))
    assert events == [SpeechStarted(5000)]


def test_default_scenario_tells_the_booking_story() -> None:
    scenario = load_scenario()
    assert scenario.greeting is not None
    calls = [s.function_call for s in scenario.steps if s.function_call]
    assert [c.name for c in calls] == ["check_availability", "book_table", "confirm_operation"]
    assert calls[0].preamble is not None
    assert calls[0].preamble.text == "Let me check that for you."
    assert set(json.loads(calls[0].rendered_arguments())) == {"date", "time", "party_size"}
    # The confirmation names the operation the booking request returned.
    confirm = json.loads(calls[2].rendered_arguments(output='{"operation_id": "op-1"}'))
    assert confirm == {"operation_id": "op-1", "confirmed": True}
    spoken = [s.spoken() for s in scenario.steps] + [scenario.greeting]
    assert all(r is not None and 500 <= r.duration_ms() <= 8000 for r in spoken)


def test_scenario_rejects_a_step_that_does_nothing() -> None:
    with pytest.raises(ValueError, match="needs a reply"):
        Scenario.model_validate({"steps": [{"caller_transcript": "hello"}]})


def test_reply_templates_read_the_function_output() -> None:
    assert render_reply_text("Booked: {output[id]}", '{"id": "B-7"}') == "Booked: B-7"
    assert render_reply_text("Said: {output}", "plain words") == "Said: plain words"
    assert render_reply_text("Missing: {output[nope]}.", "{}") == "Missing: ."


async def test_default_scenario_runs_the_booking_story_through_the_sdk(
    sim: RealtimeSimulator, conn: AsyncRealtimeConnection
) -> None:
    await _configure(conn)
    await conn.response.create()
    await _recv_until(conn, "response.done")  # greeting
    spoken: list[str] = []
    calls: list[str] = []
    for _turn in range(3):
        await _append(conn, _speech(800) + _silence(600))
        events = await _recv_until(conn, "response.done")
        done = events[-1]
        assert done.response.status == "completed"
        call = done.response.output[-1]
        assert call.type == "function_call"
        calls.append(call.name)
        await conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": call.call_id, "output": '{"ok":true}'}
        )
        await conn.response.create()
        events = await _recv_until(conn, "response.done")
        spoken += [
            e.transcript for e in events if e.type == "response.output_audio_transcript.done"
        ]
    assert calls == ["check_availability", "book_table", "confirm_operation"]
    assert len(spoken) == 3
    session = await sim.wait_for_session()
    transcripts = [
        e["transcript"]
        for e in session.sent_events("conversation.item.input_audio_transcription.completed")
    ]
    said = [s.caller_transcript for s in load_scenario().steps if s.caller_transcript]
    assert transcripts == said[:3]
    _assert_sdk_shapes(session)


SLOW_PREAMBLE_CALL: dict[str, Any] = {
    "steps": [
        {
            "function_call": {
                "name": "book_table",
                "arguments": {"party_size": 2},
                "preamble": {"text": "One moment while I book that.", "audio_ms": 30000},
            }
        }
    ]
}


async def test_cancelling_during_the_preamble_never_emits_the_function_call(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, SLOW_PREAMBLE_CALL, factor=1.0)
    conn = await _connect(stack, sim)
    await _configure(conn)
    await conn.response.create()
    await _recv_until(conn, "response.output_audio.delta")
    await conn.response.cancel()
    events = await _recv_until(conn, "response.done")
    types = [e.type for e in events]
    assert "response.function_call_arguments.done" not in types
    assert [item.type for item in events[-1].response.output] == ["message"]
    assert events[-1].response.status == "cancelled"


async def test_speech_does_not_cancel_when_interrupt_response_is_off(
    stack: contextlib.AsyncExitStack,
) -> None:
    sim = await _start(stack, LONG_REPLY, factor=1.0)
    conn = await _connect(stack, sim)
    await conn.session.update(
        session={
            "type": "realtime",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcmu"},
                    "turn_detection": {"type": "server_vad", "interrupt_response": False},
                },
                "output": {"format": {"type": "audio/pcmu"}},
            },
        }
    )
    assert (await conn.recv()).type == "session.updated"
    await conn.response.create()
    await _recv_until(conn, "response.output_audio.delta")
    await _append(conn, _speech(300))
    await _recv_until(conn, "input_audio_buffer.speech_started")
    session = await sim.wait_for_session()
    assert session.response_active
    await conn.response.cancel()
    events = await _recv_until(conn, "response.done")
    assert events[-1].response.status_details.reason == "client_cancelled"


def test_function_call_arguments_can_name_a_field_of_the_latest_output() -> None:
    from telephony.sim.scenario import FunctionCallStep

    step = FunctionCallStep(
        name="confirm_operation",
        arguments={"operation_id": "{output[operation_id]}", "confirmed": True},
    )
    rendered = step.rendered_arguments(output='{"operation_id": "op-123", "status": "x"}')
    assert json.loads(rendered) == {"operation_id": "op-123", "confirmed": True}
    # Without an output the placeholder stays visible instead of silently becoming "".
    assert "{output[operation_id]}" in step.rendered_arguments()


# --- the scripted model follows the function output it is given -----------------------------

# A line that tells the caller their request went anywhere: never after a refusal.
CLAIMS_SUCCESS = re.compile(r"\b(sent|booked|confirmed)\b", re.IGNORECASE)
READBACK = (
    "Please confirm: a table for 4 people on Sunday 06 December 2026 at 20:00 under the "
    "name Alex. Say yes to confirm."
)
NOT_HEARD = "the readback was not heard to its end"


def _book_table() -> ToolSpec:
    return next(spec for spec in restaurant_tools() if spec.name == "book_table")


def _booking(status: OperationStatus, **over: Any) -> OperationRecord:
    """The demo's booking as the ledger holds it, in `status`."""
    now = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    values: dict[str, Any] = {
        "operation_id": uuid.UUID("8d3f6c1e-0000-4000-8000-000000000001"),
        "tenant_id": "t",
        "idempotency_key": "k",
        "key_source": "derived",
        "call_id": "c",
        "caller": "+15551230000",
        "turn_id": 2,
        "tool": "book_table",
        "args": {"date": "2026-12-06", "time": "20:00", "party_size": 4, "name": "Alex"},
        "args_hash": "h",
        "resource": None,
        "status": status,
        "cancel_requested": False,
        "attempts": 0,
        "deadline": None,
        "expires_at": None,
        "next_attempt_at": None,
        "result": None,
        "error": None,
        "provider_ref": None,
        "compensates_operation_id": None,
        "readback": READBACK,
        "confirm_by": None,
        "overflow": None,
        "created_at": now,
        "updated_at": now,
        "committed_at": None,
        "finished_at": None,
    }
    values.update(over)
    return OperationRecord(**values)


# What the tool layer answers, shaped by its own functions (tools/results.py).
AWAITING = confirmation_output(_booking(OperationStatus.AWAITING_CONFIRMATION), 60)
NEEDS_CALLER = awaiting_caller_output(
    _booking(OperationStatus.AWAITING_CONFIRMATION), 60, NOT_HEARD
)
ADMITTED = operation_output(_book_table(), _booking(OperationStatus.ADMITTED))
COMMITTED = operation_output(
    _book_table(), _booking(OperationStatus.COMMITTED, provider_ref="B-42", attempts=1)
)


def _said(events: list[Any]) -> str:
    return " ".join(
        e.transcript for e in events if e.type == "response.output_audio_transcript.done"
    )


class _DemoCall:
    """The built-in scenario driven through the SDK, turn by turn, as the service drives it."""

    def __init__(self, conn: AsyncRealtimeConnection) -> None:
        self.conn = conn
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._call_id: str | None = None

    async def start(self) -> None:
        await _configure(self.conn)
        await self.conn.response.create()
        await _recv_until(self.conn, "response.done")  # greeting

    async def caller_speaks(self) -> str:
        """The caller's turn; the agent's response (a function call is recorded)."""
        await _append(self.conn, _speech(800) + _silence(600))
        events = await _recv_until(self.conn, "response.done")
        last = events[-1].response.output[-1]
        if last.type == "function_call":
            self._call_id = last.call_id
            self.calls.append((last.name, json.loads(last.arguments)))
        return _said(events)

    async def output(self, output: dict[str, Any]) -> str:
        """The function output for the latest call, then what the agent says to it."""
        assert self._call_id is not None
        await self.conn.conversation.item.create(
            item={
                "type": "function_call_output",
                "call_id": self._call_id,
                "output": json.dumps(output),
            }
        )
        self._call_id = None
        await self.conn.response.create()
        return _said(await _recv_until(self.conn, "response.done"))

    async def up_to_the_confirmation(self) -> None:
        """Availability, the booking request and its readback, the caller's yes."""
        await self.start()
        await self.caller_speaks()
        await self.output({"status": "ok", "available": True})
        await self.caller_speaks()
        assert await self.output(AWAITING) == READBACK
        await self.caller_speaks()
        assert self.calls[-1][0] == "confirm_operation"


@pytest.fixture
async def demo(conn: AsyncRealtimeConnection) -> _DemoCall:
    call = _DemoCall(conn)
    await call.up_to_the_confirmation()
    return call


async def test_a_refused_confirmation_is_read_back_again_and_never_told_as_sent(
    demo: _DemoCall,
) -> None:
    said = await demo.output(NEEDS_CALLER)
    assert not CLAIMS_SUCCESS.search(said), said
    assert READBACK in said  # it asks for the caller's yes again
    # The caller answers again: the confirmation is made again, for the same operation.
    await demo.caller_speaks()
    names = [name for name, _ in demo.calls]
    assert names[-2:] == ["confirm_operation", "confirm_operation"]
    assert demo.calls[-1][1] == {"operation_id": AWAITING["operation_id"], "confirmed": True}
    # Admitted, not yet confirmed by the restaurant: sent, and said to be unconfirmed.
    said = await demo.output(ADMITTED)
    assert "sent" in said and "isn't confirmed yet" in said


async def test_a_committed_confirmation_is_told_as_booked_and_the_call_goes_to_goodbye(
    demo: _DemoCall,
) -> None:
    said = await demo.output(COMMITTED)
    assert "booked" in said
    assert "goodbye" in (await demo.caller_speaks()).lower()


async def test_refusals_are_asked_again_a_bounded_number_of_times_then_nothing_is_claimed(
    demo: _DemoCall,
) -> None:
    asked_again = 0
    while READBACK in (said := await demo.output(NEEDS_CALLER)):
        assert not CLAIMS_SUCCESS.search(said), said
        asked_again += 1
        assert asked_again <= 5, "the scripted model asks for ever"
        await demo.caller_speaks()
    assert asked_again == 2  # the scenario's `at_most`
    assert not CLAIMS_SUCCESS.search(said), said
    assert "haven't made the booking" in said
    # It gives up politely; the caller's next words get the goodbye, not a late "confirmed".
    assert "goodbye" in (await demo.caller_speaks()).lower()
    assert [name for name, _ in demo.calls].count("confirm_operation") == 3


@pytest.mark.parametrize(
    "output",
    [
        pytest.param(denied_output("Bookings close at 22:00.", rule="hours"), id="denied"),
        pytest.param(error_output("Too many requests at once.", retryable=True), id="error"),
        pytest.param({"error": "The request could not be completed right now."}, id="crash"),
        pytest.param(
            operation_output(
                _book_table(), _booking(OperationStatus.FAILED_FINAL, error="no table free")
            ),
            id="failed_final",
        ),
        pytest.param(
            cancelled_output(
                _booking(OperationStatus.CANCELLED), "The confirmation came too late."
            ),
            id="cancelled",
        ),
    ],
)
async def test_a_confirmation_that_did_not_go_through_is_never_told_as_sent(
    demo: _DemoCall, output: dict[str, Any]
) -> None:
    said = await demo.output(output)
    assert said and not CLAIMS_SUCCESS.search(said), said
    assert READBACK not in said


def test_on_output_cases_name_existing_steps_and_need_a_reply() -> None:
    confirm = {"name": "confirm_operation", "arguments": {}}
    with pytest.raises(ValueError, match="no step has that id"):
        Scenario.model_validate(
            {"steps": [{"reply": "x", "on_output": [{"status": "ok", "reply": "y", "then": "z"}]}]}
        )
    with pytest.raises(ValueError, match="needs a reply"):
        Scenario.model_validate(
            {"steps": [{"function_call": confirm, "on_output": [{"status": "ok", "reply": "y"}]}]}
        )
    with pytest.raises(ValueError, match="unique"):
        Scenario.model_validate({"steps": [{"id": "a", "reply": "x"}, {"id": "a", "reply": "y"}]})


async def test_a_note_step_before_any_note_speaks_the_fallback_and_waits_for_the_note(
    stack: contextlib.AsyncExitStack,
) -> None:
    """A `{note}` step taken with no system message yet would say "{note}" aloud: the model
    answers with the fallback instead, and says the note once it is told one."""
    sim = await _start(
        stack,
        {
            "steps": [{"reply": {"text": "{note}", "audio_ms": 600}}],
            "fallback": {"text": "Anything else?", "audio_ms": 400},
        },
    )
    conn = await _connect(stack, sim)
    await _configure(conn)

    async def said() -> str:
        await conn.response.create()
        events = await _recv_until(conn, "response.done")
        done = next(e for e in events if e.type == "response.output_audio_transcript.done")
        return str(done.transcript)

    assert await said() == "Anything else?"
    note = "Your table for four tomorrow at eight is confirmed."
    await conn.conversation.item.create(
        item={
            "type": "message",
            "role": "system",
            "content": [{"type": "input_text", "text": note}],
        }
    )
    await _recv_until(conn, "conversation.item.done")
    assert await said() == note
    assert await said() == "Anything else?"  # the steps ran out
