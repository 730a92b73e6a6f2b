"""The live-call registry of this process: capacity, CallSid -> live bridge, ending calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from telephony.tool_gateway import LiveCall

log = logging.getLogger(__name__)


class CallPhase(StrEnum):
    """Where an attached call is, as the heartbeat must know it."""

    # Attached, its row not in_progress yet: a SIP call whose Realtime session is opening
    # (the 200 not out, or out and its row not yet written), an interconnect call being
    # accepted. Its row is `ringing` (or just became `in_progress`): that is not "ended".
    SETTING_UP = "setting_up"
    # Its row is in_progress and held by this process: any other status means it was ended.
    LIVE = "live"


@dataclass(slots=True)
class LiveCallEntry:
    """One call whose media stream runs in this process."""

    call_sid: str
    call_id: str
    live: LiveCall
    socket: Any = None  # the media socket as the leg sees it (app.legs.twilio.routes.FrameGuard)
    from_number: str | None = None  # the caller's number, as the call row has it
    # Who ended it first (status callback, stop frame, shutdown); later enders don't overwrite.
    end_reason: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Changed only through CallRegistry.went_live (set-up -> live, once).
    phase: CallPhase = CallPhase.SETTING_UP
    leg: str = ""  # how the call reached us (app.models.LegKind), for the live-calls gauge
    # The carrier brings the call back to another replica when this one lets it go (Twilio:
    # `<Connect action>`); a SIP dialog on our own user agent cannot move.
    movable: bool = False
    # Let go on purpose (the process is stopping): released for a resume, not ended.
    handed_over: bool = False
    # Being put through to a person (transfer_call): the carrier took the caller; the stream's
    # end releases the row to wait for the transfer's outcome, not ends it.
    transferring: Any = None
    # A warm transfer under way: the person is rung and briefed while the caller stays with
    # the agent (app.legs.twilio.warm.WarmTransfer).
    warm: Any = None
    # An outbound call: what acts on who answered it (app.legs.twilio.outbound.OutboundLine).
    outbound: Any = None
    # Its session is ending the row here (the caller hung up, say): a heartbeat that finds the
    # row ended meanwhile is not told of an end elsewhere.
    ending_here: bool = False


def _keeps_up() -> float | None:
    return None


class CallRegistry:
    """Counts live calls and calls answered whose stream has not started yet (reservations).

    A reservation expires (the stream never came), so a caller who hangs up during the TwiML
    exchange does not hold a slot forever. Once draining (the process is stopping), no call
    gets a slot; the live ones and those already answered go on.
    """

    def __init__(
        self,
        max_live_calls: int,
        reservation_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_live_calls = max_live_calls
        self._ttl_s = reservation_ttl_s
        self._clock = clock
        self._reserved: dict[str, float] = {}  # call_sid -> expiry
        self._live: dict[str, LiveCallEntry] = {}
        self.answered_total = 0
        self.rejected_busy_total = 0
        self.rejected_overloaded_total = 0
        self.rejected_draining_total = 0
        # How late the process's event loop runs (s) when it cannot keep up, else None
        # (serve wires its loop watch here); a new inbound call is then refused as busy.
        self.overloaded: Callable[[], float | None] = _keeps_up
        self.refusal = ""  # why try_reserve last said no: "draining", "capacity", "overloaded"
        self.draining = False
        self._drain_listeners: list[Callable[[], None]] = []

    def _purge(self) -> None:
        now = self._clock()
        for sid in [s for s, exp in self._reserved.items() if exp < now]:
            del self._reserved[sid]

    def load(self) -> int:
        """Live calls plus unexpired reservations."""
        self._purge()
        return len(self._live) + len(self._reserved)

    def on_drain(self, listener: Callable[[], None]) -> None:
        """Call `listener` once when draining starts (a leg that refuses calls before they
        reach the registry, such as SIP's health answer, must know too)."""
        if self.draining:
            listener()
        else:
            self._drain_listeners.append(listener)

    def stop_accepting(self) -> None:
        """Start draining: from now on every new call is refused."""
        if self.draining:
            return
        self.draining = True
        listeners, self._drain_listeners = self._drain_listeners, []
        for listener in listeners:
            listener()

    def try_reserve(self, call_sid: str, *, load_guard: bool = False) -> bool:
        """Hold a slot for `call_sid`; False at capacity or while draining, and with
        `load_guard` (a new inbound call) while the process is overloaded; `refusal` says
        which. A retried webhook keeps its slot."""
        self._purge()
        if call_sid in self._live:
            return True
        if call_sid in self._reserved:
            self._reserved[call_sid] = self._clock() + self._ttl_s
            return True
        if self.draining:
            self.rejected_draining_total += 1
            self.refusal = "draining"
            return False
        if self.load() >= self.max_live_calls:
            self.rejected_busy_total += 1
            self.refusal = "capacity"
            return False
        if load_guard and self.overloaded() is not None:
            self.rejected_overloaded_total += 1
            self.refusal = "overloaded"
            return False
        self._reserved[call_sid] = self._clock() + self._ttl_s
        self.answered_total += 1
        return True

    def release_reservation(self, call_sid: str) -> None:
        """The call ended (or was refused) before its stream started."""
        self._reserved.pop(call_sid, None)

    def attach(
        self,
        call_sid: str,
        call_id: str,
        live: LiveCall,
        from_number: str | None = None,
        *,
        leg: str = "",
    ) -> LiveCallEntry:
        """The stream of `call_sid` started: its reservation becomes a call in this process,
        in set-up until `went_live` (every leg attaches first, then moves its row to
        in_progress, then calls `went_live`)."""
        self._reserved.pop(call_sid, None)
        entry = LiveCallEntry(
            call_sid=call_sid, call_id=call_id, live=live, from_number=from_number, leg=leg
        )
        self._live[call_sid] = entry
        return entry

    def went_live(self, entry: LiveCallEntry) -> None:
        """The call's row is in_progress, held here: from now on any other status of the
        row means the call was ended elsewhere. Legal once, from set-up."""
        if entry.phase is not CallPhase.SETTING_UP:
            raise ValueError(f"call {entry.call_id} is {entry.phase}, not setting up")
        entry.phase = CallPhase.LIVE

    def detach(self, entry: LiveCallEntry) -> None:
        """The call is over in this process."""
        if self._live.get(entry.call_sid) is entry:
            del self._live[entry.call_sid]
        # What acts on the live call (who answered an outbound one, a warm transfer) holds
        # its session, which holds this entry: a reference cycle once the call is over here.
        entry.outbound = None
        entry.warm = None
        entry.done.set()

    def get(self, call_sid: str) -> LiveCallEntry | None:
        return self._live.get(call_sid)

    def live_call_ids(self) -> list[str]:
        """`calls.id` of every call live in this process."""
        return [e.call_id for e in self._live.values() if e.end_reason is None]

    def live_by_call_id(self, call_id: str) -> LiveCall | None:
        """The live call whose `calls.id` is `call_id`, if it runs in this process."""
        entry = self.entry_by_call_id(call_id)
        return entry.live if entry is not None else None

    def entry_by_call_id(self, call_id: str) -> LiveCallEntry | None:
        """The entry of the live call whose `calls.id` is `call_id`, if it runs here."""
        for entry in self._live.values():
            if entry.call_id == call_id and entry.end_reason is None:
                return entry
        return None

    def live_entries(self) -> list[LiveCallEntry]:
        """Every call whose stream runs in this process and is not ending."""
        return [e for e in self._live.values() if e.end_reason is None]

    def live_count(self) -> int:
        return len(self._live)

    def live_by_leg(self) -> dict[str, int]:
        """Calls whose stream runs here, by leg."""
        counts: dict[str, int] = {}
        for entry in self._live.values():
            counts[entry.leg or "unknown"] = counts.get(entry.leg or "unknown", 0) + 1
        return counts

    async def end(self, call_sid: str, reason: str) -> LiveCallEntry | None:
        """End the live call of `call_sid` (if it runs here); returns its entry."""
        self._reserved.pop(call_sid, None)
        entry = self._live.get(call_sid)
        if entry is None:
            return None
        if entry.end_reason is None:
            entry.end_reason = reason
        await entry.live.end(reason)
        return entry

    async def hand_over(self, call_sid: str, reason: str) -> LiveCallEntry | None:
        """Let the live call of `call_sid` go for its carrier to bring back to another
        replica (its leg releases the row instead of ending it); a call that cannot move is
        ended. Returns its entry."""
        entry = self._live.get(call_sid)
        if entry is None or not entry.movable:
            return await self.end(call_sid, reason)
        if entry.end_reason is None:
            entry.end_reason = reason
            entry.handed_over = True
        await entry.live.end(reason)
        return entry

    async def end_all(self, reason: str, wait_s: float, *, hand_over: bool = False) -> None:
        """End every live call (with `hand_over`, hand the movable ones over instead) and
        wait (bounded) until their handlers have finished."""
        entries = list(self._live.values())
        stop = self.hand_over if hand_over else self.end

        async def one(entry: LiveCallEntry) -> None:
            try:
                await stop(entry.call_sid, reason)
            except Exception:
                log.exception("ending call %s failed", entry.call_id)

        # At once, not one after another: each waits for its bridge to close.
        await asyncio.gather(*(one(entry) for entry in entries))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                for entry in entries:
                    await entry.done.wait()
