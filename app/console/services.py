"""The staff console's services for the life of the process.

`start_console` builds what the console needs for the life of the process: the recorder of
calls, the live-update hub (subscribed to the process's notification listener), the
operation actions (with a reconciler that asks the system of record), and the first admin
account. The routes use the `Console` it returns; `app.console.install` adds them to the app.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.access.staff import ensure_first_admin
from app.calls.query import SearchLimiter
from app.calls.recording_store import Recordings
from app.console.live import LiveHub
from app.ops.operation_actions import OperationActions
from app.ops.sms_resend import NoSmsDelivery, SmsDeliveries
from app.pg_listener import PgListener
from app.settings import Settings
from tools.executor import enqueue_operation, make_app, make_enqueue
from tools.provider import Provider
from tools.reconcile import Reconciler
from tools.registry import Registry

log = logging.getLogger(__name__)


@dataclass
class Console:
    """What the console's routes use."""

    registry: Registry
    recordings: Recordings
    live: LiveHub
    actions: OperationActions
    searches: SearchLimiter  # phone searches per staff member or token (app/calls/query.py)
    _closers: list[Any]

    async def aclose(self) -> None:
        self.live.close()
        for close in self._closers:
            try:
                await close()
            except Exception:
                log.exception("closing a console resource failed")


async def start_console(
    settings: Settings,
    engine: AsyncEngine,
    database_url: str,
    *,
    registry: Registry,
    provider: Provider,
    listener: PgListener,
    sms: SmsDeliveries | None = None,
) -> Console:
    """The console's services for this process (call before `listener.start()`)."""
    await ensure_first_admin(
        engine,
        settings.console_user,
        settings.console_password.get_secret_value() if settings.console_password else None,
    )
    live = LiveHub(
        max_streams=settings.sse_max_streams,
        max_per_principal=settings.sse_max_streams_per_principal,
        max_lifetime_s=settings.sse_max_lifetime_s,
    )
    live.subscribe(listener)
    # Deferral runs on the caller's connection, so this job-queue app is never opened.
    jobs = make_app(database_url, max_pool_size=1)
    enqueue = make_enqueue(jobs)

    async def enqueue_at(conn: AsyncConnection, op_id: uuid.UUID, at: datetime | None) -> None:
        await enqueue_operation(jobs, conn, op_id, schedule_at=at)

    # Reconciling asks the system of record through the catalog's providers, as the workers'
    # reconciler does (the caller owns the catalog and closes it).
    def reconciler(actor: str) -> Reconciler | None:
        return Reconciler(
            engine=engine, registry=registry, provider=provider, enqueue=enqueue_at, actor=actor
        )

    actions = OperationActions(
        engine,
        registry,
        enqueue=enqueue,
        reconciler=reconciler,
        sms=sms or NoSmsDelivery(),
        stuck_after_s=settings.operation_stuck_after_s,
    )
    return Console(
        registry=registry,
        recordings=Recordings(engine, settings),
        live=live,
        actions=actions,
        searches=SearchLimiter(settings.call_search_max_numbers, settings.call_search_window_s),
        _closers=[],
    )
