"""What a user meets on the first day: every problem is one line with its cause and fix, a
non-zero exit status, and never a traceback. Each test runs the real `voice-agent` command."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_database, drop_database, head_revision
from app.errors import StartupError
from app.realtime_check import plan_realtime
from app.settings import Settings, setting_problems
from telephony import audio
from telephony.sim.fake_caller import FakeTwilioCaller
from tests.cli_support import (
    clean_env,
    error_lines,
    run_cli,
    serve_process,
)
from tests.conftest import _server_url
from tests.e2e_support import call_stack
from tests.server_proc import free_port
from tests.test_audio import riff_wav


def _one_line(stderr: str, command: str) -> str:
    """The single line the command printed (log lines aside); no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"voice-agent {command}: "), lines[0]
    return lines[0]


def _revision(url: str) -> str | None:
    with psycopg.connect(url) as conn:
        try:
            row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        except psycopg.errors.UndefinedTable:
            return None
    return str(row[0]) if row else None


@pytest.fixture
def empty_db() -> Iterator[str]:
    """A database with no tables at all (never migrated)."""
    server = _server_url()
    name = f"va_cli_{os.getpid()}_{secrets.token_hex(3)}"
    url = create_database(server, name)
    yield url
    drop_database(server, name)


# --- voice-agent call --------------------------------------------------------------------


async def test_call_answered_403_says_the_signature_did_not_verify_and_why(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with call_stack(engine) as stack:
        url = stack.service.url
        env = clean_env()
        code, _, err = await run_cli(
            "call", "--server", url, "--auth-token", "not-the-servers-token",
            env=env, cwd=tmp_path,
        )  # fmt: skip
        line = _one_line(err, "call")
        assert code == 1
        assert "answered 403: the signature did not verify" in line
        assert "auth token" in line and "PUBLIC_BASE_URL" in line
        # The other usual cause: the URL the server checks signatures against is not this one.
        code, _, err = await run_cli(
            "call", "--server", url, "--public-url", "https://voice.example.com",
            env=env, cwd=tmp_path,
        )  # fmt: skip
        assert code == 1
        assert "https://voice.example.com/twilio/voice" in _one_line(err, "call")
        assert stack.service.runtime.registry.answered_total == 0


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.wav", None, "no such file: "),
        ("notes.wav", b"these are my notes, not audio\n", "not a WAV file"),
        ("float.wav", riff_wav(3, 1, 8000, 32, bytes(800)), "unsupported WAV encoding"),
    ],
)
async def test_call_with_a_bad_wav_says_so_before_placing_the_call(
    tmp_path: Path, name: str, content: bytes | None, expected: str
) -> None:
    wav = tmp_path / name
    if content is not None:
        wav.write_bytes(content)
    # Nothing listens on this port: a call placed anyway would report "could not reach".
    port = free_port()
    code, out, err = await run_cli(
        "call", "--server", f"http://127.0.0.1:{port}", "--wav", str(wav),
        env=clean_env(), cwd=tmp_path,
    )  # fmt: skip
    assert code == 2
    line = _one_line(err, "call")
    assert expected in line and name in line
    assert out == ""


