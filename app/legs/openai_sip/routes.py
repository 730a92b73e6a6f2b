"""`POST /openai/webhook`: OpenAI's webhooks (the SIP interconnect's `realtime.call.incoming`, and
`live.transport.incoming` on GPT-Live)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.deps import RuntimeDep
from app.legs.openai_sip.calls import SIGNATURE_HEADERS, WebhookRejected

log = logging.getLogger(__name__)

router = APIRouter()


@router.post("/openai/webhook")
async def openai_webhook(request: Request, runtime: RuntimeDep) -> Response:
    """Verify, take once, answer at once: accept/reject and the sideband happen off this request."""
    service = runtime.openai_sip
    if not all(request.headers.get(name) for name in SIGNATURE_HEADERS):
        # Refused before the body is read: an anonymous post costs us no memory (the body
        # itself is bounded by WEBHOOK_MAX_BODY_BYTES, app.http.body_limits).
        service.bad_signatures += 1
        log.warning("OpenAI webhook refused: no webhook signature")
        return JSONResponse({"error": "no webhook signature"}, status_code=401)
    body = await request.body()
    try:
        outcome = await service.on_webhook(body, request.headers)
    except WebhookRejected as exc:
        log.warning("OpenAI webhook refused: %s", exc)
        return JSONResponse({"error": "invalid webhook signature"}, status_code=exc.status)
    return JSONResponse({"status": outcome})
