"""The console's pages: calls, a call as swimlanes, operations, one operation and its actions,
API tokens and staff (admins). Server-rendered from the same JSON the API serves; a little
JavaScript (static/console.js) refreshes what changed when the server says so (SSE).
"""

from __future__ import annotations

import uuid
from enum import StrEnum
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Path, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import BaseModel, ValidationError

from app.access import api_tokens, login_limits, staff
from app.access.auth import AdminPageDep, OperatorPageDep, Principal, ViewerPageDep
from app.access.staff import Role, StaffError
from app.console.call_actions import (
    LIVE,
    end_live_call,
    place_outbound_call,
    transfer_live_call,
)
from app.console.schemas import ActionBody, CallListQuery, OperationListQuery, RecordOutcomeBody
from app.console.swimlanes import layout
from app.console.templating import templates
from app.console.views import (
    ConsoleDep,
    RowIdPath,
    calls_page,
    operation_detail,
    operations_page,
    run_action,
    view_or_404,
)
from app.deps import EngineDep, RuntimeDep
from app.errors import BadRequest, Conflict, Forbidden, NotFound, TooManyAttempts
from app.legs.staff_transfer import configured_targets
from app.models import LegKind
from app.ops.operation_actions import TITLES, Action
from app.ops.operation_query import ConsoleState

router = APIRouter(prefix="/console", include_in_schema=False)

FLASH = "va_flash"
STATUSES = [
    "ringing",
    "in_progress",
    "completed",
    "busy",
    "failed",
    "no_answer",
    "canceled",
    "rejected",
]
# The stored values, so a filter always matches what the legs write.
LEGS = [leg.value for leg in LegKind]
STATE_TITLES = {
    ConsoleState.AWAITING_PERSON: "Awaiting a person",
    ConsoleState.UNKNOWN: "Unknown outcome",
    ConsoleState.STUCK: "Stuck",
    ConsoleState.IN_FLIGHT: "In flight",
    ConsoleState.AWAITING_CALLER: "Awaiting the caller",
    ConsoleState.SETTLED: "Settled",
}


def _render(
    request: Request,
    name: str,
    principal: Principal,
    context: dict[str, Any],
    *,
    status: int = 200,
) -> Response:
    flash = request.cookies.get(FLASH)
    response = templates.TemplateResponse(
        request,
        name,
        {
            "who": principal,
            "csrf_token": principal.csrf_token,
            "can_act": principal.role.allows(Role.OPERATOR),
            "is_admin": principal.role.allows(Role.ADMIN),
            "flash": flash,
            **context,
        },
        status_code=status,
        headers={"Cache-Control": "no-store"},
    )
    if flash:
        response.delete_cookie(FLASH, path="/console")
    return response


# Each page with a live section: (page, the section's template, the section's element id).
LIVE_PAGES = {
    "calls": ("console/calls.html", "console/_calls_table.html", "calls-live"),
    "call": ("console/call.html", "console/_call_live.html", "call-live"),
    "operations": ("console/operations.html", "console/_operations_table.html", "ops-live"),
    "operation": ("console/operation.html", "console/_operation_live.html", "op-live"),
}


def _page_or_fragment(request: Request, context: dict[str, Any], which: str) -> str:
    """The page, or (`?fragment=1`, console.js's live refresh) its live section alone inside a
    `<template>` that the script moves into the section with the DOM (never innerHTML)."""
    page, partial, section = LIVE_PAGES[which]
    if not request.query_params.get("fragment"):
        return page
    context["partial"] = partial
    context["fragment_of"] = section
    return "console/_fragment.html"


def _parse_query(request: Request, model: type[BaseModel]) -> tuple[Any, str | None]:
    """The page's query as `model` (empty form fields dropped), or the defaults and an error."""
    raw: dict[str, Any] = {}
    for key, value in request.query_params.multi_items():
        if key == "fragment" or not value.strip():
            continue
        field = model.model_fields.get(key)
        if field is not None and "list" in str(field.annotation):
            raw.setdefault(key, []).append(value)
        else:
            raw[key] = value
    try:
        return model.model_validate(raw), None
    except ValidationError as exc:
        where = ", ".join(str(e["loc"][0]) for e in exc.errors() if e.get("loc"))
        return model.model_validate({}), f"Some filters were not understood ({where})."


