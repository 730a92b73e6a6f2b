"""Adversarial HTTP over real sockets: the operation callback and the system of record's API."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import running_service
from tests.sor_support import CALLBACK_SECRET, admit, get_op, start_sor
from tools import ledger
from tools.callback import SIGNATURE_HEADER, sign
from tools.restaurant.protocol import IDEMPOTENCY_HEADER
from tools.restaurant.sor import SystemOfRecord
from tools.states import OperationStatus as S

_GARBAGE_JSON: list[bytes] = [
    b"",
    b"null",
    b"[]",
    b"{",
    b'{"idempotency_key": 5, "status": "committed", "sequence": 1}',
    b'{"idempotency_key": "k", "status": "teleported", "sequence": 1}',
    b'{"idempotency_key": "k", "status": "committed", "sequence": -1}',
    b'{"idempotency_key": "k", "status": "committed", "sequence": 1e400}',
    b'{"idempotency_key": "k", "status": "committed", "sequence": ' + b"9" * 5000 + b"}",
    b'{"idempotency_key": "k", "status": "committed", "sequence": NaN}',
    b'{"idempotency_key": "k", "status": "committed", "sequence": 1, "booking": []}',
    b'{"idempotency_key": "\\u0000", "status": "failed", "sequence": 1}',
    b"[" * 20_000,
    b"\xff\xfe\x00garbage",
]


async def _post(
    client: httpx.AsyncClient, url: str, body: bytes, headers: dict[bytes, bytes]
) -> int:
    response = await client.post(url, content=body, headers=headers)
    return response.status_code


async def test_garbage_operation_callbacks_are_rejected_with_a_4xx(engine: AsyncEngine) -> None:
    rng = random.Random(20261130)
    bodies = [*_GARBAGE_JSON, *(rng.randbytes(rng.randrange(1, 3000)) for _ in range(10))]
    results: list[tuple[str, bytes, int]] = []
    async with (
        running_service(
            engine,
            sor_callback_secret=CALLBACK_SECRET,
            sor_callback_accept_legacy_signature=True,  # these cover the old header
        ) as service,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = f"{service.url}/operations/{uuid.uuid4()}/callback"
        for body in bodies:
            good = sign(CALLBACK_SECRET, body)
            hexdigest = good.removeprefix("sha256=")
            signatures: dict[str, bytes | None] = {
                "signed": good.encode(),
                "unsigned": None,
                "empty": b"",
                "sha1 scheme": b"sha1=" + hexdigest.encode(),
                "bare hex": hexdigest.encode(),
                "upper scheme": b"SHA256=" + hexdigest.encode(),
                "other body": sign(CALLBACK_SECRET, body + b" ").encode(),
                "wrong secret": sign("not-the-secret", body).encode(),
                "non-ascii": b"sha256=\xe9\xff" + hexdigest.encode()[2:],
            }
            for case, signature in signatures.items():
                headers = {b"content-type": b"application/json"}
                if signature is not None:
                    headers[SIGNATURE_HEADER.encode()] = signature
                results.append((case, body[:30], await _post(client, url, body, headers)))
        not_uuid = await _post(client, f"{service.url}/operations/not-a-uuid/callback", b"{}", {})
    bad = [r for r in results if not 400 <= r[2] < 500]
    assert bad == []
    assert 400 <= not_uuid < 500
    # The oracle: signed garbage is a 400 (bad report) or 404 (no such operation), never 403.
    assert {code for case, _, code in results if case == "signed"} <= {400, 404}
    assert {code for case, _, code in results if case != "signed"} == {403}


async def test_huge_operation_callbacks_declared_or_chunked_are_refused_with_413(
    engine: AsyncEngine,
) -> None:
    async with (
        running_service(
            engine,
            sor_callback_secret=CALLBACK_SECRET,
            sor_callback_accept_legacy_signature=True,  # these cover the old header
        ) as service,
        httpx.AsyncClient(timeout=30) as client,
    ):
        url = f"{service.url}/operations/{uuid.uuid4()}/callback"
        body = b'{"pad": "' + b"x" * (64 * 1024) + b'"}'
        declared = await _post(
            client, url, body, {SIGNATURE_HEADER.encode(): sign(CALLBACK_SECRET, body).encode()}
        )

        async def endless() -> AsyncIterator[bytes]:
            for _ in range(4096):  # 64 MiB if the server read it all
                yield b"x" * 16384

        streamed = await client.post(
            url, content=endless(), headers={SIGNATURE_HEADER: "sha256=00"}
        )
    assert declared == 413
    assert streamed.status_code == 413


@pytest.fixture
async def sor(database_url: str) -> AsyncIterator[SystemOfRecord]:
    system = await start_sor(database_url)
    try:
        yield system
    finally:
        await system.stop()


_BOOKINGS: list[Any] = [
    b"",
    b"{",
    b"[" * 20_000,
    b"null",
    {"date": "2026-12-05", "time": "21:00", "party_size": 2},
    {"date": "2026-12-05", "time": "21:00", "party_size": 2, "name": "A", "extra": 1},
    {"date": "2026-02-30", "time": "21:00", "party_size": 2, "name": "A"},
    {"date": "2026-12-05", "time": "25:00", "party_size": 2, "name": "A"},
    {"date": "2026-12-05", "time": "21:00", "party_size": 10**30, "name": "A"},
    {"date": "2026-12-05", "time": "21:00", "party_size": 2, "name": "A\u0000B"},
    {"date": "2026-12-05", "time": "21:00", "party_size": 2, "name": "x" * 10_000},
    {"date": "2026-12-05", "time": "21:00", "party_size": "2", "name": ["A"]},
]


def _body(item: Any) -> bytes:
    return item if isinstance(item, bytes) else json.dumps(item).encode()


async def test_the_system_of_record_answers_garbage_with_a_4xx_and_keeps_no_stuck_key(
    sor: SystemOfRecord,
) -> None:
    results: list[tuple[str, int]] = []
    async with httpx.AsyncClient(base_url=sor.url, timeout=10) as client:
        for n, item in enumerate(_BOOKINGS):
            key = f"fuzz-{n}"
            response = await client.post(
                "/bookings", content=_body(item), headers={IDEMPOTENCY_HEADER: key}
            )
            results.append((f"POST /bookings {str(item)[:40]}", response.status_code))
            if response.status_code < 500:
                state = (await client.get(f"/idempotency/{key}")).json()["state"]
                # A rejected request must not leave its key "in progress" forever.
                assert state in ("not_found", "completed"), (item, state)
        for n, path in enumerate(["%00", "x" * 5000, "%ED%A0%80", "..%2F..%2Fetc", "\u00e9"]):
            for method, url in [
                ("GET", f"/bookings/{path}"),
                ("GET", f"/idempotency/{path}"),
                ("POST", f"/bookings/{path}/cancel"),
            ]:
                response = await client.request(method, url, headers={IDEMPOTENCY_HEADER: f"c-{n}"})
                results.append((f"{method} {url[:40]}", response.status_code))
        for params in [
            {"date": "x", "time": "21:00", "party_size": "2"},
            {"date": "2026-12-05", "time": "\x00", "party_size": "2"},
            {"date": "2026-12-05", "time": "21:00", "party_size": "9" * 5000},
            {"date": "2026-12-05", "time": "21:00"},
        ]:
            response = await client.get("/availability", params=params)
            results.append((f"GET /availability {params}"[:60], response.status_code))
        incompressible = "".join(random.Random(7).choices("abcdefghijklmnopqrstuvwxyz", k=8000))
        for headers in [
            {},
            {IDEMPOTENCY_HEADER: ""},
            {IDEMPOTENCY_HEADER: "k" * 10_000},
            {IDEMPOTENCY_HEADER: incompressible},
        ]:
            good = {"date": "2026-12-05", "time": "21:00", "party_size": 2, "name": "Ada"}
            response = await client.post("/bookings", json=good, headers=headers)
            results.append((f"POST /bookings key={str(headers)[:30]}", response.status_code))
        control = {"Authorization": f"Bearer {sor.control_token}"}
        stats = (await client.get("/_stats", headers=control)).json()
    assert [r for r in results if r[1] >= 500] == []
    # Only the one well-formed booking with a long (but present) key was applied.
    assert stats["bookings_inserted"] <= 1


async def _noop_enqueue(conn: object, operation_id: uuid.UUID) -> None:
    return None


@pytest.mark.parametrize(
    "report",
    [
        {"status": "committed", "booking": {"name": "A\u0000"}},
        {"status": "committed", "booking": {"id": "BK" + "9" * 500}},
        {"status": "committed", "booking": {"id": "BK\u0000"}},
        {"status": "failed", "error": "no\u0000pe"},
        {"status": "failed", "error": "x" * 50_000},
        {"status": "committed", "sequence": 10**30},
    ],
)
async def test_signed_reports_with_unstorable_content_are_not_a_500(
    engine: AsyncEngine, report: dict[str, Any]
) -> None:
    op_id = await admit(engine, _noop_enqueue)
    async with engine.begin() as conn:
        op = await ledger.claim_for_execution(conn, op_id, worker_id="w", attempt_deadline_s=30)
    assert op is not None
    booking = {
        "id": "BK7QX2MHN4",
        "date": "2026-12-05",
        "time": "21:00",
        "party_size": 4,
        "name": "Ada",
        "status": "confirmed",
        **report.get("booking", {}),
    }
    payload = {
        "idempotency_key": op.idempotency_key,
        "status": report["status"],
        "sequence": report.get("sequence", 1),
        "booking": booking if report["status"] == "committed" else None,
        "error": report.get("error"),
    }
    body = json.dumps(payload).encode()
    async with (
        running_service(
            engine,
            sor_callback_secret=CALLBACK_SECRET,
            sor_callback_accept_legacy_signature=True,  # these cover the old header
        ) as service,
        httpx.AsyncClient(timeout=10) as client,
    ):
        status = await _post(
            client,
            f"{service.url}/operations/{op_id}/callback",
            body,
            {SIGNATURE_HEADER.encode(): sign(CALLBACK_SECRET, body).encode()},
        )
    after = await get_op(engine, op_id)
    assert status < 500, status
    assert after.status in (S.RUNNING, S.COMMITTED, S.FAILED_FINAL, S.UNKNOWN), after.status
