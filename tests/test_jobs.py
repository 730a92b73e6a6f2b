"""tools.jobs writes the job rows Procrastinate's own deferral writes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import procrastinate
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from tools import jobs

COLUMNS = "queue_name, task_name, priority, lock, queueing_lock, args, status, scheduled_at"


async def _rows(engine: AsyncEngine, ids: list[int]) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        result = await conn.execute(
            sa.text(f"SELECT id, {COLUMNS} FROM procrastinate_jobs WHERE id = ANY(:ids)"),
            {"ids": ids},
        )
        by_id = {r.id: {k: v for k, v in r._mapping.items() if k != "id"} for r in result}
    return [by_id[i] for i in ids]


async def _procrastinate_batch(
    engine: AsyncEngine, task: str, kwargs: list[dict[str, Any]], at: datetime | None
) -> list[int]:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector())
    async with engine.begin() as conn:
        raw = await conn.get_raw_connection()
        deferrer = app.configure_task(
            task, queue=jobs.DELIVERY_QUEUE, connection=raw.driver_connection, schedule_at=at
        )
        return await deferrer.batch_defer_async(*kwargs)


@pytest.mark.parametrize("scheduled", [False, True])
async def test_defer_many_writes_procrastinates_rows_in_the_arguments_order(
    engine: AsyncEngine, scheduled: bool
) -> None:
    at = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=5) if scheduled else None
    kwargs = [{"message_id": f"m-{i}", "n": i, "nested": {"a": [i]}} for i in range(7)]
    async with engine.begin() as conn:
        ours = await jobs.defer_many(conn, jobs.SMS_TASK, kwargs, schedule_at=at)
    theirs = await _procrastinate_batch(engine, jobs.SMS_TASK, kwargs, at)
    assert len(ours) == len(set(ours)) == 7
    ours_rows, their_rows = await _rows(engine, ours), await _rows(engine, theirs)
    assert ours_rows == their_rows
    assert [r["args"] for r in ours_rows] == kwargs  # each id is its own arguments' job
    assert all(r["scheduled_at"] == at for r in ours_rows)


async def test_defer_many_of_nothing_writes_nothing_and_rolls_back_with_its_transaction(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        assert await jobs.defer_many(conn, jobs.SMS_TASK, []) == []
    with pytest.raises(RuntimeError):
        async with engine.begin() as conn:
            ids = await jobs.defer_many(conn, jobs.SMS_TASK, [{"message_id": "x"}])
            raise RuntimeError("the transaction fails")
    assert await _rows_count(engine, ids) == 0


async def _rows_count(engine: AsyncEngine, ids: list[int]) -> int:
    async with engine.connect() as conn:
        return int(
            (
                await conn.execute(
                    sa.text("SELECT count(*) FROM procrastinate_jobs WHERE id = ANY(:ids)"),
                    {"ids": ids},
                )
            ).scalar_one()
        )
