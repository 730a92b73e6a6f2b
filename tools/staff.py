"""Operations a person settles: an `unknown` outcome no provider lookup can resolve.

A mutation whose provider offers no lookup declares `on_unknown: ask_staff`. When such an
operation's answer is lost, nothing is sent again: the reconciler records that it waits for
staff (a `decision` event with `data.awaiting == "staff"` for that attempt), and the operation
stays `unknown` until a member of staff who checked the provider (a phone call, its own
console) settles it: it happened (`committed`, with the provider's reference), it did not
(`not_applied`: failed for good, or cancelled when a cancel was requested), or it did not
and may be sent again (`retry`). Staff may settle any `unknown` operation this way, for
instance when a provider's lookup keeps failing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tools import ledger
from tools.compensation import compensate
from tools.errors import OperationNotFound, ToolError
from tools.ledger import OperationRecord
from tools.registry import Registry
from tools.states import OperationStatus

S = OperationStatus

AWAITING = "staff"
AWAITING_REASON = (
    "the outcome is unknown and the provider offers no lookup: waiting for staff to check "
    "with the provider and settle it (nothing is sent again meanwhile)"
)


class Verdict(StrEnum):
    """What a member of staff found at the provider."""

    COMMITTED = "committed"  # it happened
    NOT_APPLIED = "not_applied"  # it did not happen; do not send it again
    RETRY = "retry"  # it did not happen; send it again now


class NotSettleable(ToolError):
    """Only an `unknown` operation is settled by staff."""


@dataclass(frozen=True, slots=True)
class Settlement:
    """What the staff's verdict did to the operation."""

    operation: OperationRecord
    verdict: Verdict


async def awaiting_since(conn: AsyncConnection, op: OperationRecord) -> datetime | None:
    """When `op` (its current attempt) started waiting for staff; None if it is not."""
    if op.status is not S.UNKNOWN:
        return None
    row = (
        await conn.execute(
            sa.text(
                "SELECT min(at) FROM operation_events WHERE operation_id = :o "
                "AND kind = 'decision' AND data->>'awaiting' = :w "
                "AND (data->>'attempt')::int = :n"
            ),
            {"o": op.operation_id, "w": AWAITING, "n": op.attempts},
        )
    ).scalar_one_or_none()
    return row


async def ask_staff(conn: AsyncConnection, op: OperationRecord, *, actor: str) -> bool:
    """Record (once per attempt) that `op` waits for staff. True if recorded now."""
    if await awaiting_since(conn, op) is not None:
        return False
    await ledger.record_event(
        conn,
        op.operation_id,
        kind="decision",
        actor=actor,
        reason=AWAITING_REASON,
        data={"awaiting": AWAITING, "attempt": op.attempts, "tool": op.tool},
    )
    return True


async def list_awaiting(
    conn: AsyncConnection, *, tenant_id: str | None = None, limit: int = 100
) -> list[tuple[OperationRecord, datetime]]:
    """Operations waiting for staff, oldest first, with when they started waiting."""
    rows = (
        await conn.execute(
            sa.text(
                "SELECT o.operation_id, min(e.at) AS since FROM operations o "
                "JOIN operation_events e ON e.operation_id = o.operation_id "
                "WHERE o.status = 'unknown' AND e.kind = 'decision' "
                "AND e.data->>'awaiting' = :w AND (e.data->>'attempt')::int = o.attempts "
                "AND (CAST(:t AS text) IS NULL OR o.tenant_id = :t) "
                "GROUP BY o.operation_id ORDER BY since LIMIT :n"
            ),
            {"w": AWAITING, "t": tenant_id, "n": limit},
        )
    ).all()
    out = []
    for op_id, since in rows:
        op = await ledger.get_operation(conn, op_id)
        if op is not None:
            out.append((op, since))
    return out


async def settle(
    engine: AsyncEngine,
    operation_id: uuid.UUID,
    verdict: Verdict,
    *,
    actor: str,
    note: str,
    reference: str | None = None,
    result: dict[str, Any] | None = None,
    registry: Registry | None = None,
    enqueue: ledger.Enqueue | None = None,
) -> Settlement:
    """Apply a member of staff's verdict to an `unknown` operation, in one transaction.

    `registry` and `enqueue` let a commit whose cancel was requested be compensated, and a
    `retry` be enqueued; without `enqueue`, `retry` is refused. Raises `OperationNotFound`,
    or `NotSettleable` when the operation is not `unknown` (someone else settled it).
    """
    if verdict is Verdict.RETRY and enqueue is None:
        raise NotSettleable("this process cannot enqueue a retry")
    async with engine.begin() as conn:
        op = await ledger.get_operation(conn, operation_id, for_update=True)
        if op is None:
            raise OperationNotFound(f"no operation {operation_id}")
        if op.status is not S.UNKNOWN:
            raise NotSettleable(f"the operation is {op.status.value}, not unknown")
        data = {"verdict": verdict.value, "note": note[:500], "attempt": op.attempts}
        moved: OperationRecord | None
        if verdict is Verdict.COMMITTED:
            moved = await ledger.transition(
                conn,
                operation_id,
                S.UNKNOWN,
                S.COMMITTED,
                actor=actor,
                reason=f"staff checked: the provider has it ({note[:200]})",
                data=data,
                provider_ref=reference,
                result=result,
                error=None,
            )
            if (
                moved is not None
                and moved.cancel_requested
                and registry is not None
                and enqueue is not None
            ):
                await compensate(
                    conn,
                    registry,
                    moved,
                    enqueue=enqueue,
                    actor=actor,
                    reason="cancel requested; staff found it applied",
                )
        elif verdict is Verdict.NOT_APPLIED:
            to = S.CANCELLED if op.cancel_requested else S.FAILED_FINAL
            moved = await ledger.transition(
                conn,
                operation_id,
                S.UNKNOWN,
                to,
                actor=actor,
                reason=f"staff checked: the provider never applied it ({note[:200]})",
                data=data,
                error=op.error if to is S.CANCELLED else "not applied at the provider",
            )
        else:
            assert enqueue is not None
            moved = await ledger.transition(
                conn,
                operation_id,
                S.UNKNOWN,
                S.FAILED_RETRYABLE,
                actor=actor,
                reason=f"staff checked: not applied; sending it again ({note[:200]})",
                data=data,
                next_attempt_at=None,
            )
            if moved is not None:
                await enqueue(conn, operation_id)
        assert moved is not None  # the row is locked and was unknown
        return Settlement(moved, verdict)