@router.get("", response_class=HTMLResponse)
async def console_home(_who: ViewerPageDep) -> Response:
    return RedirectResponse("/console/calls", status_code=303)


@router.get("/calls", response_class=HTMLResponse)
async def calls_list(
    request: Request, engine: EngineDep, console: ConsoleDep, who: ViewerPageDep
) -> Response:
    q, error = _parse_query(request, CallListQuery)
    status = 400 if error else 200
    headers: dict[str, str] = {}
    try:
        page = await calls_page(engine, console, q, who)
    except (Forbidden, TooManyAttempts) as exc:
        # A refused search shows the form with the reason and no calls (not a bare error page).
        page = {"calls": [], "next_cursor": None, "limit": q.limit}
        error = f"{str(exc)[:1].upper()}{str(exc)[1:]}."
        status = 403 if isinstance(exc, Forbidden) else 429
        if isinstance(exc, TooManyAttempts):
            headers["Retry-After"] = str(exc.retry_after_s)
    args = {k: v for k, v in request.query_params.multi_items() if k not in ("cursor", "fragment")}
    next_url = None
    if page["next_cursor"]:
        next_url = "/console/calls?" + urlencode([*args.items(), ("cursor", page["next_cursor"])])
    context = {
        "nav": "calls",
        "page": page,
        "q": q,
        "error": error,
        "statuses": STATUSES,
        "legs": LEGS,
        "next_url": next_url,
        "first_url": "/console/calls?" + urlencode(list(args.items())) if q.cursor else None,
        "fragment_url": str(request.url.include_query_params(fragment="1")),
        # A fresh key per form shown: the same form sent twice places one call.
        "place_key": f"console-{uuid.uuid4().hex}",
    }
    name = _page_or_fragment(request, context, "calls")
    response = _render(request, name, who, context, status=status)
    response.headers.update(headers)
    return response


def trace_url(request: Request, trace_id: str | None) -> str | None:
    """The link to a trace in the deployment's tracing UI (TRACE_URL_TEMPLATE), if any."""
    template = request.app.state.runtime.settings.trace_url_template
    if not trace_id or not template:
        return None
    return str(template).replace("{trace_id}", trace_id)


@router.get("/calls/{call_id}", response_class=HTMLResponse)
async def call_page(
    call_id: uuid.UUID,
    request: Request,
    engine: EngineDep,
    console: ConsoleDep,
    who: ViewerPageDep,
) -> Response:
    view = await view_or_404(engine, console, call_id, who)
    lanes = layout(view)
    context = {
        "nav": "calls",
        "view": view,
        "call": view["call"],
        "lanes": lanes,
        "recording": view["recording"],
        "trace_url": trace_url(request, view["call"].get("trace_id")),
        "live": view["call"]["status"] in LIVE and view["call"].get("ended_at") is None,
        "transfer_targets": sorted(configured_targets(request.app.state.runtime)),
    }
    name = _page_or_fragment(request, context, "call")
    return _render(request, name, who, context)


@router.get("/operations", response_class=HTMLResponse)
async def operations_list(
    request: Request, engine: EngineDep, console: ConsoleDep, who: ViewerPageDep
) -> Response:
    q, error = _parse_query(request, OperationListQuery)
    page = await operations_page(engine, console, q, who)
    args = {k: v for k, v in request.query_params.multi_items() if k not in ("cursor", "fragment")}
    next_url = None
    if page["next_cursor"]:
        next_url = "/console/operations?" + urlencode(
            [*args.items(), ("cursor", page["next_cursor"])]
        )
    context = {
        "nav": "operations",
        "page": page,
        "q": q,
        "error": error,
        "states": STATE_TITLES,
        "next_url": next_url,
        "fragment_url": str(request.url.include_query_params(fragment="1")),
    }
    name = _page_or_fragment(request, context, "operations")
    return _render(request, name, who, context, status=400 if error else 200)


