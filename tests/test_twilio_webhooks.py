"""The Twilio webhooks over HTTP: signatures, the call row, TwiML, capacity, status callbacks."""

from __future__ import annotations

import asyncio
import time
import uuid
import xml.etree.ElementTree as ET

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.legs.twilio.stream_token import StreamTokens
from tests.e2e_support import (
    AUTH_TOKEN,
    CONSOLE,
    call_row,
    event_kinds,
    event_rows,
    post_signed,
    running_service,
    wait_until,
)
from tests.metrics_support import samples as metric_samples


def _voice_params(call_sid: str) -> dict[str, str]:
    return {
        "CallSid": call_sid,
        "AccountSid": "AC" + "0" * 32,
        "From": "+15551230000",
        "To": "+15550000000",
        "CallStatus": "ringing",
        "Direction": "inbound",
    }


def _stream(twiml: str) -> tuple[str, dict[str, str]]:
    root = ET.fromstring(twiml)
    stream = root.find("./Connect/Stream")
    assert stream is not None, twiml
    params = {p.get("name", ""): p.get("value", "") for p in stream.iter("Parameter")}
    return stream.get("url", ""), params


async def test_voice_webhook_with_bad_signature_is_forbidden(engine: AsyncEngine) -> None:
    async with running_service(engine) as service:
        response = await post_signed(
            service, "/twilio/voice", _voice_params("CAbad"), signature="not-a-signature"
        )
        missing = await post_signed(service, "/twilio/voice", _voice_params("CAbad"), signature="")
    assert response.status_code == 403
    assert missing.status_code == 403
    assert await call_row(engine, "CAbad") is None


async def test_voice_webhook_signed_for_another_url_is_forbidden(engine: AsyncEngine) -> None:
    from twilio.request_validator import RequestValidator

    params = _voice_params("CAother")
    elsewhere = RequestValidator(AUTH_TOKEN).compute_signature("https://evil.example/x", params)
    async with running_service(engine) as service:
        response = await post_signed(service, "/twilio/voice", params, signature=elsewhere)
    assert response.status_code == 403


async def test_voice_webhook_creates_the_call_and_connects_a_stream_with_a_token(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine) as service:
        response = await post_signed(service, "/twilio/voice", _voice_params("CA1"))
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/xml")
        url, params = _stream(response.text)
        row = await call_row(engine, "CA1")
        assert row is not None
        await service.runtime.events.flush()
        kinds = await event_kinds(engine, row["id"])
        tokens = StreamTokens(service.settings.stream_secret(), 60)
        claims = tokens.verify(params["token"], "CA1")
    assert url == service.settings.public_ws_base() + "/twilio/media"
    assert params["call_id"] == str(row["id"])
    assert claims.call_id == str(row["id"])
    assert row["status"] == "ringing"
    assert (row["from_number"], row["to_number"]) == ("+15551230000", "+15550000000")
    assert kinds == ["call_started"]


async def test_retried_voice_webhook_does_not_create_a_second_call(engine: AsyncEngine) -> None:
    async with running_service(engine, max_live_calls=1) as service:
        first = await post_signed(service, "/twilio/voice", _voice_params("CAdup"))
        second = await post_signed(service, "/twilio/voice", _voice_params("CAdup"))
        await service.runtime.events.flush()
        row = await call_row(engine, "CAdup")
        assert row is not None
        kinds = await event_kinds(engine, row["id"])
    # Same call, same slot: the retry is answered with a stream again, not with "busy".
    assert _stream(first.text)[1]["call_id"] == _stream(second.text)[1]["call_id"]
    assert kinds == ["call_started"]


async def test_oversized_webhook_body_is_rejected(engine: AsyncEngine) -> None:
    async with running_service(engine) as service:
        body = b"CallSid=CAbig&Junk=" + b"x" * (70 * 1024)
        response = await post_signed(service, "/twilio/voice", {}, content=body, signature="x")
    assert response.status_code == 413
    assert await call_row(engine, "CAbig") is None


