"""Cost of the per-stream budget on the receive path of the Twilio leg.

A real `TwilioLeg` reads 20 ms media frames from an in-memory socket (no network, so the
leg's own work is all that is timed), once without a budget (the baseline, as before issue
13) and once with the `StreamBudget` every admitted stream now has. Prints ns per frame.

    .venv/bin/python -m bench.leg_budget [--frames 200000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time

from telephony.call_events import MemorySink
from telephony.legs.leg import AudioIn
from telephony.legs.twilio.budget import BudgetLimits, StreamBudget
from telephony.legs.twilio.events import StartInfo
from telephony.legs.twilio.leg import TwilioLeg


class _Socket:
    """Hands out the same media frame `n` times, then reports a disconnect."""

    def __init__(self, frame: str, n: int) -> None:
        self._frame = frame
        self._left = n

    async def receive_text(self) -> str:
        if self._left == 0:
            raise ConnectionError("done")
        self._left -= 1
        return self._frame

    async def send_text(self, data: str) -> None:
        pass

    async def close(self, code: int, reason: str) -> None:
        pass


def _start() -> StartInfo:
    return StartInfo.model_validate(
        {"streamSid": "MZ" + "0" * 32, "callSid": "CA" + "0" * 32, "tracks": ["inbound"]}
    )


async def _run(frames: int, budgeted: bool) -> float:
    payload = base64.b64encode(b"\xff" * 160).decode()
    frame = json.dumps(
        {
            "event": "media",
            "sequenceNumber": "7",
            "streamSid": "MZ" + "0" * 32,
            "media": {"track": "inbound", "chunk": "6", "timestamp": "120", "payload": payload},
        }
    )
    sink = MemorySink()
    # Generous limits: the run measures the counting, not a trip.
    budget = StreamBudget(sink, "bench", BudgetLimits(frames_per_s=1e9, frame_burst=1e9))
    leg = TwilioLeg(
        _Socket(frame, frames), _start(), sink, "bench", budget=budget if budgeted else None
    )
    got = 0
    started = time.perf_counter_ns()
    async for event in leg.events():
        if isinstance(event, AudioIn):
            got += 1
    elapsed = time.perf_counter_ns() - started
    assert got == frames, got
    return elapsed / frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"no budget (baseline)": [], "with StreamBudget": []}
    for _ in range(args.repeat):  # interleaved, so drift hits both alike
        results["no budget (baseline)"].append(asyncio.run(_run(args.frames, False)))
        results["with StreamBudget"].append(asyncio.run(_run(args.frames, True)))
    base = statistics.median(results["no budget (baseline)"])
    print(f"Twilio leg receive path, {args.frames} media frames x {args.repeat} runs")
    print(f"{'variant':<24} {'median ns/frame':>16} {'min':>8} {'max':>8} {'ratio':>7}")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:<24} {med:>16.0f} {min(values):>8.0f} {max(values):>8.0f} {med / base:>7.3f}")


if __name__ == "__main__":
    main()
