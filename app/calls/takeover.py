"""A call whose stream was lost moves to another stream: released, claimed, taken over.

The row stays `in_progress` throughout (the call is up at the carrier); what moves is who holds
it. Each step is one conditional update, so a call never has two holders and a resume token is
good once, across processes:

1. `release`: the holder lost the stream without the carrier's `stop` and lets it go (its
   process lives on). A holder killed outright releases nothing: its lock says it is gone
   (app/calls/holders.py).
2. `claim`: the `<Connect action>` webhook, having seen the holder gone, records the nonce of
   the one resume token it answers with.
3. `take_over`: the new stream presents that token; the row becomes this process's and the
   nonce is spent (a replayed token finds none).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.store import CallRow, CallStatus, calls

_LIVE = CallStatus.IN_PROGRESS.value


async def _move(engine: AsyncEngine, call_id: str, where: list[Any], **values: Any) -> Any:
    """One conditional update of an in-progress call's holding (never its status); the
    updated row's mapping, or None when the conditions no longer held."""
    async with engine.begin() as conn:
        result = await conn.execute(
            sa.update(calls)
            .where(calls.c.id == uuid.UUID(call_id), calls.c.status == _LIVE, *where)
            .values(**values)
            .returning(*calls.c)
        )
        return result.mappings().first()


async def release(engine: AsyncEngine, call_id: str, holder: str, hold_for_s: float = 0.0) -> bool:
    """Let the call go for a resume (held by `holder`, in progress); False if it was not.
    The heartbeat is stamped now (`hold_for_s` ahead: a transfer that rings for a while): the
    sweep and the delivery path leave the row alone for `CALL_DEAD_AFTER_S` after it, and the
    resume window (shorter) is the action webhook's to keep."""
    now = datetime.now(UTC)
    where = [calls.c.holder == holder, calls.c.released_at.is_(None)]
    beat = now + timedelta(seconds=hold_for_s)
    return await _move(engine, call_id, where, released_at=now, heartbeat_at=beat) is not None


async def claim(engine: AsyncEngine, call_id: str, *, holder: str | None, nonce: str) -> bool:
    """Record the resume token's nonce while the row is still in progress and held by the
    same (gone) `holder`; False if anything moved meanwhile."""
    holder_is = calls.c.holder.is_(None) if holder is None else calls.c.holder == holder
    return await _move(engine, call_id, [holder_is], resume_nonce=nonce) is not None


async def take_over(
    engine: AsyncEngine, call_id: str, *, nonce: str, holder: str, stream_sid: str
) -> CallRow | None:
    """The call becomes `holder`'s, its nonce spent; None unless `nonce` was the claimed one."""
    row = await _move(
        engine,
        call_id,
        [calls.c.resume_nonce == nonce],
        holder=holder,
        stream_sid=stream_sid,
        heartbeat_at=datetime.now(UTC),
        released_at=None,
        resume_nonce=None,
    )
    return CallRow.from_mapping(row) if row is not None else None
