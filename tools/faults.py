"""Named fault points: the moments in the engine where a test may hold, fail or observe it.

The engine calls `await reach(point, **context)` at each point below; with nothing armed
that is one dict lookup and nothing else, so production never notices them. A test arms a
point with an action (`armed(point, action)`), typically a `Gate` that holds the engine right
there until the test has made the other side of the race happen. Points are named, not
monkeypatched, so a refactor that moves the moment keeps the name, and an unknown name is
refused at once instead of silently never firing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

Action = Callable[[Mapping[str, Any]], Awaitable[None]]

POINTS: Mapping[str, str] = {
    "gateway.requested": "a completed function call reached the tool gateway; nothing decided",
    "executor.claimed": "the operation is running (claimed, attempt counted), nothing sent yet",
    "executor.answered": "the provider has answered an attempt; the answer is not recorded yet",
}

_armed: dict[str, Action] = {}


def arm(point: str, action: Action) -> None:
    """Run `action(context)` whenever the engine reaches `point`."""
    if point not in POINTS:
        raise KeyError(f"no fault point named {point!r}; the points are {sorted(POINTS)}")
    _armed[point] = action


def disarm(point: str) -> None:
    _armed.pop(point, None)


@contextmanager
def armed(point: str, action: Action) -> Iterator[Action]:
    """`point` armed with `action` for the block."""
    arm(point, action)
    try:
        yield action
    finally:
        disarm(point)


async def reach(point: str, **context: Any) -> None:
    """The engine is at `point`: run what a test armed there, if anything."""
    action = _armed.get(point)
    if action is not None:
        await action(context)


class Gate:
    """An action that holds each arrival until `open()` (bounded by `most_s`, so a test that
    forgets to open it cannot wedge the engine); `reached` is set at the first arrival."""

    def __init__(self, most_s: float = 30.0) -> None:
        self.most_s = most_s
        self.reached = asyncio.Event()
        self.arrivals: list[Mapping[str, Any]] = []
        self._open = asyncio.Event()

    def open(self) -> None:
        self._open.set()

    async def __call__(self, context: Mapping[str, Any]) -> None:
        self.arrivals.append(context)
        self.reached.set()
        try:
            async with asyncio.timeout(self.most_s):
                await self._open.wait()
        except TimeoutError:
            pass