async def test_call_streams_an_8_khz_mulaw_wav_as_the_callers_voice(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    speech = audio.speech_like_mulaw(1200)
    wav = tmp_path / "twilio-recording.wav"
    wav.write_bytes(riff_wav(audio.WAVE_FORMAT_MULAW, 1, 8000, 8, speech))
    async with call_stack(engine) as stack:
        code, out, err = await run_cli(
            "call", "--server", stack.service.url, "--wav", str(wav), "--tail-ms", "500",
            "--out", str(tmp_path / "heard.wav"),
            env=clean_env(), cwd=tmp_path,
        )  # fmt: skip
        session = await stack.sim.wait_for_session(0)
    assert code == 0, err
    assert re.match(r"call CA[0-9a-f]{32}: heard \d+", out), out
    appended = b"".join(
        base64.b64decode(e["audio"]) for e in session.received_events("input_audio_buffer.append")
    )
    # The caller's voice reached the model byte for byte (mu-law in, no transcoding).
    assert speech in appended


# --- voice-agent simulator + serve --------------------------------------------------------


async def test_serve_follows_the_export_line_voice_agent_simulator_prints(
    database_url: str, tmp_path: Path
) -> None:
    sim_port = free_port()
    sim = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", "simulator", "--port", str(sim_port),
        env=clean_env(), cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert sim.stdout is not None
        async with asyncio.timeout(30):
            export = ""
            while not export.startswith("export "):
                export = (await sim.stdout.readline()).decode().strip()
        name, _, value = export.removeprefix("export ").partition("=")
        assert name == "OPENAI_BASE_URL"
        env = clean_env(
            DATABASE_URL=database_url,
            PORT=str(free_port()),
            CONSOLE_PASSWORD="a-long-password",
            **{name: value},
        )
        async with serve_process(env, tmp_path, "--no-worker") as service:
            realtime = next(line for line in service.banner if "Realtime" in line)
            assert value in realtime and "simulator" not in realtime.split(value)[0]
            async with FakeTwilioCaller(service.url) as caller:
                await caller.dial()
                # The greeting comes from the simulator the user started.
                await caller.wait_for(lambda c: c.heard_ms >= 500, 20)
                await caller.hangup()
            service.signal(signal.SIGTERM)
            assert await service.wait() == 0
        assert "realtime simulator listening" not in service.stderr
    finally:
        sim.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            await sim.wait()


# --- ports already in use -----------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


async def test_serve_on_a_port_in_use_says_so_in_one_line(
    taken_port: int, database_url: str, tmp_path: Path
) -> None:
    env = clean_env(DATABASE_URL=database_url, PORT=str(taken_port))
    code, out, err = await run_cli("serve", env=env, cwd=tmp_path)
    assert code == 2
    line = _one_line(err, "serve")
    assert f"port {taken_port} on 127.0.0.1 is already in use" in line and "--port" in line
    assert out == ""


async def test_simulator_on_a_port_in_use_says_so_in_one_line(
    taken_port: int, tmp_path: Path
) -> None:
    code, _, err = await run_cli(
        "simulator", "--port", str(taken_port), env=clean_env(), cwd=tmp_path
    )
    assert code == 2
    assert f"port {taken_port} on 127.0.0.1 is already in use" in _one_line(err, "simulator")


async def test_sor_on_a_port_in_use_says_so_in_one_line(
    taken_port: int, database_url: str, tmp_path: Path
) -> None:
    code, _, err = await run_cli(
        "sor", "--port", str(taken_port), "--database-url", database_url,
        env=clean_env(), cwd=tmp_path,
    )  # fmt: skip
    assert code == 2
    assert f"port {taken_port} on 127.0.0.1 is already in use" in _one_line(err, "sor")


HEAD = head_revision()  # the newest migration of this version


# --- voice-agent db and worker ------------------------------------------------------------


async def test_db_upgrade_reports_the_true_revision_and_never_goes_back(
    empty_db: str, tmp_path: Path
) -> None:
    env = clean_env(DATABASE_URL=empty_db)
    code, out, _ = await run_cli("db", "upgrade", "0001", env=env, cwd=tmp_path)
    assert (code, out.strip()) == (0, "database is at 0001 (was base (no tables))")
    code, out, _ = await run_cli("db", "upgrade", env=env, cwd=tmp_path)
    assert (code, out.strip()) == (0, f"database is at {HEAD} (head) (was 0001)")

    code, out, err = await run_cli("db", "upgrade", "0001", env=env, cwd=tmp_path)
    assert code == 2 and out == ""
    line = _one_line(err, "db")
    assert f"the database is at {HEAD}, newer than 0001" in line
    assert "voice-agent db downgrade 0001 --yes" in line
    assert _revision(empty_db) == HEAD

    code, out, _ = await run_cli("db", "upgrade", env=env, cwd=tmp_path)
    assert (code, out.strip()) == (0, f"database is at {HEAD} (head): nothing to do")
    code, _, err = await run_cli("db", "upgrade", "9999", env=env, cwd=tmp_path)
    assert code == 2 and "no migration '9999'" in _one_line(err, "db")


async def test_db_downgrade_is_explicit(empty_db: str, tmp_path: Path) -> None:
    env = clean_env(DATABASE_URL=empty_db)
    assert (await run_cli("db", "upgrade", env=env, cwd=tmp_path))[0] == 0
    code, _, err = await run_cli("db", "downgrade", "0002", env=env, cwd=tmp_path)
    assert code == 2 and "add --yes" in _one_line(err, "db")
    assert _revision(empty_db) == HEAD
    code, out, _ = await run_cli("db", "downgrade", "0002", "--yes", env=env, cwd=tmp_path)
    assert (code, out.strip()) == (0, f"database is at 0002 (was {HEAD} (head))")
    code, out, _ = await run_cli("db", "current", env=env, cwd=tmp_path)
    assert out.strip() == f"database is at 0002; this version's head is {HEAD}"


async def test_an_unreachable_database_is_one_line_for_db_upgrade_and_serve(
    tmp_path: Path,
) -> None:
    env = clean_env(DATABASE_URL=f"postgresql://postgres@127.0.0.1:{free_port()}/nothing", PORT="0")
    code, _, err = await run_cli("db", "upgrade", env=env, cwd=tmp_path)
    assert code == 2
    assert "cannot reach the database" in _one_line(err, "db")
    code, out, err = await run_cli("serve", env=env, cwd=tmp_path)
    assert code == 2 and out == ""
    assert "cannot reach the database" in _one_line(err, "serve")


async def test_worker_on_an_unmigrated_database_fails_and_says_to_upgrade(
    empty_db: str, tmp_path: Path
) -> None:
    env = clean_env(DATABASE_URL=empty_db)
    code, out, err = await run_cli("worker", env=env, cwd=tmp_path)
    assert code == 2 and out == ""
    assert "run `voice-agent db upgrade`" in _one_line(err, "worker")
    assert (await run_cli("db", "upgrade", "0001", env=env, cwd=tmp_path))[0] == 0
    code, _, err = await run_cli("worker", env=env, cwd=tmp_path)
    assert code == 2
    line = _one_line(err, "worker")
    assert f"at migration 0001, this version needs {HEAD}" in line
    assert "voice-agent db upgrade" in line


async def test_worker_stops_cleanly_on_sigterm(clean_db: str, tmp_path: Path) -> None:
    env = clean_env(DATABASE_URL=clean_db, LOG_LEVEL="INFO")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", "worker",
        env=env, cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()
        assert line.startswith("operation worker ") and "running" in line
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"Traceback" not in err
    assert b"stopped" in err


async def test_a_bad_setting_is_one_line(tmp_path: Path) -> None:
    code, _, err = await run_cli("serve", env=clean_env(PORT="eighty"), cwd=tmp_path)
    assert code == 2
    assert "bad setting: PORT:" in _one_line(err, "serve")


# --- settings that cannot work ------------------------------------------------------------

# Never reached: a bad setting stops the command before the database is opened.
NO_DATABASE = "postgresql://nobody@127.0.0.1:9/none"


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("SIP_BIND", "notahost", "is not host:port: write it as 0.0.0.0:5060"),
        ("SIP_BIND", "notahost:5060", "'notahost' is not an IP address"),
        ("SIP_RTP_PORTS", "abc", "set e.g. 20000-20999"),
        ("SIP_RTP_PORTS", "20001", "holds no even port"),
        ("MAX_LIVE_CALLS", "0", "greater than or equal to 1 (default 50)"),
        ("MAX_LIVE_CALLS", "-1", "greater than or equal to 1 (default 50)"),
        ("SIP_MAX_CALLS", "0", "greater than or equal to 1"),
        ("PUBLIC_BASE_URL", "voice.example.com", "write it with its scheme, e.g. https://"),
        ("OPENAI_BASE_URL", "127.0.0.1:8765/v1", "write it with its scheme"),
        ("PORT", "70000", "less than or equal to 65535"),
        ("STREAM_TOKEN_TTL_S", "0", "greater than 0"),
        ("SIP_ALLOW_FROM", "10.0.0.0/8,trunk", "'trunk' is not an address or CIDR"),
        ("SIP_TRUSTED_PROXIES", "10.0.0.10,kamailio", "'kamailio' is not an address or CIDR"),
        ("METRICS_BIND", "9100", "is not host:port"),
        ("LOG_LEVEL", "loud", "use DEBUG, INFO, WARNING or ERROR"),
        ("WEBHOOKS", "[{", "not JSON"),
        ("CONSOLE_PASSWORD", "pw", "at least 10 characters"),
        ("CONSOLE_USER", "bad name!", "a staff name is 1-48 characters"),
        ("CALL_DEAD_AFTER_S", "5", "must be above CALL_HEARTBEAT_S"),
        ("WORKER_STALLED_AFTER_S", "1", "must be above WORKER_HEARTBEAT_S"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_naming_it_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, expected: str
) -> None:
    # Read from the environment, as `voice-agent` reads it (the subprocess test below runs
    # the command itself).
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as err:
        Settings()
    (problem,) = setting_problems(err.value)
    assert problem.startswith(f"{name}: ") or name in problem, problem
    assert expected in problem, problem


async def test_every_bad_setting_is_reported_at_once_one_line_each(tmp_path: Path) -> None:
    bad = {
        "SIP_BIND": "notahost",
        "SIP_RTP_PORTS": "abc",
        "MAX_LIVE_CALLS": "0",
        "PUBLIC_BASE_URL": "voice.example.com",
        "PORT": "70000",
    }
    code, out, err = await run_cli(
        "serve", env=clean_env(DATABASE_URL=NO_DATABASE, **bad), cwd=tmp_path
    )
    assert code == 2 and out == "" and "Traceback" not in err
    lines = error_lines(err)
    assert all(line.startswith("voice-agent serve: bad setting: ") for line in lines), lines
    named = {line.split(": ")[2]: line for line in lines}
    assert sorted(named) == sorted(bad), lines
    assert "write it with its scheme" in named["PUBLIC_BASE_URL"]
    assert "'notahost' is not host:port" in named["SIP_BIND"]


async def test_a_sip_bind_that_cannot_be_bound_is_one_line(tmp_path: Path) -> None:
    # An address of another machine (TEST-NET-1), then a SIP port another process holds.
    env = clean_env(DATABASE_URL=NO_DATABASE, SIP_BIND="192.0.2.1:5060")
    code, _, err = await run_cli("serve", env=env, cwd=tmp_path)
    assert code == 2
    assert "192.0.2.1: not an address of this machine" in _one_line(err, "serve")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        env = clean_env(DATABASE_URL=NO_DATABASE, SIP_BIND=f"127.0.0.1:{port}")
        code, _, err = await run_cli("serve", env=env, cwd=tmp_path)
    assert code == 2
    line = _one_line(err, "serve")
    assert f"SIP port {port} on 127.0.0.1 is already in use" in line and "SIP_BIND" in line


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read it (No such file or directory): check the path"),
        ("{not json", "not JSON (Expecting property name"),
        ('[{"phones": ["+15551230000"]}]', 'each with "account_id"'),
    ],
)
async def test_an_accounts_file_that_cannot_be_used_is_one_line(
    tmp_path: Path, content: str | None, expected: str
) -> None:
    path = tmp_path / "accounts.json"
    if content is not None:
        path.write_text(content)
    env = clean_env(DATABASE_URL=NO_DATABASE, ACCOUNTS_FILE=str(path))
    code, _, err = await run_cli("serve", env=env, cwd=tmp_path)
    assert code == 2
    line = _one_line(err, "serve")
    assert f"ACCOUNTS_FILE {path}: " in line and expected in line, line


