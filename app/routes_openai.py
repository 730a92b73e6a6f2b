"""`POST /openai/webhook`: OpenAI's webhooks (the SIP interconnect's `realtime.call.incoming`)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.deps import RuntimeDep
from app.openai_sip import WebhookRejected

log = logging.getLogger(__name__)

router = APIRouter()


@router.post("/openai/webhook")
async def openai_webhook(request: Request, runtime: RuntimeDep) -> Response:
    """Verify, take once, answer at once: accept/reject and the sideband happen off this request."""
    body = await request.body()
    service = runtime.openai_sip
    try:
        outcome = await service.on_webhook(body, request.headers)
    except WebhookRejected as exc:
        log.warning("OpenAI webhook refused: %s", exc)
        return JSONResponse({"error": "invalid webhook signature"}, status_code=exc.status)
    return JSONResponse({"status": outcome})
