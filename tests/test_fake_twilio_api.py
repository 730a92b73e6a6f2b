"""The fake Twilio REST API, driven by the real twilio Client through app.ops.twilio_rest."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from twilio.request_validator import RequestValidator
from twilio.rest import Client
from websockets.asyncio.server import ServerConnection, serve

from app.ops.twilio_rest import (
    TwilioRestError,
    close_twilio_client,
    end_call,
    make_twilio_client,
    rewrite_twilio_url,
    send_sms,
)
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi, InProcessServer
from tests.e2e_support import wait_until

SID = "AC" + "1" * 32
TOKEN = "api-test-token"
PUBLIC = "https://voice.example.com"


@pytest.fixture
async def api() -> AsyncIterator[FakeTwilioApi]:
    async with FakeTwilioApi(account_sid=SID, auth_token=TOKEN) as fake:
        yield fake


@pytest.fixture
async def client(api: FakeTwilioApi) -> AsyncIterator[Client]:
    c = make_twilio_client(SID, TOKEN, api.base_url)
    try:
        yield c
    finally:
        await close_twilio_client(c)


@dataclass
class CallbackReceiver:
    """Our side of Twilio's status callbacks: checks each signature against the public URL."""

    received: list[tuple[str, dict[str, str], bool]] = field(default_factory=list)

    def app(self) -> Starlette:
        validator = RequestValidator(TOKEN)

        async def callback(request: Request) -> Response:
            form = {k: str(v) for k, v in (await request.form()).items()}
            url = PUBLIC + request.url.path
            valid = validator.validate(url, form, request.headers.get("x-twilio-signature", ""))
            self.received.append((request.url.path, form, valid))
            return Response(status_code=204 if valid else 403)

        return Starlette(
            routes=[
                Route("/twilio/sms-status", callback, methods=["POST"]),
                Route("/twilio/status", callback, methods=["POST"]),
            ]
        )


@pytest.fixture
async def receiver(api: FakeTwilioApi) -> AsyncIterator[CallbackReceiver]:
    rx = CallbackReceiver()
    server = InProcessServer(rx.app())
    # Callbacks name the public URL (signed as such) and are delivered to the local server.
    api.callback_base_url = await server.start()
    try:
        yield rx
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def stream_sink() -> AsyncIterator[tuple[str, list[str | bytes]]]:
    """A media-stream endpoint that just records frames."""
    frames: list[str | bytes] = []

    async def handler(ws: ServerConnection) -> None:
        async for frame in ws:
            frames.append(frame)

    async with serve(handler, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}/twilio/media", frames


def test_twilio_urls_are_rewritten_to_the_base_url_and_others_left_alone() -> None:
    url = "https://api.twilio.com/2010-04-01/Accounts/AC1/Calls/CA1.json"
    assert rewrite_twilio_url(url, "http://127.0.0.1:9999") == (
        "http://127.0.0.1:9999/2010-04-01/Accounts/AC1/Calls/CA1.json"
    )
    assert rewrite_twilio_url(url, "http://proxy:1/twilio/") == (
        "http://proxy:1/twilio/2010-04-01/Accounts/AC1/Calls/CA1.json"
    )
    assert rewrite_twilio_url("https://messaging.twilio.com/v1/x?a=1", "http://h:1") == (
        "http://h:1/v1/x?a=1"
    )
    assert rewrite_twilio_url(url, None) == url
    assert rewrite_twilio_url("https://example.com/x", "http://h:1") == "https://example.com/x"
    assert rewrite_twilio_url("https://eviltwilio.com/x", "http://h:1") == (
        "https://eviltwilio.com/x"
    )


async def test_sms_through_the_real_client_is_queued_then_delivered_with_signed_callbacks(
    api: FakeTwilioApi, client: Client, receiver: CallbackReceiver
) -> None:
    callback = PUBLIC + "/twilio/sms-status"
    sid = await send_sms(
        client, "+15557654321", "Your table is booked.", callback, from_="+15550001111"
    )
    assert sid.startswith("SM") and len(sid) == 34
    request = api.requests_to("/Messages.json")[0]
    assert request.path == f"/2010-04-01/Accounts/{SID}/Messages.json"
    assert request.form == {
        "To": "+15557654321",
        "From": "+15550001111",
        "Body": "Your table is booked.",
        "StatusCallback": callback,
    }
    assert request.status == 201 and request.authorized
    assert "authorization" not in request.headers  # secrets are not recorded
    await api.wait_for(lambda a: len(a.callbacks) == 2, timeout=5)
    assert [(path, form["MessageStatus"], valid) for path, form, valid in receiver.received] == [
        ("/twilio/sms-status", "sent", True),
        ("/twilio/sms-status", "delivered", True),
    ]
    form = receiver.received[0][1]
    assert form["MessageSid"] == sid and form["SmsSid"] == sid
    assert form["AccountSid"] == SID and form["To"] == "+15557654321"
    assert all(c.url == callback and c.status_code == 204 for c in api.callbacks)
    message = await client.messages(sid).fetch_async()
    assert message.status == "delivered"
    assert message.body == "Your table is booked."
    assert api.messages[sid].statuses == ["queued", "sent", "delivered"]


async def test_sms_outcome_can_be_undelivered_with_an_error_code(
    api: FakeTwilioApi, client: Client, receiver: CallbackReceiver
) -> None:
    api.sms_outcomes_by_to["+15550009999"] = "undelivered"
    sid = await send_sms(client, "+15550009999", "hi", PUBLIC + "/twilio/sms-status", from_="+1555")
    await api.wait_for(lambda a: a.messages[sid].status == "undelivered", timeout=5)
    await api.wait_for(lambda a: len(a.callbacks) == 2, timeout=5)
    last = receiver.received[-1][1]
    assert last["MessageStatus"] == "undelivered" and last["ErrorCode"] == "30003"
    message = await client.messages(sid).fetch_async()
    assert message.error_code == 30003