def _operation_trace_id(detail: dict[str, Any]) -> str | None:
    """The trace an operation belongs to: the traceparent its admission stored."""
    events = detail.get("events") or []
    data = events[0].get("data") if events else None
    parent = data.get("traceparent") if isinstance(data, dict) else None
    parts = parent.split("-") if isinstance(parent, str) else []
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


@router.get("/operations/{operation_id}", response_class=HTMLResponse)
async def operation_page(
    operation_id: uuid.UUID,
    request: Request,
    engine: EngineDep,
    console: ConsoleDep,
    who: ViewerPageDep,
) -> Response:
    detail = await operation_detail(engine, console, operation_id, who)
    trace_id = _operation_trace_id(detail)
    context = {
        "nav": "operations",
        "d": detail,
        "op": detail["operation"],
        "titles": TITLES,
        "states": STATE_TITLES,
        "trace_id": trace_id,
        "trace_url": trace_url(request, trace_id),
    }
    name = _page_or_fragment(request, context, "operation")
    return _render(request, name, who, context)


def _back_with(url: str, message: str, secure: bool) -> Response:
    response = RedirectResponse(url, status_code=303)
    response.set_cookie(
        FLASH, message[:300], max_age=60, path="/console", httponly=True, samesite="strict",
        secure=secure,
    )  # fmt: skip
    return response


@router.post("/calls/new")
async def place_call_form(
    request: Request,
    runtime: RuntimeDep,
    who: OperatorPageDep,
    to: Annotated[str, Form(max_length=256)] = "",
    purpose: Annotated[str, Form(max_length=500)] = "",
    operation_id: Annotated[str, Form(max_length=64)] = "",
    idempotency_key: Annotated[str, Form(max_length=128)] = "",
) -> Response:
    """Place an outbound call from the calls page's form (CSRF-checked by OperatorPageDep);
    the same checks and operation as `POST /api/calls`."""
    secure = request.url.scheme == "https" or runtime.settings.cookie_secure()
    try:
        call_id, _ = await place_outbound_call(
            runtime, who.actor, to, purpose, operation_id.strip() or None,
            idempotency_key.strip() or None,
        )  # fmt: skip
    except (Conflict, BadRequest) as exc:
        return _back_with("/console/calls", f"Refused: {exc}", secure)
    return _back_with(
        f"/console/calls/{call_id}", "Placing the call: it shows here as it rings.", secure
    )


class CallAction(StrEnum):
    END = "end"
    TRANSFER = "transfer"


@router.post("/calls/{call_id}/actions/{action}")
async def call_action(
    call_id: uuid.UUID,
    action: CallAction,
    request: Request,
    runtime: RuntimeDep,
    who: OperatorPageDep,
    why: Annotated[str, Form(max_length=500)] = "",
    target: Annotated[str, Form(max_length=256)] = "",
) -> Response:
    """End or transfer a live call from the call page's forms (CSRF-checked by
    OperatorPageDep); the same checks as the API's call actions."""
    back = f"/console/calls/{call_id}"
    secure = request.url.scheme == "https" or runtime.settings.cookie_secure()
    try:
        if not why.strip():
            raise Conflict("say why (it is recorded on the call's timeline)")
        if action is CallAction.END:
            message = await end_live_call(runtime.engine, call_id, who.name, why.strip())
        else:
            if not target.strip():
                raise Conflict("choose where to transfer the call")
            message = await transfer_live_call(runtime, call_id, who.name, target, why.strip())
    except (Conflict, BadRequest) as exc:
        return _back_with(back, f"Refused: {exc}", secure)
    return _back_with(back, message[:1].upper() + message[1:] + ".", secure)


