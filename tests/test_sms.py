"""SMS follow-ups over real sockets: the twilio library against the fake Twilio API, status
callbacks into the service's signed webhook, real Postgres. Never sent twice; reconciled by
asking Twilio when the answer is lost; statuses only move forward; STOP is honoured."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.ops.delivery import ResendRefused, resend_sms
from app.ops.delivery_jobs import DeliveryDriver
from app.ops.sms import SmsChannel
from telephony.sim.fake_twilio_api import FakeTwilioApi
from tests.delivery_support import (
    CALLER,
    OUR_NUMBER,
    booked,
    delivery_of,
    make_call,
    sms_channel,
    sms_of,
    sms_statuses,
    trail,
)
from tests.e2e_support import CONSOLE, Service, post_signed, running_service, wait_until
from tools import deliveries
from tools.delivery_states import DeliveryState, SmsStatus
from tools.restaurant.catalog import restaurant_catalog

D = DeliveryState
M = SmsStatus


@pytest.fixture
async def api() -> AsyncIterator[FakeTwilioApi]:
    async with FakeTwilioApi(sms_step_delay_s=0.01) as fake:
        yield fake
        fake.release_answers()
        fake.release_messages()


@pytest.fixture
async def service(engine: AsyncEngine, api: FakeTwilioApi) -> AsyncIterator[Service]:
    async with running_service(engine, twilio_api_base_url=api.base_url) as svc:
        # Twilio signs the public URL and delivers to wherever it reaches us.
        api.callback_base_url = svc.url
        yield svc


async def _texted_delivery(
    engine: AsyncEngine, sms: SmsChannel, caller: str = CALLER
) -> tuple[uuid.UUID, uuid.UUID]:
    """An outcome whose call has ended, handed to SMS by the delivery job; (op, message)."""
    call_id = await make_call(engine, ended=True)
    op_id = await booked(engine, call_id, caller=caller)
    driver = DeliveryDriver(engine, restaurant_catalog(), sms)
    async with engine.begin() as conn:
        delivery = await deliveries.get(conn, (await delivery_of(engine, op_id)).id)
        assert delivery is not None
    # Decide without sending: what a crash right after persisting the SMS would leave.
    from app.ops.delivery import evaluate, record_decision
    from tools import ledger
    from tools.relevance import CallState

    async with engine.begin() as conn:
        op = await ledger.get_operation(conn, op_id)
        assert op is not None
        found = await evaluate(conn, driver.registry, delivery, op, CallState.ENDED)
        await record_decision(conn, delivery, found.gate, "test")
        message = await sms.start(conn, delivery, op, reason=found.gate.reason)
        assert message is not None
    return op_id, message.id


async def _message(engine: AsyncEngine, message_id: uuid.UUID) -> deliveries.SmsRecord:
    async with engine.connect() as conn:
        message = await deliveries.get_sms(conn, message_id)
    assert message is not None
    return message


def _creates(api: FakeTwilioApi) -> list[Any]:
    return api.requests_to("/Messages.json", "POST")


async def test_a_lost_answer_after_twilio_accepted_is_reconciled_by_listing_not_resent(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    api.lose_message_answers(1)  # accepted, and the answer never comes
    api.drop_callbacks = True  # nor does any status callback
    api.hold_queued = True  # and it stays queued: no date_sent yet
    sms = sms_channel(engine, api, timeout=1.0, send_timeout_s=1.0)
    try:
        op_id, message_id = await _texted_delivery(engine, sms)
        after = await sms.drive(message_id)
        assert after is not None and after.status is M.QUEUED
        # Later, with no callback, its status is fetched from Twilio.
        api.release_messages()
        await api.wait_for(lambda a: a.created_messages()[0].status == "delivered")
        later = (await _message(engine, message_id)).next_check_at
        assert later is not None
        done = await sms.drive(message_id, now=later + timedelta(seconds=1))
    finally:
        api.release_answers()
        await sms.aclose()
    assert len(_creates(api)) == 1 and len(api.created_messages()) == 1
    listed = api.requests_to("/Messages.json", "GET")
    assert listed, "reconciled by listing"
    assert all(not any(k.startswith("DateSent") for k in r.form) for r in listed)
    assert listed[0].form["To"] == CALLER and listed[0].form["From"] == OUR_NUMBER
    assert done is not None and done.status is M.DELIVERED
    message = await _message(engine, message_id)
    assert message.message_sid == api.created_messages()[0].sid
    assert message.attempts == 1
    assert (await delivery_of(engine, op_id)).state is D.TEXTED
    events = await trail(engine, op_id)
    assert sms_statuses(events) == ["pending", "unknown", "queued", "delivered"]
    sources = [e.data.get("source") for e in events if e.kind == "sms"][1:]
    assert sources == ["send", "reconciled by listing messages", "status fetched"]


async def test_a_send_twilio_never_got_is_sent_again_once_it_is_proved_missing(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    api.fail_next(1, status=503)  # a server error: maybe made, maybe not
    sms = sms_channel(engine, api)
    try:
        _op_id, message_id = await _texted_delivery(engine, sms)
        first = await sms.drive(message_id)
        assert first is not None and first.status is M.UNKNOWN
        attempted = (await _message(engine, message_id)).attempted_at
        assert attempted is not None
        # Too early to call it missing: the request may still be on its way.
        soon = await sms.drive(message_id, now=attempted + timedelta(seconds=1))
        assert soon is not None and soon.status is M.UNKNOWN and len(_creates(api)) == 1
        proved = await sms.drive(message_id, now=attempted + timedelta(seconds=30))
    finally:
        await sms.aclose()
    assert proved is not None and proved.status is M.QUEUED
    assert len(_creates(api)) == 2 and len(api.created_messages()) == 1
    assert (await _message(engine, message_id)).attempts == 2
    await api.wait_for(lambda a: a.created_messages()[0].status == "delivered")


async def test_a_rate_limited_send_is_released_and_tried_again(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    api.fail_next(1, status=429, code=20429)
    sms = sms_channel(engine, api)
    try:
        _op_id, message_id = await _texted_delivery(engine, sms)
        first = await sms.drive(message_id)
        assert first is not None and first.status is M.PENDING
        again = await sms.drive(message_id)
    finally:
        await sms.aclose()
    assert again is not None and again.status is M.QUEUED
    assert len(api.created_messages()) == 1


async def test_status_callbacks_are_signed_idempotent_and_never_move_a_message_back(
    engine: AsyncEngine, api: FakeTwilioApi, service: Service
) -> None:
    api.callback_order = "late_sent"  # `delivered` arrives before `sent`
    api.duplicate_callbacks = 1  # and every callback twice
    sms = service.runtime.sms
    op_id, message_id = await _texted_delivery(engine, sms)
    await sms.drive(message_id)
    await api.wait_for(lambda a: len(a.callbacks) == 4)
    assert [c.params["MessageStatus"] for c in api.callbacks] == [
        "delivered",
        "delivered",
        "sent",
        "sent",
    ]
    assert all(c.status_code == 204 for c in api.callbacks)
    message = await _message(engine, message_id)
    assert message.status is M.DELIVERED
    events = await trail(engine, op_id)
    assert sms_statuses(events) == ["pending", "queued", "delivered"]
    assert (await delivery_of(engine, op_id)).state is D.TEXTED
    # A forged callback is refused, and changes nothing.
    url = f"/twilio/sms-status?delivery_id={message.delivery_id}&message_id={message_id}"
    forged = await post_signed(
        service,
        url,
        {"MessageSid": message.message_sid or "", "MessageStatus": "failed"},
        signature="bm90IGEgc2lnbmF0dXJl",
    )
    assert forged.status_code == 403
    assert (await _message(engine, message_id)).status is M.DELIVERED


async def test_a_callback_for_an_unknown_message_or_without_an_id_is_a_clean_answer(
    service: Service,
) -> None:
    unknown = await post_signed(
        service,
        f"/twilio/sms-status?message_id={uuid.uuid4()}",
        {"MessageSid": "SM" + "0" * 32, "MessageStatus": "delivered"},
    )
    assert unknown.status_code == 204
    missing = await post_signed(
        service, "/twilio/sms-status", {"MessageSid": "SM1", "MessageStatus": "sent"}
    )
    assert missing.status_code == 400


async def test_stop_from_the_caller_is_honoured_and_start_lifts_it(
    engine: AsyncEngine, api: FakeTwilioApi, service: Service
) -> None:
    url = service.settings.public_base_url + "/twilio/sms"
    assert await api.send_inbound_sms(url, CALLER, OUR_NUMBER, "STOP") == 200
    async with engine.connect() as conn:
        assert await deliveries.is_opted_out(conn, CALLER)
    call_id = await make_call(engine, ended=True)
    op_id = await booked(engine, call_id)
    driver = DeliveryDriver(engine, restaurant_catalog(), service.runtime.sms)
    assert await driver.deliver((await delivery_of(engine, op_id)).id) == "not_deliverable"
    assert (await delivery_of(engine, op_id)).reason == "the caller opted out of SMS"
    assert _creates(api) == []
    assert await api.send_inbound_sms(url, CALLER, OUR_NUMBER, "start") == 200
    async with engine.connect() as conn:
        assert not await deliveries.is_opted_out(conn, CALLER)


async def test_twilio_21610_records_the_opt_out_and_ends_not_deliverable(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    api.unsubscribed.add(CALLER)  # STOP reached Twilio, not us
    sms = sms_channel(engine, api)
    try:
        op_id, message_id = await _texted_delivery(engine, sms)
        after = await sms.drive(message_id)
    finally:
        await sms.aclose()
    assert after is not None and after.status is M.FAILED and after.error_code == 21610
    assert (await delivery_of(engine, op_id)).state is D.NOT_DELIVERABLE
    async with engine.connect() as conn:
        assert await deliveries.is_opted_out(conn, CALLER)
    assert api.created_messages() == []


async def test_a_number_that_cannot_take_sms_is_not_deliverable_not_retried(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    api.reject_next_message(21614)
    sms = sms_channel(engine, api)
    try:
        op_id, message_id = await _texted_delivery(engine, sms)
        await sms.drive(message_id)
        again = await sms.drive(message_id)
    finally:
        await sms.aclose()
    assert again is not None and again.status is M.FAILED
    assert len(_creates(api)) == 1
    delivery = await delivery_of(engine, op_id)
    assert delivery.state is D.NOT_DELIVERABLE
    assert delivery.reason == "the SMS was failed (Twilio error 21614)"


async def test_staff_resend_sends_a_new_message_and_is_refused_while_one_is_under_way(
    engine: AsyncEngine, api: FakeTwilioApi, service: Service
) -> None:
    api.sms_outcomes_by_to[CALLER] = "undelivered"
    sms = service.runtime.sms
    op_id, message_id = await _texted_delivery(engine, sms)
    await sms.drive(message_id)

    async def failed() -> bool:
        return (await delivery_of(engine, op_id)).state is D.FAILED

    await wait_until(failed, 10, "undelivered")
    delivery = await delivery_of(engine, op_id)
    api.sms_outcomes_by_to[CALLER] = "delivered"
    async with httpx.AsyncClient(base_url=service.url, auth=CONSOLE) as http:
        response = await http.post(
            f"/api/deliveries/{delivery.id}/resend-sms", json={"reason": "caller asked again"}
        )
    assert response.status_code == 200, response.text

    async def texted() -> bool:
        return (await delivery_of(engine, op_id)).state is D.TEXTED

    await wait_until(texted, 10, "resent and delivered")
    messages = await sms_of(engine, op_id)
    assert [m.status for m in messages] == [M.UNDELIVERED, M.DELIVERED]
    assert messages[1].requested_by == f"staff:{CONSOLE[0]}"
    assert len(api.created_messages()) == 2
    # While a send is under way, another resend is refused with a reason.
    api.lose_message_answers(1)
    async with engine.begin() as conn:
        pending = await deliveries.move(
            conn, delivery.id, D.TEXTED, D.TEXTING, actor="test", reason="test"
        )
        assert pending is not None
        await deliveries.create_sms(
            conn,
            pending,
            to_number=CALLER,
            from_number=OUR_NUMBER,
            messaging_service_sid=None,
            body="x",
            reference=None,
            requested_by="test",
        )
    with pytest.raises(ResendRefused, match="still under way"):
        await resend_sms(engine, delivery.id, "alice", "again", sms=sms)
    api.release_answers()


async def test_a_messaging_service_sends_without_a_from_number(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    sms = sms_channel(engine, api, from_number=None, messaging_service_sid="MG" + "1" * 32)
    try:
        _, message_id = await _texted_delivery(engine, sms)
        after = await sms.drive(message_id)
    finally:
        await sms.aclose()
    assert after is not None and after.status is M.QUEUED
    form = _creates(api)[0].form
    assert form["MessagingServiceSid"] == "MG" + "1" * 32 and "From" not in form


async def test_sms_persisted_together_go_once_each_and_an_opt_out_since_then_is_honoured(
    engine: AsyncEngine, api: FakeTwilioApi
) -> None:
    numbers = [CALLER, "+15557770001", "+15557770002"]
    sms = sms_channel(engine, api)
    try:
        made = [await _texted_delivery(engine, sms, caller=n) for n in numbers]
        async with engine.begin() as conn:
            await deliveries.set_opt_out(conn, numbers[1], opted_out=True, source="test")
        persisted = [await _message(engine, message_id) for _, message_id in made]
        await sms.send_many(persisted)
        await sms.send_many(persisted)  # a second look at the same records sends nothing
    finally:
        await sms.aclose()
    assert len(_creates(api)) == 2
    assert sorted(m.to_number for m in api.created_messages()) == [numbers[0], numbers[2]]
    after = [await _message(engine, message_id) for _, message_id in made]
    assert [m.attempts for m in after] == [1, 0, 1]
    assert after[1].status is M.FAILED
    assert (await delivery_of(engine, made[1][0])).state is D.NOT_DELIVERABLE
