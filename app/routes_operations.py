"""Operations over HTTP: the provider's signed callback (the console API shows operations)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from sqlalchemy.exc import DataError

from app.deps import CompensationDep, EngineDep, SettingsDep
from app.errors import BadRequest, BadSignature, NotFound, PayloadTooLarge
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
