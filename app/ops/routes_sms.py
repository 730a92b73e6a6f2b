"""Twilio's SMS webhooks: message status callbacks, and inbound messages (STOP / START)."""

from __future__ import annotations

import logging
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy.exc import DataError, DBAPIError

from app.deps import RuntimeDep
from app.errors import BadRequest, DatabaseUnavailable
from app.http.signatures import signed_form
from app.ops.sms import apply_inbound

log = logging.getLogger(__name__)
router = APIRouter()


@router.post("/twilio/sms-status")
async def sms_status(request: Request, runtime: RuntimeDep) -> Response:
    """A signed SMS status callback. Idempotent and order-safe: a status only moves a
    message forward, so duplicates and a late `sent` after `delivered` change nothing."""
    params = await signed_form(request, runtime.settings)
    raw_id = request.query_params.get("message_id", "")
    try:
        message_id = uuid.UUID(raw_id)
    except ValueError as exc:
        raise BadRequest("no message_id in the callback URL") from exc
    if runtime.sms is None:
        return Response(status_code=204)
    try:
        update = await runtime.sms.apply_callback(message_id, params)
    except DataError as exc:
        raise BadRequest("unstorable status") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("sms status update failed") from exc
    if update is None:
        log.info("SMS status callback for unknown message %s ignored", message_id)
    return Response(status_code=204)


@router.post("/twilio/sms")
async def sms_inbound(request: Request, runtime: RuntimeDep) -> Response:
    """An inbound SMS (the number's messaging webhook): STOP opts out, START opts back in.
    Answered with empty TwiML: Twilio itself confirms opt-outs to the sender."""
    params = await signed_form(request, runtime.settings)
    try:
        recorded = await apply_inbound(runtime.engine, params)
    except DataError as exc:
        raise BadRequest("unstorable sender") from exc
    except DBAPIError as exc:
        raise DatabaseUnavailable("opt-out update failed") from exc
    if recorded:
        log.info("inbound SMS: %s", recorded)
    return Response(content="<Response/>", media_type="application/xml")
