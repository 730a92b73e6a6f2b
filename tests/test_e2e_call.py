"""Whole calls over real sockets: fake Twilio caller -> service -> Realtime simulator."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
import wave
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.cli.demo import demo
from app.settings import Settings
from telephony.legs.twilio.leg import parse_mark_name
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.scenario import Scenario
from tests.e2e_support import CONSOLE, Stack, call_row, call_stack, post_signed, wait_until
from tests.sor_support import start_sor

GREETING_MS = 1000
FRAME_MS = 20


def scenario(reply_ms: int = 4000) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "e2e",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "What is on the menu tonight?",
                    "reply": {
                        "text": "Tonight we have fresh pasta and pizza.",
                        "audio_ms": reply_ms,
                    },
                },
                {"caller_transcript": "Thanks.", "reply": {"text": "Anytime.", "audio_ms": 800}},
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )


async def hear_greeting(caller: FakeTwilioCaller) -> float:
    """Wait until the greeting has fully played; returns what the caller heard so far (ms)."""
    await caller.wait_for(lambda c: c.media_received_ms >= GREETING_MS and c.buffered_ms == 0, 10)
    return caller.heard_ms


def heard_before(caller: FakeTwilioCaller, t: float) -> float:
    return caller.heard_ms - caller.heard_ms_after(t)


def sent_times(stack: Stack, session: int, type_: str) -> list[float]:
    return [t for t, e in stack.sim.sessions[session].sent if e.get("type") == type_]


def received_times(stack: Stack, session: int, type_: str) -> list[float]:
    return [t for t, e in stack.sim.sessions[session].received if e.get("type") == type_]


def in_order(kinds: list[str], expected: list[str]) -> bool:
    """Whether `expected` occurs in `kinds` as a subsequence."""
    it = iter(kinds)
    return all(kind in it for kind in expected)


async def test_a_normal_turn_is_heard_and_its_timeline_persisted_in_order(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, scenario(reply_ms=1500)) as stack:
        caller = stack.caller()
        await caller.dial()
        before = await hear_greeting(caller)
        await caller.play_speech(800)
        await caller.wait_for(lambda c: c.heard_ms >= before + 1500 - FRAME_MS, 15)
        await caller.hangup()
        await wait_until(lambda: stack.service.runtime.registry.live_count() == 0, 10)
        events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)
        call_id = await stack.call_id(caller)
        async with httpx.AsyncClient(base_url=stack.service.url) as http:
            anonymous = await http.get(f"/api/calls/{call_id}/timeline")
            timeline = (await http.get(f"/api/calls/{call_id}/timeline", auth=CONSOLE)).json()
            listing = (await http.get("/api/calls", auth=CONSOLE)).json()
    kinds = [e["kind"] for e in events]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert in_order(
        kinds,
        [
            "call_started",
            "stream_started",
            "realtime_connected",
            "response_created",
            "speech_started",
            "speech_stopped",
            "caller_transcript",
            "response_created",
            "response_done",
            "call_ended",
        ],
    ), kinds
    assert kinds[-1] == "call_ended"
    assert "barge_in" not in kinds
    transcripts = [e["data"]["text"] for e in events if e["kind"] == "agent_transcript"]
    assert "Tonight we have fresh pasta and pizza." in transcripts
    assert row is not None and row["status"] == "completed"
    assert row["answered_at"] is not None and row["ended_at"] is not None
    assert anonymous.status_code == 401
    shown = [e["kind"] for e in timeline["events"]]
    assert sorted(shown) == sorted(kinds)
    assert timeline["call"]["id"] == call_id
    t_ms = [e["t_ms"] for e in timeline["events"]]
    assert t_ms == sorted(t_ms) and t_ms[0] == 0
    # Agent speech sits where the caller began hearing it: the greeting before the caller's
    # turn, although it is recorded once it has played out.
    assert shown.index("agent_transcript") < shown.index("speech_started")
    assert shown.index("agent_transcript") > shown.index("response_created")
    assert [c["id"] for c in listing["calls"]] == [call_id]


# Marks every 20 ms, or every 100 ms with the tracker interpolating between them: either way
# the truncation never claims more than the caller had heard when the server decided (within
# one frame), and never less than playout had confirmed before the caller started to speak.
# How close it lands in between depends on how late mark echoes arrive, which is the machine's
# load, not correctness: bench/bridge.py measures it.
@pytest.mark.parametrize("chunk_ms", [20, 100])
async def test_barge_in_mid_playback_clears_first_and_truncates_at_the_heard_audio(
    engine: AsyncEngine, chunk_ms: int
) -> None:
    async with call_stack(engine, scenario(reply_ms=4000), twilio_media_chunk_ms=chunk_ms) as stack:
        caller = stack.caller()
        await caller.dial()
        before = await hear_greeting(caller)
        await caller.play_speech(800)
        session = stack.sim.sessions[0]
        # The reply is fully generated (so nothing more is in flight) but far from played.
        await session.wait_for_sent("response.done", count=2, within=10)
        await caller.wait_for(lambda c: c.heard_ms >= before + 1000, 10)
        speech_starts = len(sent_times(stack, 0, "input_audio_buffer.speech_started"))
        speaking_from = time.monotonic()
        await caller.play_speech(600)
        await caller.wait_for(lambda c: len(c.clears) == 1, 10)
        truncate = await session.wait_for_received("conversation.item.truncate", within=5)
        entry = stack.service.runtime.registry.get(caller.call_sid)
        assert entry is not None
        clear_sent = entry.socket.clears_sent_at[0]
        t_barge = sent_times(stack, 0, "input_audio_buffer.speech_started")[speech_starts]
        t_truncate = received_times(stack, 0, "conversation.item.truncate")[0]
        clear = caller.clears[0]
        # What the caller had heard of the reply when the server sent `clear` (it froze its
        # estimate right then), and what playout had confirmed before the barge-in began.
        heard_at_decision = heard_before(caller, clear_sent) - before
        confirmed_before = max(
            mark[1]
            for echo in caller.marks_echoed
            if not echo.cleared
            and echo.t_echoed < speaking_from
            and (mark := parse_mark_name(echo.name)) is not None
            and mark[2] == truncate["item_id"]
        )
        await caller.hangup()
        events = await stack.events(caller)
    after_barge_in = [m.event for m in caller.received if m.t > t_barge]
    assert after_barge_in[0] == "clear", after_barge_in[:5]
    assert clear_sent < t_truncate
    audio_end = truncate["audio_end_ms"]
    assert confirmed_before <= audio_end <= heard_at_decision + FRAME_MS, (
        confirmed_before,
        audio_end,
        heard_at_decision,
    )
    assert clear.dropped_ms > 1000  # most of the reply was still queued at the caller
    marks_after_clear = [
        parse_mark_name(m.data["mark"]["name"])
        for m in caller.received
        if m.t > clear.t and m.event == "mark" and m.data is not None
    ]
    assert truncate["item_id"] not in {m[2] for m in marks_after_clear if m is not None}
    barge_ins = [e["data"] for e in events if e["kind"] == "barge_in"]
    assert len(barge_ins) == 1
    assert barge_ins[0]["truncated"] is True
    assert barge_ins[0]["audio_end_ms"] == truncate["audio_end_ms"]


async def test_barge_in_while_the_reply_is_generated_cancels_it_and_none_of_it_plays_after(
    engine: AsyncEngine,
) -> None:
    # A 20 s reply is still being generated when the caller cuts in.
    async with call_stack(engine, scenario(reply_ms=20_000)) as stack:
        caller = stack.caller()
        await caller.dial()
        before = await hear_greeting(caller)
        await caller.play_speech(800)
        await caller.wait_for(lambda c: c.heard_ms >= before + 600, 10)
        session = stack.sim.sessions[0]
        assert session.response_active
        await caller.play_speech(600)
        await caller.wait_for(lambda c: len(c.clears) == 1, 10)
        truncate = await session.wait_for_received("conversation.item.truncate", within=5)
        await session.wait_for_received("response.cancel", within=5)
        # The call goes on: the agent answers the interruption.
        heard_at_clear = caller.heard_ms
        await caller.wait_for(lambda c: c.heard_ms >= heard_at_clear + 400, 15)
        clear_t = caller.clears[0].t
        await caller.hangup()
        events = await stack.events(caller)
    cancelled_item = truncate["item_id"]
    after_clear = [m for m in caller.received if m.t > clear_t]
    items_after = set()
    for message in after_clear:
        if message.event == "mark" and message.data is not None:
            parsed = parse_mark_name(message.data["mark"]["name"])
            assert parsed is not None
            items_after.add(parsed[2])
    assert cancelled_item not in items_after
    assert items_after, "the conversation continued after the barge-in"
    # Every media frame after the clear is closed by a later mark, and those name new items
    # only: all audio the caller got after the clear is accounted to a new item.
    kinds_after = [m.event for m in after_clear if m.event in ("media", "mark")]
    assert "media" in kinds_after
    assert kinds_after[-1] == "mark"
    barge_in = next(e["data"] for e in events if e["kind"] == "barge_in")
    assert barge_in["cancelled"] is True


async def test_interruption_after_playback_finished_sends_no_truncate(engine: AsyncEngine) -> None:
    async with call_stack(engine, scenario(reply_ms=1200)) as stack:
        caller = stack.caller()
        await caller.dial()
        before = await hear_greeting(caller)
        await caller.play_speech(800)
        await caller.wait_for(
            lambda c: c.heard_ms >= before + 1200 - FRAME_MS and c.buffered_ms == 0, 15
        )
        session = stack.sim.sessions[0]
        speech_starts = len(session.sent_events("input_audio_buffer.speech_started"))
        await caller.play_speech(800)
        await session.wait_for_sent(
            "input_audio_buffer.speech_started", count=speech_starts + 1, within=10
        )
        # The caller's turn is complete once the agent answers it.
        await session.wait_for_sent("response.created", count=3, within=10)
        await caller.hangup()
        events = await stack.events(caller)
    assert session.received_events("conversation.item.truncate") == []
    assert caller.clears == []
    assert "barge_in" not in [e["kind"] for e in events]


async def test_realtime_drop_mid_call_reconnects_and_the_call_continues(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, scenario(reply_ms=1200)) as stack:
        caller = stack.caller()
        await caller.dial()
        before = await hear_greeting(caller)
        await stack.sim.drop_all()
        second = await stack.sim.wait_for_session(1, within=10)
        await second.wait_for_received("session.update", within=5)
        await caller.play_speech(800)
        await caller.wait_for(lambda c: c.heard_ms >= before + 600, 15)
        await caller.hangup()
        events = await stack.events(caller)
    kinds = [e["kind"] for e in events]
    assert in_order(
        kinds, ["realtime_connected", "realtime_dropped", "realtime_reconnected", "call_ended"]
    ), kinds
    assert "realtime_failed" not in kinds
    assert second.received_events("input_audio_buffer.append"), "audio flows to the new session"


async def test_realtime_lost_for_good_apologises_and_hangs_up_through_twilio(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, scenario(), realtime_reconnect_budget_s=1.0) as stack:
        caller = stack.caller()
        await caller.dial()
        before = await hear_greeting(caller)
        stack.sim.fail_next_connects(1000)
        await stack.sim.drop_all()
        await caller.wait_closed(20)
        hangups = stack.api.requests_to(f"/Calls/{caller.call_sid}.json")
        await wait_until(lambda: stack.service.runtime.registry.live_count() == 0, 10)
        events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)
    assert [r.form.get("Status") for r in hangups] == ["completed"]
    assert caller.closed_by == "twilio-api"
    assert caller.heard_ms > before + 500  # the apology played before the hang-up
    kinds = [e["kind"] for e in events]
    assert in_order(
        kinds, ["realtime_dropped", "realtime_failed", "apology_played", "call_ended"]
    ), kinds
    assert row is not None and row["status"] == "completed"
    assert "realtime failed" in row["end_reason"]


async def test_failed_rest_hang_up_still_ends_the_call_and_says_so(engine: AsyncEngine) -> None:
    async with call_stack(engine, scenario(), realtime_reconnect_budget_s=1.0) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        stack.api.fail_next(10)
        stack.sim.fail_next_connects(1000)
        await stack.sim.drop_all()
        await caller.wait_closed(20)
        events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)
    assert caller.closed_by == "server"  # we closed the stream ourselves
    errors = [e["data"] for e in events if e["kind"] == "error"]
    assert [e["where"] for e in errors] == ["twilio_rest"]
    assert row is not None and row["status"] == "completed"


async def test_status_callback_completed_ends_a_call_whose_media_socket_is_open(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, scenario()) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        response = await post_signed(
            stack.service,
            "/twilio/status",
            {"CallSid": caller.call_sid, "CallStatus": "completed"},
        )
        await caller.wait_closed(10)
        await wait_until(lambda: stack.sim.sessions[0].closed.is_set(), 10, "realtime closed")
        events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)
    assert response.status_code == 204
    assert caller.closed_by == "server"
    assert row is not None
    assert (row["status"], row["end_reason"]) == ("completed", "twilio status completed")
    assert [e["kind"] for e in events].count("call_ended") == 1


async def test_nothing_outlives_the_server(engine: AsyncEngine) -> None:
    async with call_stack(engine, scenario()) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        # Shut down with the call still live: the service must let it go and close everything.
    await caller.wait_closed(10)
    await caller.aclose()
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert leftover == []
    row = await call_row(engine, caller.call_sid)
    # A stopping server hands a Twilio call over rather than ending it (another replica
    # resumes it through `<Connect action>`; with none, a later sweep ends it).
    assert row is not None and row["status"] == "in_progress"
    assert row["released_at"] is not None and row["end_reason"] is None


async def test_demo_runs_one_call_with_a_barge_in_and_prints_its_timeline(
    clean_db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "heard.wav"
    settings = Settings(
        database_url=clean_db, openai_api_key=None, console_password="demo-password"
    )
    # An earlier demo on this database left a booking behind: it is not this call's.
    earlier = await start_sor(clean_db)
    await earlier.stop()
    with psycopg.connect(clean_db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO sor.effects (kind, booking_id, idempotency_key) "
            "VALUES ('insert', 'BKEARLIER1', 'an-earlier-demo')"
        )
    assert await demo(settings, out) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("t ms") :]
    for kind in ("call_started", "stream_started", "barge_in", "caller_transcript", "call_ended"):
        assert kind in table, kind
    assert "truncated=true" in table
    # The booking story: requested, read back, confirmed, committed by a worker, announced,
    # heard by the caller.
    for shown in (
        "book_table -> needs_confirmation",
        "book_table: admitted",
        "book_table: running (worker:",
        "book_table: committed (worker:",
        "book_table: announce in the call",
        "result_announced",
        "book_table: heard: the caller heard it",
    ):
        assert shown in table, shown
    assert "System of record: 1 booking made by this call" in printed
    header = printed[printed.index("Timeline of call") :].splitlines()[0]
    assert "(Twilio CallSid CA" in header
    assert "book_table: admitted (policy): caller confirmed" in table
    # Nothing is cut: both announcements and the readback are printed whole (wrapped).
    assert "…" not in table
    flowing = " ".join(line[33:].strip() for line in table.splitlines())
    for said in (
        "I've sent your request to the restaurant. It isn't confirmed yet; I'll tell you as "
        "soon as it is.",
        "Good news: the restaurant has confirmed your table for four tomorrow at eight.",
        "Please confirm: a table for 4 people on",
    ):
        assert said in flowing, said
    # The call's two-leg recording, as the console plays it: caller left, agent right.
    with wave.open(str(out)) as recording:
        assert (recording.getnchannels(), recording.getframerate()) == (2, 8000)
        assert recording.getnframes() > 8000 * 20
    assert f"The call's recording (caller left, agent right): {out}" in printed


async def test_voice_agent_serve_answers_calls_with_the_local_simulator(
    clean_db: str, tmp_path: Path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TWILIO_"))},
        "DATABASE_URL": clean_db,
        "PORT": str(port),
        "PUBLIC_BASE_URL": base,
        "CONSOLE_PASSWORD": "serve-test-password",
        "CONSOLE_HTTP_BASIC": "true",
        "LOG_LEVEL": "WARNING",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", "serve", "--no-worker",
        env=env, cwd=tmp_path, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=base) as http:

            async def ready() -> bool:
                try:
                    return (await http.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_until(ready, 30, "service ready")
            async with FakeTwilioCaller(base) as caller:
                await caller.dial()
                await caller.wait_for(lambda c: c.heard_ms >= 1000, 15)
                await caller.hangup()
            auth = ("admin", "serve-test-password")
            calls = (await http.get("/api/calls", auth=auth)).json()["calls"]
    finally:
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(20):
            _, stderr = await proc.communicate()
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert [c["call_sid"] for c in calls] == [caller.call_sid]
