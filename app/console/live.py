"""Live updates for the console: Postgres notifications fanned out to server-sent events.

Three channels say that something a page shows has changed, whichever replica changed it:
- `call_events`: the event writer wrote events of a call (payload: the call id);
- `operation_status`: an operation changed status (tools.ledger, in the same transaction);
- `operation_trail`: a note or decision was added to an operation's trail (staff actions).

A watcher (one SSE response) waits on the keys it shows (`call:<id>`, `op:<id>`, `calls`);
every notification for one of its keys wakes it, and it then reads what changed from the
database. Notifications can be lost (a reconnecting listener), so a watcher also wakes on its
own every `fallback_s`.

Each stream holds a slot (`open_stream`): at most `max_per_principal` per staff member or API
token and `max_streams` in all, and it lives at most `max_lifetime_s` (then it ends and the
browser's EventSource reconnects by itself), so a held stream is never for ever (issue 22).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterable

from app.http.slots import Slot, SlotPool
from app.pg_listener import PgListener

log = logging.getLogger(__name__)

CALL_EVENTS = "call_events"
OPERATION_STATUS = "operation_status"
OPERATION_TRAIL = "operation_trail"
ALL_CALLS = "calls"


def call_key(call_id: str) -> str:
    return f"call:{call_id}"


def op_key(operation_id: str) -> str:
    return f"op:{operation_id}"


class LiveHub:
    """Wakes the watchers of whatever a notification is about."""

    def __init__(
        self,
        *,
        fallback_s: float = 5.0,
        max_streams: int = 128,
        max_per_principal: int = 8,
        max_lifetime_s: float = 300.0,
    ) -> None:
        self.fallback_s = fallback_s
        self.max_lifetime_s = max_lifetime_s
        self.streams = SlotPool(per_key=max_per_principal, total=max_streams)
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._closed = asyncio.Event()

    def open_stream(self, principal: str) -> Slot | None:
        """A slot for one more stream of `principal`, or None when it (or the hub) is full."""
        if self.closed:
            return None
        return self.streams.take(principal)

    def subscribe(self, listener: PgListener) -> None:
        listener.subscribe(CALL_EVENTS, self._on_call_events)
        listener.subscribe(OPERATION_STATUS, self._on_operation)
        listener.subscribe(OPERATION_TRAIL, self._on_operation)
        # Whatever changed while the listener was down: everyone looks again.
        listener.on_listen(self.wake_all)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """End every watch (the server is shutting down)."""
        self._closed.set()
        self.wake_all()

    def wake_all(self) -> None:
        for events in self._watchers.values():
            for event in events:
                event.set()

    def wake(self, keys: Iterable[str]) -> None:
        for key in keys:
            for event in self._watchers.get(key, ()):
                event.set()

    def _on_call_events(self, payload: str) -> None:
        self.wake((call_key(payload.strip()), ALL_CALLS))

    def _on_operation(self, payload: str) -> None:
        try:
            data = json.loads(payload)
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        keys = [ALL_CALLS]
        if data.get("operation_id"):
            keys.append(op_key(str(data["operation_id"])))
        if data.get("call_id"):
            keys.append(call_key(str(data["call_id"])))
        self.wake(keys)

    async def watch(self, keys: Iterable[str]) -> AsyncIterator[None]:
        """Yields each time one of `keys` may have changed (and every `fallback_s`), until the
        hub closes, `max_lifetime_s` has passed or the consumer stops iterating."""
        event = asyncio.Event()
        wanted = list(keys)
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + self.max_lifetime_s
        for key in wanted:
            self._watchers.setdefault(key, set()).add(event)
        try:
            while not self._closed.is_set():
                left = ends_at - loop.time()
                if left <= 0:
                    return  # a stream's life is bounded; the client reconnects
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self.fallback_s, left)):
                        await event.wait()
                event.clear()
                if self._closed.is_set() or loop.time() >= ends_at:
                    return
                yield
        finally:
            for key in wanted:
                watchers = self._watchers.get(key)
                if watchers is not None:
                    watchers.discard(event)
                    if not watchers:
                        del self._watchers[key]

    def watcher_count(self) -> int:
        return sum(len(v) for v in self._watchers.values())
