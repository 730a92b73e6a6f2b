"""The console's JSON API: calls, timelines, recordings, operations, actions, live streams,
API tokens. Every route needs a role (API token, console session, or HTTP Basic where it is
switched on); viewers get phone numbers masked; nobody gets PINs or secrets.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access import api_tokens, staff
from app.access.auth import AdminDep, OperatorDep, Principal, ViewerDep
from app.access.staff import StaffError
from app.calls.recording_store import get_recording
from app.calls.store import call_events, calls
from app.console.call_actions import end_live_call, transfer_live_call
from app.console.live import ALL_CALLS, LiveHub, call_key, op_key
from app.console.schemas import (
    ActionBody,
    ActionResult,
    CallActionResult,
    CallList,
    CallListQuery,
    NoQuery,
    OperationDetailOut,
    OperationList,
    OperationListQuery,
    OutboundCallBody,
    OutboundCallCreated,
    Problem,
    RecordOutcomeBody,
    StaffList,
    Timeline,
    TokenCreate,
    TokenCreated,
    TokenList,
    TransferBody,
    WhoAmI,
)
from app.console.views import (
    ConsoleDep,
    RowIdPath,
    calls_page,
    operation_detail,
    operations_page,
    run_action,
    view_or_404,
)
from app.console_models import call_recordings_table as recordings_t
from app.deps import EngineDep, RuntimeDep
from app.errors import Conflict, InvalidRequest, NotFound, TooManyStreams
from app.http.guard import leave_source_count
from app.http.slots import Slot
from app.ops.operation_actions import Action, ActionDone
from telephony.call_events import CallEvent
from tools.ledger_models import operation_events_table as op_events_t
from tools.ledger_models import operations_table as ops_t
from tools.ledger_models import tool_calls_table as tool_calls_t

API_DESCRIPTION = """The staff console's JSON API.

