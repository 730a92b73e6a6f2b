"""Keeps full garbage collections short in a serving process: what has lived a few seconds is
frozen, so an automatic collection walks only what was allocated since.

`serve` freezes its heap once at start (app/server.py). Without more, every live call's
long-lived state (~450 objects a call) reaches the oldest generation, and each full collection
walks all of it: 23-51 ms at 200 calls, every call's audio waiting. Every `GC_FREEZE_EVERY_S`
the steward collects what is not frozen (it was all allocated since its last tick, so this is
short: it drops the cyclic garbage made meanwhile) and freezes the survivors
(`gc.freeze()`, the permanent generation, which no automatic collection walks). A frozen
object is still freed by reference counting when dropped; only cyclic garbage frozen while it
was alive stays. A sweep (unfreeze, full collection, freeze) finds that garbage: when the
process has no call (idle), or when the frozen heap has grown by half since the last sweep.
A sweep walks the whole heap, what was frozen at start included (~370k objects at 200 calls),
so under load it is rare.

On `/metrics`: `voice_agent_gc_frozen_objects`, `voice_agent_gc_sweeps_total{reason}`,
`voice_agent_gc_swept_objects_total`; each collection's pause, sweeps included, is in
`voice_agent_gc_pause_seconds` (app/loop_watch.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge

# An idle process (no call) sweeps at most this often, and only if a call was there since
# its last sweep: the garbage a sweep finds is what calls left.
SWEEP_IDLE_AFTER_S = 60.0
# A busy process sweeps when the frozen heap has grown by this share since the last sweep
# and this long has passed. The bound caps the cyclic garbage frozen by mistake (memory) at
# about half the long-lived heap; the wait keeps the sweep's pause, which walks the whole heap
# while calls are live, to one every 10 minutes at most.
SWEEP_GROWTH = 0.5
SWEEP_GROWTH_AFTER_S = 600.0
# Counting the frozen objects walks them all (~3 ms for 370k): done at most this often.
COUNT_EVERY_S = 60.0
# A sweep that held the process up this long logs a warning (as a late loop does), not info.
WARN_SWEEP_S = 0.5

FROZEN = Gauge(
    "voice_agent_gc_frozen_objects",
    "Objects in the permanent generation (gc.freeze): no automatic collection walks them; "
    "counted at most once a minute.",
)
SWEEPS = Counter(
    "voice_agent_gc_sweeps",
    "Sweeps of the frozen heap (unfreeze, full collection, freeze), by why: idle (no call) "
    "or growth (the frozen heap grew by half).",
    ["reason"],
)
SWEPT = Counter(
    "voice_agent_gc_swept_objects",
    "Unreachable objects the sweeps found and freed: cyclic garbage that had been frozen.",
)

log = logging.getLogger(__name__)


class GcSteward:
    """Freezes what survives a collection every `every_s` (0: never) and sweeps the frozen
    heap when `idle()` says the process has no call or the frozen heap has grown. `start` on
    the running loop, `stop` (idempotent) before it closes; `tick` is one step."""

    def __init__(
        self,
        every_s: float,
        idle: Callable[[], bool],
        *,
        sweep_idle_after_s: float = SWEEP_IDLE_AFTER_S,
        sweep_growth: float = SWEEP_GROWTH,
        sweep_growth_after_s: float = SWEEP_GROWTH_AFTER_S,
        count_every_s: float = COUNT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._every_s = every_s
        self._idle = idle
        self._idle_after_s = sweep_idle_after_s
        self._growth = sweep_growth
        self._growth_after_s = sweep_growth_after_s
        self._count_every_s = count_every_s
        self._clock = clock
        self._handle: asyncio.TimerHandle | None = None
        self._swept_at = clock()
        self._counted_at = self._swept_at
        self.frozen = gc.get_freeze_count()
        self._frozen_after_sweep = self.frozen  # what the growth bound is measured from
        self._busy_since_sweep = False
        FROZEN.set(self.frozen)

    def start(self) -> GcSteward:
        """Tick every `every_s` on the running loop (idempotent; 0: does nothing)."""
        if self._every_s > 0 and self._handle is None:
            loop = asyncio.get_running_loop()
            self._handle = loop.call_later(self._every_s, self._run)
        return self

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _run(self) -> None:
        if self._handle is None:
            return
        try:
            self.tick()
        except Exception as exc:  # a bad gc callback, say: the next tick tries again
            log.warning("the collector's steward skipped a tick: %s", exc)
        self._handle = asyncio.get_running_loop().call_later(self._every_s, self._run)

    def tick(self) -> str | None:
        """Sweep if due (and say why), else collect what is not frozen and freeze the rest."""
        now = self._clock()
        idle = self._idle()
        if not idle:
            self._busy_since_sweep = True
        elif self._busy_since_sweep and now - self._swept_at >= self._idle_after_s:
            self.sweep("idle")
            return "idle"
        # Everything not frozen was allocated since the last tick: a short walk.
        gc.collect()
        gc.freeze()
        if now - self._counted_at >= self._count_every_s:
            self._counted_at = now
            self.frozen = gc.get_freeze_count()
            FROZEN.set(self.frozen)
            grown = self.frozen > self._frozen_after_sweep * (1 + self._growth)
            if grown and now - self._swept_at >= self._growth_after_s:
                self.sweep("growth")
                return "growth"
        return None

    def sweep(self, reason: str) -> int:
        """Collect the whole heap, frozen part included, and freeze what lives; the number of
        unreachable objects found."""
        started = time.perf_counter()
        gc.unfreeze()
        try:
            freed = gc.collect()
        finally:
            gc.freeze()
        took = time.perf_counter() - started
        now = self._clock()
        self._swept_at = self._counted_at = now
        self._busy_since_sweep = False
        self.frozen = self._frozen_after_sweep = gc.get_freeze_count()
        FROZEN.set(self.frozen)
        SWEEPS.labels(reason=reason).inc()
        SWEPT.inc(freed)
        log.log(
            logging.WARNING if took >= WARN_SWEEP_S else logging.INFO,
            "garbage collection sweep (%s): %d unreachable objects freed in %.0f ms; %d frozen",
            reason,
            freed,
            took * 1000,
            self.frozen,
        )
        return freed
