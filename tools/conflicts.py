"""Conflicting requests: a newer request of the same caller that contradicts an earlier one.

A tool declares what contradicts it (`ToolSpec.conflicts`, a key over its arguments). The
pipeline then never runs both on its own:

- while the earlier operation is in flight, the newer one is recorded and held
  (`awaiting_confirmation`, `held_by_operation_id` = the earlier one): it may not be
  confirmed until the earlier one is settled, and the earlier outcome is told with it;
- once the earlier one is settled, the caller decides (`resolve_conflict`): move it (the
  earlier one is compensated and the newer one admitted, in one transaction), keep both (the
  newer one admitted on that explicit yes), or drop the newer one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncConnection

from tools.ledger import OperationRecord
from tools.ledger_models import operations_table as ops_t
from tools.registry import ToolSpec
from tools.results import bounded, describe_operation
from tools.states import IN_FLIGHT, OperationStatus

S = OperationStatus


def conflict_key(spec: ToolSpec, args: BaseModel) -> str | None:
    """The declared key of these arguments (None for a tool that declares no conflicts)."""
    if spec.conflicts is None:
        return None
    return spec.conflicts.key(args)[:200]


@dataclass(frozen=True, slots=True)
class Earlier:
    """The earlier operations a new request would contradict."""

    in_flight: OperationRecord | None  # not settled yet: the new one waits for it
    committed: OperationRecord | None  # went through (and was not undone)


async def find_earlier(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    caller: str | None,
    call_id: str,
    key: str,
    exclude: uuid.UUID | None = None,
) -> Earlier:
    """The latest earlier operation with `key` of the same caller (by number; a caller
    without a number is only themselves within the call), in flight and committed."""
    who = ops_t.c.caller == caller if caller else ops_t.c.call_id == call_id
    stmt = (
        sa.select(ops_t)
        .where(
            ops_t.c.tenant_id == tenant_id,
            who,
            ops_t.c.conflict_key == key,
            ops_t.c.status.in_([s.value for s in IN_FLIGHT] + [S.COMMITTED.value]),
        )
        .order_by(ops_t.c.created_at.desc())
    )
    if exclude is not None:
        stmt = stmt.where(ops_t.c.operation_id != exclude)
    in_flight: OperationRecord | None = None
    committed: OperationRecord | None = None
    for row in await conn.execute(stmt):
        op = OperationRecord.from_row(row)
        if op.status in IN_FLIGHT and in_flight is None:
            in_flight = op
        elif op.status is S.COMMITTED and committed is None:
            if not await _undone(conn, op):
                committed = op
    return Earlier(in_flight, committed)


async def _undone(conn: AsyncConnection, op: OperationRecord) -> bool:
    """Whether a compensation of `op` went through (it no longer stands)."""
    row = (
        await conn.execute(
            sa.select(sa.literal(1))
            .where(
                ops_t.c.compensates_operation_id == op.operation_id,
                ops_t.c.status == S.COMMITTED.value,
            )
            .limit(1)
        )
    ).first()
    return row is not None


def held_output(spec: ToolSpec, op: OperationRecord, earlier: str) -> dict[str, Any]:
    """What the model hears about a request held back by an earlier one in flight."""
    return {
        "status": "held",
        "operation_id": str(op.operation_id),
        "message": bounded(
            f"Not done: the earlier request ({earlier}) is still being processed, and this "
            "one contradicts it, so nothing new was started. Tell the caller you will tell "
            "them how the earlier one went first; then they can choose to move it to this, "
            "keep both, or leave it as it is."
        ),
    }


def keep_both_readback(spec: ToolSpec, args: BaseModel, earlier: OperationRecord) -> str:
    """The readback of a request that would stand beside an earlier one that went through."""
    what = spec.describe_args(args)
    before = describe_operation(spec, earlier)
    ref = f" (reference {earlier.provider_ref})" if earlier.provider_ref else ""
    kind = spec.conflicts.what if spec.conflicts else "an earlier request"
    return (
        f"The caller already has {before}{ref}, {kind}. This would add {what} as well. "
        "Say yes to keep both, or ask to move the earlier one instead."
    )


def held_still_output(op: OperationRecord, earlier: str) -> dict[str, Any]:
    return {
        "status": "held",
        "operation_id": str(op.operation_id),
        "message": bounded(
            f"Not yet: the earlier request ({earlier}) is still being processed. Nothing new "
            "was done; its outcome comes first, then the caller can choose."
        ),
    }
