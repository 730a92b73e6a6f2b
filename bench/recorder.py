"""Call recorder benchmark: memory held per call-minute, the tap's cost per frame, render time,
and garbage-collection pauses at 200 concurrent calls with churn.

Prints tables (no assertions). Each simulated call is what a Twilio leg hands the recorder: a
caller frame every 20 ms (160 bytes of mu-law as a fresh base64 string, the stream's
timestamp), and agent turns as 100 ms base64 deltas handed over faster than real time, about a
third of them cut by a barge-in (`clear`). Time is the recorder's injected clock, so minutes of
calls run in seconds; memory is what tracemalloc sees held by the recorders once the audio has
gone through; GC pauses are timed with `gc.callbacks` (start to stop of each collection).

Rows, in the same run:
- recorder: `app.calls.recording.CallRecorder`, rendered and released when each call ends;
- bytearray of mu-law (baseline): per call two bytearrays that only append the decoded audio
  (no placement, no clears, no render) - what holding the audio in memory at all costs;
- frames to a file (baseline): per call an unlinked temporary file, each decoded frame written
  with os.write as it comes - the least memory, a system call per frame.

    .venv/bin/python bench/recorder.py [--quick] [--calls 200] [--seconds 180]
"""

from __future__ import annotations

import argparse
import base64
import binascii
import gc
import os
import random
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _stats import pct  # bench/ is on sys.path when run as a script

from app.calls.recording import CallRecorder

FRAME_MS = 20
DELTA_MS = 100
# Fresh payload strings are sliced out of one long base64 text (as if parsed from JSON).
_NOISE = base64.b64encode(random.Random(7).randbytes(1 << 16)).decode("ascii")
CALLER_BYTES = 8 * FRAME_MS  # 160
AGENT_BYTES = 8 * DELTA_MS  # 800
_TAIL = ("", "AA==", "AAA=")


