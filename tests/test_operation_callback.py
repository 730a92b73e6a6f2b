"""POST /operations/{id}/callback: signed, idempotent, order-safe."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import AsyncEngine

from app.deps import get_compensation, get_engine, get_settings_dep
from app.errors import install_error_handlers
from app.ops import routes_operations
from app.ops.worker import OperationWorker
from app.settings import Settings
from tests.sor_support import (
    CALLBACK_SECRET,
    AppServer,
    admit,
    events_of,
    exec_registry,
    get_op,
    start_sor,
    transitions,
    wait_status,
)
from tools import ledger
from tools.callback import SIGNATURE_HEADER, CallbackReport, sign, signed_headers
from tools.reconcile import Compensation
from tools.restaurant.catalog import restaurant_catalog
from tools.restaurant.client import SorClient
from tools.restaurant.protocol import Booking
from tools.restaurant.provider import SorProvider
from tools.restaurant.sor import Faults, SystemOfRecord
from tools.states import OperationStatus as S

BOOKING = Booking(
    id="BK7QX2MHN4", date="2026-12-05", time="21:00", party_size=4, name="Ada", status="confirmed"
)  # type: ignore[arg-type]


def service(
    engine: AsyncEngine,
    secret: str | None = CALLBACK_SECRET,
    compensation: Compensation | None = None,
) -> FastAPI:
    """Just the operation routes, with the service's error mapping."""
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(routes_operations.router)
    settings = Settings(sor_callback_secret=SecretStr(secret) if secret else None)
    app.dependency_overrides[get_engine] = lambda: engine
    app.dependency_overrides[get_settings_dep] = lambda: settings
    app.dependency_overrides[get_compensation] = lambda: compensation
    return app


