"""GPT-Live on OpenAI's SIP interconnect end to end over real sockets (MODEL_API=live): the
stand-in plays OpenAI's side (signed `live.transport.incoming`, the Live accept / reject / refer /
hangup, the Live sideband WebSocket with the simulator's Live conversation), the service the
rest: the bridge on the sideband, the engine, the ledger, the worker.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from app.legs.openai_sip import webhooks as openai_webhooks
from telephony.session_config import instructions_text
from telephony.sim.live_session import parse_live_client_event
from telephony.sim.live_sideband import LiveSidebandSession
from telephony.sim.scenario import Scenario
from tests.domains import RESTAURANT
from tests.e2e_support import event_rows, wait_until
from tests.openai_sip_support import Interconnect, interconnect
from tests.test_e2e_booking import tool_calls_of, wait_for_delivery, wait_for_operation
from tests.test_e2e_live import REQUESTED, live_booking


def chat() -> Scenario:
    return Scenario.model_validate(
        {
            "name": "openai-sip-live-chat",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": 800},
            "steps": [
                {"caller_transcript": "What are your hours?", "reply": "We open at noon."},
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 600},
        }
    )


async def events_of(ic: Interconnect, call_sid: str, kind: str) -> list[dict[str, Any]]:
    row = await ic.row(call_sid)
    assert row is not None
    return [e["data"] for e in await event_rows(ic.engine, row["id"]) if e["kind"] == kind]


def sideband_events(sessions: list[Any]) -> list[dict[str, Any]]:
    """Every client event the Live sideband got, each checked against the SDK's union."""
    received: list[dict[str, Any]] = []
    for session in sessions:
        assert isinstance(session, LiveSidebandSession)
        assert session.refused == []
        for _, event in session.received:
            parse_live_client_event(event, sideband=True)
            received.append(event)
    return received


async def test_a_live_transport_incoming_is_accepted_on_live_with_the_session_every_leg_gets(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat(), model_api="live") as ic:
        call = await ic.sim.place_call(live=True)
        await ic.sim.wait_for_state(call.call_id, "accepted")
        session = await ic.sim.wait_for_session(call.call_id)
        await session.wait_for_sent("session.output_transcript.delta", within=10)
        row = await ic.wait_row(call.session_id, "in_progress")
        runtime = ic.service.runtime
        bridge: Any = runtime.registry.live_by_call_id(str(row["id"]))
        # Our side plays the greeting's span by the clock, as the trunk does.
        await wait_until(
            lambda: not session.speaking and not bridge.leg.playback.is_playing(),
            5,
            "greeting played out",
        )
        await session.press("5")  # the caller's keypad, on the sideband

        async def keyed() -> bool:
            await runtime.events.flush()
            return bool(await events_of(ic, call.session_id, "dtmf"))

        await wait_until(keyed, 5, "dtmf recorded")
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.session_id)
        said = await events_of(ic, call.session_id, "agent_transcript")
        digits = await events_of(ic, call.session_id, "dtmf")
        [started] = await events_of(ic, call.session_id, "call_started")
        final = await ic.row(call.session_id)

    assert call.webhook_statuses == [200] and call.runtime == "live"
    [accept] = ic.sim.live_requests_for(call.call_id, "accept")
    assert ic.sim.requests_for(call.call_id) == []  # nothing on the Realtime call API
    body = accept["session"]
    config = runtime.bridge_config
    assert body["type"] == "live"
    assert body["model"] == config.live_model
    assert body["instructions"] == instructions_text(config)
    # SIP negotiates the media: the accept names a voice, no audio format.
    assert body["audio"] == {"output": {"voice": config.voice}}
    delegation = body["delegation"]
    assert delegation["type"] == "responses"
    assert delegation["responses"]["model"] == config.live_delegation_model
    tools = {t["name"] for t in runtime.gateway.definitions()}
    assert tools and {t["name"] for t in delegation["responses"]["tools"]} == tools
    assert row["leg"] == "openai_sip" and row["call_sid"] == call.session_id
    assert started["sip_media_security"] == "srtp"  # what the trunk negotiated, recorded
    # The greeting, heard in full by the transcript's span on the session's timeline.
    assert said and said[0]["text"] == "Hello, how can I help?" and not said[0]["cut"]
    assert said[0]["heard_ms"] == said[0]["audio_ms"] > 0
    assert [d["digit"] for d in digits] == ["5"]
    assert final is not None and final["status"] == "completed"
    assert "caller hung up" in final["end_reason"]
    assert ic.sim.live_requests_for(call.call_id, "hangup") == []  # over on OpenAI's side
    sideband_events(call.sessions)


