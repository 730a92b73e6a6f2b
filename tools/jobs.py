"""Deferring follow-up work as Procrastinate jobs inside the caller's transaction.

The job row commits or rolls back with whatever else the transaction does (the terminal
transition that opens a delivery, the SMS row persisted before its send), so work is never
lost between "decided" and "queued". Deferral runs on the transaction's own psycopg
connection (tools.driver_sql), through Procrastinate's own SQL function
(`procrastinate_defer_jobs_v1`, what its `defer_async` and `batch_defer_async` call): no
Procrastinate app or pool here.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from procrastinate.jobs import DEFAULT_PRIORITY
from psycopg.types.json import Jsonb
from sqlalchemy.ext.asyncio import AsyncConnection

from tools import driver_sql

# Delivery work has its own queue, so a deployment can size (or pause) it apart from
# operations; workers listen on both by default.
DELIVERY_QUEUE = "deliveries"
DELIVER_TASK = "deliver_outcome"  # decide and drive one delivery
SMS_TASK = "drive_sms"  # send, reconcile or poll one SMS message
WEBHOOK_TASK = "send_webhook"  # POST one integrator webhook delivery

log = logging.getLogger(__name__)

# One job, the row Procrastinate's `defer_async` writes (its `defer_jobs` query: the same
# function, the same composite, priority DEFAULT_PRIORITY, no lock or queueing lock), with the
# values as plain parameters. Run straight on the driver connection it skips what Procrastinate
# does around the statement per call (a JobDeferrer configured, the job copied twice, two log
# records of the job's dict built, a cursor wrapped in its exception mapping, the job list
# dumped as an array of records): 0.46 -> 0.27 ms CPU a defer.
# Both run through tools.driver_sql, as a call's hot statements do: SQLAlchemy's handling of a
# failed execution and its cursor listeners (statement counts) see them.
_DEFER_ONE = sa.text(
    "SELECT unnest(procrastinate_defer_jobs_v1(ARRAY["
    f"(:queue, :task, {DEFAULT_PRIORITY:d}, NULL, NULL, :args, :schedule_at)"
    "::procrastinate_job_to_defer_v1]))"
)

# Many jobs of one task, as Procrastinate's `batch_defer_async` writes them (the same function
# over the same composites, in the arguments' order), the arguments one jsonb array: its
# per-job work in Python (jobs made and logged one by one) was half of what persisting a
# batch of SMS cost the worker (bench/delivery.py, BENCH_PROFILE_WORKER). The arguments go as
# one JSON array (not a jsonb[] whose every element psycopg dumped and escaped in Python).
_DEFER_MANY = sa.text(
    "SELECT unnest(procrastinate_defer_jobs_v1(ARRAY("
    f"SELECT ROW(:queue, :task, {DEFAULT_PRIORITY:d}, NULL, NULL, a.args, :schedule_at)"
    "::procrastinate_job_to_defer_v1"
    " FROM jsonb_array_elements(CAST(:args AS jsonb)) WITH ORDINALITY AS a(args, n)"
    " ORDER BY a.n)))"
)


async def defer(
    conn: AsyncConnection,
    task: str,
    *,
    queue: str = DELIVERY_QUEUE,
    schedule_at: datetime | None = None,
    **kwargs: Any,
) -> int:
    """Defer `task(**kwargs)` on `conn`'s connection, inside its transaction; the job id."""
    params = {"queue": queue, "task": task, "args": Jsonb(kwargs), "schedule_at": schedule_at}
    [(job_id,)] = await driver_sql.fetch_tuples(conn, _DEFER_ONE, params)
    log.info("Deferred 1 job: %s[%d] on %s", task, job_id, queue)
    return job_id


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
    params = {
        "queue": queue,
        "task": task,
        "args": driver_sql.json_rows(kwargs),
        "schedule_at": schedule_at,
    }
    ids = [job_id for (job_id,) in await driver_sql.fetch_tuples(conn, _DEFER_MANY, params)]
    log.info("Deferred %d jobs: %s on %s", len(ids), task, queue)
    return ids


def defer_in_statement(*sources: str) -> str:
    """SQL for one column of a statement that defers, in that same statement, the jobs whose
    rows (`args` jsonb, `task` text) the SELECTs `sources` give, in their order (on
    `DELIVERY_QUEUE`, the priority, lock and schedule `defer` uses): the same rows
    `procrastinate_defer_jobs_v1` writes for `defer`, their ids as an array (NULL when none),
    without a round trip each. A data-modifying statement's CTEs that the sources read are
    complete before this column is computed."""
    arrays = " || ".join(
        f"ARRAY(SELECT ROW('{DELIVERY_QUEUE}', j.task, {DEFAULT_PRIORITY:d}, NULL, NULL, "
        f"j.args, NULL)::procrastinate_job_to_defer_v1 FROM ({src}) AS j)"
        for src in sources
    )
    return (
        "(SELECT procrastinate_defer_jobs_v1(a.jobs) FROM "
        f"(SELECT {arrays} AS jobs) AS a WHERE cardinality(a.jobs) > 0)"
    )
