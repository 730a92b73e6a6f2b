"""The collector's steward freezes what survives, so automatic collections do not walk it, and
sweeps the frozen heap for cyclic garbage frozen by mistake: when the process is idle, or when
the frozen heap has grown. Real collections throughout; each test leaves the heap unfrozen."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import weakref
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import REGISTRY

from app.gc_steward import GcSteward
from tests.metrics_support import samples
from tests.server_proc import ServerProcess


class Node:
    """A call's part that refers back to itself: freed only by a collection."""

    def __init__(self) -> None:
        self.me = self


def sweeps(reason: str) -> float:
    return REGISTRY.get_sample_value("voice_agent_gc_sweeps_total", {"reason": reason}) or 0.0


def swept() -> float:
    return REGISTRY.get_sample_value("voice_agent_gc_swept_objects_total") or 0.0


def frozen_gauge() -> float:
    return REGISTRY.get_sample_value("voice_agent_gc_frozen_objects") or 0.0


def about_frozen(count: float) -> bool:
    """`count` is the frozen heap's size, give or take the few frozen objects (frames, say)
    that reference counting has freed since it was read."""
    return abs(count - gc.get_freeze_count()) < 100


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


def frozen_garbage() -> weakref.ref[Node]:
    """A cycle frozen while it was alive, then dropped: in the permanent generation, which no
    collection walks."""
    node = Node()
    ref = weakref.ref(node)
    gc.collect()
    gc.freeze()
    del node
    gc.collect()
    assert ref() is not None  # frozen: the full collection did not find it
    return ref


def test_a_tick_frees_fresh_cyclic_garbage_and_freezes_what_lives() -> None:
    steward = GcSteward(5, idle=lambda: False, count_every_s=0)
    alive, dead = Node(), Node()
    alive_ref, dead_ref = weakref.ref(alive), weakref.ref(dead)
    del dead
    assert steward.tick() is None
    assert dead_ref() is None and alive_ref() is alive
    assert gc.get_freeze_count() > 0 and not gc.get_objects(generation=2)
    assert steward.frozen == frozen_gauge() and about_frozen(steward.frozen)
    del alive
    # Dropped while frozen: reference counting alone cannot free a cycle, nor can a collection.
    gc.collect()
    assert alive_ref() is not None


def test_frozen_garbage_is_swept_once_the_process_is_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="app.gc_steward")
    idle = [False]
    steward = GcSteward(5, idle=lambda: idle[0], sweep_idle_after_s=0)
    node = Node()
    ref = weakref.ref(node)
    assert steward.tick() is None  # a call is live: frozen with the rest
    del node
    assert steward.tick() is None and ref() is not None
    before_sweeps, before_swept = sweeps("idle"), swept()
    idle[0] = True
    assert steward.tick() == "idle"
    assert ref() is None
    assert sweeps("idle") == before_sweeps + 1 and swept() >= before_swept + 1
    assert gc.get_freeze_count() > 0 and about_frozen(frozen_gauge())
    [said] = [r.getMessage() for r in caplog.records if "sweep (idle)" in r.getMessage()]
    assert "unreachable objects freed in" in said
    # Idle with no call since the sweep: nothing to look for.
    assert steward.tick() is None and sweeps("idle") == before_sweeps + 1


def test_an_idle_process_sweeps_at_most_once_a_minute() -> None:
    now = [0.0]
    idle = [True]
    steward = GcSteward(5, idle=lambda: idle[0], clock=lambda: now[0])
    ref = frozen_garbage()
    idle[0] = False
    steward.tick()
    idle[0] = True
    now[0] = 59.0
    assert steward.tick() is None and ref() is not None
    now[0] = 60.0
    assert steward.tick() == "idle" and ref() is None


def test_frozen_garbage_is_swept_when_the_frozen_heap_grows_by_half_under_load() -> None:
    now = [0.0]
    gc.collect()
    gc.freeze()  # what a serving process froze at start
    steward = GcSteward(
        5, idle=lambda: False, count_every_s=0, sweep_growth_after_s=600, clock=lambda: now[0]
    )
    base = steward.frozen
    ref = frozen_garbage()
    ballast = [[i] for i in range(base // 2 + 1000)]  # long-lived state of new calls
    before_sweeps, before_swept = sweeps("growth"), swept()
    now[0] = 599.0
    assert steward.tick() is None  # grown, but the last sweep was under 10 minutes ago
    assert steward.frozen > base * 1.5 and frozen_gauge() == steward.frozen
    now[0] = 600.0
    assert steward.tick() == "growth"
    assert ref() is None and len(ballast) > base // 2
    assert sweeps("growth") == before_sweeps + 1 and swept() >= before_swept + 1
    assert steward.frozen > base and about_frozen(steward.frozen)
    del ballast
    now[0] = 1200.0
    assert steward.tick() is None  # measured from the count after the last sweep


async def test_started_it_ticks_on_the_loop_and_stops_idempotently() -> None:
    steward = GcSteward(0.02, idle=lambda: False).start()
    try:
        deadline = time.monotonic() + 5
        while gc.get_freeze_count() == 0:
            assert time.monotonic() < deadline, "the steward never froze the heap"
            await asyncio.sleep(0.01)
    finally:
        steward.stop()
    steward.stop()
    gc.unfreeze()
    await asyncio.sleep(0.1)
    assert gc.get_freeze_count() == 0  # no timer left on the loop


async def test_with_no_interval_it_does_nothing() -> None:
    before = sweeps("idle"), sweeps("growth"), swept()
    steward = GcSteward(0, idle=lambda: True, sweep_idle_after_s=0).start()
    await asyncio.sleep(0.1)
    steward.stop()
    assert gc.get_freeze_count() == 0
    assert (sweeps("idle"), sweeps("growth"), swept()) == before


async def test_serve_runs_the_steward_on_its_frozen_heap(clean_db: str) -> None:
    # The real `voice-agent serve`: its startup freeze is on /metrics, and each tick's
    # collection (a full one, of what is not frozen) counts as a generation-2 pause.
    server = ServerProcess({"DATABASE_URL": clean_db, "GC_FREEZE_EVERY_S": "0.2"})
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            before = samples((await http.get("/metrics")).text)
            await asyncio.sleep(1.5)
            after = samples((await http.get("/metrics")).text)
    finally:
        await server.stop()
    full = 'voice_agent_gc_pause_seconds_count{generation="2"}'
    assert after["voice_agent_gc_frozen_objects"] > 50_000  # what serve froze at start
    assert after[full] - before[full] >= 4  # ticks every 0.2 s