# --- which Realtime the calls reach ----------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"public_base_url": "https://voice.example.com"}, "PUBLIC_BASE_URL is https"),
        ({"twilio_account_sid": "AC" + "1" * 32}, "TWILIO_ACCOUNT_SID is set"),
        ({"twilio_auth_token": "0123456789abcdef"}, "TWILIO_AUTH_TOKEN is set"),
        ({"openai_webhook_secret": "whsec_c2VjcmV0"}, "OPENAI_WEBHOOK_SECRET is set"),
        ({"realtime_simulator": False}, "REALTIME_SIMULATOR=false"),
    ],
)
def test_without_a_key_a_production_configuration_is_refused_the_simulator(
    values: dict[str, object], named: str
) -> None:
    settings = Settings(openai_api_key=None, openai_base_url=None, **values)  # type: ignore[arg-type]
    with pytest.raises(StartupError) as err:
        plan_realtime(settings)
    assert str(err.value).startswith("OPENAI_API_KEY is not set") and named in str(err.value)
    # Asked for, the simulator runs whatever the rest says; a dev setup gets it unasked.
    assert plan_realtime(
        settings.model_copy(update={"realtime_simulator": True})
    ).in_process_simulator
    assert plan_realtime(Settings(openai_api_key=None, openai_base_url=None)).in_process_simulator


