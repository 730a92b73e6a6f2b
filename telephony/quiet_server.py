"""uvicorn's server, waking once a second when it has nothing to do.

uvicorn's main loop wakes ten times a second to look at `should_exit` (and once a second of
those to renew its Date header): ten wake-ups a second of a process with nothing to do, each
~0.1 ms of CPU on a virtual machine. `QuietServer` ticks once a second instead, and at once
when `should_exit` is set (from the loop, a signal handler or another thread). Every server a
process of ours runs is one: the service's, its `/metrics` listener, and the stand-ins the
offline demo and the tests run in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

# In uvicorn's tenths of a second: its Date header is renewed at each multiple of ten, so on
# every tick of a second.
IDLE_TICKS = 10


class QuietServer(uvicorn.Server):
    """uvicorn whose main loop ticks every `_tick_step()` tenths of a second (ten: once a
    second), woken at once by `should_exit` or `_tick_soon()`."""

    @property
    def should_exit(self) -> bool:
        return self.__dict__.get("_should_exit", False)

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self.__dict__["_should_exit"] = value
        if value:
            self._tick_soon()

    def _tick_soon(self) -> None:
        """The main loop's next tick now (safe from a signal handler or another thread)."""
        woken = self.__dict__.get("_tick_now")
        loop = self.__dict__.get("_tick_loop")
        if woken is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(woken.set)

    def _tick_step(self) -> int:
        """Tenths of a second to the next tick."""
        return IDLE_TICKS

    async def _serve(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super()._serve(sockets)
        finally:
            self.close_connections()

    def close_connections(self) -> None:
        """Close what the stop left open: a forced stop (`force_exit`, or a graceful one past
        its timeout) or a cancelled one leaves the connections it did not wait for open, their
        sockets held until the collector finds them (uvicorn closes only idle ones itself)."""
        for server in getattr(self, "servers", []):
            server.close()
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None and not transport.is_closing():
                transport.abort()

    async def main_loop(self) -> None:
        self._tick_loop = asyncio.get_running_loop()
        self._tick_now = woken = asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            step = self._tick_step()
            counter = (counter + step) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(step / 10):
                    await woken.wait()
            woken.clear()
            should_exit = await self.on_tick(counter)
