"""Issue 13, over real sockets: what a hostile HTTP client could do, and what it gets now.

Redaction of whole log records (tracebacks and SQL parameters included), read deadlines and a
per-source connection bound, a voice webhook for an ended call, provider callbacks signed the
Standard Webhooks way, the console login limit, a body cut off mid-way, METRICS_BIND and what
`serve` starts for the demo system of record.
"""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine
from twilio.request_validator import RequestValidator

from app.logging import LOG_FORMAT, RedactingFilter, RedactingFormatter
from app.settings import Settings
from app.tool_wiring import runs_demo_sor
from tests.e2e_support import (
    AUTH_TOKEN,
    CONSOLE,
    call_row,
    post_signed,
    running_service,
    wait_until,
)
from tests.metrics_support import samples as metric_samples
from tests.server_proc import ServerProcess, free_port
from tests.test_operation_callback import _report, _running
from tools.callback import SIGNATURE_HEADER, sign, signed_headers
from tools.ledger_models import operations_table

CALLER = "+15551234567"
LONG_TO = "+1555" + "7" * 100  # 104 characters: no column holds it
CALLBACK_SECRET = "callback-secret-for-tests"


@pytest.fixture
def service_log() -> Iterator[io.StringIO]:
    """Everything logged at INFO and up, formatted as `configure_logging` formats it."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(RedactingFormatter(LOG_FORMAT))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _voice(call_sid: str, **extra: str) -> dict[str, str]:
    return {
        "CallSid": call_sid,
        "AccountSid": "AC" + "0" * 32,
        "From": CALLER,
        "To": "+15550000000",
        "CallStatus": "ringing",
        "Direction": "inbound",
        **extra,
    }


# --- 1. phone numbers in tracebacks --------------------------------------------------------


async def test_a_real_database_error_carrying_phone_numbers_is_logged_redacted(
    engine: AsyncEngine, service_log: io.StringIO
) -> None:
    log = logging.getLogger("test.hardening")
    try:
        async with engine.begin() as conn:
            await conn.execute(
                sa.text("INSERT INTO calls (id, call_sid, tenant_id, status, to_number) "
                        "VALUES (gen_random_uuid(), 'CAx', 't', 'ringing', :to)"),
                {"to": LONG_TO},
            )  # fmt: skip
    except sa.exc.DBAPIError:
        log.exception("insert failed for %s", CALLER)
    text = service_log.getvalue()
    assert "StringDataRightTruncation" in text or "value too long" in text  # the real error
    assert "Traceback" in text
    assert "7777777777" not in text and "5551234567" not in text
    assert "[phone …77]" in text and "[phone …67]" in text


async def test_a_voice_webhook_at_capacity_with_a_104_character_to_logs_no_number(
    engine: AsyncEngine, service_log: io.StringIO
) -> None:
    async with running_service(engine, max_live_calls=1) as service:
        # The one slot, held by a call answered whose stream has not started yet.
        held = await post_signed(service, "/twilio/voice", _voice("CAhold"))
        assert "<Stream" in held.text
        response = await post_signed(service, "/twilio/voice", _voice("CAcap", To=LONG_TO))
    text = service_log.getvalue()
    assert response.status_code == 200 and "<Say" in response.text  # the busy answer
    assert "could not record the refused call" in text and "Traceback" in text  # the path ran
    assert "5551234567" not in text and "7777777777" not in text


async def test_serve_at_capacity_writes_no_phone_number_to_its_log_stream(
    clean_db: str, tmp_path: Path
) -> None:
    """The attack as reported: `voice-agent serve`, a signed webhook at capacity with a
    104-character To, then the whole log stream grepped."""
    stderr = tmp_path / "serve.log"
    # The held call never streams, so it is live until the drain limit: with none, the stop
    # below ends it at once (and its shutdown lines are in the grepped stream too) instead of
    # waiting out DRAIN_TIMEOUT_S's 30 s default into the SIGKILL.
    env = {"DATABASE_URL": clean_db, "MAX_LIVE_CALLS": "1", "LOG_LEVEL": "INFO"}
    server = ServerProcess({**env, "DRAIN_TIMEOUT_S": "0"}, stderr_path=stderr)
    await server.start()
    try:
        public = server.url + "/twilio/voice"
        async with httpx.AsyncClient(timeout=10) as http:
            # The one slot, held by a call answered whose stream has not started yet.
            for params in (_voice("CAhold"), _voice("CAserve", To=LONG_TO)):
                signature = RequestValidator(AUTH_TOKEN).compute_signature(public, params)
                response = await http.post(
                    public, data=params, headers={"X-Twilio-Signature": signature}
                )
    finally:
        await server.stop()
    text = stderr.read_text("utf-8", "replace")
    assert response.status_code == 200
    assert "could not record the refused call" in text and "Traceback" in text
    assert "5551234567" not in text and "7777777777" not in text


# --- 4. read deadlines and the per-source bound ------------------------------------------


def _open(port: int, payload: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if payload:
        sock.sendall(payload)
    return sock


async def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (EOF or reset), or None if it stayed open."""
    started = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - started < seconds:
        try:
            data = await asyncio.to_thread(sock.recv, 65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - started
        if data == b"" or data.startswith(b"HTTP/1.1 4"):
            return time.monotonic() - started
    return None


async def test_silent_half_headers_and_half_body_connections_are_closed(
    engine: AsyncEngine,
) -> None:
    async with running_service(
        engine, http_header_timeout_s=1.0, http_body_timeout_s=1.0, http_idle_timeout_s=1.0
    ) as service:
        port = service.settings.port
        silent = _open(port)
        half_headers = _open(port, b"POST /twilio/voice HTTP/1.1\r\nHost: x\r\nX-Slow")
        half_body = _open(
            port,
            b"POST /twilio/voice HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n\r\nCallSid=CA",
        )
        idle = _open(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        results = await asyncio.gather(
            *(_closed_within(s, 8.0) for s in (silent, half_headers, half_body))
        )
        idle.settimeout(5)
        first = idle.recv(65536)
        idle_closed = await _closed_within(idle, 8.0)
        # A request that arrives in time is answered as ever.
        async with httpx.AsyncClient(timeout=5) as http:
            ok = await http.get(service.url + "/healthz")
        for s in (silent, half_headers, half_body, idle):
            s.close()
    assert all(r is not None and r < 6.0 for r in results), results
    assert first.startswith(b"HTTP/1.1 200") and idle_closed is not None
    assert ok.status_code == 200


async def test_an_endless_header_block_is_cut_off_by_size_not_only_by_time(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine, http_header_timeout_s=30.0) as service:
        sock = _open(service.settings.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
        try:
            for _ in range(400):  # 400 KB of headers, never ended
                sock.sendall(line)
        except (BrokenPipeError, ConnectionResetError):
            pass
        closed = await _closed_within(sock, 5.0)
        sock.close()
    assert closed is not None  # long before the 30 s header deadline


async def test_connections_beyond_the_per_source_bound_are_closed_at_once(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine, http_max_connections_per_source=3) as service:
        port = service.settings.port
        held = [_open(port) for _ in range(3)]
        await asyncio.sleep(0.2)
        extra = _open(port)
        refused = await _closed_within(extra, 3.0)
        for s in held:
            s.close()
        extra.close()

        async def answered() -> bool:
            async with httpx.AsyncClient(timeout=5) as http:
                try:
                    return (await http.get(service.url + "/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False

        await wait_until(answered, 5, "a fresh connection answered")
    assert refused is not None and refused < 2.0


# --- 7. a body cut off mid-way ------------------------------------------------------------


async def test_a_body_cut_off_mid_way_logs_no_traceback(
    engine: AsyncEngine, service_log: io.StringIO
) -> None:
    async with running_service(engine) as service:
        sock = _open(
            service.settings.port,
            b"POST /twilio/voice HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n\r\nCallSid=CA",
        )
        await asyncio.sleep(0.3)
        sock.close()
        await asyncio.sleep(0.5)
    text = service_log.getvalue()
    assert "Traceback" not in text and " ERROR " not in text


# --- 8. replayed voice webhook, login limit -----------------------------------------------


async def test_a_voice_webhook_for_an_ended_call_is_refused_and_holds_no_capacity(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine) as service:
        first = await post_signed(service, "/twilio/voice", _voice("CAended"))
        assert first.status_code == 200 and "<Stream" in first.text
        status = await post_signed(
            service, "/twilio/status", {"CallSid": "CAended", "CallStatus": "completed"}
        )
        assert status.status_code == 204
        replay = await post_signed(service, "/twilio/voice", _voice("CAended"))
        reserved = service.runtime.registry.load()
    row = await call_row(engine, "CAended")
    assert replay.status_code == 409 and "<Stream" not in replay.text
    assert reserved == 0  # no capacity slot held for the replay
    assert row is not None and row["status"] == "completed"


async def test_console_login_guessing_is_rate_limited_per_account_and_per_source(
    engine: AsyncEngine,
) -> None:
    async with running_service(engine) as service:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            codes = []
            for i in range(30):
                response = await http.get("/api/calls", auth=(CONSOLE[0], f"wrong-{i}"))
                codes.append(response.status_code)
            right = await http.get("/api/calls", auth=CONSOLE)
    assert codes[:5] == [401] * 5
    assert set(codes[5:]) == {429}  # refused without even checking the password
    assert right.status_code == 429  # the account stays locked for the window


# --- 8. provider callbacks: Standard Webhooks, replays, sequence ---------------------------


def _standard(body: bytes, msg_id: str, stamp: int | None = None) -> dict[str, str]:
    signed = signed_headers(CALLBACK_SECRET, body, msg_id, stamp)
    return {"content-type": "application/json", **signed}


def _legacy(body: bytes) -> dict[str, str]:
    return {"content-type": "application/json", SIGNATURE_HEADER: sign(CALLBACK_SECRET, body)}


async def _op_status(engine: AsyncEngine, op_id: uuid.UUID) -> str:
    async with engine.connect() as conn:
        return str(
            (
                await conn.execute(
                    sa.select(operations_table.c.status).where(
                        operations_table.c.operation_id == op_id
                    )
                )
            ).scalar_one()
        )


async def test_provider_callbacks_are_standard_webhooks_replays_and_stale_reports_ignored(
    engine: AsyncEngine,
) -> None:
    op = await _running(engine)
    url = f"/operations/{op.operation_id}/callback"

    def report(status: str, sequence: int) -> bytes:
        return _report(op, status, sequence)

    committed = report("committed", 2)
    async with (
        running_service(engine, sor_callback_secret=CALLBACK_SECRET) as service,
        httpx.AsyncClient(base_url=service.url, timeout=10) as http,
    ):
        json_type = {"content-type": "application/json"}
        legacy = await http.post(
            url,
            content=committed,
            headers={**json_type, SIGNATURE_HEADER: sign(CALLBACK_SECRET, committed)},
        )
        old = await http.post(
            url,
            content=committed,
            headers={
                **json_type,
                **signed_headers(CALLBACK_SECRET, committed, "msg_a", int(time.time()) - 301),
            },
        )
        assert await _op_status(engine, op.operation_id) == "running"
        headers = _standard(committed, "msg_a")
        applied = await http.post(url, content=committed, headers=headers)
        replayed = await http.post(url, content=committed, headers=headers)
        older = report("failed", 1)
        stale = await http.post(
            url,
            content=older,
            headers={**json_type, **signed_headers(CALLBACK_SECRET, older, "msg_b")},
        )
    async with engine.connect() as conn:
        receipts = (
            await conn.execute(
                sa.text("SELECT webhook_id, sequence, outcome FROM callback_receipts "
                        "ORDER BY received_at")
            )
        ).all()  # fmt: skip
    assert legacy.status_code == 403  # the body-only signature is off by default
    assert old.status_code == 403  # outside the 300 s tolerance
    assert applied.status_code == 200 and applied.json()["applied"] is True
    assert replayed.status_code == 200 and replayed.json() == {
        "applied": False, "status": None, "reason": "duplicate"
    }  # fmt: skip
    assert stale.status_code == 200 and stale.json()["reason"] == "stale"
    assert await _op_status(engine, op.operation_id) == "committed"
    assert [tuple(r) for r in receipts] == [("msg_a", 2, "applied"), ("msg_b", 1, "stale")]


async def test_the_legacy_signature_is_accepted_only_behind_its_setting(
    engine: AsyncEngine,
) -> None:
    op = await _running(engine)
    body = _report(op, "failed")
    async with (
        running_service(
            engine, sor_callback_secret=CALLBACK_SECRET, sor_callback_accept_legacy_signature=True
        ) as service,
        httpx.AsyncClient(base_url=service.url, timeout=10) as http,
    ):
        response = await http.post(
            f"/operations/{op.operation_id}/callback",
            content=body,
            headers={
                "content-type": "application/json",
                SIGNATURE_HEADER: sign(CALLBACK_SECRET, body),
            },
        )
    assert response.status_code == 200 and response.json()["applied"] is True
    assert await _op_status(engine, op.operation_id) == "failed_final"


# --- 6. what serve starts; 8. METRICS_BIND ---------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, True),
        ({"tools": "tools.restaurant"}, True),
        ({"sor_base_url": "http://sor.internal"}, False),
        ({"tools": "tests.domains:appointments_plugin"}, False),
    ],
)
def test_serve_starts_the_demo_sor_only_for_the_restaurant_demo_without_sor_base_url(
    env: dict[str, str], expected: bool
) -> None:
    assert runs_demo_sor(Settings(**env)) is expected


async def test_metrics_bind_moves_metrics_off_the_public_port(clean_db: str) -> None:
    metrics_port = free_port()
    server = ServerProcess(
        {
            "DATABASE_URL": clean_db,
            "METRICS_BIND": f"127.0.0.1:{metrics_port}",
            "CONSOLE_PASSWORD": "console-test-password",
        }
    )
    await server.start()
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            public = await http.get(server.url + "/metrics")
            private = await http.get(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        await server.stop()
    assert public.status_code == 404
    assert private.status_code == 200 and "voice_agent_live_calls" in private.text
    assert metric_samples(private.text)["voice_agent_streams_rejected_total"] == 0
    # The loop watch: serve's start-up collection (before the heap is frozen) is one pause.
    assert metric_samples(private.text)['voice_agent_gc_pause_seconds_count{generation="2"}'] >= 1
    assert "# TYPE voice_agent_event_loop_lag_seconds histogram" in private.text
