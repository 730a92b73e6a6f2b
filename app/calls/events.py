"""Call events to Postgres, off the audio path.

`emit` is a non-blocking put into a bounded queue. One writer task drains it in batches,
numbers each call's events with a per-call `seq` in emit order, and inserts them in one
transaction per batch (one statement: the rows and the console's notification). At low load
a batch waits up to `linger_s` for more events (a call's set-up emits several within
moments), unless someone is waiting in `flush`. A database hiccup is retried with backoff
(the queue absorbs the meantime); `flush` waits until everything emitted so far is written,
which call end and shutdown use so nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import Counter
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import measures
from app.calls.store import call_events
from telephony.call_events import CallEvent, CallEventKind
from tools import driver_sql
from tools.autocommit import autocommit
from tools.outage import DATABASE

log = logging.getLogger(__name__)

_STOP = object()


# The rows, and one notification per call in the same statement (delivered at commit: console
# pages watching these calls, on any replica, look again; see app.console.live). One fixed
# statement whatever the batch, so it is prepared and cached once (a VALUES list of one row per
# event was compiled anew for every batch). The batch is one JSON document of its rows, made by
# the json module's C encoder in one pass: as six arrays (one parameter a column, unnested),
# psycopg dumped every element in Python and escaped each event's JSON text with a regular
# expression callback per quote, ~5% of a call's set-up CPU (bench/event_batch.py).
_INSERT_AND_NOTIFY = sa.text(
    "WITH written AS ("
    " INSERT INTO call_events (call_id, seq, kind, data, mono_ns, at)"
    " SELECT r.call_id, r.seq, r.kind, r.data, r.mono_ns, r.at"
    " FROM jsonb_to_recordset(CAST(:rows AS jsonb))"
    " AS r(call_id uuid, seq bigint, kind text, data jsonb, mono_ns bigint, at timestamptz)"
    " RETURNING call_id)"
    " SELECT pg_notify('call_events', ids.c)"
    " FROM (SELECT DISTINCT CAST(call_id AS text) AS c FROM written) AS ids"
)


def _insert_and_notify_params(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The statement's one parameter: the rows (their columns' names) as a JSON array."""
    return {"rows": driver_sql.json_rows(rows)}