async def test_the_realtime_incoming_for_the_same_call_is_not_accepted_on_live(
    engine: AsyncEngine,
) -> None:
    """OpenAI announces one pending call on both APIs and the first accept picks the runtime:
    on Live the `realtime.call.incoming` is left alone, however often it comes, and a retried
    `live.transport.incoming` is taken once."""
    async with interconnect(engine, chat(), model_api="live") as ic:
        call = ic.sim.new_call()
        realtime_first = await ic.sim.deliver(call)
        live = await ic.sim.deliver(call, live=True)
        live_again = await ic.sim.deliver(call, live=True)
        await ic.sim.wait_for_state(call.call_id, "accepted")
        await ic.sim.wait_for_session(call.call_id)
        await ic.wait_row(call.session_id, "in_progress")
        realtime_later = await ic.sim.deliver(call)
        duplicates = ic.service.runtime.openai_sip.duplicates
        recorded = await openai_webhooks.delivery_count(engine, call.live_webhook_id)
        untaken = await openai_webhooks.delivery_count(engine, call.webhook_id)
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.session_id)
        realtime_row = await ic.row(call.call_id)

    assert (realtime_first, live, live_again, realtime_later) == (200, 200, 200, 200)
    assert ic.sim.requests_for(call.call_id) == []  # no Realtime accept (nor reject)
    assert len(ic.sim.live_requests_for(call.call_id, "accept")) == 1
    assert call.runtime == "live" and len(call.sessions) == 1
    assert duplicates == 1 and recorded == 1 and untaken == 0
    assert realtime_row is None  # one call, by its Live session id


async def test_a_bad_signature_on_live_transport_incoming_is_refused_and_nothing_is_done(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat(), model_api="live") as ic:
        call = ic.sim.new_call()
        wrong = "whsec_" + "A" * 43 + "="
        bad = await ic.sim.deliver(call, live=True, secret=wrong)
        unsigned = await ic.sim.deliver(call, live=True, signature="v1,")
        async with httpx.AsyncClient() as http:
            anonymous = await http.post(
                ic.service.url + "/openai/webhook", content=ic.sim.live_webhook_body(call)
            )
        counter = ic.service.runtime.openai_sip.bad_signatures
        row = await ic.row(call.session_id)
        deliveries = await openai_webhooks.delivery_count(engine)

    assert (bad, unsigned, anonymous.status_code) == (400, 400, 401)
    assert counter == 3
    assert ic.sim.live_requests_for(call.call_id) == [] and call.state == "ringing"
    assert row is None and deliveries == 0


async def test_a_delegated_booking_on_live_sip_goes_through_the_engine_and_is_told_heard(
    engine: AsyncEngine, clean_db: str
) -> None:
    told = "Good news: the restaurant has confirmed your table."
    async with RESTAURANT.start(clean_db) as backend:
        backend.set_faults(latency_s=0.5)  # the commit comes after "requested, not confirmed"
        catalog = backend.catalog()
        try:
            async with interconnect(
                engine,
                live_booking(told),
                auto_caller=True,  # the caller speaks each scripted turn, then hangs up
                with_worker=True,
                catalog=catalog,
                database_url=clean_db,
                sweep_interval_s=1.0,
                model_api="live",
            ) as ic:
                call = await ic.sim.place_call(from_number="+15551230000", live=True)
                row = await ic.wait_row(call.session_id, "in_progress")
                call_id = str(row["id"])
                op = await wait_for_operation(engine, call_id, "committed", within=30)
                heard = await wait_for_delivery(engine, op["operation_id"], "heard", 30)
                await ic.sim.wait_for_state(call.call_id, "ended", within=30)
                await ic.wait_over(call.session_id)
                calls = await tool_calls_of(engine, call_id)
                announced = await events_of(ic, call.session_id, "result_announced")
                said = [e["text"] for e in await events_of(ic, call.session_id, "agent_transcript")]
                final = await ic.row(call.session_id)
                booked = await backend.booked()
        finally:
            await catalog.aclose()

    operation_id = str(op["operation_id"])
    assert booked == 1
    assert [(c["tool"], c["decision"]) for c in calls] == [
        (RESTAURANT.book_tool, "needs_confirmation"),
        ("confirm_operation", "allow"),
    ]
    # Each answer went back on the sideband as the SDK's union allows: the output, then the
    # response.create that lets the backend go on; the commit as commentary.
    received = sideband_events(call.sessions)
    assert [e["type"] for e in received] == [
        "response.item.create",
        "response.create",
        "response.item.create",
        "response.create",
        "session.commentary.append",
    ]
    outputs = [json.loads(e["item"]["output"]) for e in received[:4:2]]
    assert outputs[0]["status"] == "awaiting_confirmation" and outputs[0]["readback"]
    assert outputs[1]["operation_id"] == operation_id
    # Told by the utterance that said it, heard in full: no SMS.
    assert [a["operation_ids"] for a in announced] == [[operation_id]]
    assert heard["state"] == "heard" and ic.twilio.messages_to("+15551230000") == []
    assert REQUESTED in said and told in said and said.index(REQUESTED) < said.index(told)
    assert final is not None and final["status"] == "completed"
    assert ic.sim.live_requests_for(call.call_id, "hangup") == []  # the caller hung up