async def test_serve_without_a_key_refuses_to_answer_real_callers_with_the_simulator(
    tmp_path: Path,
) -> None:
    env = clean_env(DATABASE_URL=NO_DATABASE, PUBLIC_BASE_URL="https://voice.example.com")
    code, out, err = await run_cli("serve", env=env, cwd=tmp_path)
    assert code == 2 and out == ""
    line = _one_line(err, "serve")
    assert "OPENAI_API_KEY is not set, but PUBLIC_BASE_URL is https" in line
    assert "set OPENAI_API_KEY" in line and "REALTIME_SIMULATOR=true (serve --simulator)" in line


async def test_serve_simulator_answers_with_the_simulator_when_asked_even_in_production(
    database_url: str, tmp_path: Path
) -> None:
    env = clean_env(
        DATABASE_URL=database_url,
        PORT="0",
        CONSOLE_PASSWORD="a-long-password",
        PUBLIC_BASE_URL="https://voice.example.com",
        TWILIO_AUTH_TOKEN="0123456789abcdef",
    )
    async with serve_process(env, tmp_path, "--no-worker", "--simulator") as service:
        realtime = next(line for line in service.banner if "Realtime" in line)
        assert "local simulator" in realtime and "REALTIME_SIMULATOR" in realtime
        service.signal(signal.SIGTERM)
        assert await service.wait() == 0