class EventWriter:
    """A CallEventSink that persists events in order, without ever blocking `emit`."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_queue: int = 100_000,
        batch_size: int = 500,
        retry_initial_s: float = 0.1,
        retry_max_s: float = 2.0,
        linger_s: float = 0.05,
    ) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=max_queue)
        self._batch_size = batch_size
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._linger_s = linger_s
        self._flushing = 0  # callers waiting in `flush`: no lingering then
        self._wake = asyncio.Event()  # cuts a linger short (a flush, the close)
        self._seq: dict[uuid.UUID, int] = {}  # last seq written per call
        self._task: asyncio.Task[None] | None = None
        self._emitted = 0
        self._done = 0  # written or given up on
        self._progress = asyncio.Condition()
        self._closing = False
        self.dropped = 0
        self.written = 0
        self.retries = 0  # failed write attempts that were retried
        self.poisoned = 0  # events the database refused as such (dropped, never retried)
        self.conflicts = 0  # batches that met a seq taken by another writer (then call by call)
        self.kind_counts: Counter[str] = Counter()

    # The sink side (event loop thread, audio path): never awaits, never raises.

    def emit(self, event: CallEvent) -> None:
        """Queue one event for writing; counts it as dropped if the queue is full."""
        self.kind_counts[str(event.kind)] += 1
        measures.observe(event)
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            return
        self._emitted += 1

    def new_call(self, call_id: str) -> None:
        """`call_id` was just created (its row inserted here): it has no events yet, so its
        first batch need not look up the last `seq` written. Should another writer have
        written one meanwhile, the insert's conflict makes this writer look it up after all."""
        key = _as_uuid(call_id)
        if key is not None:
            self._seq.setdefault(key, 0)

    def forget(self, call_id: str) -> None:
        """Another writer has just written an event of `call_id` (`append_call_event` in this
        process): the next batch of the call reads its last `seq` again, rather than find the
        one it kept taken (a conflict, then the batch again call by call)."""
        key = _as_uuid(call_id)
        if key is not None:
            self._seq.pop(key, None)

    @property
    def queue_depth(self) -> int:
        """Events waiting to be written."""
        return self._queue.qsize()

    # Lifecycle.

    def start(self) -> None:
        """Start the writer task (once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="call-event-writer")

    async def flush(self, wait_s: float = 10.0) -> bool:
        """Wait until every event emitted before this call is written; False on timeout."""
        target = self._emitted
        self._flushing += 1
        self._wake.set()
        try:
            async with asyncio.timeout(wait_s):
                async with self._progress:
                    await self._progress.wait_for(lambda: self._done >= target)
        except TimeoutError:
            log.warning("call events not flushed in %.1fs (%d queued)", wait_s, self.queue_depth)
            return False
        finally:
            self._flushing -= 1
        return True

    async def close(self, wait_s: float = 10.0) -> None:
        """Write everything queued, then stop the writer task."""
        if self._task is None:
            return
        await self.flush(wait_s)
        self._closing = True
        self._wake.set()
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_STOP)
        try:
            async with asyncio.timeout(1.0):
                await asyncio.shield(self._task)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        lost = self._queue.qsize()
        if lost:
            self.dropped += lost
            log.error("%d call events could not be written before shutdown", lost)
        self._task = None

    # The writer task.

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            if item is _STOP:
                return
            batch: list[CallEvent] = [item]
            stop = False
            await self._linger()
            while len(batch) < self._batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            try:
                await self._write_with_retry(self._ours(batch))
            except Exception:
                # A bug must not kill the writer: every later event would be lost with it.
                self.dropped += len(batch)
                log.exception("dropping %d call events after an unexpected error", len(batch))
            async with self._progress:
                self._done += len(batch)
                self._progress.notify_all()
            if stop:
                return

    async def _linger(self) -> None:
        """Let a lone event wait a moment for company (one transaction for several), unless
        a flush or the close wants it written now."""
        if self._linger_s <= 0 or self._flushing or self._closing or not self._queue.empty():
            return
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._linger_s):
                await self._wake.wait()

    def _ours(self, batch: list[CallEvent]) -> list[CallEvent]:
        kept = [e for e in batch if _as_uuid(e.call_id) is not None]
        if len(kept) < len(batch):
            self.dropped += len(batch) - len(kept)
            log.error("dropping %d events with a call id that is not ours", len(batch) - len(kept))
        return kept

    async def _write_with_retry(self, batch: list[CallEvent]) -> None:
        delay = self._retry_initial_s
        while True:
            try:
                await self._write(batch)
                DATABASE.ok()
                return
            except IntegrityError:
                self.conflicts += 1
                # One bad call (unknown id, a seq taken by another process) must not sink the
                # rest: write call by call and give up only on the call that fails.
                await self._write_per_call(batch)
                return
            except DataError:
                # The database refuses these rows themselves (a value out of range): retrying
                # the batch would stall the writer for every call. Find and drop the bad ones.
                await self._write_one_by_one(batch)
                return
            except (DBAPIError, OSError) as exc:
                if self._closing:
                    self.dropped += len(batch)
                    log.error("dropping %d call events at shutdown: %s", len(batch), exc)
                    return
                self.retries += 1
                if not DATABASE.failed("call event writer", exc):
                    log.warning("call event write failed, retrying in %.1fs: %s", delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)

    async def _write_per_call(self, batch: list[CallEvent]) -> None:
        groups: dict[str, list[CallEvent]] = {}
        for event in batch:
            groups.setdefault(event.call_id, []).append(event)
        for call_id, events in groups.items():
            for attempt in range(2):
                try:
                    await self._write(events)
                    break
                except IntegrityError as exc:
                    key = _as_uuid(call_id)
                    if key is not None:
                        self._seq.pop(key, None)  # re-read max(seq) on the next attempt
                    if attempt == 1:
                        self.dropped += len(events)
                        log.error("dropping %d events of %s: %s", len(events), call_id, exc.orig)
                except (DBAPIError, OSError):
                    # Connection trouble again: let the outer loop's retry handle this group.
                    await self._write_with_retry(events)
                    break

    async def _write_one_by_one(self, batch: list[CallEvent]) -> None:
        for event in batch:
            try:
                await self._write([event])
            except (DataError, IntegrityError) as exc:
                self.dropped += 1
                self.poisoned += 1
                log.error(
                    "dropping a %s event of %s the database refuses: %s",
                    event.kind,
                    event.call_id,
                    getattr(exc, "orig", exc),
                )
            except (DBAPIError, OSError):
                await self._write_with_retry([event])

    async def _write(self, batch: list[CallEvent]) -> None:
        rows: list[dict[str, Any]] = []
        next_seq: dict[uuid.UUID, int] = {}
        # The rows and their notification are one statement: it commits alone (a `max(seq)`
        # read first, for a call this writer does not know, locks nothing either way).
        async with autocommit(self._engine) as conn:
            for event in batch:
                key = uuid.UUID(event.call_id)
                if key not in next_seq:
                    if key in self._seq:
                        next_seq[key] = self._seq[key]
                    else:
                        last = await conn.scalar(
                            sa.select(sa.func.coalesce(sa.func.max(call_events.c.seq), 0)).where(
                                call_events.c.call_id == key
                            )
                        )
                        next_seq[key] = int(last or 0)
                next_seq[key] += 1
                rows.append(
                    {
                        "call_id": key,
                        "seq": next_seq[key],
                        "kind": str(event.kind),
                        "data": _jsonable(event.data),
                        "mono_ns": event.mono_ns,
                        "at": event.at,
                    }
                )
            if rows:
                # On the driver connection (tools.driver_sql): the batch every call's
                # events go through.
                await driver_sql.execute(conn, _INSERT_AND_NOTIFY, _insert_and_notify_params(rows))
        self._seq.update(next_seq)
        self.written += len(rows)
        for event in batch:
            if event.kind is CallEventKind.CALL_ENDED:
                # Later events (an SMS outcome) re-read max(seq); keeps memory bounded.
                self._seq.pop(uuid.UUID(event.call_id), None)


def _as_uuid(call_id: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(call_id)
    except ValueError:
        return None


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = _storable(json.loads(json.dumps(data, default=str)))
    return result


def _storable(value: Any) -> Any:
    """JSONB refuses NUL (\\u0000) and lone surrogates in strings. Event data quotes caller
    input (a malformed frame's excerpt), and one such string made every retry of the batch
    fail: the writer stalled for all calls and dropped the batch at shutdown."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_storable(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value