@router.post("/operations/{operation_id}/actions/{action}")
async def operation_action(
    operation_id: uuid.UUID,
    action: Action,
    request: Request,
    console: ConsoleDep,
    who: OperatorPageDep,
    why: Annotated[str, Form(max_length=500)] = "",
    outcome: Annotated[str | None, Form(max_length=32)] = None,
    reference: Annotated[str | None, Form(max_length=200)] = None,
) -> Response:
    """An action from the operation page's forms (CSRF-checked by OperatorPageDep)."""
    back = f"/console/operations/{operation_id}"
    secure = request.url.scheme == "https" or request.app.state.runtime.settings.cookie_secure()
    try:
        body: Any
        if action is Action.RECORD_OUTCOME:
            body = RecordOutcomeBody.model_validate(
                {"why": why, "outcome": outcome, "reference": reference or None}
            )
        else:
            body = ActionBody.model_construct(why=why)
        if not body.why.strip():
            raise Conflict("say why (it is recorded in the operation's history)")
        done = await run_action(console, action, operation_id, who, body)
    except ValidationError:
        return _back_with(back, "Refused: choose what was found (committed or failed).", secure)
    except Conflict as exc:
        return _back_with(back, f"Refused: {exc}", secure)
    except NotFound:
        raise
    if done.new_operation_id:
        return _back_with(f"/console/operations/{done.new_operation_id}", done.message, secure)
    return _back_with(back, done.message, secure)


@router.get("/tokens", response_class=HTMLResponse)
async def tokens_page(request: Request, engine: EngineDep, who: AdminPageDep) -> Response:
    tokens = await api_tokens.list_tokens(engine)
    return _render(
        request, "console/tokens.html", who, {"nav": "tokens", "tokens": tokens, "created": None}
    )


@router.post("/tokens", response_class=HTMLResponse)
async def create_token(
    request: Request,
    engine: EngineDep,
    who: AdminPageDep,
    name: Annotated[str, Form(max_length=64)] = "",
    role: Annotated[Role, Form()] = Role.VIEWER,
) -> Response:
    """Create a token; its secret is in this page only (no redirect, nothing stored)."""
    error = None
    created = None
    try:
        token, secret = await api_tokens.create_token(engine, name, role, created_by=who.actor)
        created = {"token": token, "secret": secret}
    except StaffError as exc:
        error = str(exc)
    tokens = await api_tokens.list_tokens(engine)
    return _render(
        request,
        "console/tokens.html",
        who,
        {"nav": "tokens", "tokens": tokens, "created": created, "error": error},
        status=400 if error else 200,
    )


@router.post("/tokens/{token_id}/revoke")
async def revoke_token(
    token_id: RowIdPath, request: Request, engine: EngineDep, who: AdminPageDep
) -> Response:
    try:
        token = await api_tokens.revoke_token(engine, token_id)
        message = f"Token {token.name} revoked."
    except StaffError as exc:
        message = str(exc)
    return _back_with(
        "/console/tokens", message, request.app.state.runtime.settings.cookie_secure()
    )


@router.get("/staff", response_class=HTMLResponse)
async def staff_page(
    request: Request, runtime: RuntimeDep, engine: EngineDep, who: AdminPageDep
) -> Response:
    accounts = await staff.list_staff(engine)
    limits = login_limits.LoginLimits.from_settings(runtime.settings)
    lockouts = await login_limits.lockouts(engine, limits)
    locked: dict[str, list[login_limits.Lockout]] = {}
    for lockout in lockouts:
        locked.setdefault(lockout.username, []).append(lockout)
    return _render(
        request,
        "console/staff.html",
        who,
        {"nav": "staff", "accounts": accounts, "lockouts": lockouts, "locked": locked},
    )


@router.post("/staff/{username}/{change}")
async def staff_change(
    username: Annotated[str, Path(max_length=64)],
    change: str,
    request: Request,
    engine: EngineDep,
    who: AdminPageDep,
) -> Response:
    if change not in ("disable", "enable", "unlock"):
        raise NotFound(change)
    if change == "unlock":
        try:
            cleared = await staff.unlock(engine, username)
            message = f"{username}: unlocked ({cleared} failed logins cleared)."
        except StaffError as exc:
            message = str(exc)
    elif change == "disable" and username == who.name:
        message = "You cannot disable your own account."
    else:
        try:
            await staff.set_disabled(engine, username, change == "disable")
            message = f"{username}: {change}d."
        except StaffError as exc:
            message = str(exc)
    return _back_with("/console/staff", message, request.app.state.runtime.settings.cookie_secure())
