"""Helpers for console tests: staff and tokens, a logged-in HTTP client, seeded calls and
operations in any status."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access import api_tokens, staff
from app.access.staff import Role
from app.calls.store import calls
from tools import ledger
from tools.ledger_models import operations_table as ops_t
from tools.states import OperationStatus

S = OperationStatus
PASSWORD = "correct horse battery"
_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


async def add_staff(engine: AsyncEngine, name: str, role: Role, password: str = PASSWORD) -> str:
    await staff.create_staff(engine, name, password, role)
    return name


async def bearer(engine: AsyncEngine, role: Role, name: str | None = None) -> dict[str, str]:
    """Headers carrying a new API token of `role`."""
    _, secret = await api_tokens.create_token(
        engine, name or f"test-{role.value}-{uuid.uuid4().hex[:6]}", role, created_by="test"
    )
    return {"Authorization": f"Bearer {secret}"}


def csrf_of(html: str) -> str:
    found = _CSRF.search(html)
    assert found is not None, "no csrf_token field on the page"
    return found.group(1)


@asynccontextmanager
async def logged_in(
    base_url: str, name: str, password: str = PASSWORD
) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A client with a console session, and the session's CSRF token."""
    async with httpx.AsyncClient(base_url=base_url, timeout=20) as client:
        form = await client.get("/console/login")
        response = await client.post(
            "/console/login",
            data={"username": name, "password": password, "csrf_token": csrf_of(form.text)},
        )
        assert response.status_code == 303, response.text
        page = await client.get("/console/calls")
        assert page.status_code == 200, page.text
        yield client, csrf_of(page.text)


async def seed_call(
    engine: AsyncEngine,
    *,
    from_number: str | None = "+15551230000",
    to_number: str | None = "+15550000000",
    status: str = "completed",
    leg: str = "twilio",
    created_at: datetime | None = None,
) -> str:
    call_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            calls.insert().values(
                id=call_id,
                call_sid=f"CA{uuid.uuid4().hex}",
                tenant_id="default",
                leg=leg,
                from_number=from_number,
                to_number=to_number,
                status=status,
                created_at=created_at or datetime.now(UTC),
            )
        )
    return str(call_id)


async def _noop_enqueue(conn: Any, operation_id: uuid.UUID) -> None:
    return None


_PATHS: dict[S, list[S]] = {
    S.AWAITING_CONFIRMATION: [],
    S.ADMITTED: [],
    S.RUNNING: [S.RUNNING],
    S.UNKNOWN: [S.RUNNING, S.UNKNOWN],
    S.COMMITTED: [S.RUNNING, S.COMMITTED],
    S.FAILED_RETRYABLE: [S.RUNNING, S.FAILED_RETRYABLE],
    S.FAILED_FINAL: [S.RUNNING, S.FAILED_FINAL],
    S.CANCELLED: [S.CANCELLED],
}


async def seed_operation(
    engine: AsyncEngine,
    call_id: str | None,
    status: S,
    *,
    tool: str = "book_table",
    args: dict[str, Any] | None = None,
    caller: str | None = "+15551230000",
    key: str | None = None,
    reference: str | None = None,
    turn_id: int | None = 1,
) -> uuid.UUID:
    """An operation of `call_id` brought to `status` through legal transitions."""
    async with engine.begin() as conn:
        admission = await ledger.admit_operation(
            conn,
            tenant_id="default",
            tool=tool,
            args=args or {"date": "2030-01-02", "time": "20:00", "party_size": 2, "name": "Ada"},
            idempotency_key=key or f"test:{uuid.uuid4().hex}",
            call_id=call_id,
            caller=caller,
            turn_id=turn_id,
            status=S.AWAITING_CONFIRMATION if status is S.AWAITING_CONFIRMATION else S.ADMITTED,
            enqueue=_noop_enqueue,
        )
        op_id = admission.operation.operation_id
        current = admission.operation.status
        for target in _PATHS[status]:
            values: dict[str, Any] = {}
            if target is S.RUNNING:
                values = {"attempts": 1, "deadline": datetime.now(UTC) - timedelta(seconds=1)}
            if target is S.COMMITTED:
                values = {"provider_ref": reference or "BK0000TEST"}
            moved = await ledger.transition(
                conn, op_id, current, target, actor="test", reason="seeded", **values
            )
            assert moved is not None
            current = target
    return op_id


async def age_operation(engine: AsyncEngine, op_id: uuid.UUID, seconds: float) -> None:
    """Pretend nothing happened to the operation for `seconds` (stuck-ness is observable)."""
    async with engine.begin() as conn:
        await conn.execute(
            ops_t.update()
            .where(ops_t.c.operation_id == op_id)
            .values(updated_at=sa.func.now() - timedelta(seconds=seconds))
        )
