"""`voice-agent serve`: database, migrations, the offline Realtime simulator if needed, uvicorn.

Stopping (SIGTERM, as Docker, Kubernetes and systemd send, or SIGINT): no new calls (the
voice webhook answers busy, `/readyz` 503), live calls go on for up to DRAIN_TIMEOUT_S, then
the Twilio calls still live are handed over (released for another replica to resume) and the
rest are ended with a reason on their timeline, call events are flushed, workers stop at a
safe point, and the embedded PostgreSQL (if any) is stopped last.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import psycopg
import uvicorn

from app import embedded_db
from app.cli import banner
from app.db import resolve_database_url, upgrade
from app.errors import StartupError
from app.event_loops import loop_factory
from app.gc_steward import GcSteward
from app.http.guard import HttpLimits, base_protocol, guarded_protocol
from app.legs.twilio.media_ws import MediaWebSocketProtocol, media_fast_paths, missing_hooks
from app.loop_watch import LoopWatch
from app.main import SHUTDOWN_CALLS_WAIT_S, create_app
from app.pg_listener import LISTEN_CONNECTION
from app.realtime_check import check_api_key, plan_realtime
from app.settings import Settings, host_port
from app.tool_wiring import (
    load_configured_agents,
    load_configured_catalog,
    read_accounts,
    runs_demo_sor,
)
from telephony.fast_paths import FastPath, realtime_fast_paths, summary
from telephony.quiet_server import IDLE_TICKS, QuietServer
from tools.catalog import Catalog

log = logging.getLogger(__name__)

# uvicorn closes a socket on frames over its limit; ours drops them and keeps the call, so
# uvicorn's limit sits well above settings.max_ws_frame_bytes.
MIN_WS_MAX_SIZE = 1024 * 1024


async def prepare_database(settings: Settings) -> str:
    """The database URL (embedded PostgreSQL when none is configured), migrated to head."""
    url = await asyncio.to_thread(resolve_database_url, settings.database_url, settings.data_dir)
    await asyncio.to_thread(upgrade, url)
    return url


# Young collections between two collections of the middle generation (CPython's default: 10).
GC_MIDDLE_EVERY = 100
# How long another thread may keep the GIL once the event loop asks for it (CPython: 5 ms).
SWITCH_INTERVAL_S = 0.001
# uvicorn's main loop ticks every tenth of a second; ours, with nothing to do, every second.
MAIN_LOOP_IDLE_TICKS = IDLE_TICKS


class ServiceServer(QuietServer):
    """uvicorn that drains before it stops.

    The first SIGTERM or SIGINT starts the drain: the call registry refuses new calls, and
    the server keeps serving (status callbacks and media of live calls, busy answers, a
    failing /readyz) until no call is live or answered, or `drain_timeout_s` has passed. A
    second signal ends the drain at once; a third stops without waiting for anything.
    Shutdown then hands the remaining Twilio calls over to another replica and ends the
    rest (with a reason on their timeline) before closing sockets. `on_started` runs once
    the socket is listening.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        drain_timeout_s: float = 0.0,
        on_started: Callable[[], None] | None = None,
        freeze_heap: bool = False,
    ) -> None:
        super().__init__(config)
        self._freeze_heap = freeze_heap
        self.drain_timeout_s = drain_timeout_s
        self.on_started = on_started
        self.signals_received = 0
        self._drain_deadline: float | None = None
        self.drain_expired = False
        self.watch = LoopWatch()  # the loop's lateness and the collector's pauses, on /metrics
        self.steward: GcSteward | None = None  # with freeze_heap: keeps full collections short

    def _runtime(self) -> Any:
        return getattr(getattr(self.config.app, "state", None), "runtime", None)

    # The main loop ticks once a second with nothing to do (QuietServer), every tenth of one
    # while draining, and at once when `should_exit` is set or a signal comes in.
    def _tick_step(self) -> int:
        return 1 if self.signals_received else MAIN_LOOP_IDLE_TICKS

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler: only flags here; the drain itself starts on the next tick.
        self.signals_received += 1
        if self.signals_received >= 2:
            self.should_exit = True
        if self.signals_received >= 3:
            self.force_exit = True
        self._tick_soon()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the signal once it has shut down, and SIGTERM's default action
        # would then kill the process before the embedded database is stopped. The signal
        # is handled here, so it is not raised again.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def begin_drain(self) -> None:
        """Stop taking calls and let the live ones run on (what the first signal does)."""
        if self._drain_deadline is not None:
            return
        self._drain_deadline = time.monotonic() + self.drain_timeout_s
        runtime = self._runtime()
        if runtime is not None:
            runtime.registry.stop_accepting()
            log.warning(
                "stopping: new calls hear busy; %d call(s) in progress get up to %.0f s "
                "(DRAIN_TIMEOUT_S); signal again to end them now",
                runtime.registry.load(),
                self.drain_timeout_s,
            )

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        log.info("%s", summary(fast_paths(self.config)))
        self.watch.gc.install()  # start-up's collections are timed too
        await super().startup(sockets)
        runtime = self._runtime()
        if runtime is not None:
            registry = runtime.registry
            self.watch.lag.busy = lambda: registry.load() > 0  # sampled each second when idle
        if runtime is not None and runtime.settings.busy_loop_lag_ms > 0:
            threshold = runtime.settings.busy_loop_lag_ms / 1000
            lag = self.watch.lag
            runtime.registry.overloaded = lambda: lag.late(threshold)
        if self._freeze_heap:
            # What is loaded by now (modules, models, the app) lives as long as the process. A
            # full collection walks all of it, ~190k objects and ~90 ms here, stalling every
            # live call's audio; frozen, the collector only looks at what calls allocate.
            gc.collect()
            gc.freeze()
            # Each call keeps timers alive for 0.5-5 s (deadlines, a tail mark's backstop):
            # at the default thresholds they outlive two young collections, reach the oldest
            # generation and, a few hundred a second, set off a full collection every ~10 s,
            # which walks every live call's state (65 ms at 100 calls here). A middle
            # generation collected every 100 young collections (~7 s at 100 calls) lets them
            # die there instead (bench/bridge.py echo --pin --calls 100: RTT p99).
            young, _, oldest = gc.get_threshold()
            gc.set_threshold(young, GC_MIDDLE_EVERY, oldest)
            # A thread's work (a call's recording rendered as it ends, a file written) keeps
            # the GIL each time the event loop wants it back, for up to the switch interval,
            # and every live call's audio waits: a 3-minute call's render delayed a 1 ms timer
            # by up to 12-27 ms at 5 ms, 4.5-7 ms at 1 ms (bench/recorder.py, "the event loop
            # while a call renders"). The SIP leg's RTP clock thread asks for the same.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            if runtime is not None:
                # Then what calls keep for long is frozen as it goes (GC_FREEZE_EVERY_S), and
                # swept when no call is live (reservations count: a sweep walks everything).
                registry = runtime.registry
                self.steward = GcSteward(
                    runtime.settings.gc_freeze_every_s, idle=lambda: registry.load() == 0
                ).start()
        # The loop's lateness is sampled from here on, not during start-up: migrations, the
        # catalogs, the stand-ins and the freeze above hold the loop up to ~0.7 s (more on a
        # loaded machine), which says nothing about the calls it can carry. Judged with the
        # first samples after it (BUSY_LOOP_LAG_MS), it made a replica just started answer
        # its proxy's first probes 503, out of the dispatcher for seconds.
        self.watch.lag.start()
        if self.started and self.on_started is not None:
            self.on_started()

    async def on_tick(self, counter: int) -> bool:
        if self.signals_received and not self.should_exit:
            self.begin_drain()
            runtime = self._runtime()
            assert self._drain_deadline is not None
            if runtime is None or runtime.registry.load() == 0:
                self.should_exit = True
            elif time.monotonic() >= self._drain_deadline:
                self.drain_expired = True
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new calls while the live ones wind down
        runtime = self._runtime()
        if runtime is not None:
            runtime.registry.stop_accepting()
            live = runtime.registry.live_count()
            if live:
                why = "drain limit reached" if self.drain_expired else "ending calls now"
                moving = sum(e.movable for e in runtime.registry.live_entries())
                log.warning(
                    "stopping: %s; ending %d call(s), handing %d over to another replica",
                    why,
                    live - moving,
                    moving,
                )
            if runtime.console is not None:
                runtime.console.live.close()  # console live streams end, or they hold shutdown
            # A Twilio call is released, not ended: its stream closes, Twilio asks the
            # `<Connect action>` URL and another replica resumes it (app/legs/twilio/resume.py).
            # A SIP call on our own user agent cannot move: it ends, and its open operations
            # go by SMS as for any ended call.
            await runtime.registry.end_all("server shutdown", SHUTDOWN_CALLS_WAIT_S, hand_over=True)
        await super().shutdown(sockets)
        self.watch.stop()
        if self.steward is not None:
            self.steward.stop()


