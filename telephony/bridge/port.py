"""The port a part of the bridge gets from its owner: what it may ask of the call.

Every part (model link, audio path, playout, utterances, tool dispatch) is handed one `Port`
instead of a reference to the `Bridge`: it can record a call event (`emit`), start a task the
bridge owns and cancels at the end (`spawn`), end the call (`finish`), and ask whether the call
is over (`ended`). Nothing else of the bridge is reachable from a part.

The port is the parts' one way back to the bridge, and so the one place where they and the
bridge make a reference cycle: `cut` takes the bridge out of it once the call has ended, so the
ended call is freed by reference counting, not left for a full collection (which stops every
live call on the process while it walks them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from telephony.call_events import CallEventKind


class Emit(Protocol):
    """Record one call event of this call."""

    def __call__(self, kind: CallEventKind, /, **data: Any) -> None: ...


class Spawn(Protocol):
    """Start a task owned by the bridge (a tool task gets a grace period at the end)."""

    def __call__(
        self, coro: Coroutine[Any, Any, None], name: str, *, tool: bool = False
    ) -> asyncio.Task[None]: ...


@dataclass(slots=True)
class Port:
    """What each part of the bridge may do to the call as a whole."""

    call_id: str  # our row id, for log lines
    emit: Emit
    spawn: Spawn
    finish: Callable[[str], None]  # end the call with this reason (idempotent)
    ended: Callable[[], bool]  # whether the call is over (finish was called)

    def cut(self, emit: Emit) -> None:
        """The call has ended and its bridge is closed: from now on events go to `emit` (one
        that does not hold the bridge), a task spawned is the caller's own, `finish` does
        nothing and `ended` is True."""
        self.emit = emit
        self.spawn = _spawn_unowned
        self.finish = _finished
        self.ended = _ended


def _spawn_unowned(
    coro: Coroutine[Any, Any, None], name: str, *, tool: bool = False
) -> asyncio.Task[None]:
    return asyncio.create_task(coro, name=name)


def _finished(reason: str) -> None:
    return None


def _ended() -> bool:
    return True
