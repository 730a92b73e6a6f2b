"""Deferring follow-up work as Procrastinate jobs inside the caller's transaction.

The job row commits or rolls back with whatever else the transaction does (the terminal
transition that opens a delivery, the SMS row persisted before its send), so work is never
lost between "decided" and "queued". Deferral runs on the transaction's own psycopg
connection: the Procrastinate app here is never opened and holds no pool.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import procrastinate
from sqlalchemy.ext.asyncio import AsyncConnection

# Delivery work has its own queue, so a deployment can size (or pause) it apart from
# operations; workers listen on both by default.
DELIVERY_QUEUE = "deliveries"
DELIVER_TASK = "deliver_outcome"  # decide and drive one delivery
SMS_TASK = "drive_sms"  # send, reconcile or poll one SMS message
WEBHOOK_TASK = "send_webhook"  # POST one integrator webhook delivery

_deferrer = procrastinate.App(connector=procrastinate.PsycopgConnector())


async def defer(
    conn: AsyncConnection,
    task: str,
    *,
    queue: str = DELIVERY_QUEUE,
    schedule_at: datetime | None = None,
    **kwargs: Any,
) -> int:
    """Defer `task(**kwargs)` on `conn`'s connection, inside its transaction; the job id."""
    raw = await conn.get_raw_connection()
    deferrer = _deferrer.configure_task(
        task, queue=queue, connection=raw.driver_connection, schedule_at=schedule_at
    )
    return await deferrer.defer_async(**kwargs)


async def defer_many(
    conn: AsyncConnection,
    task: str,
    kwargs: list[dict[str, Any]],
    *,
    queue: str = DELIVERY_QUEUE,
    schedule_at: datetime | None = None,
) -> list[int]:
    """`defer` for many jobs of one task, in one statement; their ids in order."""
    if not kwargs:
        return []
    raw = await conn.get_raw_connection()
    deferrer = _deferrer.configure_task(
        task, queue=queue, connection=raw.driver_connection, schedule_at=schedule_at
    )
    return await deferrer.batch_defer_async(*kwargs)
