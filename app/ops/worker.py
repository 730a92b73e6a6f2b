"""Operation workers: Procrastinate workers plus sweepers, in the server or standalone.

`voice-agent serve` starts one in-process (`start_inprocess_worker`); `voice-agent worker`
runs `run_worker` until SIGINT/SIGTERM. Both wire the same pieces: the executor's task on
a Procrastinate app, the configured catalog's providers, the delivery tasks (outcomes to
callers by call or SMS, integrator webhooks), and the sweeper loops that recover what a crash
left behind.

SIP placings (`place_call` over our SIP leg) are jobs on their own queue (SIP_QUEUE), taken
only beside a SIP listener: `serve` with SIP_BIND starts a second Procrastinate worker on it
once its listener is up (`take_sip_jobs`) and stops it before the listener goes; a standalone
worker never takes it. Every worker's sweeper fails a SIP placing nobody took within
SIP_PLACE_WAIT_S (`sip_queue_wait`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Any

import procrastinate
from prometheus_client import start_http_server
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import PING_AFTER_IDLE_S, make_engine, resolve_database_url
from app.loop_watch import LoopWatch
from app.ops.callback import CallbackChannel, CallbackConfig
from app.ops.delivery_jobs import DeliveryConfig, DeliveryDriver, DeliverySweeper
from app.ops.outbound import OutboundRouter, SipPlacer, outbound_worker, sip_queue_wait
from app.ops.sms import SmsChannel
from app.settings import Settings
from app.tool_wiring import load_configured_catalog
from tools import webhooks
from tools.autocommit import hold_autocommit, release_autocommit
from tools.catalog import Catalog
from tools.executor import QUEUE, SIP_QUEUE, TASK_NAME, Executor, make_app, make_enqueue
from tools.jobs import DELIVERY_QUEUE
from tools.outage import quiet_library_outages
from tools.provider import Provider
from tools.registry import Registry
from tools.sweeper import QueueWait, Sweeper

log = logging.getLogger(__name__)

# How long past its graceful stop (`shutdown_grace_s`) a cancelled job-queue worker may take
# before it is cancelled again.
STOP_MARGIN_S = 2.0


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
        delivery: DeliveryDriver | None = None,
        queues: list[str] | None = None,
        queue_waits: dict[str, QueueWait] | None = None,
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
            queue_waits=queue_waits,
        )
        self.delivery = delivery
        self.delivery_sweeper: DeliverySweeper | None = None
        if delivery is not None:
            delivery.register(self.app)
            if delivery.callback is not None and delivery.callback.enqueue_operation is None:
                # Callback calls are place_call operations this worker's app runs.
                delivery.callback.enqueue_operation = make_enqueue(self.app)
            self.delivery_sweeper = DeliverySweeper(
                engine, delivery.config, interval_s=sweep_interval_s
            )
        default = [QUEUE, DELIVERY_QUEUE] if delivery is not None else [QUEUE]
        asked = queues or default
        # SIP_QUEUE is never among these: only `take_sip_jobs` (beside a SIP listener) takes it;
        # naming it, or `operations`, is what lets it.
        self.queues = [q for q in asked if q in default]
        self.sip_jobs = SIP_QUEUE in asked or QUEUE in asked
        if not self.queues and SIP_QUEUE not in asked:
            self.queues = default
        self._sip_task: asyncio.Task[Any] | None = None
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
        quiet_library_outages()
        await self.app.open_async()
        self._stop.clear()
        self._tasks = []
        if self.queues:
            worker = self._procrastinate(self.queues, self.worker_id)
            self._tasks.append(asyncio.create_task(worker, name=f"procrastinate:{self.worker_id}"))
        if self.sweep:
            self._tasks.append(
                asyncio.create_task(self.sweeper.run(self._stop), name="operation-sweeper")
            )
            if self.delivery_sweeper is not None:
                self._tasks.append(
                    asyncio.create_task(
                        self.delivery_sweeper.run(self._stop), name="delivery-sweeper"
                    )
                )
        log.info("operation worker %s started (concurrency %d)", self.worker_id, self.concurrency)

    def _procrastinate(self, queues: list[str], name: str) -> Any:
        return self.app.run_worker_async(
            queues=queues,
            name=name,
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

    async def take_sip_jobs(self) -> bool:
        """Take SIP placings too (call once this process's SIP listener is up); False when
        WORKER_QUEUES names neither `operations` nor `operations-sip`."""
        if not self.sip_jobs:
            return False
        if self._sip_task is None:
            self._sip_task = asyncio.create_task(
                self._procrastinate([SIP_QUEUE], f"{self.worker_id}:sip"),
                name=f"procrastinate-sip:{self.worker_id}",
            )
            self._sip_task.add_done_callback(_log_end)
            log.info("operation worker %s takes SIP placings (%s)", self.worker_id, SIP_QUEUE)
        return True

    async def leave_sip_jobs(self) -> None:
        """Stop taking SIP placings (before the SIP listener stops); the placings running
        get `shutdown_grace_s` to finish, as at `stop`."""
        task, self._sip_task = self._sip_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

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
        await self.leave_sip_jobs()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            # Cancelled while it registers itself (a query), the Procrastinate worker can lose
            # the cancellation and run on (seen: about one stop in ten right after a start on a
            # loaded machine). Past its graceful stop's longest, it is cancelled again.
            while not task.done():
                await asyncio.wait([task], timeout=self.shutdown_grace_s + STOP_MARGIN_S)
                if not task.done():
                    log.warning("%s did not stop when cancelled: cancelling again", task.get_name())
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        await self.app.close_async()
        if isinstance(self.executor.provider, OutboundRouter):
            await self.executor.provider.aclose()  # its Twilio client (the catalog's: its owner)
        if self.delivery is not None:
            await self.delivery.aclose(self.shutdown_grace_s)
        log.info("operation worker %s stopped", self.worker_id)


def _log_end(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s stopped: %r", task.get_name(), task.exception())


def delivery_config(settings: Settings) -> DeliveryConfig:
    """The delivery knobs of a deployment."""
    return DeliveryConfig(
        dead_after_s=settings.call_dead_after_s,
        max_reoffers=settings.announce_max_reoffers,
        announce_timeout_s=settings.announce_timeout_s,
        stream_wait_s=settings.stream_token_ttl_s + 30.0,
        # Queued, created (or reconciled), then rung: an outbound row is that much older.
        outbound_wait_s=2 * settings.outbound_create_timeout_s + settings.outbound_ring_timeout_s,
        webhook_policy=webhooks.RetryPolicy(
            max_attempts=settings.webhook_max_attempts,
            base_s=settings.webhook_base_backoff_s,
            timeout_s=settings.webhook_timeout_s,
        ),
    )


def build_delivery(settings: Settings, engine: AsyncEngine, registry: Registry) -> DeliveryDriver:
    """The delivery tasks of a worker process (SMS through Twilio, webhooks over HTTP)."""
    sms = SmsChannel.from_settings(settings, engine, registry, actor="sms")
    callback = None
    if settings.late_result_channel != "sms":
        callback = CallbackChannel(settings, CallbackConfig.from_settings(settings), sms)
    return DeliveryDriver(engine, registry, sms, delivery_config(settings), callback=callback)


async def start_inprocess_worker(
    settings: Settings,
    engine: AsyncEngine,
    *,
    database_url: str | None = None,
    catalog: Catalog | None = None,
    registry: Registry | None = None,
    provider: Provider | None = None,
    concurrency: int | None = None,
    sip: Callable[[], SipPlacer | None] | None = None,
) -> OperationWorker:
    """Start a worker inside the server process (for its lifespan); `stop()` it on shutdown.

    It runs `registry` (default: the catalog's tools) on `provider` (default: the catalog's
    providers, each tool routed to the one it names). Without `catalog`, the configured one
    is loaded and closed by `stop()`.
    """
    url = database_url or engine.url.render_as_string(hide_password=False)
    owned: Catalog | None = None
    if provider is None:
        if catalog is None:
            catalog = owned = load_configured_catalog(settings)
        provider = catalog.router
    if registry is None:
        if catalog is None:
            catalog = owned = load_configured_catalog(settings)
        registry = catalog.registry
    registry, provider = outbound_worker(settings, engine, registry, provider, sip)
    worker = OperationWorker(
        database_url=url,
        engine=engine,
        registry=registry,
        provider=provider,
        concurrency=concurrency or settings.worker_concurrency,
        callback_base_url=settings.public_base_url,
        sweep_interval_s=settings.sweep_interval_s,
        heartbeat_s=settings.worker_heartbeat_s,
        stalled_after_s=settings.worker_stalled_after_s,
        delivery=build_delivery(settings, engine, registry),
        queues=settings.queues(),
        queue_waits={SIP_QUEUE: sip_queue_wait(settings.sip_place_wait_s)},
    )
    if owned is not None:
        _close_with(worker, owned)
    try:
        await worker.start()
    except BaseException:
        if owned is not None:
            await owned.aclose()
        raise
    return worker


async def sync_webhooks(settings: Settings, engine: AsyncEngine) -> None:
    """Make the configured (WEBHOOKS) subscriptions match the database's."""
    configured = settings.configured_webhooks()
    async with engine.begin() as conn:
        await webhooks.sync_configured(conn, settings.tenant_id, configured)


def _close_with(worker: OperationWorker, catalog: Catalog) -> None:
    stop = worker.stop

    async def stop_and_close() -> None:
        try:
            await stop()
        finally:
            await catalog.aclose()

    worker.stop = stop_and_close  # type: ignore[method-assign]


def standalone_worker(
    settings: Settings,
    engine: AsyncEngine,
    url: str,
    catalog: Catalog,
    *,
    concurrency: int | None = None,
    worker_id: str | None = None,
) -> OperationWorker:
    """`voice-agent worker`'s worker (not started): the catalog's tools, Twilio placings and
    deliveries; no SIP listener, so never a SIP placing."""
    registry, provider = outbound_worker(settings, engine, catalog.registry, catalog.router)
    return OperationWorker(
        database_url=url,
        engine=engine,
        registry=registry,
        provider=provider,
        concurrency=concurrency or settings.worker_concurrency,
        worker_id=worker_id,
        callback_base_url=settings.public_base_url,
        sweep_interval_s=settings.sweep_interval_s,
        heartbeat_s=settings.worker_heartbeat_s,
        stalled_after_s=settings.worker_stalled_after_s,
        delivery=build_delivery(settings, engine, registry),
        queues=settings.queues(),
        queue_waits={SIP_QUEUE: sip_queue_wait(settings.sip_place_wait_s)},
    )


async def run_worker(settings: Settings, concurrency: int | None = None) -> int:
    """`voice-agent worker`: run operation workers until SIGINT/SIGTERM."""
    if SIP_QUEUE in settings.queues():
        log.warning(
            "WORKER_QUEUES names %s: SIP placings are taken only by `serve` with SIP_BIND, "
            "never by a standalone worker",
            SIP_QUEUE,
        )
        if not set(settings.queues()) & {QUEUE, DELIVERY_QUEUE}:
            print("voice-agent worker: WORKER_QUEUES leaves it nothing to take", flush=True)
            return 2
    # A catalog that cannot run is refused before anything starts.
    catalog = load_configured_catalog(settings)
    try:
        url = await asyncio.to_thread(
            resolve_database_url, settings.database_url, settings.data_dir
        )
    except BaseException:
        await catalog.aclose()
        raise
    engine = make_engine(url)
    hold_autocommit(engine, idle_s=PING_AFTER_IDLE_S)
    await sync_webhooks(settings, engine)
    worker = standalone_worker(settings, engine, url, catalog, concurrency=concurrency)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics_server = None
    watch = LoopWatch().start()
    if settings.metrics_bind:
        # This process's engine measures (commits, retries, timeouts...), as serve exports its.
        host, _, port = settings.metrics_bind.rpartition(":")
        metrics_server, _thread = start_http_server(int(port), addr=host.strip("[]"))
        log.info("worker metrics on http://%s/metrics (METRICS_BIND)", settings.metrics_bind)
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
        await catalog.aclose()
        await release_autocommit(engine)
        await engine.dispose()
        watch.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
    if died:
        # Nobody asked it to stop: the job queue failed (its error is logged above).
        log.error("operation worker %s stopped by itself", worker.worker_id)
        return 1
    return 0
