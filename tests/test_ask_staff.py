"""`on_unknown: ask_staff`: a lost answer from an API without a lookup waits for a person.

The tools file's `request_nurse_callback` posts to an endpoint with neither idempotency keys
nor a lookup. When its answer is lost, the operation goes `unknown`, is marked as waiting
for staff (ledger, timeline, API), is never sent again, and is settled by a member of staff
through the API; the caller is told only what staff found.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.domains import APPOINTMENTS, AppointmentsBackend, appointments_catalog
from tests.e2e_support import CONSOLE, Service, running_service
from tests.sor_support import admit, events_of, get_op, transitions, wait_for, wait_status
from tools import staff
from tools.executor import enqueue_operation, make_app
from tools.ledger import OperationRecord
from tools.reconcile import Reconciler
from tools.registry import OnUnknown
from tools.results import status_message
from tools.states import OperationStatus as S
from tools.sweeper import Sweeper

CALLBACK_ARGS = {"name": "Ada", "topic": "a rash after the vaccination"}


@pytest.fixture
async def clinic(clean_db: str) -> AsyncIterator[AppointmentsBackend]:
    async with APPOINTMENTS.start(clean_db) as backend:
        assert isinstance(backend, AppointmentsBackend)
        yield backend


@pytest.fixture
async def service(
    engine: AsyncEngine, clean_db: str, clinic: AppointmentsBackend
) -> AsyncIterator[Service]:
    catalog = appointments_catalog(clinic.url, deadline_s=0.5)
    try:
        async with running_service(
            engine, with_worker=True, catalog=catalog, database_url=clean_db, sweep_interval_s=0.2
        ) as svc:
            yield svc
    finally:
        await catalog.aclose()


async def _lost_callback_request(
    engine: AsyncEngine, service: Service, clinic: AppointmentsBackend
) -> OperationRecord:
    clinic.set_faults(lose_response=1)
    tools = service.runtime.tools
    assert tools is not None
    op_id = await admit(engine, tools.enqueue, tool="request_nurse_callback", args=CALLBACK_ARGS)
    op = await wait_status(engine, op_id, S.UNKNOWN)

    async def waiting() -> OperationRecord | None:
        async with engine.connect() as conn:
            found = await staff.list_awaiting(conn)
        return next((o for o, _ in found if o.operation_id == op_id), None)

    await wait_for(waiting, lambda o: o is not None, what="waiting for staff")
    return op


async def _api(service: Service, method: str, path: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=service.url, auth=CONSOLE, timeout=10) as http:
        return await http.request(method, path, **kw)


async def test_a_lost_answer_without_a_lookup_waits_for_staff_and_is_never_resent(
    engine: AsyncEngine, clean_db: str, service: Service, clinic: AppointmentsBackend
) -> None:
    op = await _lost_callback_request(engine, service, clinic)
    parked = await get_op(engine, op.operation_id)
    assert parked.next_attempt_at is not None  # looked at again only rarely
    # Time passes and sweeps come round: still waiting, nothing asked, nothing resent.
    tools = service.runtime.tools
    assert tools is not None
    queue = make_app(clean_db)

    async def enqueue_at(conn: Any, operation_id: uuid.UUID, at: Any) -> None:
        await enqueue_operation(queue, conn, operation_id, schedule_at=at)

    sweeper = Sweeper(
        engine=engine,
        reconciler=Reconciler(
            engine=engine,
            registry=tools.registry,
            provider=tools.catalog.router,
            enqueue=enqueue_at,
        ),
    )
    for _ in range(3):
        async with engine.begin() as conn:
            await conn.execute(
                sa.text("UPDATE operations SET next_attempt_at = now() WHERE operation_id = :o"),
                {"o": op.operation_id},
            )
        report = await sweeper.sweep_once()
        assert report.reconciled[op.operation_id] == "unknown"
    assert clinic.api.effects().callbacks == 1
    assert (await get_op(engine, op.operation_id)).status is S.UNKNOWN
    events = await events_of(engine, op.operation_id)
    asked = [e for e in events if e.kind == "decision" and e.data.get("awaiting") == "staff"]
    assert len(asked) == 1 and asked[0].actor == "reconciler"
    # Staff see it: in the list of operations waiting for them, and on the operation.
    listed = (
        await _api(service, "GET", "/api/operations", params={"state": "awaiting_person"})
    ).json()
    assert [o["operation_id"] for o in listed["operations"]] == [str(op.operation_id)]
    one = (await _api(service, "GET", f"/api/operations/{op.operation_id}")).json()
    assert one["operation"]["console_state"] == "awaiting_person"
    # What the caller would hear meanwhile is the truth: not confirmed, a person checks.
    spec = service.runtime.tools.registry.get("request_nurse_callback")  # type: ignore[union-attr]
    assert spec.on_unknown is OnUnknown.ASK_STAFF
    said = status_message(spec, await get_op(engine, op.operation_id))
    assert "member of staff is checking" in said and "not confirmed" in said


async def test_staff_settle_it_as_committed_with_the_reference_they_found(
    engine: AsyncEngine, service: Service, clinic: AppointmentsBackend
) -> None:
    op = await _lost_callback_request(engine, service, clinic)
    made = next(iter(clinic.api.callbacks))
    resp = await _api(
        service,
        "POST",
        f"/api/operations/{op.operation_id}/settle",
        json={"verdict": "committed", "note": "found it in the clinic's list", "reference": made},
    )
    assert resp.status_code == 200, resp.text
    done = await get_op(engine, op.operation_id)
    assert done.status is S.COMMITTED and done.provider_ref == made
    assert transitions(await events_of(engine, op.operation_id))[-1] == ("unknown", "committed")
    settled = next(
        e for e in await events_of(engine, op.operation_id) if e.to_status is S.COMMITTED
    )
    assert settled.actor == f"staff:{CONSOLE[0]}" and settled.data["verdict"] == "committed"
    # Settled once: a second verdict is refused and changes nothing; it left the list.
    again = await _api(
        service,
        "POST",
        f"/api/operations/{op.operation_id}/settle",
        json={"verdict": "not_applied", "note": "changed my mind"},
    )
    assert again.status_code == 409
    assert (await get_op(engine, op.operation_id)).status is S.COMMITTED
    listed = (
        await _api(service, "GET", "/api/operations", params={"state": "awaiting_person"})
    ).json()
    assert listed["operations"] == []
    assert clinic.api.effects().callbacks == 1


async def test_staff_who_find_it_not_applied_fail_it_or_send_it_again(
    engine: AsyncEngine, service: Service, clinic: AppointmentsBackend
) -> None:
    first = await _lost_callback_request(engine, service, clinic)
    resp = await _api(
        service,
        "POST",
        f"/api/operations/{first.operation_id}/settle",
        json={"verdict": "not_applied", "note": "the clinic has no such request"},
    )
    assert resp.status_code == 200
    failed = await get_op(engine, first.operation_id)
    assert failed.status is S.FAILED_FINAL and clinic.api.effects().callbacks == 1

    second = await _lost_callback_request(engine, service, clinic)
    resp = await _api(
        service,
        "POST",
        f"/api/operations/{second.operation_id}/settle",
        json={"verdict": "retry", "note": "not there; send it again"},
    )
    assert resp.status_code == 200
    resent = await wait_status(engine, second.operation_id, S.COMMITTED)
    assert resent.attempts == 2 and resent.provider_ref is not None
    assert clinic.api.effects().callbacks == 3  # first, second, and the resend staff asked for


async def test_settling_needs_staff_a_known_operation_and_a_verdict(
    engine: AsyncEngine, service: Service
) -> None:
    async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
        anonymous = await http.get("/api/operations", params={"state": "awaiting_person"})
    assert anonymous.status_code == 401
    missing = await _api(
        service,
        "POST",
        f"/api/operations/{uuid.uuid4()}/settle",
        json={"verdict": "committed", "note": "x"},
    )
    assert missing.status_code == 404
    bad = await _api(
        service,
        "POST",
        f"/api/operations/{uuid.uuid4()}/settle",
        json={"verdict": "maybe", "note": ""},
    )
    assert bad.status_code == 422
