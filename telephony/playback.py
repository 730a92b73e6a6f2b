"""Playback tracking: how much of each agent item the caller has actually heard."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Item:
    index: int  # position in the tracker's order
    queued_ms: float = 0.0  # audio handed to the leg for playout
    played_ms: float = 0.0  # audio the leg confirmed as played (mark echo, RTP sent)
    confirmed_at: float = 0.0  # clock() when played_ms was last confirmed
    started_at: float | None = None  # clock() when its playout began (None: never played)


class PlaybackTracker:
    """Accounts agent audio per item: queued to the leg, and confirmed played.

    Every chunk queued is stamped with the current epoch; `cleared()` starts a new epoch, so
    confirmations for audio that was cleared (Twilio echoes those marks too) never count.
    Between confirmations, playout runs in real time, so `heard_ms` interpolates from the
    last confirmation, capped at what was queued.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._items: dict[str, _Item] = {}
        self._order: list[str] = []
        # Items before this index in `_order` have all their audio confirmed played, so the
        # per-chunk lookups start here instead of at the call's first item.
        self._head = 0
        self.epoch = 0
        self._playing_since: float | None = None  # clock() when unconfirmed audio was queued

    def queued(self, item_id: str, ms: float) -> tuple[int, float]:
        """Record `ms` of audio of `item_id` handed to the leg; returns (epoch, end offset)."""
        item = self._items.get(item_id)
        if item is None:
            item = self._items[item_id] = _Item(len(self._order), confirmed_at=self._clock())
            self._order.append(item_id)
        elif item.index < self._head:
            self._head = item.index  # more audio for an item that had finished
        elif item.index == self._head and item.played_ms < item.queued_ms:
            # The usual chunk: more audio for the item playing now (current_item() is it).
            item.queued_ms += ms
            return self.epoch, item.queued_ms
        if self.current_item() is None:  # not playing
            # Playout of this chunk starts now; interpolation counts from here.
            item.confirmed_at = self._clock()
            if item.started_at is None:
                item.started_at = item.confirmed_at
        item.queued_ms += ms
        if item.index < self._head:
            # The playing check above saw a new item as empty and moved the head past it.
            self._head = item.index
        return self.epoch, item.queued_ms

    def played(self, epoch: int, item_id: str, upto_ms: float) -> bool:
        """The leg confirms `item_id` played up to `upto_ms`; False if it was cleared audio."""
        if epoch != self.epoch:
            return False
        item = self._items.get(item_id)
        if item is None:
            return False
        now = self._clock()
        if upto_ms > item.played_ms:
            if item.started_at is None:
                # Its first confirmation came before the one that ended the item ahead of it
                # (marks of two items echoed in one read): it began this much before now.
                item.started_at = now - min(upto_ms, item.queued_ms) / 1000.0
            item.played_ms = min(upto_ms, item.queued_ms)
            item.confirmed_at = now
        # Earlier items are finished once a later item plays.
        for position in range(self._head, item.index):
            other = self._items[self._order[position]]
            if other.played_ms < other.queued_ms:
                if other.started_at is None:
                    other.started_at = now - other.queued_ms / 1000.0
                other.played_ms = other.queued_ms
                other.confirmed_at = now  # its end was heard by now
        if item.played_ms >= item.queued_ms:
            # The next item queued behind this one starts playing now, not when it was queued.
            following = self.current_item()
            if following is not None and self._items[following].played_ms == 0:
                self._items[following].confirmed_at = now
                if self._items[following].started_at is None:
                    self._items[following].started_at = now
        return True

    def settle(self) -> None:
        """Finish the items whose playout has ended by the clock though the leg's last
        confirmation of it is not in yet (a mark echo on its way): each ended when its audio
        ran out, and the item behind it began then. Asked before deciding whether the caller's
        speech interrupts anything: words after the last of an item was heard do not."""
        now = self._clock()
        while (item_id := self.current_item()) is not None:
            item = self._items[item_id]
            end = item.confirmed_at + (item.queued_ms - item.played_ms) / 1000.0
            if end > now:
                return  # still audible
            if item.started_at is None:
                item.started_at = end - item.queued_ms / 1000.0
            item.played_ms = item.queued_ms
            item.confirmed_at = end
            following = self.current_item()
            if following is not None:
                nxt = self._items[following]
                if nxt.played_ms == 0:
                    # It cannot have begun before it was queued (confirmed_at, when unplayed).
                    nxt.confirmed_at = max(nxt.confirmed_at, end)
                    if nxt.started_at is None:
                        nxt.started_at = nxt.confirmed_at

    def cleared(self) -> None:
        """All unconfirmed audio was dropped; freeze each item at what was heard."""
        current = self.current_item()
        for item_id, item in self._items.items():
            # Only the item at the head of playout was audible; the ones behind it were not.
            heard = self._estimate(item) if item_id == current else item.played_ms
            if heard > item.played_ms:
                # Heard up to here at the moment playout reached it: now, unless its audio
                # ran out before the clear came (then it was heard to its end back then).
                item.confirmed_at = min(
                    self._clock(), item.confirmed_at + (heard - item.played_ms) / 1000.0
                )
            item.played_ms = heard
            item.queued_ms = heard
        self.epoch += 1

    def _estimate(self, item: _Item) -> float:
        if item.played_ms >= item.queued_ms:
            return item.played_ms
        elapsed_ms = (self._clock() - item.confirmed_at) * 1000.0
        return min(item.queued_ms, item.played_ms + max(0.0, elapsed_ms))

    def heard_ms(self, item_id: str) -> int:
        """Milliseconds of `item_id` the caller has heard so far."""
        item = self._items.get(item_id)
        if item is None:
            return 0
        # Only the item at the head of playout advances with the clock.
        if self.current_item() != item_id:
            return int(item.played_ms)
        return int(self._estimate(item))

    def started_at(self, item_id: str) -> float | None:
        """clock() when playout of `item_id` began (None if it never started)."""
        item = self._items.get(item_id)
        return item.started_at if item else None

    def ended_at(self, item_id: str) -> float | None:
        """clock() when the last of `item_id`'s audio so far was confirmed played (None while
        some is still unconfirmed, or if none ever played). After a clear this is where it
        stopped: the caller (the bridge) knows whether that was its end or a cut."""
        item = self._items.get(item_id)
        if item is None or item.played_ms <= 0 or item.played_ms < item.queued_ms:
            return None
        return item.confirmed_at

    def confirmed_ms(self, item_id: str) -> int:
        """Milliseconds of `item_id` confirmed played by the leg (no interpolation)."""
        item = self._items.get(item_id)
        return int(item.played_ms) if item else 0

    def queued_ms(self, item_id: str) -> int:
        """Milliseconds of `item_id` handed to the leg (after a clear: what was kept)."""
        item = self._items.get(item_id)
        return int(item.queued_ms) if item else 0

    def current_item(self) -> str | None:
        """The first item with audio still waiting to be confirmed played."""
        order, items = self._order, self._items
        position = self._head
        while position < len(order):
            item_id = order[position]
            item = items[item_id]
            if item.played_ms < item.queued_ms:
                self._head = position
                return item_id
            position += 1
        self._head = position
        return None

    def is_playing(self) -> bool:
        """Whether any queued audio has not yet been confirmed played."""
        return self.current_item() is not None
