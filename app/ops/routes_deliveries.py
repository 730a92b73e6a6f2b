"""Staff API for deliveries (with the "resend SMS" action) and integrator webhooks."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from app.access.auth import AdminDep, OperatorDep, ViewerDep
from app.deps import EngineDep, RuntimeDep
from app.errors import BadRequest, NotFound
from app.ops.delivery import ResendRefused, resend_sms
from tools import deliveries, webhooks

router = APIRouter(prefix="/api")


def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def delivery_json(d: deliveries.DeliveryRecord) -> dict[str, Any]:
    return {
        "id": str(d.id),
        "operation_id": str(d.operation_id),
        "call_id": d.call_id,
        "outcome": d.outcome.value,
        "channel": d.channel,
        "state": d.state.value,
        "offers": d.offers,
        "cuts": d.cuts,
        "response_id": d.response_id,
        "message_id": str(d.message_id) if d.message_id else None,
        "reason": d.reason,
        "created_at": _iso(d.created_at),
        "updated_at": _iso(d.updated_at),
        "offered_at": _iso(d.offered_at),
        "heard_at": _iso(d.heard_at),
        "finished_at": _iso(d.finished_at),
    }


def sms_json(m: deliveries.SmsRecord) -> dict[str, Any]:
    return {
        "id": str(m.id),
        "to": m.to_number,
        "from": m.from_number,
        "messaging_service_sid": m.messaging_service_sid,
        "body": m.body,
        "status": m.status.value,
        "message_sid": m.message_sid,
        "error_code": m.error_code,
        "error": m.error,
        "attempts": m.attempts,
        "requested_by": m.requested_by,
        "created_at": _iso(m.created_at),
        "attempted_at": _iso(m.attempted_at),
        "status_at": _iso(m.status_at),
    }


@router.get("/deliveries/{delivery_id}")
async def get_delivery(
    delivery_id: uuid.UUID, engine: EngineDep, _staff: ViewerDep
) -> dict[str, Any]:
    """One delivery, its trail, and the SMS that carried it."""
    async with engine.connect() as conn:
        d = await deliveries.get(conn, delivery_id)
        if d is None:
            raise NotFound(str(delivery_id))
        trail = await deliveries.events(conn, delivery_id)
        messages = await deliveries.sms_for_delivery(conn, delivery_id)
    return {
        "delivery": delivery_json(d),
        "events": [
            {
                "id": e.id,
                "at": _iso(e.at),
                "kind": e.kind,
                "from": e.from_state,
                "to": e.to_state,
                "actor": e.actor,
                "reason": e.reason,
                "data": e.data,
            }
            for e in trail
        ],
        "sms": [sms_json(m) for m in messages],
    }


class ResendBody(BaseModel):
    reason: str = Field(min_length=1, max_length=500)


@router.post("/deliveries/{delivery_id}/resend-sms")
async def resend(
    delivery_id: uuid.UUID, body: ResendBody, runtime: RuntimeDep, staff: OperatorDep
) -> dict[str, Any]:
    """Staff: send the outcome again by SMS (a new message; refused while one is under way)."""
    try:
        message = await resend_sms(
            runtime.engine, delivery_id, staff.name, body.reason, sms=runtime.sms
        )
    except ResendRefused as exc:
        raise BadRequest(str(exc)) from exc
    return {"sms": sms_json(message)}


class SubscribeBody(BaseModel):
    url: str = Field(min_length=1, max_length=2000)
    secret: str | None = Field(default=None, max_length=200)
    description: str | None = Field(default=None, max_length=500)


@router.post("/webhooks", status_code=201)
async def subscribe(body: SubscribeBody, runtime: RuntimeDep, _staff: AdminDep) -> JSONResponse:
    """Register an outbound webhook for operation status changes. The secret (given or
    generated) is returned once; it signs every delivery (Standard Webhooks)."""
    try:
        async with runtime.engine.begin() as conn:
            sub = await webhooks.subscribe(
                conn,
                tenant_id=runtime.settings.tenant_id,
                url=body.url,
                secret=body.secret,
                description=body.description,
            )
    except webhooks.WebhookError as exc:
        raise BadRequest(str(exc)) from exc
    return JSONResponse({**sub.as_json(), "secret": sub.secret}, status_code=201)


@router.get("/webhooks")
async def list_webhooks(runtime: RuntimeDep, _staff: AdminDep) -> dict[str, Any]:
    async with runtime.engine.connect() as conn:
        subs = await webhooks.list_subscriptions(conn, runtime.settings.tenant_id)
    return {"webhooks": [s.as_json() for s in subs]}


@router.delete("/webhooks/{subscription_id}")
async def unsubscribe(
    subscription_id: uuid.UUID, runtime: RuntimeDep, _staff: AdminDep
) -> dict[str, Any]:
    async with runtime.engine.begin() as conn:
        sub = await webhooks.get_subscription(conn, subscription_id)
        if sub is None or sub.tenant_id != runtime.settings.tenant_id:
            raise NotFound(str(subscription_id))
        await webhooks.unsubscribe(conn, subscription_id)
    return {"id": str(subscription_id), "active": False}


@router.get("/webhooks/{subscription_id}/deliveries")
async def webhook_log(
    subscription_id: uuid.UUID, runtime: RuntimeDep, _staff: AdminDep
) -> dict[str, Any]:
    """The delivery log of a subscription: each status change sent, with every attempt."""
    async with runtime.engine.connect() as conn:
        sub = await webhooks.get_subscription(conn, subscription_id)
        if sub is None or sub.tenant_id != runtime.settings.tenant_id:
            raise NotFound(str(subscription_id))
        log_rows = await webhooks.delivery_log(conn, subscription_id)
    return {"webhook": sub.as_json(), "deliveries": log_rows}
