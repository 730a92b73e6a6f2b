"""Late results end to end over real sockets and real Postgres: fake Twilio caller -> service
(pipeline, worker, delivery) -> Realtime simulator, the demo system of record and the fake
Twilio REST API. Each test asserts durable state, the messages at the fake Twilio API, the
order of events and the audio the caller heard.

The scripted model speaks a late result with the reply `{note}`: the text the bridge asked
it to say, so the audio the caller hears is synthesized from exactly that text.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import SimulatedSession, synthesize_speech
from tests.e2e_support import CONSOLE, Stack, call_stack, wait_until
from tests.sor_support import start_sor
from tests.test_e2e_booking import (
    CONFIRM,
    GREETING_MS,
    PREAMBLE_MS,
    READBACK_MS,
    REQUESTED,
    WAIT_S,
    call_events_at,
    delivery_row,
    delivery_trail,
    hear,
    wait_for_delivery,
    wait_for_operation,
)
from tools.restaurant.sor import Faults, SystemOfRecord

ROOT = Path(__file__).resolve().parent.parent
BOOK = {
    "name": "book_table",
    "arguments": {"date": "{tomorrow}", "time": "20:00", "party_size": 4, "name": "Alex"},
}
NOTE_MS = 1500  # the announcement's audio
REQUESTED_MS = 1200


def scenario(
    *after_requested: dict[str, Any],
    book: dict[str, Any] | None = None,
    requested_ms: int = REQUESTED_MS,
    name: str = "e2e-delivery",
) -> Scenario:
    """Book -> readback -> yes -> "requested" -> (more) -> the announcement `{note}`."""
    steps: list[dict[str, Any]] = [
        {
            "caller_transcript": "Please book a table for four tomorrow at eight.",
            "function_call": {
                **(book or BOOK),
                "preamble": {"text": "One moment.", "audio_ms": PREAMBLE_MS},
            },
        },
        {"reply": {"text": "{output[readback]}", "audio_ms": READBACK_MS}},
        {"caller_transcript": "Yes.", "function_call": CONFIRM},
        {"reply": {"text": REQUESTED, "audio_ms": requested_ms}},
        *after_requested,
        {"reply": {"text": "{note}", "audio_ms": NOTE_MS}},
    ]
    return Scenario.model_validate(
        {
            "name": name,
            "greeting": {"text": "Luigi's, how can I help?", "audio_ms": GREETING_MS},
            "steps": steps,
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )


@pytest.fixture
async def sor(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    sor = await start_sor(clean_db)
    try:
        yield sor
    finally:
        sor.release()
        await sor.stop()


def stack_for(engine: AsyncEngine, db: str, sor: SystemOfRecord, sc: Scenario, **kw: Any) -> Any:
    return call_stack(
        engine,
        sc,
        with_worker=True,
        database_url=db,
        sor_base_url=sor.url,
        sweep_interval_s=0.5,
        **kw,
    )


async def book_and_confirm(stack: Stack, caller: FakeTwilioCaller) -> str:
    """Greeting, "book it", the readback, "yes", and the "requested" answer. The call id."""
    await caller.dial()
    await hear(caller, GREETING_MS)
    before = caller.heard_ms
    await caller.play_speech(700)
    await hear(caller, before + PREAMBLE_MS + READBACK_MS)
    before = caller.heard_ms
    await caller.play_speech(500)
    await hear(caller, before + REQUESTED_MS)
    return await stack.call_id(caller)


def notes(session: SimulatedSession) -> list[str]:
    """The system messages the bridge added (each late result asked to be said)."""
    out = []
    for event in session.received_events("conversation.item.create"):
        item = event.get("item", {})
        if item.get("role") == "system":
            out.append(" ".join(p.get("text", "") for p in item.get("content", [])))
    return out


# Result events that do not end an offer.
ENDLESS = frozenset({"result_announced", "result_held"})


def noted_at(session: SimulatedSession, n: int) -> float:
    """When (monotonic) the model was told the `n`-th note (1-based)."""
    times = [
        t
        for t, event in session.received
        if event.get("type") == "conversation.item.create"
        and event.get("item", {}).get("role") == "system"
    ]
    return times[n - 1]


def announcement_audio(note: str) -> bytes:
    """What the caller hears when the scripted model says `note` (the simulator's voice)."""
    return synthesize_speech(NOTE_MS, zlib.crc32(note.encode()), "pcmu")


async def keep_talking(caller: FakeTwilioCaller, until: asyncio.Event, most_ms: int = 8000) -> None:
    """Speech, 200 ms at a time, until `until` is set (bounded)."""
    spoken = 0
    while not until.is_set() and spoken < most_ms:
        await caller.play_speech(200)
        spoken += 200


def moves(trail: list[dict[str, Any]]) -> list[str]:
    return [e["to_state"] for e in trail if e["kind"] == "transition"]


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


async def test_outcome_while_the_caller_speaks_is_held_then_announced_once_and_heard(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    sor.set_faults(Faults(hang=1))  # the restaurant answers only when the test says so
    parking = {
        "caller_transcript": "Is there parking nearby?",
        "reply": {"text": "Yes, there is parking on the square.", "audio_ms": 1000},
    }
    async with stack_for(engine, clean_db, sor, scenario(parking)) as stack:
        caller = stack.caller()
        call_id = await book_and_confirm(stack, caller)
        op = await wait_for_operation(engine, call_id, "running")
        session = stack.sim.sessions[0]
        started = len(session.sent_events("input_audio_buffer.speech_started"))
        stop = asyncio.Event()
        talking = asyncio.create_task(keep_talking(caller, stop))
        try:
            await wait_until(
                lambda: len(session.sent_events("input_audio_buffer.speech_started")) > started,
                WAIT_S,
                "caller speaking",
            )
            sor.release()  # the booking commits while the caller is mid-sentence

            async def held() -> bool:
                return any(
                    (e["reason"] or "").startswith("held: the caller is speaking")
                    for e in await delivery_trail(engine, op["operation_id"])
                )

            await wait_until(held, WAIT_S, "held while the caller speaks")
        finally:
            stop.set()
            await talking
        delivery = await wait_for_delivery(engine, op["operation_id"], "heard")
        await caller.hangup()
        events = await stack.events(caller)
        trail = await delivery_trail(engine, op["operation_id"])
        effects = await sor.side_effects()
        said = notes(session)
        heard_audio = caller.heard_audio()

    assert effects.bookings_inserted == 1
    assert moves(trail) == ["pending", "offered", "heard"]
    assert [e["data"]["action"] for e in trail if e["kind"] == "decision"] == ["announce"]
    # Held while the caller spoke, spoken after the model's own answer, heard in full.
    k = kinds(events)
    assert k.count("result_announced") == 1 and k.count("result_heard") == 1
    held_at = k.index("result_held")
    assert k.index("speech_started", held_at - 10) < held_at < k.index("speech_stopped", held_at)
    assert (
        k.index("speech_stopped", held_at) < k.index("result_announced") < k.index("result_heard")
    )
    announced = next(e for e in events if e["kind"] == "result_announced")
    assert announced["data"]["operation_ids"] == [str(op["operation_id"])]
    assert delivery["response_id"] == announced["data"]["response_id"]
    heard = next(e for e in events if e["kind"] == "result_heard")
    assert heard["data"]["heard_ms"] == heard["data"]["audio_ms"] == NOTE_MS
    # What the caller heard: the model's answer about parking, then the whole update.
    assert len(said) == 1 and "Done and confirmed by the restaurant" in said[0]
    assert announcement_audio(said[0]) in heard_audio
    assert stack.api.created_messages() == []  # heard in the call: no SMS


async def test_an_announcement_cut_by_a_barge_in_is_offered_again_then_texted(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    sor.set_faults(Faults(hang=1))
    # Each update is cut by the caller; the model answers the interruption itself first.
    sc = scenario(
        {"reply": {"text": "{note}", "audio_ms": NOTE_MS}},
        {"caller_transcript": "Sorry, what?", "reply": {"text": "Sorry, go on.", "audio_ms": 800}},
    )
    async with stack_for(engine, clean_db, sor, sc, announce_max_reoffers=1) as stack:
        caller = stack.caller()
        call_id = await book_and_confirm(stack, caller)
        op = await wait_for_operation(engine, call_id, "running")
        session = stack.sim.sessions[0]
        sor.release()
        for offer in (1, 2):
            await wait_until(lambda n=offer: len(notes(session)) >= n, WAIT_S, f"offer {offer}")
            update = announcement_audio(notes(session)[offer - 1])
            # Half a second into the update (by what the caller actually heard), they cut in.
            # Only audio played since the model was told it counts: the scripted voice's tones
            # follow crc32(text) % 630, so an earlier line can sound the same (1 run in ~60).
            since = noted_at(session, offer)
            await caller.wait_for(
                lambda c, a=update, t=since: a[:4000] in c.heard_audio(after=t), WAIT_S
            )
            await caller.play_speech(600)

            async def cut(n: int = offer) -> bool:
                row = await delivery_row(engine, op["operation_id"])
                return row is not None and row["cuts"] == n

            await wait_until(cut, WAIT_S, f"cut {offer}")
        await wait_for_delivery(engine, op["operation_id"], "texted")
        await caller.hangup()
        events = await stack.events(caller)
        trail = await delivery_trail(engine, op["operation_id"])
        said = notes(session)
        heard_audio = caller.heard_audio()
        messages = stack.api.messages_to(caller.from_number)

    assert moves(trail) == [
        "pending",
        "offered",
        "pending",
        "offered",
        "pending",
        "texting",
        "texted",
    ]
    assert [e["reason"] for e in trail if e["kind"] == "decision"][-1] == (
        "cut 2 times in the call: by SMS"
    )
    k = kinds(events)
    endings = [(e["kind"], e.get("data", {})) for e in events if e["kind"].startswith("result_")]
    reasons = [(e["kind"], e.get("reason")) for e in trail]
    assert k.count("result_cut") == 2 and "result_heard" not in k, (endings, reasons)
    assert k.count("barge_in") >= 2
    # The caller heard the start of each update, never the whole of either.
    assert len(said) == 2 and "interrupted the last update" in said[1]
    for note in said:
        audio = announcement_audio(note)
        assert audio[:4000] in heard_audio and audio not in heard_audio
    assert len(messages) == 1 and "Confirmed:" in messages[0].body


async def test_an_announcement_the_caller_talks_over_before_its_first_word_is_cut_on_both_sides(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    """The caller starts talking as the update's response begins, before any of its audio:
    the model's turn detection cancels it, so nothing of it is ever played. The caller's
    words stopped it: the call's timeline says cut (0 of 0 ms heard) as the delivery's trail
    does, and the update is offered again and heard. (The twice-cut test above met this
    when an earlier line's tones let its caller cut in early: one `result_not_spoken` where
    the trail had counted a cut.)"""
    sor.set_faults(Faults(hang=1))
    sc = scenario(
        {"reply": {"text": "{note}", "audio_ms": NOTE_MS}},
        {"caller_transcript": "Sorry, what?", "reply": {"text": "Sorry, go on.", "audio_ms": 800}},
    )
    async with stack_for(engine, clean_db, sor, sc) as stack:
        caller = stack.caller()
        call_id = await book_and_confirm(stack, caller)
        op = await wait_for_operation(engine, call_id, "running")
        session = stack.sim.sessions[0]
        items = len(session.received_events("conversation.item.create"))
        sor.release()
        # The update's note reaches the model (its response.create follows at once): the
        # caller talks now, well before the response's first audio (0.25 s in).
        await session.wait_for_received("conversation.item.create", count=items + 1, within=WAIT_S)
        await caller.play_speech(600)
        delivery = await wait_for_delivery(engine, op["operation_id"], "heard")
        await caller.hangup()
        events = await stack.events(caller)
        trail = await delivery_trail(engine, op["operation_id"])
        sent = session.sent_events()

    assert moves(trail) == ["pending", "offered", "pending", "offered", "heard"]
    assert delivery["cuts"] == 1
    # The first offer's response ended cancelled by the caller's turn, without a word of it.
    first = next(e for e in trail if e["kind"] == "note" and "announced in" in e["reason"])
    response_id = first["data"]["response_id"]
    done = next(
        e for e in sent if e["type"] == "response.done" and e["response"]["id"] == response_id
    )
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    assert not [
        e
        for e in sent
        if e["type"] == "response.output_audio.delta" and e["response_id"] == response_id
    ]
    # Both sides say the same of it: cut by the caller, nothing heard.
    endings = [(e["kind"], e["data"]) for e in events if e["kind"].startswith("result_")]
    reasons = [e["reason"] for e in trail if e["kind"] == "transition"]
    ended = [(kind, data) for kind, data in endings if kind not in ENDLESS]
    assert [kind for kind, _ in ended] == ["result_cut", "result_heard"], (endings, reasons)
    cut = ended[0][1]
    assert (cut["response_id"], cut["heard_ms"], cut["audio_ms"]) == (response_id, 0, 0)
    assert cut["reason"] == "barge-in"
    assert reasons[2] == "not heard: cut (barge-in) after 0 of 0 ms"


async def test_the_sms_answer_lost_after_twilio_accepted_is_reconciled_not_sent_twice(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    sor.set_faults(Faults(latency_s=1.5))
    async with stack_for(engine, clean_db, sor, scenario(), sms_send_timeout_s=1.0) as stack:
        stack.api.lose_message_answers(1)  # accepted at Twilio, the answer never comes
        stack.api.drop_callbacks = True  # and no status callback either
        stack.api.hold_queued = True  # still queued: no date_sent when we come asking
        caller = stack.caller()
        call_id = await book_and_confirm(stack, caller)
        op = await wait_for_operation(engine, call_id, "running")
        await caller.hangup()
        await stack.events(caller)
        await wait_for_operation(engine, call_id, "committed")

        async def reconciled() -> bool:
            trail = await delivery_trail(engine, op["operation_id"])
            return any(
                e["kind"] == "sms" and e["data"].get("source") == "reconciled by listing messages"
                for e in trail
            )

        await wait_until(reconciled, WAIT_S, "reconciled by listing")
        stack.api.release_answers()
        stack.api.release_messages()
        trail = await delivery_trail(engine, op["operation_id"])
        creates = stack.api.requests_to("/Messages.json", "POST")
        lists = stack.api.requests_to("/Messages.json", "GET")
        messages = stack.api.messages_to(caller.from_number)

    assert len(creates) == 1 and len(messages) == 1  # never sent twice
    assert lists and all(not any(k.startswith("DateSent") for k in r.form) for r in lists)
    statuses = [e["data"]["status"] for e in trail if e["kind"] == "sms"]
    assert statuses[:3] == ["pending", "unknown", "queued"]
    sms = next(e for e in trail if e["kind"] == "sms" and e["data"]["status"] == "queued")
    assert sms["data"]["message_sid"] == messages[0].sid


@pytest.mark.parametrize("outcome", ["undelivered", "failed"])
async def test_an_undelivered_or_failed_sms_is_recorded_and_on_the_timeline(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, outcome: str
) -> None:
    sor.set_faults(Faults(latency_s=1.5))
    async with stack_for(engine, clean_db, sor, scenario()) as stack:
        caller = stack.caller()
        stack.api.sms_outcomes_by_to[caller.from_number] = outcome  # type: ignore[assignment]
        call_id = await book_and_confirm(stack, caller)
        op = await wait_for_operation(engine, call_id, "running")
        await caller.hangup()
        events = await stack.events(caller)
        delivery = await wait_for_delivery(engine, op["operation_id"], "failed")
        async with httpx.AsyncClient(base_url=stack.service.url, auth=CONSOLE) as http:
            timeline = (await http.get(f"/api/calls/{call_id}/timeline")).json()
            detail = (await http.get(f"/api/deliveries/{delivery['id']}")).json()
        messages = stack.api.messages_to(caller.from_number)

    assert len(messages) == 1 and messages[0].status == outcome
    code = {"undelivered": 30003, "failed": 30008}[outcome]
    assert delivery["reason"] == f"the SMS was {outcome} (Twilio error {code})"
    sms_entries = [e for e in timeline["events"] if e["kind"] == "delivery_sms"]
    expected = ["pending", "queued"] + (["sent"] if outcome == "undelivered" else []) + [outcome]
    assert [e["data"]["details"]["status"] for e in sms_entries] == expected
    assert sms_entries[-1]["data"]["details"]["error_code"] == code
    summary = timeline["deliveries"][0]
    assert summary["state"] == "failed" and summary["sms"][0]["status"] == outcome
    assert detail["sms"][0]["error_code"] == code
    assert kinds(events)[-1] == "call_ended"
    assert REQUESTED in " ".join(
        e["data"].get("text", "") for e in await call_events_at(engine, call_id)
    )


async def test_a_call_held_by_another_server_process_is_announced_there_not_texted(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord
) -> None:
    sor.set_faults(Faults(latency_s=1.5))
    # This process holds the call and runs no worker; another process runs the worker that
    # commits the booking and whose delivery job finds the call live elsewhere.
    async with call_stack(
        engine, scenario(), with_worker=False, database_url=clean_db, sor_base_url=sor.url
    ) as stack:
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.worker_main",
            "--database-url",
            clean_db,
            "--domain",
            "restaurant",
            "--url",
            sor.url,
            "--deadline",
            "30",
            "--deliveries",
            "--twilio-api",
            stack.api.base_url,
            "--public-url",
            stack.service.settings.public_base_url,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert worker.stdout is not None
            async with asyncio.timeout(30):
                line = await worker.stdout.readline()
            assert line.startswith(b"ready"), line
            caller = stack.caller()
            call_id = await book_and_confirm(stack, caller)
            op = await wait_for_operation(engine, call_id, "committed", within=30)
            delivery = await wait_for_delivery(engine, op["operation_id"], "heard")
            await caller.hangup()
            events = await stack.events(caller)
            trail = await delivery_trail(engine, op["operation_id"])
            said = notes(stack.sim.sessions[0])
            heard_audio = caller.heard_audio()
            op_trail = await _op_actors(engine, op["operation_id"])
        finally:
            if worker.returncode is None:
                worker.terminate()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(15):
                        await worker.wait()
                if worker.returncode is None:
                    worker.kill()
                    await worker.wait()

    worker_actor = next(a for a in op_trail if a.startswith("worker:"))
    assert worker_actor  # another process ran the operation
    assert delivery["holder"] == stack.service.runtime.holder and delivery["state"] == "heard"
    decided = [e for e in trail if e["kind"] == "decision"]
    assert [e["data"]["action"] for e in decided] == ["announce"]
    assert decided[0]["actor"] == f"replica:{stack.service.runtime.holder}"
    assert announcement_audio(said[0]) in heard_audio
    assert kinds(events).count("result_heard") == 1
    assert stack.api.created_messages() == []  # heard in the call, not by SMS


async def _op_actors(engine: AsyncEngine, operation_id: uuid.UUID) -> list[str]:
    from tests.test_e2e_booking import trail as op_trail

    return [e["actor"] for e in await op_trail(engine, operation_id)]
