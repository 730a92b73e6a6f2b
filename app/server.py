"""`voice-agent serve`: database, migrations, the offline Realtime simulator if needed, uvicorn."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from app.db import resolve_database_url, upgrade
from app.main import SHUTDOWN_CALLS_WAIT_S, create_app
from app.settings import Settings

log = logging.getLogger(__name__)

# uvicorn closes a socket on frames over its limit; ours drops them and keeps the call, so
# uvicorn's limit sits well above settings.max_ws_frame_bytes.
MIN_WS_MAX_SIZE = 1024 * 1024


async def prepare_database(settings: Settings) -> str:
    """The database URL (embedded PostgreSQL when none is configured), migrated to head."""
    url = await asyncio.to_thread(resolve_database_url, settings.database_url, settings.data_dir)
    await asyncio.to_thread(upgrade, url)
    return url


class ServiceServer(uvicorn.Server):
    """uvicorn, ending live calls (with a reason on their timeline) before closing sockets."""

    def __init__(self, config: uvicorn.Config, *, freeze_heap: bool = False) -> None:
        super().__init__(config)
        self._freeze_heap = freeze_heap

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self._freeze_heap:
            # What is loaded by now (modules, models, the app) lives as long as the process. A
            # full collection walks all of it, ~190k objects and ~90 ms here, stalling every
            # live call's audio; frozen, the collector only looks at what calls allocate.
            gc.collect()
            gc.freeze()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new calls while the live ones wind down
        runtime = getattr(getattr(self.config.app, "state", None), "runtime", None)
        if runtime is not None:
            await runtime.registry.end_all("server shutdown", SHUTDOWN_CALLS_WAIT_S)
        await super().shutdown(sockets)


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for the service (also used by the demo and the tests)."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "ws_max_size": max(MIN_WS_MAX_SIZE, 4 * settings.max_ws_frame_bytes),
        "ws_per_message_deflate": settings.ws_deflate,
        "log_config": None,  # keep our redacting handlers
        "lifespan": "on",
        "timeout_graceful_shutdown": 20,
        **overrides,
    }
    return uvicorn.Config(app, **options)


async def serve(settings: Settings, with_worker: bool) -> int:
    """Run the service until interrupted."""
    url = await prepare_database(settings)
    settings = settings.model_copy(update={"database_url": url})
    simulator: Any = None
    if settings.openai_api_key is None:
        from telephony.sim.scenario import load_scenario
        from telephony.sim.simulator import RealtimeSimulator

        simulator = RealtimeSimulator(load_scenario(None), host="127.0.0.1")
        await simulator.start()
        settings = settings.model_copy(update={"openai_base_url": simulator.base_url})
        log.warning(
            "OPENAI_API_KEY is not set, so calls talk to the local Realtime simulator at %s",
            simulator.base_url,
        )
    sor: Any = None
    if settings.sor_base_url is None:
        from tools.restaurant.sor import SystemOfRecord

        callback = settings.sor_callback_secret
        sor = SystemOfRecord(
            url, host="127.0.0.1", callback_secret=callback.get_secret_value() if callback else None
        )
        await sor.start()
        settings = settings.model_copy(update={"sor_base_url": sor.url})
        log.warning(
            "SOR_BASE_URL is not set, so bookings go to the demo system of record at %s", sor.url
        )
    app = create_app(settings, with_worker=with_worker)
    server = ServiceServer(uvicorn_config(app, settings), freeze_heap=True)
    try:
        await server.serve()
    finally:
        if sor is not None:
            await sor.stop()
        if simulator is not None:
            await simulator.stop()
    return 0


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop for `serve`: uvloop unless asked for asyncio's own (or not installed).

    The media path is syscalls and callbacks; uvloop runs them in C (bench/bridge.py echo,
    target service-asyncio, measures the difference).
    """
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def run_server(settings: Settings, with_worker: bool) -> int:
    """Entry point of `voice-agent serve`."""
    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
            return runner.run(serve(settings, with_worker))
    except KeyboardInterrupt:
        return 0
