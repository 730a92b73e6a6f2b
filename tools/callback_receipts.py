"""Receipts of provider callbacks: a replayed `webhook-id` is recognised, an older
`sequence` than one already taken for the operation is ignored (out-of-order safe).

A receipt is written `pending` before the report is applied and marked with what applying
did; a `pending` one (the apply failed half-way) lets the same message through again.
"""

from __future__ import annotations

import uuid
from enum import StrEnum

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from tools.callback_models import callback_receipts_table as rc_t


class Admission(StrEnum):
    """What to do with a signed report."""

    APPLY = "apply"
    DUPLICATE = "duplicate"  # this webhook-id was taken already
    STALE = "stale"  # a report with a higher sequence was taken for this operation


async def admit(
    conn: AsyncConnection,
    webhook_id: str,
    operation_id: uuid.UUID,
    sequence: int,
    status: str,
) -> Admission:
    """Record the receipt (pending) unless it is a replay or older than one taken."""
    # Serialize the reports of one operation so two racing sequences are ordered.
    await conn.execute(
        sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtextextended(f"cb|{operation_id}", 0)))
    )
    existing = (
        await conn.execute(sa.select(rc_t.c.outcome).where(rc_t.c.webhook_id == webhook_id))
    ).scalar_one_or_none()
    if existing is not None and existing != "pending":
        return Admission.DUPLICATE
    newest = (
        await conn.execute(
            sa.select(sa.func.max(rc_t.c.sequence)).where(
                rc_t.c.operation_id == operation_id,
                rc_t.c.outcome.in_(("applied", "ignored")),
                rc_t.c.webhook_id != webhook_id,
            )
        )
    ).scalar_one_or_none()
    stale = newest is not None and sequence < newest
    await conn.execute(
        insert(rc_t)
        .values(
            webhook_id=webhook_id,
            operation_id=operation_id,
            sequence=sequence,
            status=status[:16],
            outcome="stale" if stale else "pending",
        )
        .on_conflict_do_nothing(index_elements=["webhook_id"])
    )
    return Admission.STALE if stale else Admission.APPLY


async def settle(conn: AsyncConnection, webhook_id: str, applied: bool) -> None:
    """What applying the report did."""
    await conn.execute(
        sa.update(rc_t)
        .where(rc_t.c.webhook_id == webhook_id)
        .values(outcome="applied" if applied else "ignored")
    )
