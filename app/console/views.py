"""What the console's JSON API and its pages share: the console and row-id parameters, and
the calls list, one call, the operations list, one operation and an operation action, each
as JSON fit for the asking role. `api` serves it; `pages` renders the same.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import Depends, Path
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.auth import Principal
from app.calls import query as call_query
from app.console.call_view import call_view
from app.console.masking import masker_for
from app.console.schemas import (
    CallListQuery,
    OperationListQuery,
)
from app.console.services import Console
from app.deps import RuntimeDep
from app.errors import Conflict, Forbidden, NotFound, TooManyAttempts
from app.ops import operation_query
from app.ops.operation_actions import Action, ActionDone, ActionRefused
from tools.ledger_models import operations_table as ops_t

BIGINT_MAX = 2**63 - 1


RowIdPath = Annotated[int, Path(ge=1, le=BIGINT_MAX)]


def get_console(runtime: RuntimeDep) -> Console:
    console: Console = runtime.console
    return console


ConsoleDep = Annotated[Console, Depends(get_console)]


def principal_masker(principal: Principal) -> Any:
    return masker_for(principal.sees_phone_numbers)


def call_filter(q: CallListQuery, principal: Principal) -> call_query.CallFilter:
    """The list's filter for this principal: a viewer's phone search is a whole number."""
    phone = q.phone
    if phone and not principal.sees_phone_numbers:
        try:
            phone = call_query.viewer_phone(phone)
        except call_query.SearchRefused as exc:
            raise Forbidden(str(exc)) from exc
    return call_query.CallFilter(
        phone=phone,
        phone_exact=not principal.sees_phone_numbers,
        since=q.since,
        until=q.until,
        statuses=tuple(s.value for s in q.status),
        legs=tuple(q.leg),
        unsettled=q.unsettled,
    )


async def calls_page(
    engine: AsyncEngine, console: Console, q: CallListQuery, principal: Principal
) -> dict[str, Any]:
    """The calls list as JSON for this role (the page renders the same). Forbidden for a
    viewer's partial number, TooManyAttempts past the search limit."""
    f = call_filter(q, principal)
    if f.phone:
        wait = console.searches.admit(principal.actor, f.phone)  # session and Basic share one
        if wait is not None:
            raise TooManyAttempts(
                f"too many different phone numbers searched; try again in {wait} s", wait
            )
    page = await call_query.search_calls(
        engine,
        f,
        limit=q.limit,
        cursor=call_query.Cursor.decode(q.cursor) if q.cursor else None,
    )
    masker = principal_masker(principal)
    return {
        "calls": [masker.scrub(item.as_json()) for item in page.items],
        "next_cursor": page.next_cursor,
        "limit": q.limit,
    }


async def view_or_404(
    engine: AsyncEngine, console: Console, call_id: uuid.UUID, principal: Principal
) -> dict[str, Any]:
    view = await call_view(
        engine, str(call_id), registry=console.registry, masker=principal_masker(principal)
    )
    if view is None:
        raise NotFound(f"no call {call_id}")
    return view


def op_filter(q: OperationListQuery) -> operation_query.OperationFilter:
    return operation_query.OperationFilter(
        states=tuple(q.state),
        statuses=tuple(s.value for s in q.status),
        tool=q.tool,
        call_id=str(q.call_id) if q.call_id else None,
    )


async def operations_page(
    engine: AsyncEngine, console: Console, q: OperationListQuery, principal: Principal
) -> dict[str, Any]:
    stuck = console.actions.stuck_after_s
    page = await operation_query.list_operations(
        engine,
        console.registry,
        op_filter(q),
        limit=q.limit,
        cursor=operation_query.OpCursor.decode(q.cursor) if q.cursor else None,
        stuck_after_s=stuck,
    )
    counts = await operation_query.count_by_state(engine, console.registry, stuck_after_s=stuck)
    masker = principal_masker(principal)
    return {
        "operations": [
            masker.scrub(operation_query.operation_json(i.op, i.state)) for i in page.items
        ],
        "counts": {s.value: n for s, n in counts.items()},
        "next_cursor": page.next_cursor,
        "limit": q.limit,
    }


async def operation_detail(
    engine: AsyncEngine, console: Console, operation_id: uuid.UUID, principal: Principal
) -> dict[str, Any]:
    """One operation with its history, tool calls, compensations and available actions."""
    async with engine.connect() as conn:
        detail = await operation_query.load_operation(
            conn, console.registry, operation_id, stuck_after_s=console.actions.stuck_after_s
        )
    if detail is None:
        raise NotFound(f"no operation {operation_id}")
    actions = await console.actions.availability(detail.op)
    sms = await console.actions.sms.latest_for_operation(operation_id)
    body = {
        "operation": operation_query.operation_json(detail.op, detail.state),
        "events": [operation_query.event_json(e) for e in detail.events],
        "tool_calls": [operation_query.tool_call_json(t) for t in detail.tool_calls],
        "compensations": [operation_query.operation_json(o) for o in detail.compensations],
        "compensates": (
            operation_query.operation_json(detail.compensates) if detail.compensates else None
        ),
        "actions": {a.value: {"allowed": v.allowed, "why": v.why} for a, v in actions.items()},
        "sms": (
            {
                "delivery_id": str(sms.delivery_id),
                "state": sms.state,
                "to": sms.to,
                "resendable": sms.resendable,
                "why_not": sms.why_not,
            }
            if sms
            else None
        ),
    }
    scrubbed: dict[str, Any] = principal_masker(principal).scrub(body)
    return scrubbed


async def run_action(
    console: Console, action: Action, operation_id: uuid.UUID, principal: Principal, body: Any
) -> ActionDone:
    """Do `action` as `principal`; ActionRefused becomes a 409 naming why."""
    actions = console.actions
    async with actions.engine.connect() as conn:
        exists = await conn.scalar(
            sa.select(ops_t.c.operation_id).where(ops_t.c.operation_id == operation_id)
        )
    if exists is None:
        raise NotFound(f"no operation {operation_id}")
    actor, why = principal.actor, body.why
    try:
        match action:
            case Action.RECONCILE:
                return await actions.reconcile(operation_id, actor=actor, why=why)
            case Action.RETRY:
                return await actions.retry(operation_id, actor=actor, why=why)
            case Action.RECORD_OUTCOME:
                return await actions.record_outcome(
                    operation_id, body.outcome, actor=actor, why=why, reference=body.reference
                )
            case Action.COMPENSATE:
                return await actions.compensate(operation_id, actor=actor, why=why)
            case Action.RESEND_SMS:
                return await actions.resend_sms(operation_id, actor=actor, why=why)
    except ActionRefused as exc:
        raise Conflict(str(exc)) from exc
    raise AssertionError(action)  # pragma: no cover
