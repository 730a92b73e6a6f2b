"""The media socket: stream tokens, malformed frames, capacity, over real sockets."""

from __future__ import annotations

import base64
import json

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.legs.twilio.stream_token import StreamTokens
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.scenario import Scenario
from tests.e2e_support import Stack, call_row, call_stack, event_rows

POLICY_VIOLATION = 1008

SCENARIO = Scenario.model_validate(
    {
        "name": "media",
        "greeting": {"text": "Hello.", "audio_ms": 600},
        "steps": [{"caller_transcript": "Hi there.", "reply": {"text": "Hi!", "audio_ms": 800}}],
        "fallback": {"text": "Yes?", "audio_ms": 600},
    }
)


async def _rejected(stack: Stack, caller: FakeTwilioCaller) -> list[dict[str, object]]:
    await caller.wait_closed(10)
    await stack.service.runtime.events.flush()
    row = await call_row(stack.engine, caller.call_sid)
    assert row is not None
    return [
        e["data"] for e in await event_rows(stack.engine, row["id"]) if e["kind"] == "call_rejected"
    ]


def _tamper(token: str) -> str:
    version, body, sig = token.split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    payload["exp"] += 3600
    forged = base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode()
    return f"{version}.{forged}.{sig}"


@pytest.mark.parametrize("case", ["missing", "bad_signature", "expired"])
async def test_stream_with_a_bad_token_is_closed_as_policy_violation(
    engine: AsyncEngine, case: str
) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        caller = stack.caller()
        outcome = await caller.dial(open_stream=False)
        row = await call_row(engine, caller.call_sid)
        assert row is not None
        token = outcome.parameters["token"]
        if case == "missing":
            token = ""
        elif case == "bad_signature":
            token = _tamper(token)
        else:
            secret = stack.service.settings.stream_secret()
            token = StreamTokens(secret, ttl_s=-1).issue(caller.call_sid, str(row["id"]))
        await caller.open_stream(outcome.stream_url, {**outcome.parameters, "token": token})
        rejections = await _rejected(stack, caller)
        assert stack.sim.sessions == []  # no Realtime session was opened for it
        row = await call_row(engine, caller.call_sid)
    assert caller.close_code == POLICY_VIOLATION
    # Counted, not written: an unauthenticated client must not write into a call's timeline.
    assert rejections == []
    assert stack.service.runtime.streams_rejected == 1
    assert row is not None and row["status"] == "ringing"  # the real stream may still come


async def test_token_of_another_call_is_rejected(engine: AsyncEngine) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        victim = stack.caller()
        stolen = await victim.dial(open_stream=False)
        intruder = stack.caller()
        await intruder.dial(open_stream=False)
        await intruder.open_stream(stolen.stream_url, stolen.parameters)
        rejections = await _rejected(stack, intruder)
        refused = stack.service.runtime.streams_rejected
    assert intruder.close_code == POLICY_VIOLATION
    assert rejections == [] and refused == 1


async def test_reused_stream_token_is_rejected_and_the_live_call_goes_on(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        caller = stack.caller()
        outcome = await caller.dial()
        await caller.wait_for(lambda c: c.heard_ms > 0, 10)
        replay = stack.caller(call_sid=caller.call_sid)
        await replay.open_stream(outcome.stream_url, outcome.parameters)
        rejections = await _rejected(stack, replay)
        refused = stack.service.runtime.streams_rejected
        assert not caller.closed
        assert stack.service.runtime.registry.live_count() == 1
        await caller.hangup()
    assert replay.close_code == POLICY_VIOLATION
    assert rejections == [] and refused == 1


async def test_malformed_frames_are_recorded_and_survived(engine: AsyncEngine) -> None:
    async with call_stack(engine, SCENARIO, max_ws_frame_bytes=4096) as stack:
        caller = stack.caller()
        await caller.dial()
        await caller.wait_for(lambda c: c.media_received_ms >= 600 and c.buffered_ms == 0, 10)
        heard = caller.heard_ms
        await caller.send_raw("this is not json")
        await caller.send_raw(json.dumps({"event": "teleport", "streamSid": caller.stream_sid}))
        await caller.send_raw(
            json.dumps(
                {
                    "event": "media",
                    "streamSid": caller.stream_sid,
                    "media": {"track": "inbound", "timestamp": "0", "payload": "%%%not base64"},
                }
            )
        )
        await caller.send_raw("x" * 5000)
        await caller.send_raw(b"\x00\x01binary")
        # The call goes on: the caller speaks and hears the reply.
        await caller.play_speech(800)
        await caller.wait_for(lambda c: c.heard_ms >= heard + 800 - 20, 15)
        assert not caller.closed
        await caller.hangup()
        events = await stack.events(caller)
    malformed = [e["data"] for e in events if e["kind"] == "malformed_frame"]
    assert len(malformed) == 5, malformed
    reasons = " | ".join(str(m["reason"]) for m in malformed)
    assert "not JSON" in reasons and "teleport" in reasons and "base64" in reasons
    assert "oversized" in reasons and "binary" in reasons


async def test_call_beyond_capacity_hears_busy_while_a_call_is_live(engine: AsyncEngine) -> None:
    async with call_stack(engine, SCENARIO, max_live_calls=1) as stack:
        first = stack.caller()
        await first.dial()
        await first.wait_for(lambda c: c.heard_ms > 0, 10)
        second = stack.caller()
        outcome = await second.dial()
        busy_row = await call_row(engine, second.call_sid)
        await first.hangup()
    assert outcome.kind == "hangup"
    assert outcome.says and "busy" in outcome.says[0]
    assert second.stream_started_at is None
    assert busy_row is not None and busy_row["status"] == "busy"
