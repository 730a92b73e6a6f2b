"""Cancelling an operation: at once when nothing was sent, else only if the provider's
`cancel` hook confirms it; a staff member asks through the API."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ConfigDict
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import CONSOLE, Service, running_service, wait_until
from tests.sor_support import admit, events_of, get_op, wait_status
from tools.cancellation import request_cancel
from tools.catalog import Catalog
from tools.ledger import OperationRecord
from tools.provider import ActionResult, Finding, Outcome
from tools.registry import ToolKind, ToolSpec
from tools.states import OperationStatus as S


class OrderArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dish: str


class Kitchen:
    """A provider that can withdraw an order until the kitchen starts cooking it."""

    def __init__(self) -> None:
        self.waiting: dict[str, asyncio.Event] = {}
        self.withdrawn: set[str] = set()
        self.cooked: list[str] = []
        self.cancels: list[str] = []

    async def perform(
        self, op: OperationRecord, spec: ToolSpec, *, timeout_s: float, callback_url: Any = None
    ) -> ActionResult:
        gate = self.waiting.setdefault(op.idempotency_key, asyncio.Event())
        await gate.wait()
        if op.idempotency_key in self.withdrawn:
            return ActionResult(Outcome.failed_final, error="withdrawn")
        self.cooked.append(op.idempotency_key)
        return ActionResult(Outcome.committed, reference=f"D{len(self.cooked)}")

    async def lookup(self, op: OperationRecord, spec: ToolSpec) -> Finding:
        if op.idempotency_key in self.cooked:
            return Finding("applied", reference="D1")
        return Finding("not_found")

    async def read(self, spec: ToolSpec, args: BaseModel) -> Mapping[str, Any]:
        return {}

    async def cancel(
        self, op: OperationRecord, spec: ToolSpec, *, timeout_s: float
    ) -> ActionResult:
        self.cancels.append(op.idempotency_key)
        if op.idempotency_key in self.cooked:
            return ActionResult(Outcome.failed_final, error="already cooked")
        self.withdrawn.add(op.idempotency_key)
        self.waiting.setdefault(op.idempotency_key, asyncio.Event()).set()
        return ActionResult(Outcome.committed)

    def cook(self) -> None:
        for gate in self.waiting.values():
            gate.set()


ORDER = ToolSpec(
    name="order_dish",
    description="Order a dish for the caller's table, after they confirmed it.",
    args_model=OrderArgs,
    kind=ToolKind.MUTATION,
    provider_action="kitchen.order",
    needs_confirmation=False,
    provider_idempotent=True,
    reconcile="kitchen.lookup",
    cancellable_at_provider=True,
    deadline_s=10.0,
)


@pytest.fixture
def kitchen() -> Kitchen:
    return Kitchen()


@pytest.fixture
async def service(engine: AsyncEngine, clean_db: str, kitchen: Kitchen) -> AsyncIterator[Service]:
    catalog = Catalog(
        [ORDER, dataclasses.replace(ORDER, name="order_plain", cancellable_at_provider=False)],
        {"kitchen": kitchen},
    ).checked()
    async with running_service(
        engine, with_worker=True, catalog=catalog, database_url=clean_db, sweep_interval_s=0.5
    ) as svc:
        yield svc


async def _cancel(service: Service, op: OperationRecord) -> httpx.Response:
    async with httpx.AsyncClient(base_url=service.url, auth=CONSOLE, timeout=15) as http:
        return await http.post(
            f"/api/operations/{op.operation_id}/cancel", json={"reason": "caller changed mind"}
        )


async def _running(engine: AsyncEngine, service: Service, tool: str) -> OperationRecord:
    tools = service.runtime.tools
    assert tools is not None
    op_id = await admit(engine, tools.enqueue, tool=tool, args={"dish": "soup"})
    return await wait_status(engine, op_id, S.RUNNING)


async def test_a_running_operation_is_cancelled_only_when_the_provider_confirms(
    engine: AsyncEngine, service: Service, kitchen: Kitchen
) -> None:
    op = await _running(engine, service, "order_dish")
    resp = await _cancel(service, op)
    assert resp.status_code == 200 and resp.json()["operation"]["status"] == "cancelled"
    assert kitchen.cancels == [op.idempotency_key] and kitchen.cooked == []
    # The attempt still in flight answers "withdrawn", before or after the cancel is recorded:
    # either way it is history, never a second outcome.
    late = "late outcome of attempt 1 ignored"
    raced = "cancel requested, and the provider did not do it"

    async def answered() -> bool:
        return await _has_note(engine, op, late) or await _has_note(engine, op, raced)

    await wait_until(answered, 10, "the worker's answer recorded")
    assert (await get_op(engine, op.operation_id)).status is S.CANCELLED
    outcomes = [e.to_status for e in await events_of(engine, op.operation_id) if e.to_status]
    assert outcomes.count(S.CANCELLED) == 1 and S.FAILED_FINAL not in outcomes


async def test_a_provider_that_refuses_leaves_the_outcome_to_decide(
    engine: AsyncEngine, service: Service, kitchen: Kitchen
) -> None:
    op = await _running(engine, service, "order_dish")
    kitchen.cooked.append(op.idempotency_key)  # cooking started: too late to withdraw
    resp = await _cancel(service, op)
    body = resp.json()["operation"]
    assert body["status"] == "running" and body["cancel_requested"] is True
    assert await _has_note(engine, op, "the provider did not confirm the cancel (failed_final)")
    kitchen.cook()
    assert (await wait_status(engine, op.operation_id, S.COMMITTED)).cancel_requested


async def test_a_tool_its_provider_cannot_withdraw_is_not_asked(
    engine: AsyncEngine, service: Service, kitchen: Kitchen
) -> None:
    op = await _running(engine, service, "order_plain")
    resp = await _cancel(service, op)
    assert resp.json()["operation"]["status"] == "running"
    assert kitchen.cancels == []
    kitchen.cook()
    await wait_status(engine, op.operation_id, S.COMMITTED)


async def test_nothing_sent_yet_is_cancelled_at_once(
    engine: AsyncEngine, clean_db: str, kitchen: Kitchen
) -> None:
    async def no_job(conn: Any, operation_id: Any) -> None:
        return None

    op_id = await admit(engine, no_job, tool="order_dish", args={"dish": "soup"})
    registry = Catalog([ORDER], {"kitchen": kitchen}).registry
    done = await request_cancel(
        engine, registry, kitchen, op_id, actor="staff:admin", reason="changed mind"
    )
    assert done.status is S.CANCELLED and kitchen.cancels == []


async def _has_note(engine: AsyncEngine, op: OperationRecord, reason: str) -> bool:
    return any(e.reason and reason in e.reason for e in await events_of(engine, op.operation_id))
