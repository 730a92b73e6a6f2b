"""Shared helpers for tests that need the demo system of record (a real HTTP service)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tools.sor import Faults, SystemOfRecord

CALLBACK_SECRET = "test-callback-secret"

T = TypeVar("T")


async def start_sor(database_url: str, faults: Faults | None = None) -> SystemOfRecord:
    """A started SOR on an ephemeral port, storing into the test database's `sor` schema."""
    sor = SystemOfRecord(database_url, faults=faults, callback_secret=CALLBACK_SECRET)
    await sor.start()
    return sor


async def wait_for(
    probe: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    *,
    timeout_s: float = 20.0,
    interval_s: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll `probe` until `done(value)`; fail with the last value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    value = await probe()
    while not done(value):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last value: {value!r}")
        await asyncio.sleep(interval_s)
        value = await probe()
    return value


class AppServer:
    """Serve an ASGI app on an ephemeral local port for the duration of a test."""

    def __init__(self, app: object) -> None:
        import uvicorn

        self._server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)  # type: ignore[arg-type]
        )
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> AppServer:
        import socket

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        server = self._server
        await wait_for(lambda: asyncio.sleep(0, server.started), bool, what="server start")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
