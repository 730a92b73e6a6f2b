"""The Realtime read loop over a real socket: each frame parsed once, audio deltas without the
SDK's models, events no handler acts on dropped unparsed (in the reader and in the socket's
lane), the rest parsed by the SDK and handed on in order; frames that are not JSON objects
skipped with a warning, never a traceback or the end of the session."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import logging
import textwrap
from collections import deque
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.types.realtime import (
    InputAudioBufferSpeechStartedEvent,
    RealtimeErrorEvent,
    ResponseAudioTranscriptDoneEvent,
)
from websockets.asyncio.server import ServerConnection, serve

from telephony.bridge import BridgeConfig
from telephony.bridge.bridge import LIVE_EVENTS_READ, REALTIME_EVENTS_HANDLED, Bridge
from telephony.bridge.live_events import LIVE_EVENTS_HANDLED, LiveEvents
from telephony.bridge.live_link import LiveLink
from telephony.bridge.port import Port
from telephony.bridge.realtime_link import RealtimeLink
from telephony.call_events import CallEventKind
from tests.test_bridge import ScriptedRealtime, wait_until


def _case_labels(handler: Any) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(handler)))
    labels: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.match_case):
            for value in ast.walk(node.pattern):
                if isinstance(value, ast.MatchValue) and isinstance(value.value, ast.Constant):
                    labels.add(value.value.value)
    assert labels
    return labels


def test_the_handled_sets_are_what_the_handlers_match() -> None:
    """An event type a handler acts on but its set lacks would be dropped unread: each set is
    held to its handler's `case` labels (Realtime: `Bridge._on_event`; GPT-Live: the router's,
    and the caller's keypad, which the bridge takes before it)."""
    assert _case_labels(Bridge._on_event) == REALTIME_EVENTS_HANDLED
    assert _case_labels(LiveEvents.on_event) == LIVE_EVENTS_HANDLED
    assert 'event.type == "transport.dtmf.received"' in inspect.getsource(Bridge._on_live_event)
    assert LIVE_EVENTS_READ == LIVE_EVENTS_HANDLED | {"transport.dtmf.received"}


def _port(call_id: str) -> Port:
    return Port(
        call_id=call_id,
        emit=lambda kind, **data: None,
        spawn=lambda coro, name, tool=False: asyncio.create_task(coro, name=name),
        finish=lambda reason: None,
        ended=lambda: False,
    )


SCRIPT: list[Any] = [
    {"type": "response.output_audio_transcript.delta", "response_id": "r1", "item_id": "i1",
     "output_index": 0, "content_index": 0, "delta": "Hello "},
    {"type": "input_audio_buffer.speech_started", "item_id": "i2", "audio_start_ms": 40},
    "[1, 2]",  # JSON, not an object
    "not json at all",
    {"type": 5, "delta": "x"},  # a type that is not a string
    {"type": "response.content_part.added", "response_id": "r1", "item_id": "i1",
     "output_index": 0, "content_index": 0, "part": {"type": "audio", "transcript": ""}},
    {"type": "response.output_audio.delta", "response_id": "r1", "item_id": "i1",
     "output_index": 0, "content_index": 0, "delta": "f39/fw=="},
    {"type": "some.future.event", "detail": {"nested": True}},
    {"type": "response.output_audio_transcript.done", "response_id": "r1", "item_id": "i1",
     "output_index": 0, "content_index": 0, "transcript": "Hello there"},
    {"type": "error", "error": {"type": "invalid_request_error", "code": "x",
                                "message": "odd", "event_id": None}},
]  # fmt: skip
DROPPED = 4  # the transcript delta, the non-string type, the content part, the future event


@pytest.mark.parametrize("lane", [False, True], ids=["reader", "lane"])
async def test_only_the_handled_events_are_parsed_and_handed_on_in_order(
    lane: bool, caplog: pytest.LogCaptureFixture
) -> None:
    server = ScriptedRealtime([])
    await server.start()
    emitted: list[tuple[CallEventKind, dict[str, Any]]] = []
    port = Port(
        call_id="call-read",
        emit=lambda kind, **data: emitted.append((kind, data)),
        spawn=lambda coro, name, tool=False: asyncio.create_task(coro, name=name),
        finish=lambda reason: None,
        ended=lambda: False,
    )
    client = AsyncOpenAI(api_key="sk-test", base_url=server.base_url)
    link = RealtimeLink(port, BridgeConfig(), client, "audio/pcmu", lambda: [], deque(maxlen=20))
    try:
        session, _, error = await link.connect(resumed=False)
        assert session is not None, error
        conn = await server.connection()
        deltas: list[tuple[str, str, str]] = []
        events: list[Any] = []

        async def on_delta(_session: Any, delta: Any) -> None:
            deltas.append((delta.response_id, delta.item_id, delta.delta))

        async def on_event(_session: Any, event: Any) -> str | None:
            events.append(event)
            return None

        if lane:
            assert link.open_lane(session, lambda _s, *fields: deltas.append(fields))
        caplog.set_level(logging.WARNING)
        reading = link.read(session, on_delta, on_event, REALTIME_EVENTS_HANDLED)
        reader = asyncio.create_task(reading)
        for frame in SCRIPT:
            await conn.ws.send(frame if isinstance(frame, str) else json.dumps(frame))
            if lane:  # one at a time, so each arrives while the reader waits: the lane's
                await asyncio.sleep(0.02)
        await wait_until(lambda: len(events) == 3, what="the handled events")
        await conn.ws.close()
        reason = await asyncio.wait_for(reader, 5)
    finally:
        await server.stop()
        await client.close()
    assert reason == "socket closed (1000)"
    assert [type(e) for e in events] == [
        InputAudioBufferSpeechStartedEvent,
        ResponseAudioTranscriptDoneEvent,
        RealtimeErrorEvent,
    ]
    assert events[0].item_id == "i2" and events[1].transcript == "Hello there"
    assert deltas == [("r1", "i1", "f39/fw==")]
    assert link.events_dropped == DROPPED
    if lane:
        assert link.deltas_by_lane == 1
    assert emitted == []  # nothing went wrong handling any of it
    warnings = [r for r in caplog.records if r.name == "telephony.bridge.realtime_link"]
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.WARNING]
    assert all("not a JSON object" in r.getMessage() for r in warnings)
    assert not [r for r in caplog.records if r.exc_info]


