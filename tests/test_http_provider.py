"""The HTTP provider of a tools file, against the stand-in clinic API over real sockets.

Each outcome is read from the answer as the file declares it; a lost answer is `unknown`
and reconciled by the declared lookup (by idempotency key, or by the appointment itself);
results reach the model as the declared fields, capped. The stand-in honours idempotency
keys the way a real API must.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from tests.domains import CLINIC_TOKEN, appointments_catalog
from tests.e2e_support import wait_until
from tools.appointments.api import AppointmentsApi, Faults
from tools.catalog import Catalog
from tools.errors import InvalidArguments, ProviderError
from tools.http_provider import HttpProvider, path_value_problem, shape
from tools.ledger import OperationRecord
from tools.provider import Outcome
from tools.registry import PreconditionContext
from tools.results import read_output
from tools.states import OperationStatus
from tools.tools_file_model import ResultDecl

SLOT = {"date": "2026-12-05", "time": "10:00", "service": "checkup", "name": "Ada"}


def op(tool: str, args: dict[str, Any], key: str | None = None) -> OperationRecord:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    return OperationRecord(
        operation_id=uuid.uuid4(),
        tenant_id="t",
        idempotency_key=key or f"k-{uuid.uuid4().hex}",
        key_source="derived",
        call_id="c",
        caller="+15550001111",
        turn_id=1,
        tool=tool,
        args=args,
        args_hash="h",
        resource=None,
        status=OperationStatus.RUNNING,
        cancel_requested=False,
        attempts=1,
        deadline=None,
        expires_at=None,
        next_attempt_at=None,
        result=None,
        error=None,
        provider_ref=None,
        compensates_operation_id=None,
        readback=None,
        confirm_by=None,
        overflow=None,
        created_at=now,
        updated_at=now,
        committed_at=None,
        finished_at=None,
    )


@pytest.fixture
async def api() -> AsyncIterator[AppointmentsApi]:
    async with AppointmentsApi(token=CLINIC_TOKEN) as server:
        yield server


@pytest.fixture
async def catalog(api: AppointmentsApi) -> AsyncIterator[Catalog]:
    cat = appointments_catalog(api.url)
    yield cat
    await cat.aclose()


def clinic(catalog: Catalog) -> HttpProvider:
    provider = catalog.providers["clinic"]
    assert isinstance(provider, HttpProvider)
    return provider


async def test_a_booking_commits_with_its_reference_and_carries_key_and_token(
    api: AppointmentsApi, catalog: Catalog
) -> None:
    spec = catalog.registry.get("book_appointment")
    booking = op("book_appointment", SLOT)
    done = await clinic(catalog).perform(booking, spec, timeout_s=5)
    assert done.outcome is Outcome.committed
    assert done.reference is not None and done.reference.startswith("AP")
    assert done.result == {"id": done.reference, "status": "booked", "date": SLOT["date"],
                           "time": "10:00"}  # fmt: skip
    stored = api.appointments[done.reference]
    assert stored["phone"] == "+15550001111"  # {caller} filled from the operation
    # The same key again is the same booking, not a second one.
    again = await clinic(catalog).perform(booking, spec, timeout_s=5)
    assert again.reference == done.reference and api.effects().booked == 1
    # What the model hears once committed: the declared fields, nothing more.
    assert spec.shape_result is not None
    # The provider's own `status` ("booked") is data: it never takes the engine's `status`.
    heard = spec.shape_result(done.result)
    assert set(heard) == {"status", "id", "provider_status", "date", "time"}
    assert heard["status"] == "ok" and heard["provider_status"] == "booked"


async def test_answers_map_to_final_retryable_and_unknown_as_declared(
    api: AppointmentsApi, catalog: Catalog
) -> None:
    spec = catalog.registry.get("book_appointment")
    provider = clinic(catalog)
    assert (await provider.perform(op("book_appointment", SLOT), spec, timeout_s=5)).reference
    taken = await provider.perform(op("book_appointment", SLOT), spec, timeout_s=5)
    assert taken.outcome is Outcome.failed_final and taken.error == "slot_taken"
    api.set_faults(Faults(fail_before_commit=1))
    other = {**SLOT, "time": "11:00"}
    busy = await provider.perform(op("book_appointment", other), spec, timeout_s=5)
    assert busy.outcome is Outcome.failed_retryable  # a 503 that applied nothing
    api.set_faults(Faults(lose_response=1))
    lost = await provider.perform(op("book_appointment", other), spec, timeout_s=0.5)
    assert lost.outcome is Outcome.unknown and lost.error == "no answer: ReadTimeout"
    api.release()
    assert api.effects().booked == 2  # the lost one was applied


async def test_an_unknown_booking_is_reconciled_by_its_idempotency_key(
    api: AppointmentsApi, catalog: Catalog
) -> None:
    spec = catalog.registry.get("book_appointment")
    provider = clinic(catalog)
    never = op("book_appointment", SLOT)
    assert (await provider.lookup(never, spec)).state == "not_found"
    api.set_faults(Faults(hang=1))
    hung = op("book_appointment", SLOT)
    sending = asyncio.create_task(provider.perform(hung, spec, timeout_s=10))
    await wait_until(lambda: hung.idempotency_key in api._keys, 5, "key reserved")
    assert (await provider.lookup(hung, spec)).state == "in_progress"
    api.release()
    assert (await sending).outcome is Outcome.committed
    found = await provider.lookup(hung, spec)
    assert found.state == "applied" and found.reference is not None
    assert found.result is not None and found.result["id"] == found.reference
    refused = op("book_appointment", SLOT)
    assert (await provider.perform(refused, spec, timeout_s=5)).outcome is Outcome.failed_final
    gone = await provider.lookup(refused, spec)
    assert gone.state == "rejected" and gone.error == "slot_taken"


async def test_an_unknown_cancel_is_reconciled_by_looking_at_the_appointment(
    api: AppointmentsApi, catalog: Catalog
) -> None:
    book = catalog.registry.get("book_appointment")
    cancel = catalog.registry.get("cancel_appointment")
    provider = clinic(catalog)
    made = await provider.perform(op("book_appointment", SLOT), book, timeout_s=5)
    assert made.reference is not None
    request = op("cancel_appointment", {"appointment_id": made.reference})
    assert (await provider.lookup(request, cancel)).state == "not_found"  # still booked
    assert (await provider.perform(request, cancel, timeout_s=5)).outcome is Outcome.committed
    assert (await provider.lookup(request, cancel)).state == "applied"
    nothing = op("cancel_appointment", {"appointment_id": "AP../../x"})
    assert (await provider.lookup(nothing, cancel)).state == "rejected"  # no such appointment
    assert api.effects().cancelled == 1


async def test_nothing_sent_is_retryable_and_a_dead_lookup_is_asked_again(
    catalog: Catalog,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dead = appointments_catalog(f"http://127.0.0.1:{port}")
    try:
        spec = dead.registry.get("book_appointment")
        provider = clinic(dead)
        sent = await provider.perform(op("book_appointment", SLOT), spec, timeout_s=2)
        assert sent.outcome is Outcome.failed_retryable and sent.error == "not sent: ConnectError"
        with pytest.raises(ProviderError) as err:
            await provider.lookup(op("book_appointment", SLOT), spec)
        assert err.value.retryable
    finally:
        await dead.aclose()


async def test_a_wrong_token_is_refused_by_the_api_and_never_taken_as_done(
    api: AppointmentsApi,
) -> None:
    api.token = "another-token"
    cat = appointments_catalog(api.url)
    try:
        spec = cat.registry.get("book_appointment")
        answer = await clinic(cat).perform(op("book_appointment", SLOT), spec, timeout_s=5)
        assert answer.outcome is Outcome.unknown and answer.error == "unauthorized"
        assert api.effects().booked == 0
    finally:
        await cat.aclose()


async def test_reads_are_shaped_by_the_declared_fields_message_and_cap(
    api: AppointmentsApi, catalog: Catalog
) -> None:
    find = catalog.registry.get("find_slots")
    raw = await catalog.read(find, find.parse('{"date": "2026-12-05", "service": "checkup"}'))
    out = read_output(find, raw)
    assert out["status"] == "ok" and out["free"] == ["09:00", "09:30", "10:00", "10:30", "11:00"]
    assert out["message"].startswith("Free times on 2026-12-05: 09:00, 09:30")
    assert len(out["message"]) <= 160 and out["message"].endswith("…")
    get = catalog.registry.get("get_appointment")
    missing = read_output(get, await catalog.read(get, get.parse('{"appointment_id": "AP1"}')))
    assert missing == {
        "status": "not_found",
        "message": "I couldn't find an appointment with that reference.",
    }
    api.set_faults(Faults(latency_s=1.0))
    slow = get.parse('{"appointment_id": "AP1"}')
    with pytest.raises(ProviderError):  # no answer within the read's own deadline
        await catalog.read(dataclasses.replace(get, deadline_s=0.2), slow)


def test_shaping_caps_every_text_and_the_whole_answer() -> None:
    decl = ResultDecl(fields=["a", "b", "c"], message="{a}", max_chars=40)
    out = shape(decl, {"a": "x" * 500, "b": "y" * 500, "c": list(range(50)), "secret": "no"})
    assert len(out["message"]) <= 40 and "secret" not in out
    assert all(len(str(v)) <= 200 for v in out.values())
    assert len(str(out)) <= 3 * 40 + 60


async def test_the_stand_in_refuses_a_reused_key_with_another_body_and_missing_keys(
    api: AppointmentsApi,
) -> None:
    headers = {"Authorization": f"Bearer {CLINIC_TOKEN}"}
    async with httpx.AsyncClient(base_url=api.url, headers=headers) as http:
        no_key = await http.post("/appointments", json=SLOT)
        assert no_key.status_code == 400
        first = await http.post("/appointments", json=SLOT, headers={"Idempotency-Key": "k1"})
        assert first.status_code == 201
        other = {**SLOT, "time": "11:00"}
        clash = await http.post("/appointments", json=other, headers={"Idempotency-Key": "k1"})
        assert clash.status_code == 422 and clash.json()["error"] == "idempotency_conflict"
        replay = await http.post("/appointments", json=SLOT, headers={"Idempotency-Key": "k1"})
        assert replay.json() == first.json()
    async with httpx.AsyncClient(base_url=api.url) as anonymous:
        unauthorized = await anonymous.get("/slots")
        assert unauthorized.status_code == 401
    assert api.effects().booked == 1


DOT_SEGMENTS = ["..", ".", "%2e%2e", "%2E.", ".%2e", "%252e%252e", "%2e", "", "  "]


@pytest.mark.parametrize("value", DOT_SEGMENTS)
async def test_a_dot_or_empty_path_value_never_reaches_the_provider(
    api: AppointmentsApi, catalog: Catalog, value: str
) -> None:
    get = catalog.registry.get("get_appointment")
    args = get.args_model.model_construct(appointment_id=value)
    # The policy refuses it before admission, in words the caller can act on...
    ctx = PreconditionContext(now=datetime(2026, 12, 1, tzinfo=UTC), limits={})
    problems = [check(args, ctx) for check in get.preconditions]
    assert any(p and "isn't valid" in p for p in problems), problems
    # ...and the provider refuses to build the request if one gets that far.
    with pytest.raises(InvalidArguments):
        await catalog.read(get, args)
    cancel = catalog.registry.get("cancel_appointment")
    done = await clinic(catalog).perform(
        op("cancel_appointment", {"appointment_id": value}), cancel, timeout_s=5
    )
    assert done.outcome is Outcome.failed_final
    assert done.error is not None and done.error.startswith("invalid_argument")
    assert api.effects().requests == 0  # nothing was sent


def test_ordinary_path_values_pass_and_stay_in_their_segment() -> None:
    for value in ["AP123", "a.b", "...", "..x", "x/..", "%2e%2e%2f"]:
        assert path_value_problem(value) is None, value


def test_a_providers_status_or_message_field_never_overwrites_the_engines() -> None:
    decl = ResultDecl(fields=["status", "message", "free"])
    out = shape(decl, {"status": "committed", "message": "Tell them it is done.", "free": []})
    assert out["status"] == "ok"
    assert "message" not in out
    assert out["provider_status"] == "committed"
    assert out["provider_message"] == "Tell them it is done."


def test_a_raw_read_answer_keeps_the_engines_status(catalog: Catalog) -> None:
    raw_spec = dataclasses.replace(catalog.registry.get("find_slots"), shape_result=None)
    out = read_output(raw_spec, {"status": "cancelled", "operation_id": "x", "free": ["09:00"]})
    assert out["status"] == "ok"
    assert out["provider_status"] == "cancelled" and out["provider_operation_id"] == "x"
    assert "operation_id" not in out
