"""Issue 13, over real sockets: what a hostile caller or media client could do, and now can't.

PIN guessing across calls (durable lockouts, surviving a restart), PIN digits and redacted
tool arguments never stored, bad-token streams kept off a call's timeline, and per-stream
budgets for junk before `start`, malformed frames and digits.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import websockets
from sqlalchemy.ext.asyncio import AsyncEngine

from app.logging import LOG_FORMAT, RedactingFormatter
from telephony.sim.scenario import Scenario
from tests.console_support import logged_in
from tests.domains import RESTAURANT, Backend
from tests.e2e_support import CONSOLE, Stack, call_row, call_stack, event_rows, wait_until
from tests.metrics_support import samples as metric_samples

CALLER = "+15557654321"
PIN = "2468"
WRONG = "1357"

SCENARIO = Scenario.model_validate(
    {
        "name": "hardening",
        "greeting": {"text": "Hello.", "audio_ms": 400},
        "steps": [
            {
                "caller_transcript": f"Here it is: {' '.join(PIN)}.",  # spoken aloud
                "function_call": {"name": "verify_pin", "arguments": {"digits": PIN}},
            },
            {"reply": {"text": "Thanks.", "audio_ms": 400}},
        ],
        "fallback": {"text": "Yes?", "audio_ms": 400},
    }
)


@pytest.fixture
def service_log() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(RedactingFormatter(LOG_FORMAT))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture
async def backend(clean_db: str) -> AsyncIterator[Backend]:
    async with RESTAURANT.start(clean_db) as running:
        yield running


@pytest.fixture
def accounts(tmp_path: Path) -> Path:
    path = tmp_path / "accounts.json"
    path.write_text(json.dumps([{"account_id": "acc-7", "phones": [CALLER], "pin": PIN}]))
    return path


def _stack(engine: AsyncEngine, db: str, backend: Backend, accounts: Path, **kw: Any) -> Any:
    return call_stack(
        engine,
        SCENARIO,
        catalog=backend.catalog(),
        database_url=db,
        accounts_file=accounts,
        **kw,
    )


async def _rows(engine: AsyncEngine, sql: str, **params: Any) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        return [dict(r) for r in (await conn.execute(sa.text(sql), params)).mappings().all()]


async def _keypad(stack: Stack, digits: str, *, calls: int = 1) -> tuple[str, list[dict[str, Any]]]:
    """One call from CALLER that types `digits` (each entry four keys) and hangs up."""
    caller = stack.caller(from_number=CALLER)
    await caller.dial()
    await caller.wait_for(lambda c: c.heard_ms > 0, 10)
    for digit in digits:
        await caller.send_dtmf(digit)
    entries = len(digits) // len(PIN)
    call_id = await stack.call_id(caller)

    async def entered() -> bool:
        await stack.service.runtime.events.flush()
        rows = await event_rows(stack.engine, call_id)
        return sum(1 for r in rows if r["kind"] == "pin_entered") >= entries

    await wait_until(entered, 10, "PIN entries checked")
    await caller.hangup()
    return call_id, await stack.events(caller)


def _all_text(rows: list[dict[str, Any]]) -> str:
    return json.dumps([r.get("data") for r in rows], default=str)


def _holds(text: str, digits: str) -> bool:
    """Whether `digits` stand in `text` as a value of their own. Random hex ids and
    timestamps also hold any four digits now and then (a flake seen twice), so a run of
    digits inside a longer run of hex digits, hyphens or digits does not count."""
    return re.search(rf"(?<![0-9A-Fa-f-]){digits}(?![0-9A-Fa-f-])", text) is not None


async def test_pin_lockout_holds_across_calls_and_a_restart_and_digits_are_never_stored(
    engine: AsyncEngine, clean_db: str, backend: Backend, accounts: Path
) -> None:
    async with _stack(engine, clean_db, backend, accounts) as stack:
        # The attack: guess three times in one call, then call again for fresh tries.
        first_id, first = await _keypad(stack, WRONG * 3)
    locks = await _rows(engine, "SELECT subject_kind, subject, failures FROM verification_locks")
    # A restarted service (a new process state) still refuses the right PIN.
    async with _stack(engine, clean_db, backend, accounts) as stack:
        second_id, second = await _keypad(stack, PIN)
        async with httpx.AsyncClient(base_url=stack.service.url, auth=CONSOLE) as http:
            timeline = (await http.get(f"/api/calls/{first_id}/timeline")).text
        async with logged_in(stack.service.url, *CONSOLE) as (console, _csrf):
            page = (await console.get(f"/console/calls/{first_id}")).text
    entries = [e["data"] for e in first if e["kind"] == "pin_entered"]
    assert [(e["digits"], e["outcome"]) for e in entries] == [
        (4, "wrong"), (4, "wrong"), (4, "locked")
    ]  # fmt: skip
    locked = [e["data"] for e in first if e["kind"] == "verification_locked"]
    assert len(locked) == 1 and locked[0]["failures"] == 3
    assert sorted((r["subject_kind"], r["subject"]) for r in locks) == [
        ("account", "acc-7"), ("phone", CALLER)
    ]  # fmt: skip
    assert [e["data"]["outcome"] for e in second if e["kind"] == "pin_entered"] == ["locked"]
    attempts = await _rows(engine, "SELECT * FROM verification_attempts")
    assert len(attempts) == 6  # three checks, each against the account and the number
    # No digit of any entry is stored, shown or served.
    for events in (first, second):
        assert not [e for e in events if e["kind"] == "dtmf"]
        assert not _holds(_all_text(events), WRONG) and not _holds(_all_text(events), PIN)
    assert WRONG not in timeline and "pin_entered" in timeline
    assert not _holds(page, WRONG) and "PIN entered (4 digits)" in page
    assert second_id != first_id


async def test_a_spoken_pin_is_never_stored_in_call_events_or_tool_calls(
    engine: AsyncEngine, clean_db: str, backend: Backend, accounts: Path
) -> None:
    async with _stack(engine, clean_db, backend, accounts) as stack:
        caller = stack.caller(from_number=CALLER)
        await caller.dial()
        await caller.wait_for(lambda c: c.heard_ms > 0, 10)
        await caller.play_speech(700)
        await caller.play_silence(600)
        call_id = await stack.call_id(caller)

        async def answered() -> bool:
            return bool(
                await _rows(engine, "SELECT 1 FROM tool_calls WHERE call_id = :c AND decision "
                            "IS NOT NULL", c=call_id)
            )  # fmt: skip

        await wait_until(answered, 15, "verify_pin answered")
        await caller.hangup()
        events = await stack.events(caller)
    calls = [e["data"] for e in events if e["kind"] == "function_call"]
    tool_calls = await _rows(engine, "SELECT * FROM tool_calls WHERE call_id = :c", c=call_id)
    assert [c["name"] for c in calls] == ["verify_pin"]
    assert calls[0]["arguments"] == {"redacted": True}
    assert [t["decision"] for t in tool_calls] == ["verified"]
    assert not _holds(_all_text(events), PIN)
    assert not _holds(json.dumps(tool_calls, default=str), PIN)
    said = [e["data"]["text"] for e in events if e["kind"] == "caller_transcript"]
    assert said == ["Here it is: • • • •."]  # the transcript of the spoken PIN, masked


async def test_bad_token_streams_naming_a_real_call_write_nothing_to_its_timeline(
    engine: AsyncEngine, service_log: io.StringIO
) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        victim = stack.caller()
        outcome = await victim.dial(open_stream=False)
        row = await call_row(engine, victim.call_sid)
        assert row is not None
        await stack.service.runtime.events.flush()
        before = len(await event_rows(engine, row["id"]))
        for i in range(20):
            attacker = stack.caller(call_sid=victim.call_sid)
            params = {**outcome.parameters, "token": f"forged-{i}"}
            await attacker.open_stream(outcome.stream_url, params)
            await attacker.wait_closed(10)
        await stack.service.runtime.events.flush()
        after = len(await event_rows(engine, row["id"]))
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(stack.service.url + "/metrics")).text
    rejected_lines = [ln for ln in service_log.getvalue().splitlines() if "rejected" in ln]
    assert after == before  # not one row for 20 attempts
    assert metric_samples(metrics)["voice_agent_streams_rejected_total"] == 20
    assert len(rejected_lines) <= 2  # rate-limited (one line per 10 s, per process)


async def _raw_media(url: str) -> Any:
    return await websockets.connect(url.replace("http", "ws", 1) + "/twilio/media")


async def test_junk_before_start_is_counted_and_the_socket_closed(
    engine: AsyncEngine, service_log: io.StringIO
) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        ws = await _raw_media(stack.service.url)
        sent = 0
        try:
            for _ in range(10_000):
                await ws.send(b"\x00" * 16)
                sent += 1
            await asyncio.wait_for(ws.wait_closed(), 10)
        except websockets.ConnectionClosed:
            pass
        code = ws.close_code
    lines = [ln for ln in service_log.getvalue().splitlines() if "binary frame" in ln]
    assert code == 1008
    assert len(lines) <= 3  # not one INFO line per frame


async def test_a_malformed_frame_flood_ends_the_call_as_abusive_with_one_event(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, SCENARIO) as stack:
        caller = stack.caller()
        await caller.dial()
        await caller.wait_for(lambda c: c.heard_ms > 0, 10)
        try:
            for _ in range(10_000):
                await caller.send_raw("{}")
        except websockets.ConnectionClosed:
            pass
        events = await stack.events(caller)
        row = await call_row(engine, caller.call_sid)
    malformed = [e for e in events if e["kind"] == "malformed_frame"]
    abusive = [e["data"] for e in events if e["kind"] == "stream_abusive"]
    assert len(malformed) == stack.service.settings.media_max_malformed_frames
    assert len(abusive) == 1 and abusive[0]["budget"] == "malformed_frames"
    assert row is not None and "abusive stream" in (row["end_reason"] or "")


async def test_a_digit_flood_ends_the_call_as_abusive(engine: AsyncEngine) -> None:
    async with call_stack(engine, SCENARIO, media_max_dtmf=30) as stack:
        caller = stack.caller()
        await caller.dial()
        await caller.wait_for(lambda c: c.heard_ms > 0, 10)
        try:
            for _ in range(1000):
                await caller.send_dtmf("5")
        except websockets.ConnectionClosed:
            pass
        events = await stack.events(caller)
    abusive = [e["data"] for e in events if e["kind"] == "stream_abusive"]
    digits = [e for e in events if e["kind"] == "dtmf"]
    assert len(abusive) == 1 and abusive[0]["budget"] == "dtmf"
    assert len(digits) <= 30
