"""The demo system of record over real HTTP: idempotency keys, key lookup and faults."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import date

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.sor_support import CALLBACK_SECRET, AppServer, start_sor, wait_for
from tools.callback import SIGNATURE_HEADER, CallbackReport, verify_standard
from tools.provider import Outcome
from tools.restaurant.client import SorClient
from tools.restaurant.protocol import BookingRequest
from tools.restaurant.sor import Faults, SystemOfRecord

DAY = date(2026, 12, 5)
REQ = BookingRequest(date=DAY, time="21:00", party_size=4, name="Ada")


@pytest.fixture
async def sor(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    server = await start_sor(clean_db)
    yield server
    await server.stop()


@pytest.fixture
async def client(sor: SystemOfRecord) -> AsyncIterator[SorClient]:
    async with SorClient(sor.url, timeout_s=2.0) as c:
        yield c


async def test_same_key_same_body_replays_the_same_booking(
    sor: SystemOfRecord, client: SorClient
) -> None:
    first = await client.book_table("k1", REQ)
    second = await client.book_table("k1", REQ)
    assert first.outcome is Outcome.committed and second.outcome is Outcome.committed
    assert first.reference == second.reference
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_same_key_different_body_is_a_conflict(
    sor: SystemOfRecord, client: SorClient
) -> None:
    await client.book_table("k1", REQ)
    other = await client.book_table("k1", REQ.model_copy(update={"party_size": 5}))
    assert other.outcome is Outcome.failed_final
    assert other.status_code == 409 and other.error == "idempotency_conflict"
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_mutation_without_idempotency_key_is_refused(sor: SystemOfRecord) -> None:
    async with httpx.AsyncClient(base_url=sor.url, timeout=2.0) as http:
        resp = await http.post("/bookings", json=REQ.model_dump(mode="json"))
    assert resp.status_code == 400
    assert (await sor.side_effects()).bookings_inserted == 0


async def test_key_lookup_tells_applied_from_never_seen(client: SorClient) -> None:
    assert (await client.key_status("nope")).state == "not_found"
    booked = await client.book_table("k1", REQ)
    status = await client.key_status("k1")
    assert status.state == "completed" and status.result is not None
    assert status.result.id == booked.reference


async def test_fail_before_commit_applies_nothing_and_the_key_stays_free(
    sor: SystemOfRecord, client: SorClient
) -> None:
    sor.set_faults(Faults(fail_before_commit=1))
    failed = await client.book_table("k1", REQ)
    assert failed.outcome is Outcome.failed_retryable
    assert (await client.key_status("k1")).state == "not_found"
    retried = await client.book_table("k1", REQ)
    assert retried.outcome is Outcome.committed
    assert (await sor.side_effects()).bookings_inserted == 1


# Only the request that never gets an answer goes through an impatient client: every other
# request must be answered, however loaded the machine (a short timeout on those would make
# the test measure the machine's speed).


async def test_lost_response_is_unknown_yet_applied(sor: SystemOfRecord, client: SorClient) -> None:
    sor.set_faults(Faults(lose_response=1))
    async with SorClient(sor.url, timeout_s=0.5) as impatient:
        lost = await impatient.book_table("k1", REQ)
    assert lost.outcome is Outcome.unknown
    assert (await client.key_status("k1")).state == "completed"
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_hang_keeps_the_key_in_progress_until_released(
    sor: SystemOfRecord, client: SorClient
) -> None:
    sor.set_faults(Faults(hang=1))
    async with SorClient(sor.url, timeout_s=0.3) as impatient:
        hung = await impatient.book_table("k1", REQ)
    assert hung.outcome is Outcome.unknown
    assert (await client.key_status("k1")).state == "in_progress"
    again = await client.book_table("k1", REQ)
    assert again.outcome is Outcome.unknown and again.error == "in_progress"
    sor.release()
    await wait_for(lambda: client.key_status("k1"), lambda s: s.state == "completed", what="apply")
    assert (await sor.side_effects()).bookings_inserted == 1


async def test_faults_are_settable_over_http(sor: SystemOfRecord, client: SorClient) -> None:
    async with httpx.AsyncClient(base_url=sor.url, timeout=2.0) as http:
        # Without the SOR's own control token nothing is changed.
        for auth in ({}, {"Authorization": "Bearer wrong"}):
            refused = await http.post("/_faults", json={"fail_before_commit": 1}, headers=auth)
            assert refused.status_code == 401
            assert (await http.get("/_faults", headers=auth)).status_code == 401
        assert sor.faults.fail_before_commit == 0
        resp = await http.post(
            "/_faults",
            json={"fail_before_commit": 1},
            headers={"Authorization": f"Bearer {sor.control_token}"},
        )
        assert resp.status_code == 200
    assert (await client.book_table("k1", REQ)).outcome is Outcome.failed_retryable
    assert (await client.book_table("k1", REQ)).outcome is Outcome.committed


async def test_cancel_is_idempotent_and_counted_once(
    sor: SystemOfRecord, client: SorClient
) -> None:
    booked = await client.book_table("k1", REQ)
    assert booked.reference is not None
    first = await client.cancel_booking("c1", booked.reference)
    second = await client.cancel_booking("c2", booked.reference)
    assert first.outcome is Outcome.committed and second.outcome is Outcome.committed
    assert first.booking is not None and first.booking.status == "cancelled"
    assert (await sor.side_effects()).cancellations == 1
    fetched = await client.get_booking(booked.reference)
    assert fetched is not None and fetched.status == "cancelled"


async def test_unknown_booking_cancel_fails_for_good(client: SorClient) -> None:
    result = await client.cancel_booking("c1", "BKMISSING")
    assert result.outcome is Outcome.failed_final and result.status_code == 404


async def test_availability_counts_confirmed_seats(sor: SystemOfRecord, client: SorClient) -> None:
    before = await client.check_availability(DAY, "21:00", 4)
    await client.book_table("k1", REQ)
    after = await client.check_availability(DAY, "21:00", 4)
    assert before.seats_left - after.seats_left == 4
    full = await client.book_table(
        "k2", REQ.model_copy(update={"party_size": after.seats_left + 1})
    )
    assert full.outcome is Outcome.failed_final and full.error == "no_availability"


async def test_async_mode_accepts_then_reports_through_a_signed_callback(
    sor: SystemOfRecord, client: SorClient
) -> None:
    received: list[tuple[bytes, dict[str, str]]] = []
    hook = FastAPI()

    @hook.post("/cb")
    async def cb(request: Request) -> JSONResponse:
        received.append((await request.body(), dict(request.headers)))
        return JSONResponse({"ok": True})

    async with AppServer(hook) as receiver:
        sor.set_faults(Faults(async_mode=True, async_delay_s=0.05))
        accepted = await client.book_table("k1", REQ, callback_url=f"{receiver.url}/cb")
        assert accepted.outcome is Outcome.pending
        await wait_for(lambda: asyncio.sleep(0, len(received)), bool, what="callback")
    body, headers = received[0]
    assert verify_standard(CALLBACK_SECRET, headers, body) == headers["webhook-id"]
    assert SIGNATURE_HEADER.lower() not in headers  # the deprecated header is not sent
    report = CallbackReport.model_validate(json.loads(body))
    assert report.status == "committed" and report.result is not None
    assert (await sor.side_effects()).bookings_inserted == 1
