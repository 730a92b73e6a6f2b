"""Operation workers: Procrastinate workers plus a sweeper, in the server or standalone.

`voice-agent serve` starts one in-process (`start_inprocess_worker`); `voice-agent worker`
runs `run_worker` until SIGINT/SIGTERM. Both wire the same pieces: the executor's task on
a Procrastinate app, the SOR provider, and a sweeper loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

import procrastinate
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import make_engine, resolve_database_url
from app.settings import Settings
from tools.executor import QUEUE, TASK_NAME, Executor, make_app
from tools.provider import Provider
from tools.registry import Registry
from tools.restaurant.catalog import restaurant_catalog
from tools.restaurant.client import SorClient
from tools.restaurant.provider import SorProvider
from tools.sweeper import Sweeper

log = logging.getLogger(__name__)


class OperationWorker:
    """A Procrastinate worker running `execute_operation` jobs, and a sweeper beside it."""

    def __init__(
        self,
        *,
        database_url: str,
        engine: AsyncEngine,
        registry: Registry,
        provider: Provider,
        concurrency: int = 4,
        worker_id: str | None = None,
        callback_base_url: str | None = None,
        sweep_interval_s: float = 5.0,
        deadline_margin_s: float = 2.0,
        heartbeat_s: float = 5.0,
        stalled_after_s: float = 30.0,
        poll_interval_s: float = 1.0,
        shutdown_grace_s: float = 10.0,
        sweep: bool = True,
    ) -> None:
        self.app: procrastinate.App = make_app(database_url, max_pool_size=concurrency + 4)
        self.executor = Executor(
            app=self.app,
            engine=engine,
            registry=registry,
            provider=provider,
            worker_id=worker_id,
            deadline_margin_s=deadline_margin_s,
            callback_base_url=callback_base_url,
        )
        self.sweeper = Sweeper(
            engine=engine,
            reconciler=self.executor.reconciler,
            app=self.app,
            task_name=TASK_NAME,
            interval_s=sweep_interval_s,
            stalled_after_s=stalled_after_s,
        )
        self.concurrency = concurrency
        self.heartbeat_s = heartbeat_s
        self.stalled_after_s = stalled_after_s
        self.poll_interval_s = poll_interval_s
        self.shutdown_grace_s = shutdown_grace_s
        self.sweep = sweep
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def worker_id(self) -> str:
        return self.executor.worker_id

    async def start(self) -> None:
        """Open the job queue connection and start the worker and sweeper tasks."""
        await self.app.open_async()
        self._stop.clear()
        worker = self.app.run_worker_async(
            queues=[QUEUE],
            name=self.worker_id,
            concurrency=self.concurrency,
            wait=True,
            install_signal_handlers=False,
            listen_notify=True,
            fetch_job_polling_interval=self.poll_interval_s,
            abort_job_polling_interval=self.poll_interval_s,
            update_heartbeat_interval=self.heartbeat_s,
            stalled_worker_timeout=self.stalled_after_s,
            shutdown_graceful_timeout=self.shutdown_grace_s,
            delete_jobs="successful",
        )
        self._tasks = [asyncio.create_task(worker, name=f"procrastinate:{self.worker_id}")]
        if self.sweep:
            self._tasks.append(
                asyncio.create_task(self.sweeper.run(self._stop), name="operation-sweeper")
            )
        log.info("operation worker %s started (concurrency %d)", self.worker_id, self.concurrency)

    async def wait(self) -> None:
        """Until the Procrastinate worker ends (it only ends on stop or on a fatal error)."""
        if self._tasks:
            await asyncio.wait([self._tasks[0]])

    async def stop(self) -> None:
        """Graceful: running jobs get `shutdown_grace_s` to finish; then everything closes.

        A job cut off here leaves its operation `running`; the sweeper of any worker moves
        it to `unknown` after its deadline and reconciles it.
        """
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        await self.app.close_async()
        log.info("operation worker %s stopped", self.worker_id)


def build_provider(settings: Settings) -> tuple[Provider, SorClient]:
    """The SOR provider of this deployment (and its client, which the caller closes)."""
    client = SorClient(settings.sor_url())
    return SorProvider(client), client


async def start_inprocess_worker(
    settings: Settings,
    engine: AsyncEngine,
    *,
    database_url: str | None = None,
    registry: Registry | None = None,
    provider: Provider | None = None,
    concurrency: int | None = None,
) -> OperationWorker:
    """Start a worker inside the server process (for its lifespan); `stop()` it on shutdown.

    Without `provider`, a SOR client is built from settings and closed by `stop()`.
    """
    url = database_url or engine.url.render_as_string(hide_password=False)
    client: SorClient | None = None
    if provider is None:
        provider, client = build_provider(settings)
    worker = OperationWorker(
        database_url=url,
        engine=engine,
        registry=registry or restaurant_catalog(),
        provider=provider,
        concurrency=concurrency or settings.worker_concurrency,
        callback_base_url=settings.public_base_url,
        sweep_interval_s=settings.sweep_interval_s,
    )
    if client is not None:
        _close_with(worker, client)
    await worker.start()
    return worker


def _close_with(worker: OperationWorker, client: SorClient) -> None:
    stop = worker.stop

    async def stop_and_close() -> None:
        try:
            await stop()
        finally:
            await client.aclose()

    worker.stop = stop_and_close  # type: ignore[method-assign]


async def run_worker(settings: Settings, concurrency: int | None = None) -> int:
    """`voice-agent worker`: run operation workers until SIGINT/SIGTERM."""
    url = await asyncio.to_thread(resolve_database_url, settings.database_url, settings.data_dir)
    engine = make_engine(url)
    provider, client = build_provider(settings)
    worker = OperationWorker(
        database_url=url,
        engine=engine,
        registry=restaurant_catalog(),
        provider=provider,
        concurrency=concurrency or settings.worker_concurrency,
        callback_base_url=settings.public_base_url,
        sweep_interval_s=settings.sweep_interval_s,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await worker.start()
        print(f"operation worker {worker.worker_id} running", flush=True)
        waiter = asyncio.create_task(worker.wait())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        died = not stop.is_set()
        for t in (waiter, stopper):
            t.cancel()
        await asyncio.gather(waiter, stopper, return_exceptions=True)
    finally:
        await worker.stop()
        await client.aclose()
        await engine.dispose()
    if died:
        # Nobody asked it to stop: the job queue failed (its error is logged above).
        log.error("operation worker %s stopped by itself", worker.worker_id)
        return 1
    return 0
