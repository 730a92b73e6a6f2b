"""Call liveness: every in-progress call row is held by a live process, or it is ended.

The process running a call's media stream writes itself into the row (`holder`) when the
stream starts and heartbeats its live calls every few seconds (`CallHeartbeat`); a call
attached but still in set-up (its row `ringing`, see `CallPhase`) is heartbeated too, and
moves to live through `CallSession.go_live` (app.legs.session), the one step every leg
uses. Any process then finds the calls whose holder stopped (no heartbeat for `dead_after_s`, by
default 30 s: the process died, or the call's media went quiet long enough that its holder
let it go) and ends them, with the reason on the call's timeline, handing their pending
outcomes to out-of-call delivery. Rows whose stream was rejected or never came are ended
the same way once their stream token can no longer be used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.calls.registry import CallPhase, CallRegistry
from app.calls.store import CallStatus, EndSource, call_ended_data, call_events, calls, sources_of
from telephony.call_events import CallEventKind
from tools import deliveries
from tools.outage import DATABASE

log = logging.getLogger(__name__)

ACTOR = EndSource.LIVENESS.value


@dataclass(frozen=True, slots=True)
class EndedCall:
    """A call row ended by the liveness sweep."""

    call_id: str
    call_sid: str
    status: CallStatus
    reason: str


async def append_call_event(
    conn: AsyncConnection, call_id: uuid.UUID, kind: CallEventKind, data: dict[str, Any]
) -> None:
    """Write one call event from a process that is not the call's writer (its holder is
    gone), numbered after the last one, in this transaction."""
    await conn.execute(
        sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtextextended(f"events:{call_id}", 0)))
    )
    last = await conn.scalar(
        sa.select(sa.func.coalesce(sa.func.max(call_events.c.seq), 0)).where(
            call_events.c.call_id == call_id
        )
    )
    await conn.execute(
        call_events.insert().values(
            call_id=call_id,
            seq=int(last or 0) + 1,
            kind=str(kind),
            data=json.loads(json.dumps(data, default=str)),
            mono_ns=time.monotonic_ns(),
            at=datetime.now(UTC),
        )
    )


async def end_row(
    conn: AsyncConnection,
    call_id: str,
    target: CallStatus,
    reason: str,
    *,
    expect: CallStatus | None = None,
    source: str = ACTOR,
) -> EndedCall | None:
    """End a call row (conditionally), put the end on its timeline and re-drive its
    pending deliveries, all in this transaction. None when it was not in `expect` (or no
    longer endable)."""
    froms = [expect.value] if expect is not None else sources_of(target)
    row = (
        await conn.execute(
            sa.update(calls)
            .where(calls.c.id == uuid.UUID(call_id), calls.c.status.in_(froms))
            .values(status=target.value, end_reason=reason[:128], ended_at=datetime.now(UTC))
            .returning(calls.c.id, calls.c.call_sid)
        )
    ).first()
    if row is None:
        return None
    await append_call_event(conn, row.id, CallEventKind.CALL_ENDED, call_ended_data(reason, source))
    await deliveries.redrive_for_call(conn, call_id, actor=source, reason=reason)
    return EndedCall(call_id, row.call_sid, target, reason)


async def end_dead_calls(
    engine: AsyncEngine, *, dead_after_s: float, now: datetime | None = None, limit: int = 100
) -> list[EndedCall]:
    """End in-progress calls whose holder stopped heartbeating for `dead_after_s`."""
    now = now or datetime.now(UTC)
    cutoff = now - timedelta(seconds=dead_after_s)
    ended: list[EndedCall] = []
    async with engine.begin() as conn:
        rows = await conn.execute(
            sa.select(calls.c.id, calls.c.holder, calls.c.heartbeat_at)
            .where(
                calls.c.status == CallStatus.IN_PROGRESS.value,
                sa.func.coalesce(calls.c.heartbeat_at, calls.c.answered_at, calls.c.created_at)
                < cutoff,
            )
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        for call_id, holder, _beat in rows.all():
            reason = dead_reason(holder, dead_after_s)
            done = await end_row(
                conn, str(call_id), CallStatus.COMPLETED, reason, expect=CallStatus.IN_PROGRESS
            )
            if done is not None:
                ended.append(done)
    for call in ended:
        log.warning("call %s ended: %s", call.call_id, call.reason)
    return ended


def dead_reason(holder: str | None, dead_after_s: float) -> str:
    who = f" ({holder})" if holder else ""
    return f"its process stopped{who}: no heartbeat for {dead_after_s:g} s"[:128]


async def end_unstreamed_calls(
    engine: AsyncEngine,
    *,
    stream_wait_s: float,
    now: datetime | None = None,
    limit: int = 100,
    outbound_wait_s: float = 0.0,
) -> list[EndedCall]:
    """End `ringing` rows whose stream never came or was rejected, once their stream token
    has expired (no stream can start any more). An outbound call's row is written before it
    is placed and rings for a while: it gets `outbound_wait_s` more."""
    now = now or datetime.now(UTC)
    cutoff = now - timedelta(seconds=stream_wait_s)
    outbound_cutoff = cutoff - timedelta(seconds=outbound_wait_s)
    ended: list[EndedCall] = []
    async with engine.begin() as conn:
        rows = await conn.execute(
            sa.select(calls.c.id)
            .where(
                calls.c.status == CallStatus.RINGING.value,
                calls.c.created_at < cutoff,
                sa.or_(calls.c.direction != "outbound", calls.c.created_at < outbound_cutoff),
                # A row a live process heartbeats in set-up is that process's to end.
                sa.or_(calls.c.heartbeat_at.is_(None), calls.c.heartbeat_at < cutoff),
            )
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        for (call_id,) in rows.all():
            rejected = await conn.scalar(
                sa.select(sa.func.count())
                .select_from(call_events)
                .where(
                    call_events.c.call_id == call_id,
                    call_events.c.kind == CallEventKind.CALL_REJECTED.value,
                )
            )
            if rejected:
                status, reason = CallStatus.REJECTED, "its media stream was rejected"
            else:
                status, reason = CallStatus.FAILED, "its media stream never came"
            done = await end_row(conn, str(call_id), status, reason, expect=CallStatus.RINGING)
            if done is not None:
                ended.append(done)
    return ended


# What a call's row may be in, by its phase here, for the call still to be going.
_KEPT_IN = {
    CallPhase.SETTING_UP: [CallStatus.RINGING.value, CallStatus.IN_PROGRESS.value],
    CallPhase.LIVE: [CallStatus.IN_PROGRESS.value],
}


class CallHeartbeat:
    """Heartbeats this process's live calls; ends the ones whose row was ended elsewhere."""

    def __init__(
        self, engine: AsyncEngine, registry: CallRegistry, *, holder: str, interval_s: float
    ) -> None:
        self._engine = engine
        self._registry = registry
        self.holder = holder
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.beats = 0

    def start(self) -> None:
        if self._task is None:
            self._stop.clear()
            self._task = asyncio.create_task(self._run(), name="call-heartbeat")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def beat_once(self) -> list[str]:
        """One heartbeat; returns the CallSids ended here because their row had ended."""
        live = self._registry.live_entries()
        if not live:
            return []
        by_id = {e.call_id: e for e in live}
        # A call in set-up keeps a `ringing` row (its leg moves it to in_progress once the
        # call is answered); only a row that is neither for it was ended elsewhere. The
        # phase is read before the update: a call going live meanwhile has an in_progress
        # row, which both conditions keep.
        kept = sa.or_(
            *(
                sa.and_(
                    calls.c.id.in_([uuid.UUID(e.call_id) for e in live if e.phase is phase]),
                    calls.c.status.in_(statuses),
                )
                for phase, statuses in _KEPT_IN.items()
            )
        )
        async with self._engine.begin() as conn:
            rows = await conn.execute(
                sa.update(calls)
                .where(kept)
                .values(heartbeat_at=sa.func.now(), holder=self.holder)
                .returning(calls.c.id)
            )
            alive = {str(r.id) for r in rows}
        self.beats += 1
        # (A call ending here meanwhile, its row ended before the update ran, is not gone.)
        gone = [
            e for i, e in by_id.items() if i not in alive and not e.ending_here and not e.end_reason
        ]
        for entry in gone:
            # Declared dead while this process was stalled (or ended by staff): stop here too.
            log.warning("call %s was ended elsewhere; ending it here", entry.call_id)
            await self._registry.end(entry.call_sid, "the call was ended by another process")
        return [e.call_sid for e in gone]

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.beat_once()
            except Exception as exc:
                if not DATABASE.failed("call heartbeat", exc):
                    log.exception("call heartbeat failed; trying again next interval")
            else:
                DATABASE.ok()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._stop.wait()
