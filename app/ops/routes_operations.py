"""Operations over HTTP: the provider's signed callback, and the settlement and cancel requests
staff make (the console API lists and shows operations)."""

from __future__ import annotations

import hashlib
import logging
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.exc import DataError, IntegrityError

from app.access.auth import OperatorDep
from app.deps import CompensationDep, EngineDep, RuntimeDep, SettingsDep
from app.errors import BadRequest, BadSignature, Conflict, NotFound, PayloadTooLarge
from tools import callback_receipts as receipts
from tools import staff
from tools.callback import (
    ID_HEADER,
    SIGNATURE_HEADER,
    STANDARD_SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    CallbackReport,
    verify,
    verify_standard,
)
from tools.cancellation import request_cancel
from tools.errors import IdempotencyConflict, OperationNotFound
from tools.ledger import OperationRecord
from tools.reconcile import apply_report

log = logging.getLogger(__name__)

router = APIRouter()

MAX_CALLBACK_BYTES = 64 * 1024
# A Standard Webhooks signature is these three headers (tools.callback.verify_standard).
STANDARD_HEADERS = (ID_HEADER, TIMESTAMP_HEADER, STANDARD_SIGNATURE_HEADER)


@router.post("/operations/{operation_id}/callback")
async def operation_callback(
    operation_id: uuid.UUID,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    compensation: CompensationDep,
) -> dict[str, Any]:
    """The system of record reports an outcome (HMAC-signed, idempotent, order-safe)."""
    secret = settings.sor_callback_secret
    # No secret configured means no callback can be trusted; no signature header at all is
    # refused too, both before a byte of the body is read.
    standard = all(request.headers.get(name) for name in STANDARD_HEADERS)
    legacy_signed = settings.sor_callback_accept_legacy_signature and bool(
        request.headers.get(SIGNATURE_HEADER)
    )
    if secret is None or not (standard or legacy_signed):
        raise BadSignature()
    # Read at most the limit (as the Twilio webhooks do): request.body() would first buffer
    # a body of any size in memory, declared or chunked, before refusing it.
    limit = max(MAX_CALLBACK_BYTES, settings.webhook_max_body_bytes)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise PayloadTooLarge()
    buffer = bytearray()
    async for chunk in request.stream():
        buffer += chunk
        if len(buffer) > limit:
            raise PayloadTooLarge()
    body = bytes(buffer)
    key = secret.get_secret_value()
    webhook_id = verify_standard(key, request.headers, body)
    if webhook_id is None:
        legacy = request.headers.get(SIGNATURE_HEADER)
        if not (settings.sor_callback_accept_legacy_signature and verify(key, body, legacy)):
            raise BadSignature()
        # The old scheme has no id: the same body twice is the same message.
        webhook_id = "legacy_" + hashlib.sha256(body).hexdigest()
        log.warning("provider callback signed with the deprecated X-Signature header")
    try:
        report = CallbackReport.model_validate_json(body)
    except ValidationError as exc:
        raise BadRequest("malformed report") from exc
    try:
        async with engine.begin() as conn:
            admission = await receipts.admit(
                conn, webhook_id, operation_id, report.sequence, report.status
            )
    except IntegrityError as exc:
        raise NotFound(str(operation_id)) from exc
    except DataError as exc:
        raise BadRequest("unstorable report") from exc
    if admission is not receipts.Admission.APPLY:
        return {"applied": False, "status": None, "reason": admission.value}
    try:
        outcome = await apply_report(
            engine,
            operation_id,
            idempotency_key=report.idempotency_key,
            status=report.status,
            result=report.result,
            reference=report.reference,
            error=report.error,
            compensation=compensation,
        )
        async with engine.begin() as conn:
            await receipts.settle(conn, webhook_id, outcome.applied)
    except OperationNotFound as exc:
        raise NotFound(str(operation_id)) from exc
    except IdempotencyConflict as exc:
        raise BadRequest("report for another idempotency key") from exc
    except DataError as exc:
        # Signed, but holding what the ledger cannot store (NUL, an over-long booking id): a
        # 400 the sender does not retry, not a 500; reconciliation settles the operation.
        raise BadRequest("unstorable report") from exc
    return {"applied": outcome.applied, "status": outcome.status.value, "reason": outcome.reason}


def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _operation_json(op: OperationRecord) -> dict[str, Any]:
    return {
        "operation_id": str(op.operation_id),
        "tenant_id": op.tenant_id,
        "idempotency_key": op.idempotency_key,
        "call_id": op.call_id,
        "caller": op.caller,
        "tool": op.tool,
        "args": op.args,
        "status": op.status.value,
        "cancel_requested": op.cancel_requested,
        "attempts": op.attempts,
        "deadline": _iso(op.deadline),
        "expires_at": _iso(op.expires_at),
        "next_attempt_at": _iso(op.next_attempt_at),
        "result": op.result,
        "error": op.error,
        "provider_ref": op.provider_ref,
        "compensates_operation_id": (
            str(op.compensates_operation_id) if op.compensates_operation_id else None
        ),
        "created_at": _iso(op.created_at),
        "updated_at": _iso(op.updated_at),
        "committed_at": _iso(op.committed_at),
        "finished_at": _iso(op.finished_at),
    }


class Settle(BaseModel):
    """A member of staff's finding at the provider about an `unknown` operation."""

    model_config = ConfigDict(extra="forbid")

    verdict: staff.Verdict
    note: str = Field(min_length=1, max_length=500, description="What was checked, and how.")
    reference: str | None = Field(default=None, max_length=200)


@router.post("/api/operations/{operation_id}/settle")
async def settle_operation(
    operation_id: uuid.UUID, body: Settle, runtime: RuntimeDep, user: OperatorDep
) -> dict[str, Any]:
    """Settle an `unknown` operation: it happened (`committed`), it did not (`not_applied`),
    or it did not and is to be sent again (`retry`). Recorded with the staff member's name."""
    tools = runtime.tools
    try:
        done = await staff.settle(
            runtime.engine,
            operation_id,
            body.verdict,
            actor=user.actor,
            note=body.note,
            reference=body.reference,
            registry=tools.registry if tools is not None else None,
            enqueue=tools.enqueue if tools is not None else None,
        )
    except OperationNotFound as exc:
        raise NotFound(str(operation_id)) from exc
    except staff.NotSettleable as exc:
        raise Conflict(str(exc)) from exc
    except DataError as exc:
        raise BadRequest("unstorable settlement") from exc
    return {"operation": _operation_json(done.operation), "verdict": done.verdict.value}


class CancelRequest(BaseModel):
    """Why a member of staff asks to cancel an operation."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=500)


@router.post("/api/operations/{operation_id}/cancel")
async def cancel_operation(
    operation_id: uuid.UUID, body: CancelRequest, runtime: RuntimeDep, user: OperatorDep
) -> dict[str, Any]:
    """Ask to cancel: at once if nothing was sent; else only the provider can confirm it
    (its cancel hook), and a commit that lands anyway is compensated."""
    tools = runtime.tools
    if tools is None:
        raise Conflict("this process runs no tool pipeline")
    try:
        op = await request_cancel(
            runtime.engine,
            tools.registry,
            tools.catalog.router,
            operation_id,
            actor=user.actor,
            reason=body.reason,
        )
    except OperationNotFound as exc:
        raise NotFound(str(operation_id)) from exc
    return {"operation": _operation_json(op)}
