"""What holds up a process's event loop, measured where it happens: how late the loop runs a
timer (everything a call's audio waits behind: a long callback, a stalled thread holding the
GIL, a collection) and how long each garbage collection stops the process.

Both are histograms on the process's `/metrics` (`voice_agent_event_loop_lag_seconds`,
`voice_agent_gc_pause_seconds{generation}`, and the collections' CPU time beside their pauses,
`voice_agent_gc_pause_cpu_seconds{generation}`: a pause much longer than its CPU waited for
the core, not for the collector); a loop held up past `WARN_LAG_S` also logs a
warning (at most one a minute), since every call on the process went silent meanwhile.
`serve` and `voice-agent worker` watch themselves; the cost is a timer every
`INTERVAL_S` (every `IDLE_INTERVAL_S` while `serve` carries no call) and four clock reads a
collection.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import Histogram

INTERVAL_S = 0.25  # how often the loop's lateness is sampled
# ... and while the process has nothing to carry (`LoopLag.busy` says so): each sample is a
# wake-up of a process with nothing else to do.
IDLE_INTERVAL_S = 1.0
RECENT_S = 5.0  # `LoopLag.late` judges the samples of this long
WARN_LAG_S = 0.5  # a loop this late logs a warning ...
WARN_EVERY_S = 60.0  # ... at most this often

LOOP_LAG = Histogram(
    "voice_agent_event_loop_lag_seconds",
    "How late the event loop ran a timer, sampled every 0.25 s: what every call's audio on "
    "the process waited behind.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5.0),
)
GC_PAUSE = Histogram(
    "voice_agent_gc_pause_seconds",
    "Each garbage collection, start to stop (the whole process waits), by generation.",
    ["generation"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32),
)

GC_PAUSE_CPU = Histogram(
    "voice_agent_gc_pause_cpu_seconds",
    "The CPU time each garbage collection took (of the thread that ran it), by generation: "
    "the collector's own work. Where it is well under the pause, the collection waited for "
    "the CPU (a core shared with other processes or saturated).",
    ["generation"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32),
)

log = logging.getLogger(__name__)


class GcPauses:
    """Times every collection through `gc.callbacks` (one at a time: the collector holds the
    GIL), into `GC_PAUSE`. Installed once per process; `close` takes it out."""

    def __init__(self) -> None:
        self._started = 0.0
        self._started_cpu = 0.0
        self._by_generation = tuple(GC_PAUSE.labels(generation=str(g)) for g in range(3))
        self._cpu_by_generation = tuple(GC_PAUSE_CPU.labels(generation=str(g)) for g in range(3))

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self._started_cpu = time.thread_time()
        elif self._started:
            pause = time.perf_counter() - self._started
            cpu = time.thread_time() - self._started_cpu
            self._started = 0.0
            generation = min(max(int(info.get("generation", 2)), 0), 2)
            self._by_generation[generation].observe(pause)
            self._cpu_by_generation[generation].observe(cpu)

    def install(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class LoopLag:
    """Samples how late the running loop runs a timer due every `interval` s, into `LOOP_LAG`,
    and keeps the last `RECENT_S` of samples to judge whether the loop keeps up (`late`).
    With `busy` set, every `idle_interval` s while it answers False."""

    def __init__(
        self, interval: float = INTERVAL_S, idle_interval: float = IDLE_INTERVAL_S
    ) -> None:
        self._interval = interval
        self._idle_interval = max(interval, idle_interval)
        self.busy: Callable[[], bool] | None = None  # whether the process carries anything
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._warned_at = -WARN_EVERY_S
        self.worst = 0.0  # the latest sample's worst so far (tests, benchmarks)
        self.recent: deque[float] = deque(maxlen=max(4, round(RECENT_S / interval)))

    def late(self, threshold_s: float) -> float | None:
        """The median lateness of the recent samples when it is `threshold_s` or more (the
        loop does not keep up: more work than time, not one stall), else None. Needs a
        quarter of the recent window sampled."""
        recent = self.recent
        if threshold_s <= 0 or len(recent) < max(4, recent.maxlen or 0) // 4:
            return None
        median = sorted(recent)[len(recent) // 2]
        return median if median >= threshold_s else None

    def start(self) -> LoopLag:
        """Start on the running loop (idempotent)."""
        if self._handle is None:
            self._loop = asyncio.get_running_loop()
            self._arm()
        return self

    def _arm(self) -> None:
        assert self._loop is not None
        busy = self.busy
        interval = self._interval if busy is None or busy() else self._idle_interval
        self._due = self._loop.time() + interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        lag = max(0.0, now - self._due)
        LOOP_LAG.observe(lag)
        self.recent.append(lag)
        self.worst = max(self.worst, lag)
        if lag >= WARN_LAG_S and now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "the event loop was held up %.2f s: every call on this process waited "
                "(voice_agent_event_loop_lag_seconds)",
                lag,
            )
        self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.recent.clear()


class LoopWatch:
    """Both watches for one process's loop: `start` on it, `stop` before it closes."""

    def __init__(self, interval: float = INTERVAL_S) -> None:
        self.gc = GcPauses()
        self.lag = LoopLag(interval)

    def start(self) -> LoopWatch:
        self.gc.install()
        self.lag.start()
        return self

    def stop(self) -> None:
        self.lag.stop()
        self.gc.close()