async def test_without_a_handled_set_every_event_reaches_the_handler() -> None:
    """`handles` None (GPT-Live's router, any other reader): nothing is dropped."""
    server = ScriptedRealtime([])
    await server.start()
    client = AsyncOpenAI(api_key="sk-test", base_url=server.base_url)
    link = RealtimeLink(
        _port("call-all"), BridgeConfig(), client, "audio/pcmu", lambda: [], deque()
    )
    try:
        session, _, error = await link.connect(resumed=False)
        assert session is not None, error
        conn = await server.connection()
        types: list[str] = []

        async def on_event(_session: Any, event: Any) -> str | None:
            types.append(event.type)
            return None

        async def on_delta(_session: Any, _delta: Any) -> None:
            return None

        reader = asyncio.create_task(link.read(session, on_delta, on_event))
        for frame in SCRIPT:
            if isinstance(frame, dict) and isinstance(frame["type"], str):
                await conn.ws.send(json.dumps(frame))
        await wait_until(lambda: len(types) == 6, what="every event but the audio delta")
        await conn.ws.close()
        await asyncio.wait_for(reader, 5)
    finally:
        await server.stop()
        await client.close()
    assert "response.output_audio_transcript.delta" in types
    assert "some.future.event" in types
    assert link.events_dropped == 0


LIVE_SCRIPT: list[Any] = [
    {"type": "session.output_audio.delta", "event_id": "e1", "delta": "f39/fw=="},
    {"type": "session.usage.updated", "event_id": "e2", "usage": {"total_tokens": 3}},
    {"type": "session.output_transcript.delta", "event_id": "e3", "delta": "Hello "},
    "[]",
    {"type": "session.output_audio.delta", "event_id": "e4", "delta": 7},  # no audio
    {"type": "session.input_transcript.delta", "event_id": "e5", "delta": "hi"},
    {"type": "some.future.event", "event_id": "e6"},
    {"type": "transport.dtmf.received", "event_id": "e7", "event": "5"},
    {"type": "session.closed", "event_id": "e8", "reason": "expired"},
]


async def test_a_live_read_parses_only_what_is_handled_and_plays_audio_unparsed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """GPT-Live's primary socket: audio deltas go to the leg without the SDK's model, the
    usage notice and an unknown type are dropped, the handled events arrive in order, and
    frames with no object or no audio are skipped with a warning."""

    async def handle(ws: ServerConnection) -> None:
        async for raw in ws:
            if json.loads(raw).get("type") == "session.start":
                break
        await ws.send(json.dumps({"type": "session.started", "event_id": "e0",
                                  "session": {"id": "sess_live"}}))  # fmt: skip
        for frame in LIVE_SCRIPT:
            await ws.send(frame if isinstance(frame, str) else json.dumps(frame))
        await ws.wait_closed()

    async with serve(handle, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        client = AsyncOpenAI(api_key="sk-test", base_url=f"http://127.0.0.1:{port}/v1")
        link = LiveLink(_port("call-live"), BridgeConfig(), client, "audio/pcmu", lambda: [])
        try:
            session, _, error = await link.connect(resumed=False)
            assert session is not None, error
            deltas: list[str] = []
            events: list[Any] = []

            async def on_delta(_session: Any, delta: Any) -> None:
                deltas.append(delta.delta)

            async def on_event(_session: Any, event: Any) -> str | None:
                events.append(event)
                return "closed" if event.type == "session.closed" else None

            caplog.set_level(logging.WARNING)
            reason = await asyncio.wait_for(
                link.read(session, on_delta, on_event, LIVE_EVENTS_READ), 5
            )
        finally:
            await client.close()
    assert reason == "closed"
    assert deltas == ["f39/fw=="]
    assert [e.type for e in events] == [
        "session.output_transcript.delta",
        "session.input_transcript.delta",
        "transport.dtmf.received",
        "session.closed",
    ]
    assert events[0].delta == "Hello "
    assert link.events_dropped == 2
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("telephony")]
    assert len(warnings) == 2
    assert "not a JSON object" in warnings[0] and "without audio" in warnings[1]
    assert not [r for r in caplog.records if r.exc_info]
