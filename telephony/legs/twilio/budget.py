"""Per-stream budgets: what one media connection may cost us before it is ended as abusive.

A genuine Twilio stream sends 50 media frames a second, a handful of marks, a few digits and
no malformed frames at all. Anything far beyond that is a client burdening the process (the
shared event queue, the log, tasks), so the stream is ended; one timeline event says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from telephony.call_events import CallEvent, CallEventKind, CallEventSink

BATCH = 64  # frames counted between two looks at the clock (a power of two)


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    """Per-stream limits (the defaults are far above what Twilio sends)."""

    max_malformed: int = 100
    max_dtmf: int = 200
    # Frames: a bucket of `frame_burst`, refilled at `frames_per_s` (Twilio: 50/s).
    frames_per_s: float = 200.0
    frame_burst: float = 2000.0


class StreamBudget:
    """Counts one stream's frames, malformed frames and digits; trips once."""

    def __init__(
        self,
        sink: CallEventSink,
        call_id: str,
        limits: BudgetLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sink = sink
        self._call_id = call_id
        self.limits = limits or BudgetLimits()
        self._clock = clock
        self.malformed_count = 0
        self.dtmf_count = 0
        self._tokens = self.limits.frame_burst
        self._frames = 0
        self._refilled = clock()
        self.tripped: str | None = None

    def frame(self) -> None:
        """One frame received (the clock is read once every `BATCH` frames)."""
        self._frames += 1
        if not self._frames & (BATCH - 1):
            self._look()

    def batch(self) -> None:
        """`BATCH` more frames received, counted by the caller (the hot path: no call per
        frame); the same as `BATCH` calls of `frame()`."""
        self._frames += BATCH
        self._look()

    def _look(self) -> None:
        now = self._clock()
        lim = self.limits
        refill = (now - self._refilled) * lim.frames_per_s
        self._tokens = min(lim.frame_burst, self._tokens + refill) - BATCH
        self._refilled = now
        if self._tokens < 0:
            self._trip("frames", f"more than {lim.frames_per_s:g} frames a second")

    def malformed(self) -> None:
        self.malformed_count += 1
        if self.malformed_count > self.limits.max_malformed:
            self._trip("malformed_frames", f"more than {self.limits.max_malformed} bad frames")

    def may_record(self) -> bool:
        """Whether one more malformed frame may still be written to the timeline."""
        return self.tripped is None and self.malformed_count < self.limits.max_malformed

    def dtmf(self) -> None:
        self.dtmf_count += 1
        if self.dtmf_count > self.limits.max_dtmf:
            self._trip("dtmf", f"more than {self.limits.max_dtmf} keypad digits")

    def _trip(self, budget: str, why: str) -> None:
        if self.tripped is not None:
            return
        self.tripped = why
        self._sink.emit(
            CallEvent(
                self._call_id,
                CallEventKind.STREAM_ABUSIVE,
                {
                    "budget": budget,
                    "reason": why,
                    "malformed": self.malformed_count,
                    "dtmf": self.dtmf_count,
                },
            )
        )
