"""CPU of ending a call's leg reader: async generators closed where they are left, or left to
the event loop's finalizer hook.

A call's bridge reads its leg through three nested async generators (the recording tap, the
Twilio leg, its frame reader) and stops at the leg's last event, with all three suspended.
Left so, each is closed by the loop's finalizer hook once it is dropped: a
`call_soon_threadsafe` (a write to the loop's eventfd, a wake-up to read it) and a task
running its `aclose()`. Closed where they were left (`contextlib.aclosing` at each level)
they end in the reader's own task. Here: `--calls` readers of a three-level chain each way,
one every `--gap` seconds (the loop idles between, as it does between a call's events),
alternated round by round in one process on uvloop; `time.process_time` per reader. No
assertions.

    .venv/bin/python bench/asyncgen_close.py [--calls 2000] [--rounds 3] [--gap 0.002]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

try:
    import uvloop
except ImportError:  # pragma: no cover - the service's default loop
    uvloop = None  # type: ignore[assignment]


async def _frames() -> AsyncIterator[int]:
    n = 0
    while True:
        await asyncio.sleep(0)
        n += 1
        yield n


async def _leg(closing: bool) -> AsyncIterator[int]:
    if closing:
        async with contextlib.aclosing(_frames()) as frames:
            async for frame in frames:
                yield frame
    else:
        async for frame in _frames():
            yield frame


async def _tap(closing: bool) -> AsyncIterator[int]:
    if closing:
        async with contextlib.aclosing(_leg(closing)) as leg:
            async for frame in leg:
                yield frame
    else:
        async for frame in _leg(closing):
            yield frame


async def _reader(closing: bool, frames: int) -> None:
    if closing:
        async with contextlib.aclosing(_tap(closing)) as events:
            async for n in events:
                if n >= frames:
                    return
    else:
        async for n in _tap(closing):
            if n >= frames:
                return


async def _round(closing: bool, calls: int, gap: float, frames: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        await _reader(closing, frames)
        await asyncio.sleep(gap)
    await asyncio.sleep(0.05)  # the finalizer's tasks of the last readers run
    return (time.process_time() - started) / calls


async def run(calls: int, rounds: int, gap: float, frames: int) -> None:
    spent: dict[str, list[float]] = {"left to the finalizer": [], "closed where left": []}
    await _round(False, 100, gap, frames)
    await _round(True, 100, gap, frames)
    for _ in range(rounds):
        spent["left to the finalizer"].append(await _round(False, calls, gap, frames))
        spent["closed where left"].append(await _round(True, calls, gap, frames))
    print(f"\n{calls} readers a round, {rounds} rounds alternated, one every {gap * 1e3:g} ms")
    print("| way | CPU per reader (its frames, the sleep between, the close), each round |")
    print("|---|---|")
    for way, values in spent.items():
        print(f"| {way} | {' / '.join(f'{v * 1e6:.1f}' for v in values)} us |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.002)
    parser.add_argument("--frames", type=int, default=3)
    args = parser.parse_args()
    coro = run(args.calls, args.rounds, args.gap, args.frames)
    if uvloop is not None:
        uvloop.run(coro)
    else:
        asyncio.run(coro)


if __name__ == "__main__":
    main()
