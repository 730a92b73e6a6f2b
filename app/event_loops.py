"""Which event loop a long-lived command runs on (`serve`, `worker`): EVENT_LOOP."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop for `serve` and `worker`: uvloop unless asked for asyncio's own (or
    not installed).

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