def payload(n: int, size: int) -> str:
    """A fresh base64 string of `size` bytes."""
    chars = 4 * (size // 3)
    at = (n * 4 * 37) % (len(_NOISE) - chars - 4)
    return _NOISE[at : at + chars] + _TAIL[size % 3]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder(Protocol):
    def caller_audio(self, payload: str, timestamp_ms: int) -> None: ...
    def agent_audio(self, audio: str) -> None: ...
    def cleared(self) -> None: ...
    def finish(self) -> None: ...


class Ours:
    label = "recorder"
    renders = True

    def __init__(self, clock: Clock) -> None:
        self.rec = CallRecorder("audio/pcmu", max_ms=4 * 3600 * 1000, clock=clock)
        self.caller_audio = self.rec.caller_audio
        self.agent_audio = self.rec.agent_audio
        self.cleared = self.rec.cleared

    def finish(self) -> None:
        # As Recordings.finish does (getattr: the recorder before the spool had neither).
        self.rec.stop()
        seal = getattr(self.rec, "seal", None)
        if seal is not None:
            seal()
        try:
            self.rec.render()
        finally:
            discard = getattr(self.rec, "discard", None)
            if discard is not None:
                discard()


class Bytearrays:
    label = "bytearray of mu-law (baseline)"
    renders = False

    def __init__(self, clock: Clock) -> None:
        self.caller = bytearray()
        self.agent = bytearray()

    def caller_audio(self, payload: str, timestamp_ms: int) -> None:
        try:
            self.caller += binascii.a2b_base64(payload)
        except (binascii.Error, ValueError):
            pass

    def agent_audio(self, audio: str) -> None:
        try:
            self.agent += binascii.a2b_base64(audio)
        except (binascii.Error, ValueError):
            pass

    def cleared(self) -> None:
        pass

    def finish(self) -> None:
        pass


class ToFile:
    label = "frames to a file (baseline)"
    renders = False

    def __init__(self, clock: Clock) -> None:
        fd, path = tempfile.mkstemp(prefix="bench-rec-")
        os.unlink(path)
        self.fd = fd

    def caller_audio(self, payload: str, timestamp_ms: int) -> None:
        os.write(self.fd, binascii.a2b_base64(payload))

    def agent_audio(self, audio: str) -> None:
        os.write(self.fd, binascii.a2b_base64(audio))

    def cleared(self) -> None:
        pass

    def finish(self) -> None:
        os.close(self.fd)


IMPLS: list[Callable[[Clock], Any]] = [Ours, Bytearrays, ToFile]
CHURN_HEADER = (
    "recorder",
    "calls ended",
    "gen0 n / max ms",
    "gen1 n / max ms",
    "gen2 n / max ms",
    "p99 ms",
    "max ms",
    "> 10 ms",
    "full collection ms",
    "CPU s",
)


def script(seed: int, seconds: float) -> Iterator[tuple[float, str, int]]:
    """(at s from the call's start, kind, n) events of one call: caller frames every 20 ms;
    agent turns of 2-8 s as 100 ms deltas two per 20 ms tick; a third of turns cut."""
    rnd = random.Random(seed)
    ticks = int(seconds * 1000 / FRAME_MS)
    next_turn = rnd.randint(100, 250)  # the agent starts after 2-5 s
    deltas_left = 0
    clear_at = -1
    for tick in range(ticks):
        at = tick * FRAME_MS / 1000
        yield at, "caller", tick
        if tick == next_turn:
            turn = rnd.randint(20, 80)  # deltas
            deltas_left = turn
            clear_at = tick + rnd.randint(10, turn * 5) if rnd.random() < 0.33 else -1
            next_turn = tick + turn * 5 + rnd.randint(100, 300)
        for _ in range(min(2, deltas_left)):
            deltas_left -= 1
            yield at, "agent", tick * 2 + deltas_left
        if tick == clear_at:
            deltas_left = 0
            yield at, "clear", 0


class Call:
    def __init__(self, impl: Callable[[Clock], Any], seed: int, seconds: float) -> None:
        self.clock = Clock()
        self.start = self.clock.now
        self.rec = impl(self.clock)
        self.events = script(seed, seconds)

    def run_until(self, t: float) -> bool:
        """Feed the call up to `t` s of its time; False once it is over."""
        rec, clock = self.rec, self.clock
        for at, kind, n in self.events:
            clock.now = self.start + at
            if kind == "caller":
                rec.caller_audio(payload(n, CALLER_BYTES), n * FRAME_MS)
            elif kind == "agent":
                rec.agent_audio(payload(n, AGENT_BYTES))
            else:
                rec.cleared()
            if at >= t:
                return True
        return False


class Null:
    """Takes every event and keeps nothing: the driver's own cost."""

    def __init__(self, clock: Clock) -> None:
        pass

    def caller_audio(self, payload: str, timestamp_ms: int) -> None:
        pass

    def agent_audio(self, audio: str) -> None:
        pass

    def cleared(self) -> None:
        pass

    def finish(self) -> None:
        pass


def memory_row(impl: Callable[[Clock], Any], calls: int, seconds: float) -> float:
    """MB held per call-minute once the audio went through (recorders alive, not finished)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    live = [Call(impl, seed, seconds) for seed in range(calls)]
    for call in live:
        call.run_until(float("inf"))
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    for call in live:
        call.rec.finish()
    return held / 1e6 / (calls * seconds / 60)


def tap_us(impl: Callable[[Clock], Any], seconds: float, repeat: int = 7) -> float:
    """Microseconds per event (caller frame, agent delta or clear) the recorder adds to the
    driver: the best of `repeat` calls, each beside a call to a recorder that keeps nothing."""
    events = sum(1 for _ in script(0, seconds))
    best = {Null: float("inf"), impl: float("inf")}
    for _ in range(repeat):
        for each in (Null, impl):
            call = Call(each, 0, seconds)
            t0 = time.perf_counter()
            call.run_until(float("inf"))
            best[each] = min(best[each], time.perf_counter() - t0)
            call.rec.finish()
    return (best[impl] - best[Null]) / events * 1e6


def render_row(minutes: float) -> tuple[float, float]:
    """(ms to render one call of `minutes`, the best of 3; MB of WAV)."""
    call = Call(Ours, 1, minutes * 60)
    call.run_until(float("inf"))
    call.rec.rec.stop()
    took = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        wav = call.rec.rec.render().wav
        took = min(took, time.perf_counter() - t0)
    call.rec.finish()
    return took * 1000, len(wav) / 1e6


def stall_row(
    minutes: float, switch_s: float, renders: int = 5
) -> tuple[float, float, float, float]:
    """The event loop (uvloop, as `serve` runs) ticking every millisecond while a call of
    `minutes` renders in a thread (`asyncio.to_thread`, as at a call's end), `renders` times
    one after another, with the GIL's switch interval `switch_s`: (tick lateness p99 and max
    in ms while rendering; the same with nothing rendering, the baseline)."""
    import asyncio

    import uvloop

    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)

    call = Call(Ours, 1, minutes * 60)
    call.run_until(float("inf"))
    call.rec.rec.stop()

    async def measure(render: bool) -> list[float]:
        late: list[float] = []
        done = False

        async def ticker() -> None:
            while not done:
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                late.append((time.perf_counter() - t0 - 0.001) * 1000)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        late.clear()
        for _ in range(renders):
            if render:
                await asyncio.to_thread(call.rec.rec.render)
            else:
                await asyncio.sleep(0.08)
        done = True
        await task
        return late

    try:
        busy = uvloop.run(measure(True))
        idle = uvloop.run(measure(False))
    finally:
        sys.setswitchinterval(before)
    call.rec.finish()
    return pct(busy, 99), max(busy), pct(idle, 99), max(idle)


class Pauses:
    """Every collection's duration, by generation, from gc.callbacks."""

    def __init__(self) -> None:
        self.by_gen: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.by_gen[info["generation"]].append((time.perf_counter() - self._t0) * 1000)


def churn_row(impl: Callable[[Clock], Any], calls: int, seconds: float) -> dict[str, Any]:
    """`calls` at once for `seconds`, each lasting 20-120 s, replaced as it ends (rendered and
    released); the GC pauses meanwhile."""
    rnd = random.Random(3)
    seed = 0

    def new_call() -> Call:
        nonlocal seed
        seed += 1
        call = Call(impl, seed, rnd.uniform(20, 120))
        return call

    live = [new_call() for _ in range(calls)]
    # Stagger the first wave so calls end at different moments.
    for call in live:
        call.run_until(rnd.uniform(0, 60))
    gc.collect()
    pauses = Pauses()
    gc.callbacks.append(pauses)
    ended = 0
    t0 = time.process_time()
    try:
        step = 1.0  # seconds of call time fed per call per round
        for _ in range(int(seconds / step)):
            for i, call in enumerate(live):
                if not call.run_until(call.clock.now - call.start + step):
                    call.rec.finish()
                    ended += 1
                    live[i] = new_call()
    finally:
        gc.callbacks.remove(pauses)
    took = time.process_time() - t0
    full = []
    for _ in range(5):  # what the live calls' recorders add to a full collection
        t1 = time.perf_counter()
        gc.collect()
        full.append((time.perf_counter() - t1) * 1000)
    for call in live:
        call.rec.finish()
    every = [p for gen in pauses.by_gen.values() for p in gen]
    return {
        "pauses": pauses.by_gen,
        "max": max(every, default=0.0),
        "over10": sum(1 for p in every if p > 10),
        "ended": ended,
        "took": took,
        "p99": pct(every, 99),
        "full": pct(full, 50),
    }


def table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, shorter")
    parser.add_argument("--calls", type=int, default=200, help="concurrent calls in the churn")
    parser.add_argument("--seconds", type=float, default=180, help="call time of the churn")
    args = parser.parse_args()
    mem_calls, mem_s = (5, 60.0) if args.quick else (20, 180.0)
    churn_s = 30.0 if args.quick else args.seconds
    # The collector as `voice-agent serve` sets it: the loaded service frozen out of the
    # collections, the middle generation collected every GC_MIDDLE_EVERY young ones.
    import app.main  # noqa: F401
    from app.server import GC_MIDDLE_EVERY

    gc.collect()
    gc.freeze()
    young, _, oldest = gc.get_threshold()
    gc.set_threshold(young, GC_MIDDLE_EVERY, oldest)

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, gc thresholds "
          f"{gc.get_threshold()}")  # fmt: skip
    rows = []
    for impl in IMPLS:
        mb = memory_row(impl, mem_calls, mem_s)
        us = tap_us(impl, 60.0)
        rows.append((impl.label, f"{mb:.3f}", f"{us:.2f}"))
    table(
        f"Held while recording: {mem_calls} calls of {mem_s / 60:g} min, in one process",
        ("recorder", "MB per call-minute", "us per event on the event loop"),
        rows,
    )
    rrows = []
    for minutes in (1, 10, 60):
        ms, wav_mb = render_row(minutes)
        rrows.append((f"{minutes} min", f"{ms:.0f}", f"{ms / minutes:.1f}", f"{wav_mb:.1f}"))
    table("Render (CallRecorder.render)", ("call", "ms", "ms per call-minute", "WAV MB"), rrows)
    from app.server import SWITCH_INTERVAL_S

    srows = []
    for minutes in (3, 10):
        for switch_s, who in ((0.005, "CPython's default"), (SWITCH_INTERVAL_S, "serve's")):
            p99, worst, base_p99, base_worst = stall_row(minutes, switch_s)
            srows.append(
                (
                    f"{minutes} min",
                    f"{switch_s * 1000:g} ms ({who})",
                    f"{p99:.2f} / {worst:.2f}",
                    f"{base_p99:.2f} / {base_worst:.2f}",
                )
            )
    table(
        "The event loop while a call renders in a thread: a 1 ms timer's lateness, ms",
        ("call", "GIL switch interval", "rendering: p99 / max", "nothing rendering: p99 / max"),
        srows,
    )
    crows = []
    for impl in IMPLS:
        r = churn_row(impl, args.calls, churn_s)
        g = r["pauses"]
        crows.append(
            (
                impl.label,
                str(r["ended"]),
                *(f"{len(g[n])} / {max(g[n], default=0):.1f}" for n in (0, 1, 2)),
                f"{r['p99']:.2f}",
                f"{r['max']:.1f}",
                str(r["over10"]),
                f"{r['full']:.2f}",
                f"{r['took']:.1f}",
            )
        )
    table(
        f"GC pauses: {args.calls} calls at once for {churn_s:g} s of call time, each 20-120 s, "
        "replaced as it ends (rendered)",
        CHURN_HEADER,
        crows,
    )
    print(
        "(full collection ms: gc.collect() with the calls live, the median of 5; CPU s: all of"
        " the churn's, the driver, taps, renders and collections)"
    )


if __name__ == "__main__":
    main()
