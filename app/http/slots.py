"""Slots held per key (a source address, a staff member) and in all, each bounded.

Something that holds a resource for a while before it has proved much (a media socket waiting
for `start`, a console event stream) takes a slot first; beyond either bound it is refused.
The holder releases its slot once, when it ends or no longer needs counting.
"""

from __future__ import annotations

from collections import defaultdict


class Slot:
    """One held slot; `release()` gives it back (once: later calls do nothing)."""

    __slots__ = ("_key", "_pool")

    def __init__(self, pool: SlotPool, key: str) -> None:
        self._pool: SlotPool | None = pool
        self._key = key

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self._key)


class SlotPool:
    """At most `per_key` slots per key and `total` in all."""

    def __init__(self, *, per_key: int, total: int) -> None:
        self.per_key = per_key
        self.total = total
        self._held: defaultdict[str, int] = defaultdict(int)
        self._count = 0
        self.refused = 0

    def take(self, key: str) -> Slot | None:
        """A slot for `key`, or None when `key` or the pool is at its bound."""
        if self._count >= self.total or self._held[key] >= self.per_key:
            if not self._held[key]:
                del self._held[key]
            self.refused += 1
            return None
        self._held[key] += 1
        self._count += 1
        return Slot(self, key)

    def held(self, key: str | None = None) -> int:
        """Slots held for `key`, or in all."""
        return self._count if key is None else self._held.get(key, 0)

    def _give_back(self, key: str) -> None:
        self._count -= 1
        left = self._held[key] - 1
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)
