"""The server's main loop (app/server.py): with nothing to do it ticks once a second, not
uvicorn's ten times; a stop or a signal is acted on at once, whatever the tick.

Here the idle tick is made 10,000 s long, so a server that waited for it would not stop
within the test's bound."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn
from sqlalchemy.ext.asyncio import AsyncEngine

import app.server as server_module
from app.main import create_app
from app.server import ServiceServer, uvicorn_config
from telephony.quiet_server import QuietServer
from tests.e2e_support import make_settings, wait_until


@asynccontextmanager
async def serving(
    engine: AsyncEngine, wrap: Callable[[Any], Any] = lambda app: app, **overrides: Any
) -> AsyncIterator[tuple[ServiceServer, asyncio.Task[None]]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    settings = make_settings(sock.getsockname()[1], **overrides)
    app = wrap(create_app(settings, engine=engine))
    server = ServiceServer(
        uvicorn_config(app, settings, log_level="warning", access_log=False),
        drain_timeout_s=30,
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_until(lambda: server.started, 10, "the server started")
        yield server, task
    finally:
        if not task.done():
            server.force_exit = True
            server.should_exit = True
            await asyncio.wait_for(task, 30)
        sock.close()


@pytest.fixture
def long_idle_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "MAIN_LOOP_IDLE_TICKS", 100_000)


@pytest.mark.usefixtures("long_idle_tick")
async def test_should_exit_stops_the_server_without_waiting_for_a_tick(
    engine: AsyncEngine,
) -> None:
    async with serving(engine) as (server, task):
        server.should_exit = True
        async with asyncio.timeout(10):
            await task
    assert task.exception() is None


@pytest.mark.usefixtures("long_idle_tick")
async def test_a_signal_starts_the_drain_at_once_and_an_idle_server_then_stops(
    engine: AsyncEngine,
) -> None:
    async with serving(engine) as (server, task):
        runtime = server.config.app.state.runtime  # type: ignore[attr-defined]
        assert not runtime.registry.draining
        server.handle_exit(signal.SIGTERM, None)
        # The drain began on the tick the signal asked for: no call is live, so it stops.
        async with asyncio.timeout(10):
            await task
        assert runtime.registry.draining
    assert server.signals_received == 1
    assert not server.drain_expired


async def test_every_server_we_run_ticks_once_a_second_and_stops_at_once() -> None:
    # The /metrics listener and the in-process stand-ins (the demo's system of record, the
    # fake Twilio API) are QuietServers too: uvicorn's own would tick five times in 0.5 s.
    async def app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - unused
        raise AssertionError

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
    server = QuietServer(config)
    ticks: list[int] = []
    on_tick = server.on_tick

    async def counting(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter)

    server.on_tick = counting  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_until(lambda: server.started, 10, "the server started")
        await asyncio.sleep(0.5)
        assert len(ticks) <= 2, ticks  # the first tick, and at most one a second after
        stopping = asyncio.get_running_loop().time()
        server.should_exit = True
        async with asyncio.timeout(10):
            await task
        assert asyncio.get_running_loop().time() - stopping < 0.5  # not the next tick
    finally:
        if not task.done():
            server.force_exit = server.should_exit = True
            await asyncio.wait_for(task, 10)
        sock.close()


@pytest.mark.parametrize("stop", ["force_exit", "cancel"])
async def test_a_forced_or_cancelled_stop_closes_the_connections_it_did_not_wait_for(
    stop: str,
) -> None:
    # uvicorn closes idle connections itself; one whose request is still being answered it
    # waits for, and a forced or cancelled stop left its socket open until the collector
    # found it (a ResourceWarning in whatever ran next).
    answering = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        answering.set()
        await asyncio.Event().wait()  # never answers

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="critical", access_log=False)
    server = QuietServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        await wait_until(lambda: server.started, 10, "the server started")
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            clients.append((reader, writer))
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
        await asyncio.wait_for(answering.wait(), 10)
        await wait_until(lambda: len(server.server_state.connections) == 2, 10, "2 connections")
        if stop == "force_exit":
            server.should_exit = True
            await asyncio.sleep(0.3)  # the graceful stop waits on the open requests
            assert not task.done()
            server.force_exit = True
            await asyncio.wait_for(task, 10)
        else:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)
        for reader, _ in clients:
            # The server's side is closed: the client reads the end (or a reset), not silence.
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(), 5) == b""
        await wait_until(lambda: not server.server_state.connections, 5, "connections gone")
    finally:
        for _, writer in clients:
            writer.close()
        if not task.done():
            server.force_exit = server.should_exit = True
            await asyncio.wait_for(task, 10)
        sock.close()


class SlowStart:
    """The app, whose start-up holds the event loop: four synchronous 0.3 s steps (migrations,
    catalogs, models loaded on a slow machine)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def slow_receive() -> Any:
            message = await receive()
            if message["type"] == "lifespan.startup":
                for _ in range(4):
                    time.sleep(0.3)  # noqa: ASYNC251 (the point: the loop is held)
                    await asyncio.sleep(0)
            return message

        return await self.app(scope, slow_receive, send)


async def test_a_slow_start_up_is_not_taken_for_an_overloaded_loop(engine: AsyncEngine) -> None:
    # Judged as load, start-up's own hold-ups had a replica just started answer its proxy's
    # probes 503 (overloaded) and leave the dispatcher for seconds.
    async with serving(engine, SlowStart, busy_loop_lag_ms=100) as (server, _):
        registry = server.config.app.state.runtime.registry  # type: ignore[attr-defined]
        started_with = list(server.watch.lag.recent)
        await wait_until(lambda: len(server.watch.lag.recent) >= 5, 10, "five samples")
        overloaded = registry.overloaded()
        assert registry.try_reserve("CAafter-start", load_guard=True)
    assert all(lag < 0.2 for lag in started_with), started_with
    assert overloaded is None
