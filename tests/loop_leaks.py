"""Every test closes the connections it opened: a socket still open when the test's event loop
closes is an error of that test.

Left alone, such a socket is found by the collector whenever it next runs, and its
ResourceWarning (an error here) fails whatever test runs then, on whichever xdist worker: a
failure that names neither the test that leaked nor the socket. Checked as the loop closes,
the leak is the leaking test's own error, with the socket's two addresses and its protocol.
The transports are closed before the error, so nothing is left for the collector.
"""

from __future__ import annotations

import asyncio
from asyncio.selector_events import BaseSelectorEventLoop
from typing import Any

_close = BaseSelectorEventLoop.close


def open_transports(loop: BaseSelectorEventLoop) -> list[asyncio.Transport]:
    """The loop's socket transports not closed (asyncio's own registry of them)."""
    registry: Any = getattr(loop, "_transports", {})
    return [
        t
        for t in list(registry.values())
        if t is not None and not t.is_closing() and t.get_extra_info("socket") is not None
    ]


def _describe(transport: asyncio.Transport) -> str:
    protocol = getattr(transport, "_protocol", None)
    kind = f"{type(protocol).__module__}.{type(protocol).__qualname__}" if protocol else "?"
    local = transport.get_extra_info("sockname")
    peer = transport.get_extra_info("peername")
    return f"{local} -> {peer} ({kind})"


def _close_checked(self: BaseSelectorEventLoop) -> None:
    left = [] if self.is_closed() or self.is_running() else open_transports(self)
    described = [_describe(t) for t in left]
    for transport in left:
        transport.abort()
    if left:
        self.run_until_complete(asyncio.sleep(0))  # their connection_lost closes the sockets
    _close(self)
    if left:
        raise AssertionError(
            "the test left connections open when its event loop closed (close what it "
            "opened): " + "; ".join(described)
        )


def install() -> None:
    BaseSelectorEventLoop.close = _close_checked  # type: ignore[method-assign,assignment]
