"""A deadline for a per-frame await of the audio path, without a timer per frame.

`asyncio.timeout()` around each receive and send of a call costs a Timeout, a timer handle,
a heap push and a cancel per frame, three or four times per 20 ms frame. A Watchdog guards the
same awaits with one timer per call instead: the timer is re-armed only when it fires (about
once per limit while frames flow), and it cancels the guarded task only when the await in
progress has really run past its limit, which the body then sees as TimeoutError, exactly as
with `asyncio.timeout()`.

One Watchdog guards one await at a time (the leg's receive, the sends under one lock); it is
reused for every frame.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Watchdog:
    """`with watchdog: await ...` raises TimeoutError if the await takes over `limit_s`."""

    def __init__(self, limit_s: float) -> None:
        if limit_s <= 0:
            raise ValueError("limit_s must be positive")
        self.limit_s = limit_s
        self._since: float | None = None  # loop.time() when the guarded await began
        self._task: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fired = False
        self._cancelling = 0

    def __enter__(self) -> Watchdog:
        if self._since is not None:
            raise RuntimeError("a Watchdog guards one await at a time")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("Watchdog used outside a task")
        self._task = task
        self._since = loop.time()
        if self._timer is None:
            self._timer = loop.call_at(self._since + self.limit_s, self._check)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._since = None
        if not self._fired:
            return
        self._fired = False
        task = self._task
        assert task is not None
        if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def _check(self) -> None:
        self._timer = None
        since, task, loop = self._since, self._task, self._loop
        if since is None or task is None or loop is None:
            return  # idle: the next guarded await arms the timer again
        if loop.time() - since >= self.limit_s:
            self._fired = True
            self._cancelling = task.cancelling()
            task.cancel()
        else:
            self._timer = loop.call_at(since + self.limit_s, self._check)

    def touch(self) -> None:
        """What the guarded await waits for came by another way: its clock starts again."""
        if self._since is not None and self._loop is not None:
            self._since = self._loop.time()

    def close(self) -> None:
        """Drop the timer (the owner is done with this watchdog)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