class ModelsApi:
    """A stand-in for the API's `GET /v1/models/{model}` on a real socket: answers `status`,
    or never answers (None); records what it was asked."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        self.requests: list[str] = []
        self._server: asyncio.Server | None = None
        self._held: list[asyncio.StreamWriter] = []

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    async def __aenter__(self) -> ModelsApi:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        for writer in self._held:
            writer.close()
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        self.requests.append(head)
        if self.status is None:
            self._held.append(writer)  # read, never answered
            return
        body = json.dumps({"id": "gpt-realtime", "object": "model", "created": 0, "owned_by": ""})
        if self.status == 401:
            body = json.dumps(
                {"error": {"message": "Incorrect API key", "code": "invalid_api_key"}}
            )
        writer.write(
            f"HTTP/1.1 {self.status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode()
        )
        await writer.drain()
        writer.close()


async def test_serve_refuses_a_key_the_api_refuses_naming_openai_api_key(tmp_path: Path) -> None:
    async with ModelsApi(401) as api:
        env = clean_env(
            DATABASE_URL=NO_DATABASE, OPENAI_API_KEY="sk-wrong", OPENAI_BASE_URL=api.base_url
        )
        code, out, err = await run_cli("serve", env=env, cwd=tmp_path)
    assert code == 2 and out == ""
    line = _one_line(err, "serve")
    assert "refused OPENAI_API_KEY (401)" in line and "set OPENAI_API_KEY" in line
    # One models request, with the key, before anything else (the database was never needed).
    (request,) = api.requests
    assert request.startswith("GET /v1/models/gpt-realtime ")
    assert "authorization: bearer sk-wrong" in request.lower()
    assert "sk-wrong" not in err


@pytest.mark.parametrize(
    ("answer", "warning"),
    [
        (200, None),
        ("closed", "cannot reach"),
        (None, "did not answer within 1 s (OPENAI_CHECK_TIMEOUT_S)"),
    ],
)
async def test_serve_checks_the_key_at_start_and_an_unreachable_api_is_a_warning(
    database_url: str, tmp_path: Path, answer: int | str | None, warning: str | None
) -> None:
    async with ModelsApi(None if answer == "closed" else answer) as api:  # type: ignore[arg-type]
        base_url = f"http://127.0.0.1:{free_port()}/v1" if answer == "closed" else api.base_url
        env = clean_env(
            DATABASE_URL=database_url,
            PORT="0",
            CONSOLE_PASSWORD="a-long-password",
            OPENAI_API_KEY="sk-test",
            OPENAI_BASE_URL=base_url,
            OPENAI_CHECK_TIMEOUT_S="1",
        )
        async with serve_process(env, tmp_path, "--no-worker") as service:
            service.signal(signal.SIGTERM)
            assert await service.wait() == 0
    logged = service.stderr
    assert "Traceback" not in logged
    if warning is None:
        assert "OPENAI_API_KEY checked" in logged and "not checked" not in logged
        assert len(api.requests) == 1
    else:
        (line,) = [x for x in logged.splitlines() if "OPENAI_API_KEY not checked" in x]
        assert " WARNING " in line and warning in line and "starting anyway" in line


async def test_sor_takes_its_database_from_sor_database_url(
    database_url: str, tmp_path: Path
) -> None:
    # DATABASE_URL leads nowhere: only SOR_DATABASE_URL can make it start.
    env = clean_env(DATABASE_URL=NO_DATABASE, SOR_DATABASE_URL=database_url)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", "sor", "--port", str(free_port()),
        env=env, cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            line = (await proc.stdout.readline()).decode()
        assert line.startswith("system of record listening on "), line
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
