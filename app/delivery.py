"""Late results: when an operation finishes, tell the call that asked for it.

Every status change is NOTIFYed on `operation_status` in the transaction that made it (see
`tools.ledger.transition`), so whichever replica holds the live call hears it. The outcome
is already durable when the notification arrives; this step only decides how the caller
learns it, and records that decision on the operation's trail.

Decisions made here:
- the call is live on this replica: speak the outcome at the bridge's next safe moment
  ("announced in call");
- the call is not live here: nothing (the replica that holds it decides), unless the call
  has ended everywhere, in which case the outcome is recorded as "awaiting out-of-call
  delivery" exactly once (SMS delivery is the next capability to land on this seam).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.owned_tasks import OwnedTasks
from app.pg_listener import PgListener
from telephony.tool_gateway import CallContext, LateResult, LiveCall
from tools import ledger
from tools.ledger import OperationRecord
from tools.registry import Registry
from tools.results import status_message
from tools.states import OperationStatus

log = logging.getLogger(__name__)

CHANNEL = "operation_status"
FINAL = {OperationStatus.COMMITTED, OperationStatus.FAILED_FINAL, OperationStatus.CANCELLED}
ACTOR = "delivery"
ANNOUNCED = "announced in call"
DEFERRED = "call ended: awaiting out-of-call delivery"


class ResultDelivery:
    """Listens for finished operations and hands each outcome to the call that asked."""

    def __init__(
        self,
        engine: AsyncEngine,
        registry: Registry,
        find_live: Callable[[str], LiveCall | None],
        live_call_ids: Callable[[], list[str]],
    ) -> None:
        self._engine = engine
        self._registry = registry
        self._find_live = find_live
        self._live_call_ids = live_call_ids
        self._work = OwnedTasks()
        self.delivered: set[uuid.UUID] = set()

    def subscribe(self, listener: PgListener) -> None:
        """Hear every operation status change through the process's listener."""
        listener.subscribe(CHANNEL, self._on_notify)
        listener.on_listen(self._schedule_catch_up)

    def _schedule_catch_up(self) -> None:
        self._work.spawn(self.catch_up(), "delivery-catch-up")

    async def catch_up(self) -> int:
        """Deliver finished operations of this process's live calls that no replica has
        decided on yet (their notification was missed while the listener was down)."""
        call_ids = self._live_call_ids()
        if not call_ids:
            return 0
        async with self._engine.connect() as conn:
            rows = (
                await conn.execute(
                    sa.text(
                        "SELECT o.operation_id FROM operations o WHERE o.call_id = ANY(:calls) "
                        "AND o.status = ANY(:final) AND NOT EXISTS (SELECT 1 FROM "
                        "operation_events e WHERE e.operation_id = o.operation_id "
                        "AND e.kind = 'decision' AND e.actor = :actor)"
                    ),
                    {"calls": call_ids, "final": [s.value for s in FINAL], "actor": ACTOR},
                )
            ).all()
        for row in rows:
            await self.deliver(row.operation_id)
        return len(rows)

    async def stop(self) -> None:
        """Cancel deliveries still under way (the calls they were for are ending too)."""
        await self._work.cancel_all()

    def _on_notify(self, payload: str) -> None:
        try:
            data = json.loads(payload)
            status = OperationStatus(data["status"])
            operation_id = uuid.UUID(str(data["operation_id"]))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed %s notification", CHANNEL)
            return
        if status not in FINAL or not data.get("call_id"):
            return
        self._work.spawn(self.deliver(operation_id), f"deliver-{operation_id}")

    async def deliver(self, operation_id: uuid.UUID) -> str | None:
        """Decide how the outcome of `operation_id` reaches the caller; returns the decision."""
        try:
            return await self._deliver(operation_id)
        except Exception:
            log.exception("delivering the outcome of operation %s failed", operation_id)
            return None

    async def _deliver(self, operation_id: uuid.UUID) -> str | None:
        async with self._engine.connect() as conn:
            op = await ledger.get_operation(conn, operation_id)
        if op is None or op.status not in FINAL or op.call_id is None:
            return None
        if op.status is OperationStatus.CANCELLED and op.attempts == 0:
            # Never reached the provider (unconfirmed, declined, withdrawn): nothing to tell.
            return None
        live = self._find_live(op.call_id)
        if live is not None:
            return await self._announce(live, op)
        return await self._defer_if_call_ended(op)

    def _text(self, op: OperationRecord) -> str:
        if op.tool in self._registry:
            return status_message(self._registry.get(op.tool), op)
        return f"The request {op.tool} ended as {op.status.value}."

    async def _announce(self, live: LiveCall, op: OperationRecord) -> str | None:
        if not await self._claim(op, ANNOUNCED):
            return None
        result = LateResult(
            operation_id=str(op.operation_id),
            text=self._text(op),
            data={"status": op.status.value, "tool": op.tool, "reference": op.provider_ref},
        )
        accepted = await live.deliver_result(result)
        if not accepted:
            # The call is ending as we speak; it becomes an out-of-call delivery.
            await self._note(op, DEFERRED, {"why": "call ending"})
            return DEFERRED
        self.delivered.add(op.operation_id)
        return ANNOUNCED

    async def _defer_if_call_ended(self, op: OperationRecord) -> str | None:
        assert op.call_id is not None
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(
                    sa.text("SELECT status, ended_at FROM calls WHERE id::text = :c"),
                    {"c": op.call_id},
                )
            ).first()
        if row is not None and row.ended_at is None:
            return None  # live on another replica: that one decides
        if await self._claim(op, DEFERRED):
            return DEFERRED
        return None

    async def _claim(self, op: OperationRecord, decision: str) -> bool:
        """Record `decision` once per operation across replicas; False if already decided."""
        async with self._engine.begin() as conn:
            await ledger.lock_scope(conn, "delivery", str(op.operation_id))
            done = (
                await conn.execute(
                    sa.text(
                        "SELECT 1 FROM operation_events WHERE operation_id = :o "
                        "AND kind = 'decision' AND actor = :a"
                    ),
                    {"o": op.operation_id, "a": ACTOR},
                )
            ).first()
            if done is not None:
                return False
            await ledger.record_event(
                conn,
                op.operation_id,
                kind="decision",
                actor=ACTOR,
                reason=decision,
                data={"status": op.status.value},
            )
        return True

    async def _note(self, op: OperationRecord, reason: str, data: dict[str, Any]) -> None:
        async with self._engine.begin() as conn:
            await ledger.record_event(
                conn, op.operation_id, kind="note", actor=ACTOR, reason=reason, data=data
            )

    async def call_ended(self, ctx: CallContext, pending: list[OperationRecord]) -> None:
        """The call ended with operations still in flight: their outcomes go out of call."""
        for op in pending:
            try:
                await self._note(
                    op,
                    "call ended while in flight: the outcome will be delivered out of call",
                    {"call_id": ctx.call_id, "status": op.status.value},
                )
            except Exception:
                log.exception("could not note the pending outcome of %s", op.operation_id)