async def test_the_models_transfer_call_on_live_sip_refers_the_session(
    engine: AsyncEngine,
) -> None:
    scripted = Scenario.model_validate(
        {
            "name": "openai-sip-live-transfer",
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
    async with interconnect(
        engine, scripted, transfer_targets="front_desk=+15550100009", model_api="live"
    ) as ic:
        call = await ic.sim.place_call(live=True)
        session = await ic.sim.wait_for_session(call.call_id)
        await ic.wait_row(call.session_id, "in_progress")
        await session.wait_for_sent("session.output_transcript.delta", within=10)
        await session.caller_says()
        await ic.wait_over(call.session_id, within=30)
        started = await events_of(ic, call.session_id, "transfer_started")
        final = await ic.row(call.session_id)
        said = [e["text"] for e in await events_of(ic, call.session_id, "agent_transcript")]

    assert ic.sim.live_requests_for(call.call_id, "refer") == [{"target_uri": "tel:+15550100009"}]
    assert ic.sim.requests_for(call.call_id) == []
    assert started == [
        {"target": "front_desk", "target_uri": "tel:+15550100009", "by": "transfer_call"}
    ]
    assert "Putting you through now." in said  # the sentence before the refer
    assert final is not None and final["end_reason"] == "transferred to front_desk"
    assert ic.sim.live_requests_for(call.call_id, "hangup") == []
    sideband_events(call.sessions)


async def test_staff_transfer_and_end_call_from_the_console_on_live_sip(
    engine: AsyncEngine,
) -> None:
    from app.access.staff import Role
    from tests.console_support import bearer

    async with interconnect(engine, chat(), model_api="live") as ic:
        operator = await bearer(engine, Role.OPERATOR, "olga")
        first = await ic.sim.place_call(live=True)
        second = await ic.sim.place_call(live=True)
        for call in (first, second):
            await ic.sim.wait_for_session(call.call_id)
        rows = [await ic.wait_row(c.session_id, "in_progress") for c in (first, second)]
        async with httpx.AsyncClient(base_url=ic.service.url) as http:
            moved = await http.post(
                f"/api/calls/{rows[0]['id']}/actions/transfer",
                json={"target": "+15559990000", "why": "asked for a person"},
                headers=operator,
            )
            ended = await http.post(
                f"/api/calls/{rows[1]['id']}/actions/end",
                json={"why": "abusive caller"},
                headers=operator,
            )
            await ic.wait_over(first.session_id)
            await ic.wait_over(second.session_id)
        transferred = await events_of(ic, first.session_id, "call_transferred")
        hung = await events_of(ic, second.session_id, "call_hangup")
        finals = [await ic.row(c.session_id) for c in (first, second)]

    assert moved.status_code == 202 and ended.status_code == 202
    assert ic.sim.live_requests_for(first.call_id, "refer") == [{"target_uri": "tel:+15559990000"}]
    assert transferred == [
        {"target_uri": "tel:+15559990000", "ok": True, "by": "olga: asked for a person"}
    ]
    assert ic.sim.live_requests_for(second.call_id, "hangup") == [{}]
    assert second.hangups == 1 and second.ended_by == "api"
    assert all(s.closed.is_set() for s in second.sessions)
    assert len(hung) == 1 and hung[0]["ok"] is True
    assert ic.sim.requests_for(first.call_id) == ic.sim.requests_for(second.call_id) == []
    assert finals[0] is not None and finals[0]["end_reason"].startswith("transferred to tel:")
    assert finals[1] is not None
    assert finals[1]["end_reason"] == "ended by staff (olga): abusive caller"


async def test_a_dropped_live_sideband_is_reattached_and_the_conversation_goes_on(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat(), model_api="live") as ic:
        call = await ic.sim.place_call(live=True)
        first = await ic.sim.wait_for_session(call.call_id)
        await first.wait_for_sent("session.output_transcript.delta", within=10)
        await ic.wait_row(call.session_id, "in_progress")
        await ic.sim.drop_sideband(call.call_id)  # a network drop: the call goes on
        second = await ic.sim.wait_for_session(call.call_id, 1)
        await second.caller_says()
        answer = await second.wait_for_sent("session.output_transcript.delta", within=10)
        await ic.sim.remote_hangup(call.call_id)
        await ic.wait_over(call.session_id)
        caller = await events_of(ic, call.session_id, "caller_transcript")
        reconnected = await events_of(ic, call.session_id, "realtime_reconnected")

    assert answer["delta"] == "We open at noon."  # where it was, not a second greeting
    assert [c["text"] for c in caller] == ["What are your hours?"]
    assert len(reconnected) == 1 and len(call.sessions) == 2
    assert len(ic.sim.live_requests_for(call.call_id, "accept")) == 1
    sideband_events(call.sessions)  # and no session.start: the sideband union has none