async def test_call_beyond_capacity_hears_busy_and_is_recorded(engine: AsyncEngine) -> None:
    async with running_service(engine, max_live_calls=1) as service:
        await post_signed(service, "/twilio/voice", _voice_params("CAfirst"))
        busy = await post_signed(service, "/twilio/voice", _voice_params("CAsecond"))
        await service.runtime.events.flush()
        row = await call_row(engine, "CAsecond")
        assert row is not None
        kinds = await event_kinds(engine, row["id"])
    root = ET.fromstring(busy.text)
    assert [child.tag for child in root] == ["Say", "Hangup"]
    assert root.find("Connect") is None
    assert row["status"] == "busy"
    assert kinds == ["call_rejected"]


async def burn(stop: asyncio.Event, block_s: float) -> None:
    """More work than the event loop has time for: it runs its timers late nearly all the
    time (blocked `block_s`, then free for 50 ms, where the requests get through)."""
    while not stop.is_set():
        time.sleep(block_s)  # noqa: ASYNC251 - the point: a loop that cannot keep up
        await asyncio.sleep(0.05)


async def test_a_new_call_hears_busy_while_the_event_loop_cannot_keep_up(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine, busy_loop_lag_ms=50) as service:
        registry = service.runtime.registry
        assert registry.overloaded() is None
        one_stall = await post_signed(service, "/twilio/voice", _voice_params("CAbefore"))
        stop = asyncio.Event()
        burner = asyncio.create_task(burn(stop, 0.3))
        try:
            await wait_until(lambda: registry.overloaded() is not None, 15, "overloaded")
            busy = await post_signed(service, "/twilio/voice", _voice_params("CAheavy"))
            # A call already answered keeps its slot (Twilio retrying its webhook).
            again = await post_signed(service, "/twilio/voice", _voice_params("CAbefore"))
        finally:
            stop.set()
            await burner
        await wait_until(lambda: registry.overloaded() is None, 15, "keeping up again")
        after = await post_signed(service, "/twilio/voice", _voice_params("CAafter"))
        await service.runtime.events.flush()
        row = await call_row(engine, "CAheavy")
        assert row is not None
        events = await event_rows(engine, row["id"])
        async with httpx.AsyncClient() as http:
            exposition = (await http.get(service.url + "/metrics")).text
    root = ET.fromstring(busy.text)
    assert [child.tag for child in root] == ["Say", "Hangup"] and row["status"] == "busy"
    assert [e["kind"] for e in events] == ["call_rejected"]
    assert events[0]["data"]["reason"] == "overloaded"
    assert events[0]["data"]["loop_lag_ms"] >= 50
    assert _stream(one_stall.text)[1]["call_id"] == _stream(again.text)[1]["call_id"]
    assert _stream(after.text)[0]  # keeping up again: the next call is answered
    found = metric_samples(exposition)
    assert found["voice_agent_calls_rejected_overloaded_total"] == 1
    assert found["voice_agent_calls_rejected_busy_total"] == 0


async def test_status_callback_with_bad_signature_is_forbidden(engine: AsyncEngine) -> None:
    async with running_service(engine) as service:
        await post_signed(service, "/twilio/voice", _voice_params("CAst"))
        response = await post_signed(
            service,
            "/twilio/status",
            {"CallSid": "CAst", "CallStatus": "completed"},
            signature="forged",
        )
        row = await call_row(engine, "CAst")
    assert response.status_code == 403
    assert row is not None and row["status"] == "ringing"


@pytest.mark.parametrize(
    ("twilio_status", "recorded"), [("completed", "completed"), ("no-answer", "no_answer")]
)
async def test_status_callback_ends_a_call_once(
    engine: AsyncEngine, twilio_status: str, recorded: str
) -> None:
    async with running_service(engine) as service:
        await post_signed(service, "/twilio/voice", _voice_params("CAend"))
        params = {"CallSid": "CAend", "CallStatus": twilio_status}
        first = await post_signed(service, "/twilio/status", params)
        again = await post_signed(service, "/twilio/status", params)
        await service.runtime.events.flush()
        row = await call_row(engine, "CAend")
        assert row is not None
        kinds = await event_kinds(engine, row["id"])
        # The slot held for the stream is free again.
        await wait_until(lambda: service.runtime.registry.load() == 0, 2, "slot released")
    assert (first.status_code, again.status_code) == (204, 204)
    assert row["status"] == recorded
    assert row["ended_at"] is not None
    assert kinds == ["call_started", "call_ended"]


