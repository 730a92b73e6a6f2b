"""TwilioLeg fed arbitrary frames, and the Realtime simulator fed arbitrary client events."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from telephony.call_events import CallEventKind, MemorySink
from telephony.errors import MalformedFrame
from telephony.legs.leg import AudioIn, DtmfIn, LegClosed, LegEvent
from telephony.legs.twilio.events import StartInfo, Stop, parse_inbound
from telephony.legs.twilio.leg import TwilioLeg
from telephony.sim.simulator import RealtimeSimulator
from tests.test_fuzz_parsers import _frameish, json_values

FAST = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class ScriptedSocket:
    """A TextWebSocket that replays frames, then reports the peer gone."""

    def __init__(self, frames: list[str]) -> None:
        self._frames = list(frames)
        self.sent: list[str] = []
        self.closed: tuple[int, str] | None = None

    async def receive_text(self) -> str:
        if not self._frames:
            raise ConnectionResetError("peer gone")
        return self._frames.pop(0)

    async def send_text(self, data: str) -> None:
        self.sent.append(data)

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


_START = StartInfo.model_validate({"streamSid": "MZ1", "callSid": "CA1"})


async def _drain(frames: list[str]) -> tuple[list[LegEvent], TwilioLeg, MemorySink]:
    sink = MemorySink()
    leg = TwilioLeg(ScriptedSocket(frames), _START, sink, "call-1", idle_timeout_s=5)
    seen: list[LegEvent] = []
    async with asyncio.timeout(10):
        async for event in leg.events():
            seen.append(event)
    await leg.close("done")
    return seen, leg, sink


def _frames() -> st.SearchStrategy[list[str]]:
    frame = (
        st.text(max_size=80)
        | json_values.map(json.dumps)
        | _frameish().map(json.dumps)
        | st.sampled_from(
            [
                '{"event":"media","media":{"payload":"//8=","timestamp":"20"}}',
                '{"event":"dtmf","dtmf":{"digit":"5"}}',
                '{"event":"mark","mark":{"name":"0:20:item_1"}}',
                '{"event":"connected"}',
                "[" * 5000,
                "x" * 70_000,
            ]
        )
    )
    return st.lists(frame, max_size=12)


@FAST
@given(_frames())
def test_twilio_leg_survives_any_frames_and_records_every_unusable_one(frames: list[str]) -> None:
    seen, leg, sink = asyncio.run(_drain(frames))
    # Exactly one LegClosed, last; everything before it is audio or digits.
    assert isinstance(seen[-1], LegClosed)
    assert all(isinstance(e, AudioIn | DtmfIn) for e in seen[:-1])
    malformed = [e for e in sink.events if e.kind is CallEventKind.MALFORMED_FRAME]
    assert leg.malformed_frames == len(malformed)
    # The oracle: every frame the parser refuses (before a stop ends the stream) is recorded.
    refused = 0
    for raw in frames:
        try:
            if isinstance(parse_inbound(raw), Stop):
                break
        except MalformedFrame:
            refused += 1
    assert leg.malformed_frames >= refused
    for event in malformed:
        assert len(event.data["excerpt"]) <= 120 and len(event.data["reason"]) <= 200


def test_twilio_leg_turns_valid_frames_into_events_amid_junk() -> None:
    frames = [
        "junk",
        '{"event":"media","media":{"payload":"//8=","timestamp":"20"}}',
        "[" * 5000,
        '{"event":"dtmf","dtmf":{"digit":"7"}}',
        '{"event":"media","media":{"payload":"//8=","timestamp":"1e3"}}',
        '{"event":"stop"}',
        '{"event":"dtmf","dtmf":{"digit":"9"}}',  # after stop: never read
    ]
    seen, leg, _ = asyncio.run(_drain(frames))
    assert seen == [AudioIn.of_bytes(b"\xff\xff", 20), DtmfIn("7"), LegClosed("stop")]
    assert leg.malformed_frames == 3


# The simulator (a product stand-in): a session answers errors and never dies of bad input.

_TYPES = [
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "output_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.truncate",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "response.create",
    "response.cancel",
]
_JUNK: list[Any] = [None, 0, -1, 10**20, 1.5, "", "x", "\x00", [], {}, {"type": "x"}, True]


def _junk_event(rng: random.Random) -> str | bytes:
    shape = rng.randrange(6)
    if shape == 0:
        return rng.randbytes(rng.randrange(1, 100))
    if shape == 1:
        return "".join(chr(rng.randrange(1, 0xD7FF)) for _ in range(rng.randrange(1, 40)))
    if shape == 2:
        return "[" * rng.randrange(100, 5000)
    event: dict[str, Any] = {"type": rng.choice(_TYPES)}
    for key in rng.sample(
        ["session", "audio", "item", "item_id", "audio_end_ms", "content_index", "event_id"],
        rng.randrange(0, 4),
    ):
        event[key] = rng.choice(_JUNK)
    if shape == 3 and event["type"] == "session.update":
        event["session"] = {
            "type": rng.choice(["realtime", "transcription", 5]),
            "audio": {
                "input": rng.choice(
                    [None, {}, {"format": rng.choice(_JUNK)}, {"turn_detection": rng.choice(_JUNK)}]
                ),
                "output": rng.choice([None, {}, {"voice": rng.choice(_JUNK)}]),
            },
            "instructions": rng.choice(_JUNK),
        }
    if shape == 4 and event["type"] == "input_audio_buffer.append":
        event["audio"] = rng.choice(["%%%", "AAA", base64.b64encode(b"\xff" * 160).decode(), "é"])
    return json.dumps(event)


async def _discard(ws: ClientConnection) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


async def test_simulator_session_survives_a_burst_of_junk_client_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rng = random.Random(20261130)
    caplog.set_level(logging.ERROR, logger="telephony.sim.simulator")
    async with RealtimeSimulator() as sim:
        async with connect(
            sim.ws_url + "?model=gpt-realtime",
            additional_headers={"Authorization": "Bearer sk-test"},
            open_timeout=5,
        ) as ws:
            created = json.loads(await asyncio.wait_for(ws.recv(), 5))
            assert created["type"] == "session.created"
            for _ in range(150):
                await ws.send(_junk_event(rng))
            # Still serving: a probe gets its own answer.
            await ws.send(json.dumps({"type": "input_audio_buffer.clear", "event_id": "probe"}))
            errors = 0
            async with asyncio.timeout(10):
                while True:
                    message = json.loads(await ws.recv())
                    errors += message["type"] == "error"
                    if message["type"] == "input_audio_buffer.cleared":
                        break
            assert not sim.sessions[0].closed.is_set()
            # Read what the junk's responses still stream, so the close handshake gets through.
            reader = asyncio.create_task(_discard(ws))
            await ws.close()
            await asyncio.wait_for(reader, 5)
            await asyncio.wait_for(sim.sessions[0].closed.wait(), 5)
    assert errors > 0
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert failures == [], [r.getMessage() for r in failures]
