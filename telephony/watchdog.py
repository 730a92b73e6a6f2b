"""A deadline for a per-frame await of the audio path, without a timer per frame.

`asyncio.timeout()` around each receive and send of a call costs a Timeout, a timer handle,
a heap push and a cancel per frame, three or four times per 20 ms frame. A Watchdog guards the
same awaits with one timer per call instead: the timer is re-armed only when it fires (about
once per limit while frames flow), and it cancels the guarded task only when the await in
progress has really run past its limit, which the body then sees as TimeoutError, exactly as
with `asyncio.timeout()`.

One Watchdog guards one await at a time (the leg's receive, the sends under one lock); it is
reused for every frame.

What the await waits for may also come by another way (the leg's frames, handled where the
socket receives them while its reader waits): a `progress` counter that the timer reads says
so, with no call per frame; progress seen restarts the clock from that look, and the timer
then looks every quarter of the limit, so an await with no progress times out between 1 and
1.25 times the limit after the last.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType


class Watchdog:
    """`with watchdog: await ...` raises TimeoutError if the await takes over `limit_s`."""

    def __init__(self, limit_s: float, progress: Callable[[], int] | None = None) -> None:
        if limit_s <= 0:
            raise ValueError("limit_s must be positive")
        self.limit_s = limit_s
        self._progress = progress
        self._seen = 0  # progress() at the last look
        # How often the timer looks: with a progress counter, often enough for the bound.
        self._look_s = limit_s / 4 if progress is not None else limit_s
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
        if self._progress is not None:
            self._seen = self._progress()
        if self._timer is None:
            self._timer = loop.call_at(self._since + self._look_s, self._check)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._since = None
        task, self._task = self._task, None  # a done task (its traceback) is not kept
        if not self._fired:
            return
        self._fired = False
        assert task is not None
        if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def _check(self) -> None:
        self._timer = None
        since, task, loop = self._since, self._task, self._loop
        if since is None or task is None or loop is None:
            return  # idle: the next guarded await arms the timer again
        now = loop.time()
        progress = self._progress
        if progress is not None:
            seen = progress()
            if seen != self._seen:  # it came by another way since the last look
                self._seen = seen
                self._since = now
                self._timer = loop.call_at(now + self._look_s, self._check)
                return
        if now - since >= self.limit_s:
            self._fired = True
            self._cancelling = task.cancelling()
            task.cancel()
        else:
            self._timer = loop.call_at(min(since + self.limit_s, now + self._look_s), self._check)

    def close(self) -> None:
        """Drop the timer and what it reads (the owner is done with this watchdog: an owner's
        method as `progress` would otherwise keep the two in a reference cycle)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._progress = None
        self._task = None