Authenticate with an API token (`Authorization: Bearer va_…`, made with `voice-agent token
add` or on the console's Tokens page), or with the console's session cookie (then every POST
carries the session's CSRF token in `X-CSRF-Token`). HTTP Basic (staff name and password)
works only where CONSOLE_HTTP_BASIC is on.

Lists are paged by keyset: pass a page's `next_cursor` as `cursor` for the next one. Unknown
query parameters and malformed values are refused with 422.
"""


# A row id in a path: Postgres' bigint holds at most 2**63 - 1, and a larger number reached the
# query as an error (500). Every integer path parameter uses this (tests walk the routes).


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "No valid credentials."},
    403: {"model": Problem, "description": "The role does not allow this (or a bad CSRF token)."},
    422: {"description": "A bad or unknown parameter."},
}
_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "No such thing."}
}
_SSE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {}},
        "description": "Server-sent events: `changed` whenever what the page shows changed "
        "(then fetch it again), and keep-alive comments.",
    }
}

router = APIRouter(prefix="/api", tags=["console"], responses=_ERRORS)


# --- who ---------------------------------------------------------------------------------


@router.get("/me", response_model=WhoAmI)
async def whoami(principal: ViewerDep, _q: Annotated[NoQuery, Query()]) -> dict[str, Any]:
    """Who these credentials belong to."""
    return {"name": principal.name, "role": principal.role, "kind": principal.kind}


# --- calls -------------------------------------------------------------------------------


@router.get("/calls", response_model=CallList)
async def list_calls(
    engine: EngineDep,
    console: ConsoleDep,
    principal: ViewerDep,
    q: Annotated[CallListQuery, Query()],
) -> dict[str, Any]:
    """Calls, newest first, filtered and paged by keyset. Viewers search by a full number
    only; distinct numbers searched are rate-limited per staff member or token (429)."""
    return await calls_page(engine, console, q, principal)


@router.post(
    "/calls",
    response_model=OutboundCallCreated,
    status_code=202,
    responses={
        400: {"model": Problem, "description": "A number that is not E.164, no purpose."},
        409: {"model": Problem, "description": "This process cannot place calls."},
    },
)
async def place_call(
    body: OutboundCallBody,
    runtime: RuntimeDep,
    principal: OperatorDep,
    _q: Annotated[NoQuery, Query()],
    idempotency_key: Annotated[str | None, Header(max_length=128)] = None,
) -> dict[str, Any]:
    """Place an outbound call: Twilio calls `to` with answering-machine detection. A person
    hears the purpose first (and where `operation_id` stands); a machine gets a short message
    naming the purpose only. Placing it is an operation (`place_call`); the same
    `Idempotency-Key` again answers the same call."""
    from app.ops.outbound import OutboundRefused, request_call, requested_events

    if runtime.tools is None:
        raise Conflict("this process has no operation ledger to place calls with")
    try:
        placed = await request_call(
            runtime.engine,
            runtime.settings,
            runtime.tools.enqueue,
            to=body.to,
            purpose=body.purpose,
            about_operation_id=body.operation_id,
            by=principal.actor,
            idempotency_key=idempotency_key,
        )
    except OutboundRefused as exc:
        raise InvalidRequest(str(exc)) from exc
    if placed.created:
        to = body.to.strip().removeprefix("tel:")
        purpose = " ".join(body.purpose.split())
        for kind, data in requested_events(placed, to, purpose, principal.actor):
            runtime.events.emit(CallEvent(placed.call_id, kind, data))
    return {"call_id": placed.call_id, "operation_id": placed.operation_id}


async def _calls_snapshot(engine: AsyncEngine) -> tuple[Any, ...]:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                sa.select(
                    sa.select(sa.func.max(calls.c.created_at)).scalar_subquery(),
                    sa.select(sa.func.max(call_events.c.id)).scalar_subquery(),
                    sa.select(sa.func.max(op_events_t.c.id)).scalar_subquery(),
                )
            )
        ).one()
    return tuple(str(v) for v in row)


@router.get("/calls/stream", response_class=StreamingResponse, responses=_SSE)
async def calls_stream(
    request: Request,
    engine: EngineDep,
    console: ConsoleDep,
    who: ViewerDep,
    _q: Annotated[NoQuery, Query()],
) -> Response:
    """`changed` whenever a call starts, a call's events are written or an operation moves."""
    return _sse(
        request,
        console.live,
        who,
        [ALL_CALLS],
        lambda: _calls_snapshot(engine),
        min_interval_s=1.0,
    )


@router.get("/calls/{call_id}/timeline", response_model=Timeline, responses=_NOT_FOUND)
async def call_timeline(
    call_id: uuid.UUID,
    engine: EngineDep,
    console: ConsoleDep,
    principal: ViewerDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """The call, its operations, its recording, and every event in time order: what was
    said, what the model asked, what policy decided, what the system of record confirmed,
    how outcomes reached the caller."""
    return await view_or_404(engine, console, call_id, principal)


async def _call_snapshot(engine: AsyncEngine, call_id: uuid.UUID) -> tuple[Any, ...]:
    key = str(call_id)
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                sa.select(
                    sa.select(calls.c.status).where(calls.c.id == call_id).scalar_subquery(),
                    sa.select(sa.func.max(call_events.c.seq))
                    .where(call_events.c.call_id == call_id)
                    .scalar_subquery(),
                    sa.select(sa.func.max(tool_calls_t.c.id))
                    .where(tool_calls_t.c.call_id == key)
                    .scalar_subquery(),
                    sa.select(sa.func.max(op_events_t.c.id))
                    .select_from(
                        op_events_t.join(ops_t, ops_t.c.operation_id == op_events_t.c.operation_id)
                    )
                    .where(ops_t.c.call_id == key)
                    .scalar_subquery(),
                    # The recording lands after the call's last event (no notification).
                    sa.exists().where(recordings_t.c.call_id == call_id),
                )
            )
        ).one()
    return tuple(str(v) for v in row)


@router.get(
    "/calls/{call_id}/stream", response_class=StreamingResponse, responses={**_SSE, **_NOT_FOUND}
)
async def call_stream(
    call_id: uuid.UUID,
    request: Request,
    engine: EngineDep,
    console: ConsoleDep,
    who: ViewerDep,
    _q: Annotated[NoQuery, Query()],
) -> Response:
    """`changed` whenever the call's timeline changed (events, tool calls, operations)."""
    await _require_call(engine, call_id)
    return _sse(
        request,
        console.live,
        who,
        [call_key(str(call_id))],
        lambda: _call_snapshot(engine, call_id),
    )


async def _require_call(engine: AsyncEngine, call_id: uuid.UUID) -> None:
    async with engine.connect() as conn:
        found = await conn.scalar(sa.select(calls.c.id).where(calls.c.id == call_id))
    if found is None:
        raise NotFound(f"no call {call_id}")


_CALL_ACTION: dict[str, Any] = {
    "response_model": CallActionResult,
    "status_code": 202,
    "responses": {
        **_NOT_FOUND,
        400: {"model": Problem, "description": "A transfer target that is not a number or URI."},
        409: {"model": Problem, "description": "The call is not live (or its leg cannot)."},
    },
}


@router.post("/calls/{call_id}/actions/end", **_CALL_ACTION)
async def call_action_end(
    call_id: uuid.UUID,
    body: ActionBody,
    engine: EngineDep,
    principal: OperatorDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """End a live call on any leg (Twilio: the stream ends and the call is hung up; SIP: BYE;
    OpenAI SIP interconnect: `hangup`). The process holding the call ends it; the reason on
    the timeline names who and why."""
    message = await end_live_call(engine, call_id, principal.name, body.why)
    return {"message": message, "call_id": str(call_id)}


@router.post("/calls/{call_id}/actions/transfer", **_CALL_ACTION)
async def call_action_transfer(
    call_id: uuid.UUID,
    body: TransferBody,
    runtime: RuntimeDep,
    principal: OperatorDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """Transfer a live call to a TRANSFER_TARGETS name, a number or a SIP URI. An OpenAI SIP
    interconnect call is referred at once (`call_transferred` on the timeline); a Twilio call
    (and a SIP call, where the leg can transfer) is put through after the agent's sentence
    (`transfer_requested`, `transfer_started`, then answered or failed)."""
    message = await transfer_live_call(runtime, call_id, principal.name, body.target, body.why)
    return {"message": message, "call_id": str(call_id)}


_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
CHUNK = 256 * 1024


@router.get(
    "/calls/{call_id}/recording",
    response_class=Response,
    responses={
        200: {"content": {"audio/wav": {}}, "description": "The whole recording."},
        206: {"content": {"audio/wav": {}}, "description": "The byte range asked for."},
        416: {"description": "A range outside the recording."},
        **_NOT_FOUND,
    },
)
async def call_recording(
    call_id: uuid.UUID,
    engine: EngineDep,
    console: ConsoleDep,
    _who: ViewerDep,
    _q: Annotated[NoQuery, Query()],
    range_header: Annotated[str | None, Header(alias="range", max_length=100)] = None,
) -> Response:
    """The call's recording: a stereo WAV, caller left, agent right (byte ranges work)."""
    info = await get_recording(engine, str(call_id))
    if info is None:
        raise NotFound(f"no recording of call {call_id}")
    size = info.bytes
    start, end, status = 0, size - 1, 200
    if range_header:
        m = _RANGE.match(range_header.strip())
        if m is None or (not m.group(1) and not m.group(2)):
            return Response(status_code=416, headers={"Content-Range": f"bytes */{size}"})
        if m.group(1):
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        else:  # a suffix: the last N bytes
            start = max(0, size - int(m.group(2)))
        if start >= size or start > end:
            return Response(status_code=416, headers={"Content-Range": f"bytes */{size}"})
        status = 206
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Length": str(end - start + 1),
        "Cache-Control": "private, max-age=3600",
    }
    if status == 206:
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"

    async def body() -> AsyncIterator[bytes]:
        offset = start
        while offset <= end:
            n = min(CHUNK, end - offset + 1)
            yield await console.recordings.read(info, offset, n)
            offset += n

    return StreamingResponse(
        body(), status_code=status, media_type=info.content_type, headers=headers
    )


# --- operations --------------------------------------------------------------------------


@router.get("/operations", response_model=OperationList)
async def list_operations(
    engine: EngineDep,
    console: ConsoleDep,
    principal: ViewerDep,
    q: Annotated[OperationListQuery, Query()],
) -> dict[str, Any]:
    """Operations, open ones first (awaiting a person, unknown, stuck, in flight, awaiting
    the caller), then settled ones; newest change first within each; keyset pages."""
    return await operations_page(engine, console, q, principal)


@router.get("/operations/{operation_id}", response_model=OperationDetailOut, responses=_NOT_FOUND)
async def get_operation(
    operation_id: uuid.UUID,
    engine: EngineDep,
    console: ConsoleDep,
    principal: ViewerDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """One operation: its full history (who did what, when, why), the model's function calls
    that asked for it (call and turn), compensations, and what may be done now."""
    return await operation_detail(engine, console, operation_id, principal)


async def _op_snapshot(engine: AsyncEngine, operation_id: uuid.UUID) -> tuple[Any, ...]:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                sa.select(
                    sa.select(ops_t.c.status)
                    .where(ops_t.c.operation_id == operation_id)
                    .scalar_subquery(),
                    sa.select(sa.func.max(op_events_t.c.id))
                    .where(op_events_t.c.operation_id == operation_id)
                    .scalar_subquery(),
                )
            )
        ).one()
    return tuple(str(v) for v in row)


@router.get(
    "/operations/{operation_id}/stream",
    response_class=StreamingResponse,
    responses={**_SSE, **_NOT_FOUND},
)
async def operation_stream(
    operation_id: uuid.UUID,
    request: Request,
    engine: EngineDep,
    console: ConsoleDep,
    who: ViewerDep,
    _q: Annotated[NoQuery, Query()],
) -> Response:
    """`changed` whenever the operation's status or history changed."""
    snapshot = await _op_snapshot(engine, operation_id)
    if snapshot[0] == "None":
        raise NotFound(f"no operation {operation_id}")
    return _sse(
        request,
        console.live,
        who,
        [op_key(str(operation_id))],
        lambda: _op_snapshot(engine, operation_id),
    )


_ACTION_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_NOT_FOUND,
    409: {"model": Problem, "description": "The engine does not allow this action now (why)."},
}