def fast_paths(config: uvicorn.Config) -> list[FastPath]:
    """The media path's shortcuts into uvicorn, websockets, FastAPI and the OpenAI SDK, the
    LISTEN connection's long wait in psycopg, and whether each is on in this process (said at
    start-up: a library release can turn one off)."""
    if config.ws is MediaWebSocketProtocol:
        media = media_fast_paths(deflate=bool(config.ws_per_message_deflate))
    else:
        media = [
            FastPath("media socket lane", False, f"uvicorn lacks {', '.join(missing_hooks())}")
        ]
    lane = getattr(getattr(config.app, "state", None), "route_lane", None)
    routes = [] if lane is None else [FastPath("route lane", not lane, lane)]
    long_wait = LISTEN_CONNECTION is not psycopg.AsyncConnection
    listen = FastPath(
        "listener long wait",
        long_wait,
        "" if long_wait else "psycopg's AsyncConnection.wait takes no interval",
    )
    return [*media, *routes, *realtime_fast_paths(), listen]


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for the service (also used by the demo and the tests)."""
    limits = HttpLimits(
        header_timeout_s=settings.http_header_timeout_s,
        body_timeout_s=settings.http_body_timeout_s,
        max_connections_per_source=settings.http_max_connections_per_source,
    )
    http = overrides.pop("http", "auto")
    options: dict[str, Any] = {
        "http": guarded_protocol(base_protocol(http), limits) if isinstance(http, str) else http,
        "timeout_keep_alive": settings.http_idle_timeout_s,
        # A header block larger than this is refused (h11; httptools has its own bound).
        "h11_max_incomplete_event_size": 16 * 1024,
        "host": settings.host,
        "port": settings.port,
        # uvicorn's sans-I/O WebSocket protocol plus the media lane (app/legs/twilio/media_ws.py).
        # (uvicorn's own where this uvicorn lacks what the lane overrides: no lane, no crash)
        "ws": MediaWebSocketProtocol if not missing_hooks() else "websockets-sansio",
        "ws_max_size": max(MIN_WS_MAX_SIZE, 4 * settings.max_ws_frame_bytes),
        "ws_per_message_deflate": settings.ws_deflate,
        "log_config": None,  # keep our redacting handlers
        "lifespan": "on",
        "timeout_graceful_shutdown": 20,
        **overrides,
    }
    return uvicorn.Config(app, **options)


def metrics_listener(app: Any, settings: Settings) -> tuple[uvicorn.Server, socket.socket]:
    """A small server for `/metrics` alone on METRICS_BIND (`host:port`)."""
    from app.http.health import metrics_app

    assert settings.metrics_bind is not None
    host, _, port = settings.metrics_bind.rpartition(":")
    if not host or not port.isdigit():
        raise StartupError(f"METRICS_BIND must be host:port, not {settings.metrics_bind!r}")
    sock = bind_listener(host.strip("[]"), int(port))
    config = uvicorn.Config(
        metrics_app(app),
        log_config=None,
        lifespan="off",
        access_log=False,
        timeout_keep_alive=max(1, int(settings.http_idle_timeout_s)),
    )
    return _SideServer(config), sock


class _SideServer(QuietServer):
    """A side server: the service's own server owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def bind_listener(host: str, port: int) -> socket.socket:
    """The service's listening socket, bound before anything else starts, so a taken port
    is a one-line error and not a half-started service."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {port} on {host} is already in use (another voice-agent serve?): "
                "stop that process or choose another port with PORT=... or --port"
            ) from exc
        if exc.errno == errno.EACCES:
            raise StartupError(
                f"not allowed to listen on port {port}: choose one above 1023 "
                "with PORT=... or --port"
            ) from exc
        if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
            raise StartupError(
                f"cannot listen on {host!r}: not an address of this machine (HOST or --host)"
            ) from exc
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def check_sip_bind(spec: str) -> None:
    """SIP_BIND can be bound for UDP and TCP, so a wrong address or a taken port is a one-line
    error before anything starts (the SIP listener binds it for real once the app starts)."""
    host, port = host_port(spec, "0.0.0.0:5060")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        probe = socket.socket(family, kind)
        try:
            if kind == socket.SOCK_STREAM:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(
                    f"SIP port {port} on {host} is already in use (another voice-agent serve, "
                    "or a PBX?): stop that process or choose another port in SIP_BIND"
                ) from exc
            if exc.errno == errno.EADDRNOTAVAIL:
                raise StartupError(
                    f"cannot listen for SIP on {host}: not an address of this machine: set "
                    f"SIP_BIND to one of its addresses, or 0.0.0.0:{port} for all of them"
                ) from exc
            raise StartupError(
                f"cannot listen for SIP on {host}:{port} ({exc.strerror or exc}): check SIP_BIND"
            ) from exc
        finally:
            probe.close()


async def serve(settings: Settings, with_worker: bool) -> int:
    """Run the service until SIGTERM or SIGINT, then stop cleanly. A catalog that cannot run
    refuses to start (`tools.catalog.CatalogError`), before the database when it does not need
    the demo SOR."""
    plan = plan_realtime(settings)  # StartupError: calls would reach the wrong model
    if settings.sip_bind:
        check_sip_bind(settings.sip_bind)
    if settings.accounts_file is not None:
        # Read again when the app starts; a bad file stops here, before anything started.
        read_accounts(settings.accounts_file, settings.tenant_id)
    demo_sor = runs_demo_sor(settings)
    catalog: Catalog | None = None if demo_sor else load_configured_catalog(settings)
    try:
        if settings.agents_file is not None:
            # A bad agents file stops here too (the demo's catalog is checked without its SOR).
            check_catalog = catalog or load_configured_catalog(settings)
            try:
                load_configured_agents(settings, check_catalog)
            finally:
                if check_catalog is not catalog:
                    await check_catalog.aclose()
        sock = bind_listener(settings.host, settings.port)
    except BaseException:
        if catalog is not None:
            await catalog.aclose()
        raise
    port = sock.getsockname()[1]
    simulator: Any = None
    sor: Any = None
    metrics_server: uvicorn.Server | None = None
    metrics_task: asyncio.Task[None] | None = None
    try:
        if "public_base_url" not in settings.model_fields_set:
            # Unset: this process as reached from this machine (on the port actually bound).
            host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
            settings = settings.model_copy(
                update={"public_base_url": f"http://{banner.url_host(host)}:{port}"}
            )
        if plan.check_key:
            warning = await check_api_key(settings)  # StartupError: the key is refused
            if warning is not None:
                log.warning("%s", warning)
            else:
                log.info("OPENAI_API_KEY checked: %s answers", settings.openai_realtime_model)
        url = await prepare_database(settings)
        embedded = settings.database_url is None
        settings = settings.model_copy(update={"database_url": url})
        realtime = banner.realtime_of(settings, reason=plan.reason)
        if plan.in_process_simulator:
            from telephony.sim.scenario import load_scenario
            from telephony.sim.simulator import RealtimeSimulator
            from telephony.sim.speech import speech_setup

            speech = speech_setup(
                settings.sim_voice,
                piper_model=settings.sim_piper_voice,
                cache_dir=settings.speech_cache_path(),
                recognition=settings.sim_recognition,
                vad=settings.sim_vad,
            )
            for notice in speech.notices:
                log.warning("%s", notice)
            simulator = RealtimeSimulator(
                load_scenario(None),
                host="127.0.0.1",
                voice=speech.agent,
                recognize=speech.recognize,
                vad=speech.vad,
            )
            await simulator.start()
            settings = settings.model_copy(update={"openai_base_url": simulator.base_url})
            realtime = banner.realtime_of(
                settings, in_process_simulator=True, voice=speech.describe(), reason=plan.reason
            )
        log.info("Realtime: %s", realtime)
        if demo_sor:
            from tools.restaurant.sor import SystemOfRecord

            callback = settings.sor_callback_secret
            control = settings.sor_control_token
            sor = SystemOfRecord(
                url,
                host="127.0.0.1",
                callback_secret=callback.get_secret_value() if callback else None,
                control_token=control.get_secret_value() if control else None,
            )
            await sor.start()
            settings = settings.model_copy(update={"sor_base_url": sor.url})
            log.info("SOR_BASE_URL unset: bookings go to the demo system of record at %s", sor.url)
            catalog = load_configured_catalog(settings)
        assert catalog is not None
        app = create_app(settings, with_worker=with_worker, catalog=catalog)
        info = banner.StartInfo(
            settings=settings,
            listen_url=f"http://{banner.url_host(settings.host)}:{port}",
            database=banner.database_of(settings, embedded),
            realtime=realtime,
            demo_sor=sor is not None,
            with_worker=with_worker,
        )
        server = ServiceServer(
            uvicorn_config(app, settings),
            drain_timeout_s=settings.drain_timeout_s,
            on_started=lambda: banner.show(info),
            freeze_heap=True,
        )
        if settings.metrics_bind:
            metrics_server, metrics_sock = metrics_listener(app, settings)
            metrics_task = asyncio.create_task(
                metrics_server.serve(sockets=[metrics_sock]), name="metrics"
            )
            log.info("metrics on http://%s/metrics (METRICS_BIND)", settings.metrics_bind)
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        if metrics_server is not None and metrics_task is not None:
            metrics_server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(metrics_task, 5)
        if catalog is not None:
            await catalog.aclose()
        if sor is not None:
            await sor.stop()
        if simulator is not None:
            await simulator.stop()
        # Last: everything that used the embedded database has closed its connections.
        await asyncio.to_thread(embedded_db.stop, settings.data_dir)
    return 0


def run_server(settings: Settings, with_worker: bool) -> int:
    """Entry point of `voice-agent serve`."""
    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
            return runner.run(serve(settings, with_worker))
    except KeyboardInterrupt:
        # Stopped while starting: the `finally` blocks have run.
        return 0
