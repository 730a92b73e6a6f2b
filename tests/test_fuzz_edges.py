"""Adversarial input over real sockets: the media stream and the Twilio webhooks.

Every case must end in a clean rejection (4xx, a policy-violation close, a recorded
MALFORMED_FRAME) while the service and any live call carry on; never a 500, a hang or lost data.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from twilio.request_validator import RequestValidator
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from app.http import signatures
from app.legs.twilio import routes as routes_twilio
from telephony.sim.fake_caller import http_to_ws
from telephony.sim.scenario import Scenario
from tests.e2e_support import (
    AUTH_TOKEN,
    Stack,
    call_row,
    call_stack,
    post_signed,
    running_service,
    wait_until,
)

POLICY_VIOLATION = 1008
FRAME_LIMIT = 4096

SCENARIO = Scenario.model_validate(
    {
        "name": "fuzz",
        "greeting": {"text": "Hello.", "audio_ms": 400},
        "steps": [{"caller_transcript": "Hi there.", "reply": {"text": "Hi!", "audio_ms": 600}}],
        "fallback": {"text": "Yes?", "audio_ms": 400},
    }
)


def _media(stream_sid: str, payload: str, timestamp: Any = "0", track: str = "inbound") -> str:
    frame = {"event": "media", "streamSid": stream_sid}
    frame["media"] = {"track": track, "chunk": "1", "timestamp": timestamp, "payload": payload}  # type: ignore[assignment]
    return json.dumps(frame)


def garbage_frame(rng: random.Random, stream_sid: str) -> str | bytes:
    """One frame no media stream sends; each must be recorded as exactly one MALFORMED_FRAME."""
    kind = rng.randrange(10)
    if kind == 0:
        return "".join(chr(rng.randrange(1, 0xD7FF)) for _ in range(rng.randrange(1, 60)))
    if kind == 1:
        return json.dumps({"event": rng.choice(["teleport", "", "clear", "MEDIA", None, 7])})
    if kind == 2:
        return _media(stream_sid, rng.choice(["%%%", "é", "A", "AAA", "\x00"]))
    if kind == 3:
        return _media(stream_sid, "AAAA", timestamp=rng.choice(["soon", "1.5", "", "9" * 5000]))
    if kind == 4:
        name = rng.choice(["nope", "1:2", "x:y:z", "", "🙂"])
        return json.dumps({"event": "mark", "streamSid": stream_sid, "mark": {"name": name}})
    if kind == 5:
        return "[" * rng.randrange(1000, 3000)
    if kind == 6:
        return rng.randbytes(rng.randrange(1, 200))
    if kind == 7:
        return "x" * (FRAME_LIMIT + rng.randrange(1, 2000))
    if kind == 8:
        # A NUL inside a frame must survive the trip into the call's JSONB timeline.
        return "not json \x00 at all"
    return json.dumps(
        {"event": "media", "streamSid": stream_sid, "media": rng.choice([None, [], 3, {"x": 1}])}
    )


def _malformed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in events if e["kind"] == "malformed_frame"]


async def test_a_burst_of_random_garbage_is_recorded_and_the_call_goes_on_and_ends_cleanly(
    engine: AsyncEngine,
) -> None:
    rng = random.Random(20261130)
    async with call_stack(engine, SCENARIO, max_ws_frame_bytes=FRAME_LIMIT) as stack:
        caller = stack.caller()
        await caller.dial()
        await caller.wait_for(lambda c: c.media_received_ms >= 400 and c.buffered_ms == 0, 10)
        heard = caller.heard_ms
        sent = 0
        for _ in range(60):
            await caller.send_raw(garbage_frame(rng, caller.stream_sid))
            sent += 1
            if rng.random() < 0.5:  # valid media interleaved with the junk
                await caller.send_raw(
                    _media(caller.stream_sid, base64.b64encode(b"\xff" * 160).decode())
                )
        # The call goes on: the caller speaks and hears the reply.
        await caller.play_speech(800)
        await caller.wait_for(lambda c: c.heard_ms >= heard + 600 - 20, 15)
        assert not caller.closed
        await caller.hangup()
        events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)
    malformed = _malformed(events)
    assert len(malformed) == sent, [m["reason"] for m in malformed]
    kinds = [e["kind"] for e in events]
    assert kinds.count("call_ended") == 1 and kinds[-1] == "call_ended"
    assert row is not None and row["status"] == "completed"


async def test_frames_at_and_over_the_size_limit_and_binary_frames(engine: AsyncEngine) -> None:
    async with call_stack(engine, SCENARIO, max_ws_frame_bytes=FRAME_LIMIT) as stack:
        caller = stack.caller()
        await caller.dial()
        await caller.wait_for(lambda c: c.media_received_ms >= 400, 10)
        valid = _media(caller.stream_sid, base64.b64encode(b"\xff" * 800).decode())
        at_limit = valid + " " * (FRAME_LIMIT - len(valid))  # JSON allows trailing blanks
        assert len(at_limit.encode()) == FRAME_LIMIT
        await caller.send_raw(at_limit)
        await caller.send_raw(at_limit + " ")
        await caller.send_raw(json.dumps({"event": "note", "text": "é" * (FRAME_LIMIT // 2)}))
        await caller.send_raw(valid.encode())
        await caller.send_raw(b"")
        await caller.hangup()
        events = await stack.events(caller)
    malformed = _malformed(events)
    reasons = [m["reason"] for m in malformed]
    assert reasons == ["oversized frame", "oversized frame", "binary frame", "binary frame"]
    assert malformed[0]["length"] == FRAME_LIMIT + 1


async def test_second_start_mid_stream_and_stop_twice_end_the_call_once(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        caller = stack.caller()
        outcome = await caller.dial()
        await caller.wait_for(lambda c: c.media_received_ms >= 400, 10)
        second_start = {
            "event": "start",
            "streamSid": "MZother",
            "start": {
                "streamSid": "MZother",
                "callSid": caller.call_sid,
                "customParameters": outcome.parameters,
            },
        }
        await caller.send_raw(json.dumps(second_start))
        await caller.send_dtmf("5")  # still served after the stray start
        stop = json.dumps({"event": "stop", "streamSid": caller.stream_sid, "stop": {}})
        await caller.send_raw(stop)
        try:
            await caller.send_raw(stop)
        except ConnectionClosed:
            pass  # the server may already have closed: also fine
        await caller.wait_closed(10)
        events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)
    kinds = [e["kind"] for e in events]
    assert "dtmf" in kinds
    assert kinds.count("call_ended") == 1
    assert kinds.count("stream_started") == 1
    assert row is not None and row["status"] == "completed"
    assert row["stream_sid"] == caller.stream_sid


async def _raw_stream(stack: Stack, frames: list[str | bytes]) -> tuple[int | None, float]:
    """Open /twilio/media, send `frames`, return (close code, seconds until closed)."""
    url = http_to_ws(stack.service.url) + "/twilio/media"
    loop = asyncio.get_running_loop()
    async with connect(url, open_timeout=5, close_timeout=5) as ws:
        started = loop.time()
        for frame in frames:
            try:
                await ws.send(frame)
            except ConnectionClosed:
                break
        try:
            async with asyncio.timeout(15):
                async for _ in ws:
                    pass
        except ConnectionClosed:
            pass
        return ws.close_code, loop.time() - started


def _start(call_sid: str, custom: Any, **start_over: Any) -> str:
    start: dict[str, Any] = {"streamSid": "MZfuzz", "callSid": call_sid, **start_over}
    if custom is not ...:
        start["customParameters"] = custom
    return json.dumps({"event": "start", "streamSid": "MZfuzz", "start": start})


@pytest.mark.parametrize(
    "custom",
    [
        ...,
        {},
        [],
        None,
        "token",
        {"token": 7},
        {"token": ""},
        {"token": "v1.garbage.sig"},
        {"token": "v1.é.\u00ff"},
        {"token": "v1." + "A" * 3000 + ".x"},
        {"token": "\x00"},
    ],
)
async def test_start_with_missing_or_garbage_custom_parameters_is_a_policy_violation(
    engine: AsyncEngine, custom: Any
) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        caller = stack.caller()
        await caller.dial(open_stream=False)
        code, _ = await _raw_stream(
            stack, [json.dumps({"event": "connected"}), _start(caller.call_sid, custom)]
        )
        await stack.service.runtime.events.flush()
        row = await call_row(engine, caller.call_sid)
        assert stack.sim.sessions == []
    assert code == POLICY_VIOLATION
    assert row is not None and row["status"] == "ringing"  # the genuine stream may still come


@pytest.mark.parametrize(
    "frames",
    [
        [_media("MZ", "AAAA")],
        [json.dumps({"event": "connected"}), json.dumps({"event": "stop"})],
        [json.dumps({"event": "connected"})] * 6,
        ["{"] * 3,
        [b"\x00binary", _start("CAnone", {})],
        [_start("CA\u00e9\ud7ff", {"token": "v1.a.b"})],
        [_start("CAnone", {"token": "x"}, mediaFormat=[1, 2])],
        [_start("CA\u0000", {"token": "v1.a.b"})],
        [_start("CA" + "9" * 500, {"token": "v1.a.b"})],
    ],
)
async def test_media_before_start_and_bad_openings_are_closed_as_policy_violation(
    engine: AsyncEngine, frames: list[str | bytes]
) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        code, _ = await _raw_stream(stack, frames)
        assert stack.service.runtime.registry.live_count() == 0
    assert code == POLICY_VIOLATION


async def test_a_client_that_sends_nothing_is_closed_within_the_start_timeout_and_leaks_no_task(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routes_twilio, "START_TIMEOUT_S", 0.5)
    async with call_stack(engine, SCENARIO) as stack:
        baseline = len(asyncio.all_tasks())
        code, took = await _raw_stream(stack, [])
        await wait_until(lambda: len(asyncio.all_tasks()) <= baseline, 5, "connection tasks gone")
    assert code == POLICY_VIOLATION
    assert took < 5


# Webhooks.

_VOICE_PARAMS = {"CallSid": "CAfuzzvoice", "From": "+15550001", "To": "+15559999"}


_GARBAGE_BODIES = [
    (b"", "application/x-www-form-urlencoded"),
    (b"\xff\xfe\x00\x80garbage=\xff", "application/x-www-form-urlencoded"),
    (b'{"CallSid": "CA1"}', "application/json"),
    (b"CallSid=CA1&CallSid=CA2&&&===&%zz=%", "application/x-www-form-urlencoded"),
    (b"<xml/>", "text/xml"),
    (b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--", "multipart/form-data"),
    (b"a=" + b"%00" * 1000, "application/x-www-form-urlencoded"),
    (b"CallSid=" + b"%ED%A0%80" * 10 + b"&CallStatus=completed", "text/plain; charset=utf-7"),
]
_BAD_SIGNATURES: list[bytes | None] = [
    None,
    b"",
    b"bm90IGEgc2lnbmF0dXJl",
    b"\xe9\xff",
    b"x" * 10_000,
]


@pytest.mark.parametrize("path", ["/twilio/voice", "/twilio/status"])
async def test_garbage_webhooks_are_rejected_with_a_4xx(engine: AsyncEngine, path: str) -> None:
    rng = random.Random(f"webhooks-{path}")
    bodies = [*_GARBAGE_BODIES]
    bodies += [(rng.randbytes(rng.randrange(1, 2000)), "application/x-www-form-urlencoded")] * 5
    statuses: list[tuple[bytes, bytes | None, int]] = []
    async with running_service(engine) as service, httpx.AsyncClient(timeout=10) as client:
        for body, content_type in bodies:
            for signature in _BAD_SIGNATURES:
                headers = {b"Content-Type": content_type.encode()}
                if signature is not None:
                    headers[b"X-Twilio-Signature"] = signature
                response = await client.post(service.url + path, content=body, headers=headers)
                statuses.append((body[:20], signature and signature[:10], response.status_code))
        assert await call_row(engine, "CA1") is None
    assert all(400 <= code < 500 for *_, code in statuses), [s for s in statuses if s[2] >= 500]


async def test_duplicate_signature_headers_and_huge_bodies_are_rejected(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine) as service:
        good = await post_signed(service, "/twilio/voice", _VOICE_PARAMS)
        assert good.status_code == 200  # the oracle: a correct signature passes
        public = service.settings.public_base_url + "/twilio/voice"
        sig = RequestValidator(AUTH_TOKEN).compute_signature(public, _VOICE_PARAMS)
        body = "&".join(f"{k}={v}" for k, v in _VOICE_PARAMS.items()).replace("+", "%2B").encode()
        async with httpx.AsyncClient(timeout=10) as client:
            dup = await client.post(
                service.url + "/twilio/voice",
                content=body,
                headers=[
                    ("Content-Type", "application/x-www-form-urlencoded"),
                    ("X-Twilio-Signature", "forged"),
                    ("X-Twilio-Signature", sig),
                ],
            )
            huge = await client.post(
                service.url + "/twilio/voice",
                content=b"a=" + b"b" * (signatures.MAX_WEBHOOK_BYTES + 1),
                headers={
                    "Content-Type": "application/x-www-form-urlencoded",
                    "X-Twilio-Signature": sig,
                },
            )

            async def chunks() -> Any:
                for _ in range(200):
                    yield b"x" * 1024

            streamed = await client.post(
                service.url + "/twilio/status",
                content=chunks(),
                headers={
                    "Content-Type": "application/x-www-form-urlencoded",
                    "X-Twilio-Signature": sig,
                },
            )
        lying = [
            await _raw_http_status(service.url, "/twilio/status", length, b"CallSid=CA1")
            for length in ("-5", "abc", "99999999999999999999999")
        ]
    assert dup.status_code == 403
    assert huge.status_code == 413
    assert streamed.status_code == 413
    assert all(status is None or 400 <= status < 500 for status in lying), lying


async def _raw_http_status(base: str, path: str, length: str, body: bytes) -> int | None:
    """POST with a hand-written (lying) Content-Length; the status, or None if refused."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {length}\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\nX-Twilio-Signature: x\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        async with asyncio.timeout(10):
            line = await reader.readline()
    finally:
        writer.close()
    return int(line.split()[1]) if line.startswith(b"HTTP/1.1") else None


