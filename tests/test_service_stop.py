"""`voice-agent serve` stopped as Docker, Kubernetes and systemd stop it: SIGTERM drains.

Each test runs the real command as a subprocess with the embedded PostgreSQL in its own data
directory, places calls with the fake Twilio caller, and checks what a caller, a load
balancer and the next start see.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.legs.twilio.twiml import BUSY_MESSAGE
from telephony.sim.fake_caller import FakeTwilioCaller
from tests.cli_support import (
    clean_env,
    kill_postgres,
    postgres_processes,
    serve_process,
)
from tests.e2e_support import wait_until
from tests.server_proc import free_port

CONSOLE = ("admin", "stop-test-password")


def _env(data_dir: Path, port: int, drain_s: float) -> dict[str, str]:
    return clean_env(
        DATA_DIR=str(data_dir),
        PORT=str(port),
        CONSOLE_PASSWORD=CONSOLE[1],
        CONSOLE_HTTP_BASIC="true",
        DRAIN_TIMEOUT_S=str(drain_s),
        LOG_LEVEL="INFO",
    )


async def _readyz(url: str) -> int | None:
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            return (await http.get("/readyz")).status_code
    except httpx.TransportError:
        return None


async def _calls(url: str) -> dict[str, dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        response = await http.get("/api/calls", auth=CONSOLE)
        response.raise_for_status()
    return {c["call_sid"]: c for c in response.json()["calls"]}


async def _in_call(url: str) -> FakeTwilioCaller:
    caller = FakeTwilioCaller(url)
    outcome = await caller.dial()
    assert outcome.kind == "stream", outcome
    await caller.wait_for(lambda c: c.heard_ms > 0, 20)  # the agent's greeting plays
    return caller


@pytest.fixture
def data_dir(tmp_path: Path) -> Any:
    path = tmp_path / "data"
    yield path
    kill_postgres((path / "pg").resolve())


async def test_sigterm_answers_busy_lets_live_calls_finish_and_stops_the_database(
    data_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    env = _env(data_dir, port, drain_s=120)
    pgdata = (data_dir / "pg").resolve()
    async with serve_process(env, tmp_path) as service:
        assert postgres_processes(pgdata)
        first = await _in_call(service.url)
        second = await _in_call(service.url)

        service.signal(signal.SIGTERM)
        await wait_until(lambda: _is(service.url, 503), 20, "readyz failing")
        # A load balancer stops sending calls; one that still comes in hears busy.
        late = FakeTwilioCaller(service.url)
        outcome = await late.dial()
        assert outcome.kind == "hangup"
        assert outcome.says == (BUSY_MESSAGE,)
        await late.aclose()

        # The live calls go on during the drain: audio still flows both ways.
        heard = first.heard_ms
        await first.play_speech(1500)
        await first.wait_for(lambda c: c.heard_ms > heard, 20)
        await first.hangup()
        await first.aclose()
        assert service.proc.returncode is None  # still serving the second call
        assert await _readyz(service.url) == 503

        await second.hangup()
        await second.aclose()
        # The last live call has finished: the process stops by itself, well before 120 s.
        assert await service.wait(60) == 0
    assert not postgres_processes(pgdata), "the embedded PostgreSQL was left running"
    assert json.loads((pgdata / ".handle_pids.json").read_text()) == []
    assert "Traceback" not in service.stderr

    # A second start on the same data directory works and holds the whole story.
    async with serve_process(env, tmp_path) as again:
        assert await _readyz(again.url) == 200
        calls = await _calls(again.url)
        assert calls[first.call_sid]["status"] == "completed"
        assert calls[second.call_sid]["status"] == "completed"
        assert calls[late.call_sid]["status"] == "busy"
        for caller in (first, second):
            assert calls[caller.call_sid]["end_reason"] != "server shutdown"
        again.signal(signal.SIGINT)
        assert await again.wait(60) == 0
    assert not postgres_processes(pgdata)


async def test_sigterm_hands_a_twilio_call_still_live_at_the_drain_limit_over(
    data_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    # A released call nobody resumes is ended by the next sweep after CALL_DEAD_AFTER_S.
    env = {**_env(data_dir, port, drain_s=2), "CALL_DEAD_AFTER_S": "2", "CALL_HEARTBEAT_S": "0.5"}
    pgdata = (data_dir / "pg").resolve()
    async with serve_process(env, tmp_path) as service:
        caller = await _in_call(service.url)
        service.signal(signal.SIGTERM)
        # The caller never hangs up: once the limit has passed the server lets the call go
        # (its stream closes); Twilio asks the action URL, which no replica answers here.
        await caller.wait_closed(40)
        assert caller.closed_by == "server"
        assert "the action URL failed" in (caller.closed_reason or "")
        assert await service.wait(60) == 0
        await caller.aclose()
    assert not postgres_processes(pgdata)
    assert "Traceback" not in service.stderr
    assert "drain limit reached; ending 0 call(s), handing 1 over" in service.stderr

    async with serve_process(env, tmp_path) as again:

        async def swept() -> bool:
            return (await _calls(again.url))[caller.call_sid]["status"] == "completed"

        await wait_until(swept, 30, "the released call ended by the sweep")
        call_id = (await _calls(again.url))[caller.call_sid]["id"]
        async with httpx.AsyncClient(base_url=again.url, timeout=10, auth=CONSOLE) as http:
            kinds = [
                e["kind"]
                for e in (await http.get(f"/api/calls/{call_id}/timeline")).json()["events"]
            ]
        again.signal(signal.SIGTERM)
        assert await again.wait(60) == 0
    assert not postgres_processes(pgdata)
    # Handed over, not ended by the shutdown: released (no end of its own), then ended by
    # the sweep once nobody resumed it.
    assert "released_for_drain" in kinds
    assert kinds.index("released_for_drain") < kinds.index("call_ended")


async def _is(url: str, status: int) -> bool:
    return await _readyz(url) == status


async def test_a_second_signal_ends_the_drain_at_once(data_dir: Path, tmp_path: Path) -> None:
    env = _env(data_dir, free_port(), drain_s=600)
    pgdata = (data_dir / "pg").resolve()
    async with serve_process(env, tmp_path) as service:
        caller = await _in_call(service.url)
        service.signal(signal.SIGTERM)
        await wait_until(lambda: _is(service.url, 503), 20, "readyz failing")
        assert not caller.closed  # the drain lets it go on
        service.signal(signal.SIGINT)  # the operator does not want to wait 600 s
        await caller.wait_closed(40)
        assert caller.closed_by == "server"
        assert await service.wait(60) == 0
        await caller.aclose()
    assert "ending calls now; ending 0 call(s), handing 1 over" in service.stderr
    assert not postgres_processes(pgdata)


async def test_a_killed_serve_leaves_nothing_the_next_start_cannot_recover(
    data_dir: Path, tmp_path: Path
) -> None:
    env = _env(data_dir, free_port(), drain_s=5)
    pgdata = (data_dir / "pg").resolve()
    async with serve_process(env, tmp_path) as crashed:
        crashed.signal(signal.SIGKILL)
        assert await crashed.wait() == -signal.SIGKILL
    # What a crash leaves: the server still running, the dead PID still listed as a holder.
    orphans = postgres_processes(pgdata)
    assert orphans
    assert json.loads((pgdata / ".handle_pids.json").read_text()) == [crashed.proc.pid]

    async with serve_process(env, tmp_path) as again:
        assert await _readyz(again.url) == 200
        assert [p.pid for p in postgres_processes(pgdata)] == [p.pid for p in orphans]
        again.signal(signal.SIGTERM)
        assert await again.wait(60) == 0
    assert f"stale holder PIDs [{crashed.proc.pid}] dropped" in again.stderr
    assert not postgres_processes(pgdata), "the recovered server was left running"
    assert json.loads((pgdata / ".handle_pids.json").read_text()) == []
