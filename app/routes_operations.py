"""Operations over HTTP: the provider's signed callback, and the operation with its trail."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from sqlalchemy.exc import DataError

from app.deps import CompensationDep, EngineDep, SettingsDep, StaffDep
from app.errors import BadRequest, BadSignature, NotFound, PayloadTooLarge
from tools import ledger
from tools.callback import SIGNATURE_HEADER, CallbackReport, verify
from tools.errors import IdempotencyConflict, OperationNotFound
from tools.reconcile import apply_report

log = logging.getLogger(__name__)

router = APIRouter()

MAX_CALLBACK_BYTES = 64 * 1024


@router.post("/operations/{operation_id}/callback")
async def operation_callback(
    operation_id: uuid.UUID,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    compensation: CompensationDep,
) -> dict[str, Any]:
    """The system of record reports an outcome (HMAC-signed, idempotent, order-safe)."""
    # Read at most the limit (as the Twilio webhooks do): request.body() would first buffer
    # a body of any size in memory, declared or chunked, before refusing it.
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_CALLBACK_BYTES):
        raise PayloadTooLarge()
    buffer = bytearray()
    async for chunk in request.stream():
        buffer += chunk
        if len(buffer) > MAX_CALLBACK_BYTES:
            raise PayloadTooLarge()
    body = bytes(buffer)
    secret = settings.sor_callback_secret
    # No secret configured means no callback can be trusted.
    if secret is None or not verify(
        secret.get_secret_value(), body, request.headers.get(SIGNATURE_HEADER)
    ):
        raise BadSignature()
    try:
        report = CallbackReport.model_validate_json(body)
    except ValidationError as exc:
        raise BadRequest("malformed report") from exc
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


@router.get("/api/operations/{operation_id}")
async def get_operation(
    operation_id: uuid.UUID, engine: EngineDep, _staff: StaffDep
) -> dict[str, Any]:
    """One operation and its append-only trail of events."""
    async with engine.connect() as conn:
        op = await ledger.get_operation(conn, operation_id)
        if op is None:
            raise NotFound(str(operation_id))
        events = await ledger.get_events(conn, operation_id)
    return {
        "operation": {
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
        },
        "events": [
            {
                "id": e.id,
                "at": _iso(e.at),
                "kind": e.kind,
                "from_status": e.from_status.value if e.from_status else None,
                "to_status": e.to_status.value if e.to_status else None,
                "actor": e.actor,
                "reason": e.reason,
                "data": e.data,
            }
            for e in events
        ],
    }