@pytest.fixture
async def http(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=service(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as client:
        yield client


async def _noop_enqueue(conn: object, operation_id: uuid.UUID) -> None:
    return None


async def _running(engine: AsyncEngine) -> ledger.OperationRecord:
    op_id = await admit(engine, _noop_enqueue)
    async with engine.begin() as conn:
        op = await ledger.claim_for_execution(conn, op_id, worker_id="w", attempt_deadline_s=30)
    assert op is not None
    return op


def _report(op: ledger.OperationRecord, status: str, sequence: int = 1) -> bytes:
    return (
        CallbackReport(
            idempotency_key=op.idempotency_key,
            status=status,  # type: ignore[arg-type]
            sequence=sequence,
            result=BOOKING.model_dump(mode="json") if status == "committed" else None,
            reference=BOOKING.id if status == "committed" else None,
            error="no_availability" if status == "failed" else None,
        )
        .model_dump_json()
        .encode()
    )


async def _post(
    http: httpx.AsyncClient, op_id: uuid.UUID, body: bytes, secret: str = CALLBACK_SECRET
) -> httpx.Response:
    return await http.post(
        f"/operations/{op_id}/callback",
        content=body,
        headers={
            **signed_headers(secret, body, "msg_" + hashlib.sha256(body).hexdigest()[:32]),
            "content-type": "application/json",
        },
    )


async def test_signed_commit_report_moves_a_running_operation_to_committed(
    engine: AsyncEngine, http: httpx.AsyncClient
) -> None:
    op = await _running(engine)
    resp = await _post(http, op.operation_id, _report(op, "committed"))
    assert resp.status_code == 200 and resp.json()["applied"] is True
    after = await get_op(engine, op.operation_id)
    assert after.status is S.COMMITTED and after.provider_ref == BOOKING.id


async def test_commit_reported_after_a_cancel_request_is_compensated_by_a_linked_cancel(
    engine: AsyncEngine,
) -> None:
    enqueued: list[uuid.UUID] = []

    async def enqueue(conn: object, operation_id: uuid.UUID) -> None:
        enqueued.append(operation_id)

    op = await _running(engine)
    async with engine.begin() as conn:
        await ledger.request_cancel(
            conn, op.operation_id, actor="model", reason="caller changed mind"
        )
    app = service(engine, compensation=Compensation(restaurant_catalog(), enqueue))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        resp = await _post(http, op.operation_id, _report(op, "committed"))
        again = await _post(http, op.operation_id, _report(op, "committed"))
    assert resp.status_code == 200 and resp.json()["applied"] is True
    assert again.json()["applied"] is False
    # What happened stays true: the booking committed. Undoing it is a new operation.
    after = await get_op(engine, op.operation_id)
    assert after.status is S.COMMITTED
    assert len(enqueued) == 1
    comp = await get_op(engine, enqueued[0])
    assert comp.tool == "cancel_booking"
    assert comp.compensates_operation_id == op.operation_id
    assert comp.args == {"booking_id": BOOKING.id}
    assert comp.status is S.ADMITTED


async def test_signed_failure_report_moves_an_unknown_operation_to_failed_final(
    engine: AsyncEngine, http: httpx.AsyncClient
) -> None:
    op = await _running(engine)
    async with engine.begin() as conn:
        await ledger.transition(conn, op.operation_id, S.RUNNING, S.UNKNOWN, actor="t", reason="")
    resp = await _post(http, op.operation_id, _report(op, "failed"))
    assert resp.status_code == 200
    after = await get_op(engine, op.operation_id)
    assert after.status is S.FAILED_FINAL and after.error == "no_availability"


@pytest.mark.parametrize("signature", [None, "sha256=00", "wrong-secret"])
async def test_bad_signature_is_refused_and_changes_nothing(
    engine: AsyncEngine, http: httpx.AsyncClient, signature: str | None
) -> None:
    op = await _running(engine)
    body = _report(op, "committed")
    headers = {"content-type": "application/json"}
    if signature == "wrong-secret":
        headers[SIGNATURE_HEADER] = sign("not-the-secret", body)
    elif signature is not None:
        headers[SIGNATURE_HEADER] = signature
    resp = await http.post(f"/operations/{op.operation_id}/callback", content=body, headers=headers)
    assert resp.status_code == 403
    assert (await get_op(engine, op.operation_id)).status is S.RUNNING


async def test_no_configured_secret_trusts_no_callback(engine: AsyncEngine) -> None:
    op = await _running(engine)
    transport = httpx.ASGITransport(app=service(engine, secret=None))
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        resp = await _post(http, op.operation_id, _report(op, "committed"))
    assert resp.status_code == 403


async def test_duplicate_reports_apply_once(engine: AsyncEngine, http: httpx.AsyncClient) -> None:
    op = await _running(engine)
    body = _report(op, "committed")
    first = await _post(http, op.operation_id, body)
    second = await _post(http, op.operation_id, body)
    assert first.json()["applied"] is True
    assert second.status_code == 200 and second.json()["applied"] is False
    commits = [
        t for t in transitions(await events_of(engine, op.operation_id)) if t[1] == "committed"
    ]
    assert len(commits) == 1


async def test_out_of_order_reports_never_undo_a_settled_outcome(
    engine: AsyncEngine, http: httpx.AsyncClient
) -> None:
    op = await _running(engine)
    await _post(http, op.operation_id, _report(op, "committed", sequence=2))
    late_pending = await _post(http, op.operation_id, _report(op, "pending", sequence=0))
    late_failed = await _post(http, op.operation_id, _report(op, "failed", sequence=1))
    assert late_pending.json()["applied"] is False and late_failed.json()["applied"] is False
    assert (await get_op(engine, op.operation_id)).status is S.COMMITTED


async def test_report_for_an_unknown_operation_is_404(http: httpx.AsyncClient) -> None:
    fake = ledger.OperationRecord.__new__(ledger.OperationRecord)
    object.__setattr__(fake, "idempotency_key", "k")
    resp = await _post(http, uuid.uuid4(), _report(fake, "committed"))
    assert resp.status_code == 404


async def test_report_naming_another_key_is_refused(
    engine: AsyncEngine, http: httpx.AsyncClient
) -> None:
    op = await _running(engine)
    other = await _running(engine)
    resp = await _post(http, op.operation_id, _report(other, "committed"))
    assert resp.status_code == 400
    assert (await get_op(engine, op.operation_id)).status is S.RUNNING


async def test_async_provider_completion_arrives_through_the_signed_callback(
    engine: AsyncEngine, clean_db: str
) -> None:
    """End to end over sockets: the SOR accepts (202), commits later, calls us back."""
    sor: SystemOfRecord = await start_sor(clean_db, Faults(async_mode=True, async_delay_s=0.3))
    try:
        async with AppServer(service(engine)) as svc, SorClient(sor.url) as client:
            worker = OperationWorker(
                database_url=clean_db,
                engine=engine,
                registry=exec_registry(deadline_s=5.0),
                provider=SorProvider(client),
                callback_base_url=svc.url,
                poll_interval_s=0.2,
                sweep=False,
            )
            await worker.start()
            try:
                op_id = await admit(engine, worker.executor.enqueue)
                op = await wait_status(engine, op_id, S.COMMITTED)
            finally:
                await worker.stop()
        events = await events_of(engine, op_id)
        assert any(e.kind == "note" and "report" in (e.reason or "") for e in events)
        assert events[-1].actor == "provider-callback"
        assert op.provider_ref is not None
        assert (await sor.side_effects()).bookings_inserted == 1
    finally:
        await sor.stop()
