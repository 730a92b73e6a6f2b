"""The process watches its own event loop: how late it runs a timer, how long each collection
stops it; both on /metrics, and a loop held up for long is logged (once a minute at most)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest
from prometheus_client import REGISTRY

from app.loop_watch import GcPauses, LoopLag


def lag_samples(le: str | None = None) -> float:
    if le is None:
        return REGISTRY.get_sample_value("voice_agent_event_loop_lag_seconds_count") or 0.0
    bucket = REGISTRY.get_sample_value("voice_agent_event_loop_lag_seconds_bucket", {"le": le})
    return bucket or 0.0


def pauses(generation: int) -> float:
    labels = {"generation": str(generation)}
    return REGISTRY.get_sample_value("voice_agent_gc_pause_seconds_count", labels) or 0.0


async def test_a_held_event_loop_is_measured_and_warned_about_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="app.loop_watch")
    watch = LoopLag(interval=0.05).start()
    try:
        samples, prompt = lag_samples(), lag_samples("0.32")
        await asyncio.sleep(0.3)
        assert lag_samples() - samples >= 3  # sampled while nothing held the loop ...
        assert lag_samples("0.32") - prompt == lag_samples() - samples  # ... and never late
        for _ in range(2):
            late = lag_samples() - lag_samples("0.32")
            # A callback that blocks the loop (a synchronous call, a stall) for 0.6 s.
            asyncio.get_running_loop().call_soon(time.sleep, 0.6)
            await asyncio.sleep(0.75)
            assert lag_samples() - lag_samples("0.32") == late + 1
        assert watch.worst >= 0.5
    finally:
        watch.stop()
    held = [r for r in caplog.records if "event loop was held up" in r.getMessage()]
    assert len(held) == 1 and held[0].levelno == logging.WARNING
    stopped = lag_samples()
    await asyncio.sleep(0.15)
    assert lag_samples() == stopped  # stopped: no timer left on the loop


async def test_an_idle_process_samples_its_loop_less_often() -> None:
    # Each sample wakes the process; with nothing to carry it samples every idle_interval.
    carrying = False
    watch = LoopLag(interval=0.05, idle_interval=1.0)
    watch.busy = lambda: carrying
    watch.start()
    try:
        samples = lag_samples()
        await asyncio.sleep(0.5)
        assert lag_samples() == samples  # idle: the first sample is 1 s away
        carrying = True  # from that sample on, every 0.05 s
        await asyncio.sleep(0.8)
        assert lag_samples() - samples >= 3
        carrying = False
        await asyncio.sleep(0.25)  # the sample armed while carrying
        idle_from = lag_samples()
        await asyncio.sleep(0.5)
        assert lag_samples() == idle_from
    finally:
        watch.stop()


def test_every_collection_is_timed_by_its_generation() -> None:
    watch = GcPauses().install()
    try:
        before = [pauses(g) for g in range(3)]
        gc.collect(0)
        gc.collect(2)
        assert pauses(0) >= before[0] + 1 and pauses(2) >= before[2] + 1
        seconds = REGISTRY.get_sample_value("voice_agent_gc_pause_seconds_sum", {"generation": "2"})
        assert seconds is not None and seconds > 0
    finally:
        watch.close()
    after = pauses(2)
    gc.collect(2)
    assert pauses(2) == after  # taken out of gc.callbacks


def seconds(name: str, generation: int) -> float:
    labels = {"generation": str(generation)}
    return REGISTRY.get_sample_value(f"voice_agent_gc_pause{name}_seconds_sum", labels) or 0.0


def test_a_collection_that_waits_off_the_cpu_is_a_long_pause_and_little_cpu() -> None:
    """A collection held up without working (here a callback that sleeps, as a process
    preempted on a busy core is) counts as a pause of that length, and as the CPU it used."""
    watch = GcPauses().install()

    def held(phase: str, info: dict[str, object]) -> None:
        if phase == "start":
            time.sleep(0.3)

    gc.callbacks.append(held)
    try:
        wall, cpu = seconds("", 2), seconds("_cpu", 2)
        gc.collect(2)
        wall, cpu = seconds("", 2) - wall, seconds("_cpu", 2) - cpu
    finally:
        gc.callbacks.remove(held)
        watch.close()
    assert wall >= 0.3  # the pause: the whole wait
    assert 0 < cpu < wall - 0.2  # the CPU: the collector's own work only