async def test_signed_webhooks_with_garbage_fields_are_answered_without_a_500(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine) as service:
        cases = [
            ("/twilio/voice", {"From": "+1"}),  # no CallSid
            ("/twilio/voice", {"CallSid": "CA" + "9" * 300, "From": "x" * 1000}),
            ("/twilio/voice", {"CallSid": "CA\u00e9\U0001f642", "From": "\u0000"}),
            ("/twilio/status", {"CallSid": "CAunknown", "CallStatus": "completed"}),
            ("/twilio/status", {"CallSid": "CAunknown", "CallStatus": "\u00e9" * 50}),
            ("/twilio/status", {"CallStatus": "completed"}),
            ("/twilio/status", {"CallSid": "CA\u0000", "CallStatus": "completed"}),
            ("/twilio/status", {"CallSid": "CA" + "9" * 300, "CallStatus": "completed"}),
        ]
        statuses = [
            (path, (await post_signed(service, path, params)).status_code) for path, params in cases
        ]
    assert all(code < 500 for _, code in statuses), statuses


async def test_a_frame_over_the_transport_limit_ends_the_call_cleanly(engine: AsyncEngine) -> None:
    async with call_stack(engine, SCENARIO, max_ws_frame_bytes=FRAME_LIMIT) as stack:
        caller = stack.caller()
        await caller.dial()
        await caller.wait_for(lambda c: c.media_received_ms >= 400, 10)
        limit = max(1024 * 1024, 4 * FRAME_LIMIT)
        try:
            await caller.send_raw("x" * (limit + 1))
        except ConnectionClosed:
            pass
        await caller.wait_closed(10)
        events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)
    assert caller.close_code == 1009  # message too big: refused by the transport
    kinds = [e["kind"] for e in events]
    assert kinds.count("call_ended") == 1
    assert row is not None and row["status"] == "completed"


async def test_a_start_whose_fields_no_column_can_hold_is_refused_cleanly(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        caller = stack.caller()
        outcome = await caller.dial(open_stream=False)
        start = _start(caller.call_sid, outcome.parameters)
        long_sid = start.replace('"MZfuzz"', json.dumps("MZ" + "9" * 200))
        code, _ = await _raw_stream(stack, [long_sid])
        assert stack.service.runtime.registry.live_count() == 0
        # The genuine stream (well-formed streamSid) is still admitted afterwards.
        await caller.open_stream(outcome.stream_url, outcome.parameters)
        await caller.wait_for(lambda c: c.media_received_ms >= 400, 10)
        await caller.hangup()
        events = await stack.events(caller)
    assert code == POLICY_VIOLATION
    assert [e["kind"] for e in events].count("stream_started") == 1