async def test_status_callback_for_an_unfinished_status_changes_nothing(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine) as service:
        await post_signed(service, "/twilio/voice", _voice_params("CAring"))
        response = await post_signed(
            service, "/twilio/status", {"CallSid": "CAring", "CallStatus": "in-progress"}
        )
        row = await call_row(engine, "CAring")
    assert response.status_code == 204
    assert row is not None and row["status"] == "ringing"


async def test_health_readiness_and_metrics_answer(engine: AsyncEngine) -> None:
    async with running_service(engine, max_live_calls=1) as service:
        await post_signed(service, "/twilio/voice", _voice_params("CAm1"))
        await post_signed(service, "/twilio/voice", _voice_params("CAm2"))  # busy
        async with httpx.AsyncClient(base_url=service.url) as http:
            health = await http.get("/healthz")
            ready = await http.get("/readyz")
            metrics = (await http.get("/metrics")).text
    assert health.json() == {"status": "ok"}
    assert ready.status_code == 200
    samples = metric_samples(metrics)
    assert samples["voice_agent_calls_total"] == 1
    assert samples["voice_agent_calls_rejected_busy_total"] == 1
    assert samples["voice_agent_live_calls"] == 0
    assert {
        "voice_agent_barge_ins_total",
        "voice_agent_event_queue_depth",
        "voice_agent_results_heard_total",
        "voice_agent_sms_sends_total",
    } <= samples.keys()
    assert "voice_agent_events_dropped_total" in samples


async def test_console_api_needs_the_console_password(engine: AsyncEngine) -> None:
    async with running_service(engine) as service:
        async with httpx.AsyncClient(base_url=service.url) as http:
            anonymous = await http.get("/api/calls")
            wrong = await http.get("/api/calls", auth=("admin", "guess"))
            unknown = await http.get(f"/api/calls/{uuid.uuid4()}/timeline", auth=CONSOLE)
            listing = await http.get("/api/calls", auth=CONSOLE)
    assert (anonymous.status_code, wrong.status_code) == (401, 401)
    assert unknown.status_code == 404
    assert listing.json()["calls"] == []


async def test_a_draining_service_answers_busy_fails_readiness_and_keeps_answered_calls(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine) as service:
        answered = await post_signed(service, "/twilio/voice", _voice_params("CAanswered"))
        service.runtime.registry.stop_accepting()  # what the first SIGTERM does
        late = await post_signed(service, "/twilio/voice", _voice_params("CAlate"))
        # Twilio retries the webhook of a call answered before the drain: it keeps its slot.
        retried = await post_signed(service, "/twilio/voice", _voice_params("CAanswered"))
        async with httpx.AsyncClient(base_url=service.url) as http:
            ready = await http.get("/readyz")
            metrics = (await http.get("/metrics")).text
        await service.runtime.events.flush()
        row = await call_row(engine, "CAlate")
        assert row is not None
        rejected = await event_rows(engine, row["id"])
    _stream(answered.text)
    _stream(retried.text)
    assert "<Hangup" in late.text and "busy" in late.text
    assert row["status"] == "busy"
    assert [(e["kind"], e["data"]) for e in rejected] == [("call_rejected", {"reason": "draining"})]
    assert ready.status_code == 503 and "draining" in ready.text
    assert metric_samples(metrics)["voice_agent_draining"] == 1
    assert metric_samples(metrics)["voice_agent_calls_rejected_draining_total"] == 1


async def test_voice_webhook_with_fields_the_columns_refuse_is_a_bad_request(
    engine: AsyncEngine,
) -> None:
    """The call's insert runs on the driver connection (tools.driver_sql); the database's
    refusal still reaches the webhook as SQLAlchemy's DataError: a bad request, no row."""
    async with running_service(engine) as service:
        long_from = _voice_params("CAlong") | {"From": "+1" + "5" * 200}
        refused = await post_signed(service, "/twilio/voice", long_from)
        after = await post_signed(service, "/twilio/voice", _voice_params("CAafter"))
    assert refused.status_code == 400 and await call_row(engine, "CAlong") is None
    assert after.status_code == 200
