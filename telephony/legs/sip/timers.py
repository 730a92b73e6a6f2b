"""Timer values of RFC 3261 (section 17, table 4) and a heap of deadlines for the sans-I/O core."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TimerConfig:
    """T1 (RTT estimate), T2 (cap of non-INVITE retransmits), T4 (network lifetime)."""

    t1: float = 0.5
    t2: float = 4.0
    t4: float = 5.0

    @property
    def b(self) -> float:
        """64*T1: timers B, F, H, J, L and the wait for the ACK of a 2xx."""
        return 64 * self.t1


@dataclass(eq=False, slots=True)
class TimerOwner:
    """Anything that owns timers: a transaction or a call. `timers` maps kind -> live token."""

    timers: dict[str, int] = field(default_factory=dict)


class TimerHeap:
    """Deadlines by owner and kind; rescheduling or cancelling a kind invalidates its old entry.

    Invalidated entries are dropped lazily, and the heap is rebuilt when they outnumber the live
    ones, so an ended call's far-off timers (a 30-minute session timer) do not keep it alive.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any, str]] = []
        self._tokens = itertools.count()
        self._live = 0

    def set(self, owner: TimerOwner, kind: str, at: float) -> None:
        if kind in owner.timers:
            self._live -= 1
        token = next(self._tokens)
        owner.timers[kind] = token
        self._live += 1
        heapq.heappush(self._heap, (at, token, owner, kind))
        self._maybe_compact()

    def cancel(self, owner: TimerOwner, kind: str) -> None:
        if owner.timers.pop(kind, None) is not None:
            self._live -= 1
            self._maybe_compact()

    def cancel_all(self, owner: TimerOwner) -> None:
        self._live -= len(owner.timers)
        owner.timers.clear()
        self._maybe_compact()

    def _valid(self, entry: tuple[float, int, Any, str]) -> bool:
        _, token, owner, kind = entry
        return bool(owner.timers.get(kind) == token)

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [e for e in self._heap if self._valid(e)]
            heapq.heapify(self._heap)

    def next_deadline(self) -> float | None:
        while self._heap and not self._valid(self._heap[0]):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[tuple[Any, str]]:
        """Every (owner, kind) due at `now`, earliest first; each fires once."""
        due: list[tuple[Any, str]] = []
        while self._heap and self._heap[0][0] <= now:
            entry = heapq.heappop(self._heap)
            if self._valid(entry):
                _, _, owner, kind = entry
                del owner.timers[kind]
                self._live -= 1
                due.append((owner, kind))
        return due

    def __len__(self) -> int:
        return len(self._heap)
