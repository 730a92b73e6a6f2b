"""OpenAI's SIP interconnect end to end over real sockets: the stand-in plays OpenAI's side
(signed webhook, accept/reject/refer/hangup, the sideband WebSocket), the service the rest.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from openai import OpenAI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.legs.openai_sip import webhooks as openai_webhooks
from app.legs.openai_sip.calls import sip_user, transfer_target
from telephony.session_config import instructions_text
from telephony.sim.interconnect import sign_webhook
from telephony.sim.scenario import Scenario
from tests.domains import RESTAURANT
from tests.e2e_support import event_rows, wait_until
from tests.metrics_support import samples as metric_samples
from tests.openai_sip_support import SECRET, Interconnect, interconnect
from tests.test_e2e_booking import (
    REQUESTED,
    booking_scenario,
    tool_calls_of,
    wait_for_delivery,
    wait_for_operation,
)
from tools import webhooks as our_webhooks

LONG_GREETING = {"text": "Thanks for calling, " + "this is a long welcome message. " * 6}


def chat(greeting: dict[str, Any] | None = None) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "openai-sip-chat",
            "greeting": greeting or {"text": "Hello, how can I help?", "audio_ms": 800},
            "steps": [
                {"caller_transcript": "What are your hours?", "reply": "We open at noon."},
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 600},
        }
    )


async def kinds(ic: Interconnect, call_id: str) -> list[str]:
    row = await ic.row(call_id)
    assert row is not None
    return [e["kind"] for e in await event_rows(ic.engine, row["id"])]


async def events_of(ic: Interconnect, call_id: str, kind: str) -> list[dict[str, Any]]:
    row = await ic.row(call_id)
    assert row is not None
    return [e["data"] for e in await event_rows(ic.engine, row["id"]) if e["kind"] == kind]


def test_the_stand_in_signs_like_openai_and_like_our_own_webhooks() -> None:
    body = b'{"type":"realtime.call.incoming"}'
    stamp = int(time.time())
    signature = sign_webhook(SECRET, "wh_1", stamp, body)
    assert signature == our_webhooks.sign(SECRET, "wh_1", stamp, body)
    headers = {"webhook-id": "wh_1", "webhook-timestamp": str(stamp)}
    # The SDK accepts it among several signatures, space-separated.
    OpenAI(api_key="x").webhooks.verify_signature(
        body, {**headers, "webhook-signature": f"v1,bm9wZQ== {signature}"}, secret=SECRET
    )


def test_sip_header_values_give_numbers_and_transfer_targets_are_checked() -> None:
    assert sip_user('"Alex" <sip:+15551230000@trunk.example.com>;tag=9') == "+15551230000"
    assert sip_user("<tel:+15557654321>") == "+15557654321"
    assert sip_user("garbage") is None
    assert transfer_target("+15559990000") == "tel:+15559990000"
    assert transfer_target("sip:desk@pbx.example.com") == "sip:desk@pbx.example.com"
    with pytest.raises(ValueError):
        transfer_target("http://example.com")


async def test_signed_incoming_call_gets_exactly_one_accept_with_the_session_of_every_leg(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat()) as ic:
        call = await ic.sim.place_call(from_number="+15551230000", to_number="+15557654321")
        await ic.sim.wait_for_state(call.call_id, "accepted")
        session = await ic.sim.wait_for_session(call.call_id)
        greeting = await session.wait_for_received("response.create", within=10)
        row = await ic.wait_row(call.call_id, "in_progress")
        runtime = ic.service.runtime
        accepts = ic.sim.requests_for(call.call_id, "accept")
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.call_id)
        final = await ic.row(call.call_id)
        timeline = await kinds(ic, call.call_id)

    assert call.webhook_statuses == [200]
    assert len(accepts) == 1
    body = accepts[0]
    config = runtime.bridge_config
    assert body["type"] == "realtime"
    assert body["model"] == config.model
    assert body["instructions"] == instructions_text(config)
    assert body["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert body["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    assert body["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert body["audio"]["input"]["turn_detection"]["eagerness"] == config.vad_eagerness
    assert body["audio"]["input"]["transcription"] == {"model": config.transcription_model}
    tools = {t["name"] for t in runtime.gateway.definitions()}
    assert tools and {t["name"] for t in body["tools"]} == tools
    # The agent greets first, over the sideband, after attaching.
    assert "instructions" in greeting.get("response", {})
    assert row["leg"] == "openai_sip"
    assert (row["from_number"], row["to_number"]) == ("+15551230000", "+15557654321")
    assert final is not None and final["status"] == "completed"
    assert "caller hung up" in final["end_reason"]
    assert timeline[0] == "call_started" and timeline[-1] == "call_ended"
    assert "realtime_connected" in timeline
    # The caller hung up: we do not hang up a call that is already over.
    assert ic.sim.requests_for(call.call_id, "hangup") == []


async def test_bad_or_stale_signature_gets_400_and_nothing_is_accepted_or_recorded(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat()) as ic:
        call = ic.sim.new_call()
        wrong = "whsec_" + "A" * 43 + "="
        bad = await ic.sim.deliver(call, secret=wrong)
        stale = await ic.sim.deliver(call, timestamp=int(time.time()) - 301)
        unsigned = await ic.sim.deliver(call, signature="v1,")
        async with httpx.AsyncClient() as http:
            anonymous = await http.post(
                ic.service.url + "/openai/webhook", content=ic.sim.webhook_body(call)
            )
        tampered_body = ic.sim.webhook_body(call).replace(b"+1555", b"+1666")
        stamp = int(time.time())
        signed_other = sign_webhook(SECRET, call.webhook_id, stamp, ic.sim.webhook_body(call))
        tampered = await ic.sim.deliver(
            call, body=tampered_body, timestamp=stamp, signature=signed_other
        )
        counter = ic.service.runtime.openai_sip.bad_signatures
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(ic.service.url + "/metrics")).text
        row = await ic.row(call.call_id)
        deliveries = await openai_webhooks.delivery_count(engine)

    assert [bad, stale, unsigned, tampered] == [400, 400, 400, 400]
    assert anonymous.status_code == 401  # no signature at all: not even an attempt
    assert counter == 5
    assert metric_samples(metrics)["voice_agent_openai_webhooks_bad_signature_total"] == 5
    assert ic.sim.requests_for(call.call_id) == []
    assert row is None and deliveries == 0


async def test_the_same_delivery_twice_gives_one_call_and_one_accept(engine: AsyncEngine) -> None:
    async with interconnect(engine, chat()) as ic:
        call = ic.sim.new_call()
        first = await ic.sim.deliver(call)
        again = await ic.sim.deliver(call)
        await ic.sim.wait_for_state(call.call_id, "accepted")
        await ic.sim.wait_for_session(call.call_id)
        await ic.wait_row(call.call_id, "in_progress")
        third = await ic.sim.deliver(call)  # a retry while the call runs
        duplicates = ic.service.runtime.openai_sip.duplicates
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    sa.text("SELECT count(*) FROM calls WHERE call_sid = :s"), {"s": call.call_id}
                )
            ).scalar_one()
        recorded = await openai_webhooks.delivery_count(engine, call.webhook_id)
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.call_id)

    assert (first, again, third) == (200, 200, 200)
    assert len(ic.sim.requests_for(call.call_id, "accept")) == 1
    assert rows == 1 and recorded == 1 and duplicates == 2
    assert len(call.sessions) == 1


async def test_at_capacity_the_call_is_rejected_with_486_and_recorded_busy(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat(), max_live_calls=1) as ic:
        first = await ic.sim.place_call(from_number="+15551110000")
        await ic.sim.wait_for_state(first.call_id, "accepted")
        second = await ic.sim.place_call(from_number="+15552220000")
        await ic.sim.wait_for_state(second.call_id, "rejected")
        busy = await ic.wait_row(second.call_id, "busy")

        async def rejection_written() -> bool:
            # The event writer writes it after the row's own statement, in a batch of its own.
            return bool(await events_of(ic, second.call_id, "call_rejected"))

        await wait_until(rejection_written, 5.0, "call_rejected written")
        rejected = await events_of(ic, second.call_id, "call_rejected")
        await ic.sim.remote_hangup(first.call_id)
        await ic.wait_over(first.call_id)

    assert second.reject_status == 486
    assert ic.sim.requests_for(second.call_id, "accept") == []
    assert busy["leg"] == "openai_sip"
    assert rejected[0]["reason"] == "capacity"


async def test_a_to_number_that_is_not_ours_is_rejected_with_403(engine: AsyncEngine) -> None:
    async with interconnect(engine, chat(), openai_sip_numbers="+15557654321, +15550000001") as ic:
        other = await ic.sim.place_call(to_number="+15559999999")
        await ic.sim.wait_for_state(other.call_id, "rejected")
        ours = await ic.sim.place_call(to_number="+15550000001")
        await ic.sim.wait_for_state(ours.call_id, "accepted")
        refused = await ic.wait_row(other.call_id, "rejected")
        await ic.sim.remote_hangup(ours.call_id)
        await ic.wait_over(ours.call_id)

    assert other.reject_status == 403
    assert refused["to_number"] == "+15559999999"
    assert len(ic.sim.requests_for(ours.call_id, "accept")) == 1


async def test_barge_in_sends_response_cancel_then_output_audio_buffer_clear(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat(LONG_GREETING)) as ic:
        call = await ic.sim.place_call()
        session = await ic.sim.wait_for_session(call.call_id)
        await session.wait_for_sent("output_audio_buffer.started", within=10)
        await asyncio.sleep(0.15)  # the caller hears a little of the greeting first
        await session.caller_says(speech_ms=400)
        await session.wait_for_received("output_audio_buffer.clear")
        await wait_until(lambda: not session.playing, 5, "playout stopped")
        sent_types = [e.get("type") for e in session.received_events()]
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.call_id)
        barge = await events_of(ic, call.call_id, "barge_in")
        said = await events_of(ic, call.call_id, "agent_transcript")

    cancel = sent_types.index("response.cancel")
    clear = sent_types.index("output_audio_buffer.clear")
    assert cancel < clear
    assert sent_types.count("output_audio_buffer.clear") == 1
    assert len(barge) == 1 and barge[0]["cancelled"] and barge[0]["output_cleared"]
    # What the caller heard follows the server's playout, cut by the barge-in.
    greeting = said[0]
    assert greeting["cut"] is True, (barge, said)
    assert 0 < greeting["heard_ms"] < greeting["audio_ms"], (barge, said)
    assert len(greeting["text"]) < len(greeting["full_text"])


async def test_dtmf_on_the_sideband_reaches_the_timeline(engine: AsyncEngine) -> None:
    async with interconnect(engine, chat()) as ic:
        call = await ic.sim.place_call()
        session = await ic.sim.wait_for_session(call.call_id)
        await session.wait_for_received("response.create", within=10)
        await session.press("5")
        await ic.service.runtime.events.flush()

        async def keyed() -> bool:
            await ic.service.runtime.events.flush()
            return bool(await events_of(ic, call.call_id, "dtmf"))

        await wait_until(keyed, 5, "dtmf recorded")
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.call_id)
        digits = await events_of(ic, call.call_id, "dtmf")

    assert [d["digit"] for d in digits] == ["5"]


async def test_transfer_sends_refer_and_is_on_the_timeline(engine: AsyncEngine) -> None:
    async with interconnect(engine, chat()) as ic:
        call = await ic.sim.place_call()
        await ic.sim.wait_for_session(call.call_id)
        await ic.wait_row(call.call_id, "in_progress")
        await ic.service.runtime.openai_sip.transfer(call.call_id, "+15559990000")
        await ic.wait_over(call.call_id)
        transferred = await events_of(ic, call.call_id, "call_transferred")
        final = await ic.row(call.call_id)

    assert ic.sim.requests_for(call.call_id, "refer") == [{"target_uri": "tel:+15559990000"}]
    assert call.refers == ["tel:+15559990000"]
    assert transferred == [{"target_uri": "tel:+15559990000", "ok": True}]
    assert ic.sim.requests_for(call.call_id, "hangup") == []
    assert final is not None and final["status"] == "completed"
    assert final["end_reason"].startswith("transferred to tel:+15559990000")


async def test_the_models_transfer_call_refers_the_call_after_its_sentence(
    engine: AsyncEngine,
) -> None:
    scripted = Scenario.model_validate(
        {
            "name": "openai-sip-transfer",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": 800},
            "steps": [
                {
                    "caller_transcript": "A person please.",
                    "function_call": {
                        "name": "transfer_call",
                        "arguments": {"target": "front_desk", "reason": "asked for a person"},
                    },
                },
                {"reply": {"text": "Putting you through now.", "audio_ms": 800}},
            ],
        }
    )
    async with interconnect(engine, scripted, transfer_targets="front_desk=+15550100009") as ic:
        call = await ic.sim.place_call()
        session = await ic.sim.wait_for_session(call.call_id)
        await ic.wait_row(call.call_id, "in_progress")
        await session.wait_for_received("response.create", within=10)
        await session.caller_says()
        await ic.wait_over(call.call_id, within=30)
        started = await events_of(ic, call.call_id, "transfer_started")
        final = await ic.row(call.call_id)
        said = [e["text"] for e in await events_of(ic, call.call_id, "agent_transcript")]

    assert ic.sim.requests_for(call.call_id, "refer") == [{"target_uri": "tel:+15550100009"}]
    assert started == [
        {"target": "front_desk", "target_uri": "tel:+15550100009", "by": "transfer_call"}
    ]
    assert "Putting you through now." in said  # the sentence before the refer
    assert final is not None and final["status"] == "completed"
    assert final["end_reason"] == "transferred to front_desk"


async def test_hang_up_from_our_side_sends_hangup_closes_the_sideband_and_ends_the_call(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat()) as ic:
        call = await ic.sim.place_call()
        session = await ic.sim.wait_for_session(call.call_id)
        await ic.wait_row(call.call_id, "in_progress")
        await ic.service.runtime.openai_sip.hangup(call.call_id, "agent finished")
        await ic.wait_over(call.call_id)
        hung = await events_of(ic, call.call_id, "call_hangup")
        final = await ic.row(call.call_id)

    assert call.hangups == 1 and call.state == "ended" and call.ended_by == "api"
    assert session.closed.is_set()
    assert len(hung) == 1 and hung[0]["ok"] is True
    assert final is not None and final["status"] == "completed"
    assert final["end_reason"] == "agent finished"


async def test_a_dropped_sideband_is_reattached_and_the_call_goes_on(engine: AsyncEngine) -> None:
    async with interconnect(engine, chat()) as ic:
        call = await ic.sim.place_call()
        first = await ic.sim.wait_for_session(call.call_id)
        await first.wait_for_received("response.create", within=10)
        await ic.sim.drop_sideband(call.call_id)
        await ic.sim.wait_for_session(call.call_id, 1)
        row = await ic.row(call.call_id)
        still = ic.service.runtime.registry.get(call.call_id) is not None
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.call_id)
        timeline = await kinds(ic, call.call_id)

    assert still and row is not None and row["status"] == "in_progress"
    assert "realtime_dropped" in timeline and "realtime_reconnected" in timeline
    assert ic.sim.requests_for(call.call_id, "hangup") == []


async def test_a_sideband_that_cannot_come_back_in_budget_is_ended_with_hangup(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat(), openai_sip_reattach_budget_s=1.0) as ic:
        call = await ic.sim.place_call()
        first = await ic.sim.wait_for_session(call.call_id)
        await first.wait_for_received("response.create", within=10)
        ic.sim.fail_sideband(100)  # the network: every re-attach fails (503)
        await ic.sim.drop_sideband(call.call_id)
        await ic.wait_over(call.call_id)
        hung = await events_of(ic, call.call_id, "call_hangup")
        final = await ic.row(call.call_id)

    assert call.hangups == 1 and call.state == "ended"
    assert len(hung) == 1 and hung[0]["reason"].startswith("sideband lost")
    assert final is not None and final["status"] == "completed"
    assert len(call.sessions) == 1


def _notes(session: Any) -> list[str]:
    texts = []
    for event in session.received_events("conversation.item.create"):
        item = event.get("item") or {}
        if item.get("type") == "message":
            texts += [c.get("text", "") for c in item.get("content", [])]
    return texts


def _outputs(sessions: list[Any]) -> list[dict[str, Any]]:
    found = []
    for session in sessions:
        for event in session.received_events("conversation.item.create"):
            item = event.get("item") or {}
            if item.get("type") == "function_call_output":
                found.append(json.loads(item["output"]))
    return found


async def test_a_function_call_on_the_sideband_reaches_the_ledger_and_its_late_result_is_announced_there(  # noqa: E501
    engine: AsyncEngine, clean_db: str
) -> None:
    domain = RESTAURANT
    async with domain.start(clean_db) as backend:
        backend.set_faults(latency_s=0.5)  # the commit comes after "requested, not confirmed"
        catalog = backend.catalog()
        try:
            async with interconnect(
                engine,
                booking_scenario(domain),
                auto_caller=True,  # the caller speaks each scripted turn, then hangs up
                with_worker=True,
                catalog=catalog,
                database_url=clean_db,
                sweep_interval_s=1.0,
            ) as ic:
                call = await ic.sim.place_call(from_number="+15551230000")
                row = await ic.wait_row(call.call_id, "in_progress")
                call_id = str(row["id"])
                op = await wait_for_operation(engine, call_id, "committed", within=30)
                delivered = await wait_for_delivery(engine, op["operation_id"], "heard", 30)
                await ic.sim.wait_for_state(call.call_id, "ended", within=30)
                await ic.wait_over(call.call_id)
                calls = await tool_calls_of(engine, call_id)
                announced = await events_of(ic, call.call_id, "result_announced")
                heard = await events_of(ic, call.call_id, "result_heard")
                said = [e["text"] for e in await events_of(ic, call.call_id, "agent_transcript")]
                final = await ic.row(call.call_id)
        finally:
            await catalog.aclose()

    operation_id = str(op["operation_id"])
    assert [(c["tool"], c["decision"]) for c in calls] == [
        (domain.book_tool, "needs_confirmation"),
        ("confirm_operation", "allow"),
    ]
    assert {str(c["operation_id"]) for c in calls} == {operation_id}
    # The outputs went back on the sideband, and the late result was added there and spoken.
    outputs = _outputs(call.sessions)
    assert len(outputs) == 2 and all(o.get("operation_id") == operation_id for o in outputs)
    notes = [n for s in call.sessions for n in _notes(s)]
    assert any("An update arrived" in n for n in notes)
    assert [a["operation_ids"] for a in announced] == [[operation_id]]
    assert delivered["state"] == "heard"
    # Heard means the server played the announcement out, not merely that it was generated.
    assert len(heard) == 1 and heard[0]["heard_ms"] > 0
    assert heard[0]["heard_ms"] == heard[0]["audio_ms"]
    assert REQUESTED in said and domain.confirmed_text in said
    assert said.index(REQUESTED) < said.index(domain.confirmed_text)
    assert final is not None and final["status"] == "completed"
    assert ic.sim.requests_for(call.call_id, "hangup") == []  # the caller hung up


async def test_a_hang_up_on_openais_side_before_the_commit_hands_the_outcome_to_sms(
    engine: AsyncEngine, clean_db: str
) -> None:
    domain = RESTAURANT
    async with domain.start(clean_db) as backend:
        backend.set_faults(latency_s=2.0)
        catalog = backend.catalog()
        try:
            async with interconnect(
                engine,
                booking_scenario(domain),
                auto_caller=True,
                with_worker=True,
                catalog=catalog,
                database_url=clean_db,
                sweep_interval_s=1.0,
            ) as ic:
                call = await ic.sim.place_call(from_number="+15551230000")
                row = await ic.wait_row(call.call_id, "in_progress")
                call_id = str(row["id"])
                op = await wait_for_operation(engine, call_id, "running", within=30)
                await ic.sim.remote_hangup(call.call_id)  # the caller hangs up mid-operation
                await ic.wait_over(call.call_id)
                ended = await ic.row(call.call_id)
                await wait_for_operation(engine, call_id, "committed", within=30)
                texted = await wait_for_delivery(engine, op["operation_id"], "texted", 30)
                messages = ic.twilio.messages_to("+15551230000")
                announced = await events_of(ic, call.call_id, "result_announced")
        finally:
            await catalog.aclose()

    assert ended is not None and ended["status"] == "completed"
    assert "caller hung up" in ended["end_reason"]
    assert texted["state"] == "texted"
    assert len(messages) == 1
    assert announced == []
    assert ic.sim.requests_for(call.call_id, "hangup") == []


async def test_staff_transfer_and_end_a_live_call_through_the_api(engine: AsyncEngine) -> None:
    from app.access.staff import Role
    from tests.console_support import bearer

    async with interconnect(engine, chat()) as ic:
        operator = await bearer(engine, Role.OPERATOR, "olga")
        viewer = await bearer(engine, Role.VIEWER, "vic")
        first = await ic.sim.place_call()
        second = await ic.sim.place_call()
        for call in (first, second):
            await ic.sim.wait_for_session(call.call_id)
        rows = [await ic.wait_row(c.call_id, "in_progress") for c in (first, second)]
        async with httpx.AsyncClient(base_url=ic.service.url) as http:
            api = f"/api/calls/{rows[0]['id']}/actions"
            refused = await http.post(
                f"{api}/transfer", json={"target": "+15559990000", "why": "x"}, headers=viewer
            )
            bad = await http.post(
                f"{api}/transfer", json={"target": "http://evil", "why": "x"}, headers=operator
            )
            moved = await http.post(
                f"{api}/transfer",
                json={"target": "+15559990000", "why": "asked for a person"},
                headers=operator,
            )
            ended = await http.post(
                f"/api/calls/{rows[1]['id']}/actions/end",
                json={"why": "abusive caller"},
                headers=operator,
            )
            await ic.wait_over(first.call_id)
            await ic.wait_over(second.call_id)
            again = await http.post(f"{api}/end", json={"why": "late"}, headers=operator)
        transferred = await events_of(ic, first.call_id, "call_transferred")
        finals = [await ic.row(c.call_id) for c in (first, second)]

    assert refused.status_code == 403 and bad.status_code == 400
    assert moved.status_code == 202 and ended.status_code == 202
    assert again.status_code == 409  # the call is over: nothing to end
    assert ic.sim.requests_for(first.call_id, "refer") == [{"target_uri": "tel:+15559990000"}]
    assert transferred == [
        {"target_uri": "tel:+15559990000", "ok": True, "by": "olga: asked for a person"}
    ]
    assert ic.sim.requests_for(second.call_id, "refer") == []
    assert second.hangups == 1  # our `hangup` reached OpenAI's side
    assert finals[0] is not None and finals[0]["end_reason"].startswith("transferred to tel:")
    assert finals[1] is not None
    assert finals[1]["end_reason"] == "ended by staff (olga): abusive caller"
