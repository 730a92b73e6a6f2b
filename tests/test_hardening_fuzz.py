"""Issue 13: random and hostile input to every unauthenticated entry point, over real sockets.

Hypothesis draws requests (method, path, headers, body, lying Content-Length, odd content
types) and media-socket frames; the service must answer each without a 5xx, log no traceback
and no ERROR, and keep the database exactly as it was (nothing unauthenticated is stored).
The examples run in a worker thread with blocking clients while the service runs in the
test's event loop.
"""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import uuid
from collections.abc import Iterator
from urllib.parse import urlencode

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine
from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

from app.logging import LOG_FORMAT, RedactingFormatter
from tests.e2e_support import running_service

EXAMPLES = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)

PATHS = [
    "/twilio/voice",
    "/twilio/status",
    "/twilio/sms-status",
    f"/operations/{uuid.uuid4()}/callback",
    "/operations/not-a-uuid/callback",
    "/console/login",
    "/console/calls",
    "/api/calls",
    "/healthz",
    "/readyz",
    "/metrics",
    "/openai/webhook",
    "/%00",
    "/" + "a" * 3000,
]
_text = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], max_codepoint=0x2FFF), max_size=80
)
_header_value = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=120
)
HEADERS = st.dictionaries(
    st.sampled_from(
        [
            "content-type",
            "x-twilio-signature",
            "webhook-id",
            "webhook-timestamp",
            "webhook-signature",
            "x-signature",
            "authorization",
            "cookie",
            "x-forwarded-for",
            "transfer-encoding-x",
        ]
    ),
    _header_value,
    max_size=6,
)
BODIES = st.one_of(
    st.binary(max_size=4000),
    st.dictionaries(_text, _text, max_size=8).map(
        lambda d: "&".join(f"{k}={v}" for k, v in d.items()).encode()
    ),
    st.just(b'{"idempotency_key": "k", "status": "committed", "sequence": 1}'),
    st.just(b"CallSid=CA" + b"1" * 200 + b"&From=%2B15551234567&To=%2B1" + b"5" * 120),
)
FRAMES = st.lists(
    st.one_of(
        st.binary(max_size=200),
        _text,
        st.sampled_from(
            [
                '{"event":"connected"}',
                '{"event":"start","start":{}}',
                '{"event":"start","start":{"streamSid":"MZ1","callSid":"CA1",'
                '"customParameters":{"token":"x"}}}',
                '{"event":"media"}',
                "{}",
                "[]",
                "null",
            ]
        ),
    ),
    max_size=12,
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


async def _row_counts(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        tables = (
            (
                await conn.execute(
                    sa.text(
                        "SELECT table_schema || '.' || table_name FROM information_schema.tables "
                        "WHERE table_type = 'BASE TABLE' AND table_schema NOT IN "
                        "('pg_catalog', 'information_schema')"
                    )
                )
            )
            .scalars()
            .all()
        )
        counts = {}
        for table in tables:
            schema, name = table.split(".", 1)
            counts[table] = (
                await conn.execute(sa.text(f'SELECT count(*) FROM "{schema}"."{name}"'))
            ).scalar_one()
    return counts


async def test_hostile_input_to_every_unauthenticated_entry_point(
    engine: AsyncEngine, service_log: io.StringIO
) -> None:
    statuses: list[int] = []
    async with running_service(
        engine, console_http_basic=False, http_header_timeout_s=2.0, http_body_timeout_s=1.0
    ) as service:
        port = service.settings.port
        before = await _row_counts(engine)

        @EXAMPLES
        @given(
            method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD"]),
            path=st.sampled_from(PATHS),
            query=st.dictionaries(_text, _text, max_size=3),
            headers=HEADERS,
            body=BODIES,
            lie=st.sampled_from([None, "0", "1", "99999999", "-1", "abc", "1e3"]),
        )
        def http_example(
            method: str,
            path: str,
            query: dict[str, str],
            headers: dict[str, str],
            body: bytes,
            lie: str | None,
        ) -> None:
            # Raw bytes on a socket: a client library would refuse to send the lies.
            length = lie if lie is not None else str(len(body))
            head = f"{method} {path}{'?' + urlencode(query) if query else ''} HTTP/1.1\r\n"
            head += "Host: 127.0.0.1\r\nConnection: close\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            head += f"content-length: {length}\r\n\r\n"
            answer = b""
            with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
                try:
                    sock.sendall(head.encode() + body)
                    while chunk := sock.recv(65536):
                        answer += chunk
                except (ConnectionResetError, BrokenPipeError):
                    pass
            if not answer:
                return  # closed without an answer (a deadline, a refused request)
            status = int(answer.split(b" ", 2)[1])
            statuses.append(status)
            assert status < 500, (method, path, status, answer[:300])

        @settings(EXAMPLES, max_examples=40)
        @given(frames=FRAMES)
        def media_example(frames: list[str | bytes]) -> None:
            try:
                with connect(f"ws://127.0.0.1:{port}/twilio/media", open_timeout=10) as ws:
                    for frame in frames:
                        ws.send(frame)
                    ws.recv(timeout=0.5)  # a close or nothing; never a call
            except (WebSocketException, TimeoutError, OSError):
                pass

        await asyncio.to_thread(http_example)
        await asyncio.to_thread(media_example)
        await service.runtime.events.flush()
        after = await _row_counts(engine)
    text = service_log.getvalue()
    assert statuses  # the examples ran
    assert "Traceback" not in text
    assert [ln for ln in text.splitlines() if " ERROR " in ln] == []
    grown = {t: (before[t], after.get(t)) for t in before if after.get(t) != before[t]}
    assert grown == {}