async def test_failed_sms_goes_straight_to_failed(
    api: FakeTwilioApi, client: Client, receiver: CallbackReceiver
) -> None:
    api.sms_outcome = "failed"
    sid = await send_sms(client, "+15550001234", "hi", PUBLIC + "/twilio/sms-status", from_="+1555")
    await api.wait_for(lambda a: len(a.callbacks) == 1, timeout=5)
    assert api.messages[sid].statuses == ["queued", "failed"]
    assert receiver.received[0][1]["ErrorCode"] == "30008"


async def test_sms_without_a_status_callback_sends_no_callbacks(
    api: FakeTwilioApi, client: Client
) -> None:
    sid = await send_sms(client, "+15550001234", "hi", None, from_="+1555")
    await api.wait_for(lambda a: a.messages[sid].status == "delivered", timeout=5)
    assert "StatusCallback" not in api.requests_to("/Messages.json")[0].form
    assert api.callbacks == []


async def test_wrong_credentials_get_twilio_401_and_are_not_retryable(
    api: FakeTwilioApi,
) -> None:
    bad = make_twilio_client(SID, "not-the-token", api.base_url)
    try:
        with pytest.raises(TwilioRestError) as info:
            await send_sms(bad, "+15550001234", "hi", None, from_="+1555")
    finally:
        await close_twilio_client(bad)
    assert info.value.status == 401 and info.value.code == 20003
    assert not info.value.retryable
    assert api.requests[0].authorized is False
    assert api.messages == {}


async def test_missing_body_is_refused_like_twilio(api: FakeTwilioApi, client: Client) -> None:
    with pytest.raises(TwilioRestError) as info:
        await send_sms(client, "+15550001234", "", None, from_="+1555")
    assert info.value.status == 400 and info.value.code == 21602


async def test_injected_server_errors_are_retryable(api: FakeTwilioApi, client: Client) -> None:
    api.fail_next(1, status=503)
    with pytest.raises(TwilioRestError) as info:
        await send_sms(client, "+15550001234", "hi", None, from_="+1555")
    assert info.value.status == 503 and info.value.retryable
    # The next request goes through.
    assert (await send_sms(client, "+15550001234", "hi", None, from_="+1555")).startswith("SM")


async def test_end_call_hangs_up_the_attached_caller_who_sends_stop(
    api: FakeTwilioApi, client: Client
) -> None:
    async with stream_sink() as (url, frames), FakeTwilioCaller(auth_token=TOKEN) as caller:
        api.attach(caller)
        assert await caller.open_stream(url)
        assert await end_call(client, caller.call_sid) is True
        await caller.wait_closed(timeout=5)
        request = api.requests_to(f"/Calls/{caller.call_sid}.json")[0]
        assert request.form == {"Status": "completed"}
        assert caller.closed_by == "twilio-api"
        # The server side sees the stream stop, and nothing after it.
        await wait_until(lambda: bool(frames) and '"event":"stop"' in str(frames[-1]), 5)
        call = await client.calls(caller.call_sid).fetch_async()
        assert call.status == "completed"
        assert call.sid == caller.call_sid
        # Ending it again is not an error: it had already ended.
        assert await end_call(client, caller.call_sid) is False


async def test_twiml_update_ends_the_stream_and_is_recorded(
    api: FakeTwilioApi, client: Client
) -> None:
    twiml = "<Response><Say>Sorry, we have to hang up.</Say><Hangup/></Response>"
    async with stream_sink() as (url, _), FakeTwilioCaller(auth_token=TOKEN) as caller:
        api.attach(caller)
        await caller.open_stream(url)
        await client.calls(caller.call_sid).update_async(twiml=twiml)
        await caller.wait_closed(timeout=5)
    assert caller.twiml_updates == [twiml]
    assert api.calls[caller.call_sid].status == "completed"
    assert api.requests_to(f"/Calls/{caller.call_sid}.json")[0].form == {"Twiml": twiml}


async def test_unknown_call_is_a_404(api: FakeTwilioApi, client: Client) -> None:
    with pytest.raises(TwilioRestError) as info:
        await end_call(client, "CA" + "f" * 32)
    assert info.value.status == 404 and info.value.code == 20404


async def test_completing_a_call_posts_a_signed_call_status_callback(
    api: FakeTwilioApi, client: Client, receiver: CallbackReceiver
) -> None:
    api.call_status_callback_url = PUBLIC + "/twilio/status"
    call = api.add_call("CA" + "a" * 32, "+15557654321", "+15550000000")
    assert await end_call(client, call.sid)
    await api.wait_for(lambda a: len(a.callbacks) == 1, timeout=5)
    path, form, valid = receiver.received[0]
    assert (path, valid) == ("/twilio/status", True)
    assert form["CallSid"] == call.sid and form["CallStatus"] == "completed"


async def test_a_call_whose_caller_hung_up_is_completed_and_cannot_be_ended_again(
    api: FakeTwilioApi, client: Client
) -> None:
    async with stream_sink() as (url, _), FakeTwilioCaller(auth_token=TOKEN) as caller:
        api.attach(caller)
        await caller.open_stream(url)
        await caller.hangup()
        assert await end_call(client, caller.call_sid) is False
        assert (await client.calls(caller.call_sid).fetch_async()).status == "completed"
    assert caller.closed_by == "caller"
