"""Compensation: undoing a committed operation is a new operation that points at it.

The original stays `committed` (that is what happened); the compensating operation (for
a booking, its cancel) is admitted and enqueued like any other, with
`compensates_operation_id` set, and its key derived from the original's so that asking
twice compensates once.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from tools import ledger, measures
from tools.ledger import OperationRecord
from tools.registry import Registry
from tools.states import OperationStatus


def compensation_key(original: OperationRecord) -> str:
    return f"comp:{original.idempotency_key}"[:200]


async def admit_compensation(
    conn: AsyncConnection,
    original: OperationRecord,
    tool: str,
    args: dict[str, Any],
    *,
    enqueue: ledger.Enqueue,
    actor: str,
    reason: str,
) -> OperationRecord:
    """Admit and enqueue an operation of `tool` compensating `original`, in this transaction."""
    if original.status is not OperationStatus.COMMITTED:
        raise ValueError(f"only a committed operation is compensated, not {original.status}")
    admission = await ledger.admit_operation(
        conn,
        tenant_id=original.tenant_id,
        tool=tool,
        args=args,
        idempotency_key=compensation_key(original),
        call_id=original.call_id,
        caller=original.caller,
        compensates_operation_id=original.operation_id,
        actor=actor,
        reason=reason,
        enqueue=enqueue,
    )
    if admission.created:
        measures.COMPENSATIONS.inc()
        await ledger.record_event(
            conn,
            original.operation_id,
            kind="decision",
            actor=actor,
            reason=f"compensation admitted: {reason}",
            data={"compensation_operation_id": str(admission.operation.operation_id)},
        )
    return admission.operation


async def compensate(
    conn: AsyncConnection,
    registry: Registry,
    original: OperationRecord,
    *,
    enqueue: ledger.Enqueue,
    actor: str,
    reason: str,
) -> OperationRecord | None:
    """Compensate `original` with its tool's declared compensating tool, if it has one.

    The compensating tool receives the provider's reference in its `reference_arg` (the
    booking id a cancel takes). Without a compensating tool, a note asks a human to look.
    """
    spec = registry.get(original.tool)
    by = spec.compensated_by
    comp = registry.get(by) if by is not None and by in registry else None
    if comp is None or comp.reference_arg is None or original.provider_ref is None:
        await ledger.record_event(
            conn,
            original.operation_id,
            kind="note",
            actor=actor,
            reason=f"{reason}; nothing can compensate it automatically: needs a human",
        )
        return None
    return await admit_compensation(
        conn,
        original,
        comp.name,
        {comp.reference_arg: original.provider_ref},
        enqueue=enqueue,
        actor=actor,
        reason=reason,
    )