def _result(done: ActionDone) -> dict[str, Any]:
    return {
        "message": done.message,
        "status": done.status,
        "new_operation_id": done.new_operation_id,
    }


_ACTION: dict[str, Any] = {"response_model": ActionResult, "responses": _ACTION_RESPONSES}


@router.post("/operations/{operation_id}/actions/reconcile", **_ACTION)
async def action_reconcile(
    operation_id: uuid.UUID,
    body: ActionBody,
    console: ConsoleDep,
    principal: OperatorDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """Ask the system of record about an `unknown` operation now (by idempotency key)."""
    return _result(await run_action(console, Action.RECONCILE, operation_id, principal, body))


@router.post("/operations/{operation_id}/actions/retry", **_ACTION)
async def action_retry(
    operation_id: uuid.UUID,
    body: ActionBody,
    console: ConsoleDep,
    principal: OperatorDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """Run the next attempt of a `failed_retryable` operation now (only for tools that allow
    automatic retries)."""
    return _result(await run_action(console, Action.RETRY, operation_id, principal, body))


@router.post("/operations/{operation_id}/actions/record-outcome", **_ACTION)
async def action_record_outcome(
    operation_id: uuid.UUID,
    body: RecordOutcomeBody,
    console: ConsoleDep,
    principal: OperatorDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """Record what a person found at the system of record: for `unknown` operations of tools
    with no automatic lookup (`on_unknown: ask_staff`), and for stuck operations."""
    return _result(await run_action(console, Action.RECORD_OUTCOME, operation_id, principal, body))


@router.post("/operations/{operation_id}/actions/compensate", **_ACTION)
async def action_compensate(
    operation_id: uuid.UUID,
    body: ActionBody,
    console: ConsoleDep,
    principal: OperatorDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """Admit the compensating operation of a committed one (its tool's `compensated_by`)."""
    return _result(await run_action(console, Action.COMPENSATE, operation_id, principal, body))


@router.post("/operations/{operation_id}/actions/resend-sms", **_ACTION)
async def action_resend_sms(
    operation_id: uuid.UUID,
    body: ActionBody,
    console: ConsoleDep,
    principal: OperatorDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """Send the outcome's SMS again (refused while the operation has no SMS delivery)."""
    return _result(await run_action(console, Action.RESEND_SMS, operation_id, principal, body))


# --- tokens and staff (admin) ------------------------------------------------------------


@router.get("/tokens", response_model=TokenList)
async def list_tokens(
    engine: EngineDep, _admin: AdminDep, _q: Annotated[NoQuery, Query()]
) -> dict[str, Any]:
    """API tokens (never their secrets)."""
    return {"tokens": [t.as_json() for t in await api_tokens.list_tokens(engine)]}


@router.post("/tokens", response_model=TokenCreated, status_code=201)
async def create_token(
    body: TokenCreate, engine: EngineDep, admin: AdminDep, _q: Annotated[NoQuery, Query()]
) -> dict[str, Any]:
    """A new API token; its secret is in this response only."""
    try:
        token, secret = await api_tokens.create_token(
            engine, body.name, body.role, created_by=admin.actor
        )
    except StaffError as exc:
        raise Conflict(str(exc)) from exc
    return {**token.as_json(), "token": secret}


@router.post("/tokens/{token_id}/revoke", response_model=TokenList, responses=_NOT_FOUND)
async def revoke_token(
    token_id: RowIdPath,
    engine: EngineDep,
    _admin: AdminDep,
    _q: Annotated[NoQuery, Query()],
) -> dict[str, Any]:
    """Revoke a token (it stops working at once)."""
    try:
        await api_tokens.revoke_token(engine, int(token_id))
    except StaffError as exc:
        raise NotFound(str(exc)) from exc
    return {"tokens": [t.as_json() for t in await api_tokens.list_tokens(engine)]}


@router.get("/staff", response_model=StaffList)
async def list_staff(
    engine: EngineDep, _admin: AdminDep, _q: Annotated[NoQuery, Query()]
) -> dict[str, Any]:
    """Staff accounts and their roles."""
    return {
        "staff": [
            {
                "username": a.username,
                "role": a.role,
                "created_at": a.created_at.isoformat(),
                "last_login_at": a.last_login_at.isoformat() if a.last_login_at else None,
                "disabled": not a.active,
            }
            for a in await staff.list_staff(engine)
        ]
    }


# --- server-sent events ------------------------------------------------------------------

KEEPALIVE = ": keep-alive\n\n"


class EventStream(StreamingResponse):
    """A server-sent event stream that holds a slot of the hub while it is served, and whose
    connection leaves the per-source HTTP connection count meanwhile: the hub's bounds (per
    staff member or token, and in all) cap held streams, so they cannot lock an address out
    of everything else (app.http.guard)."""

    def __init__(self, content: AsyncIterator[str], slot: Slot, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._slot = slot

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        leave_source_count(scope)
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()


def _sse(
    request: Request,
    hub: LiveHub,
    principal: Principal,
    keys: list[str],
    snapshot: Callable[[], Awaitable[tuple[Any, ...]]],
    *,
    min_interval_s: float = 0.0,
) -> StreamingResponse:
    """An SSE response that says `changed` each time `snapshot()` differs from before, at
    most once per `min_interval_s` (a busy list must not cost a query per event written).
    It ends after the hub's `max_lifetime_s` (the browser reconnects after `retry`)."""
    slot = hub.open_stream(principal.actor)
    if slot is None:
        raise TooManyStreams(
            "too many live streams open (SSE_MAX_STREAMS_PER_PRINCIPAL, SSE_MAX_STREAMS)"
        )

    async def events() -> AsyncIterator[str]:
        last = await snapshot()
        yield "retry: 3000\n\n"
        yield f"event: ready\ndata: {json.dumps({'version': list(last)})}\n\n"
        async for _ in hub.watch(keys):
            if await request.is_disconnected():
                return
            now = await snapshot()
            if now != last:
                last = now
                yield f"event: changed\ndata: {json.dumps({'version': list(now)})}\n\n"
                if min_interval_s:
                    await asyncio.sleep(min_interval_s)  # rate limit, not synchronisation
            else:
                yield KEEPALIVE

    return EventStream(
        events(),
        slot,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


def add_schema_route(app: FastAPI) -> None:
    """The OpenAPI schema, for signed-in callers only."""

    @app.get("/api/openapi.json", include_in_schema=False)
    async def openapi_schema(_who: ViewerDep) -> JSONResponse:
        return JSONResponse(app.openapi())
