"""Heard, not sent: following a late result from its response to the caller's ear.

The bridge hands every response that carries late results to an `AnnouncementTracker`. The
tracker reports each result to the call's `AnnouncementSink` (and as a call event):
`held` while no safe moment comes, `spoken` when its response is created, then exactly one
of `heard` (every item of the response was played out in full, as confirmed by the leg:
Twilio mark echoes, RTP sent), `cut` (a barge-in cut it, the response did not complete, or
playout was never confirmed) or `not_spoken` (no audio at all, or the call ended first).

A response the model's turn detection cancelled because the caller began to speak is cut even
when none of its audio had come yet: the caller's words stopped it, as a barge-in does, and
the delivery counts it as a cut either way (its report and the call event say the same).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from telephony.call_events import CallEventKind
from telephony.playback import PlaybackTracker
from telephony.tool_gateway import (
    AnnouncementReport,
    AnnouncementSink,
    AnnouncementStatus,
    LateResult,
)

log = logging.getLogger(__name__)

MAX_CHECKS = 20  # looks at a finished response's playout before it counts as unconfirmed
# `status_details.reason` of a response the server cancelled because the caller spoke.
TURN_DETECTED = "turn_detected"


@dataclass(frozen=True, slots=True)
class ItemAudio:
    """One assistant item of a response, as far as its audio went."""

    item_id: str
    received_ms: float  # audio received from the model
    cut_at_ms: int | None  # heard ms when a barge-in cut it


@dataclass(slots=True)
class _Announcement:
    results: tuple[LateResult, ...]
    done: bool = False
    status: str | None = None
    why: str | None = None  # status_details.reason of a response that did not complete
    checks: int = 0
    timer: asyncio.TimerHandle | None = None


_KINDS = {
    AnnouncementStatus.HELD: CallEventKind.RESULT_HELD,
    AnnouncementStatus.HEARD: CallEventKind.RESULT_HEARD,
    AnnouncementStatus.CUT: CallEventKind.RESULT_CUT,
    AnnouncementStatus.NOT_SPOKEN: CallEventKind.RESULT_NOT_SPOKEN,
}


class AnnouncementTracker:
    """The announcements of one call, from response.created to heard or not."""

    def __init__(
        self,
        sink: AnnouncementSink | None,
        emit: Callable[..., None],
        playback: Callable[[], PlaybackTracker],
        items_of: Callable[[str], list[ItemAudio]],
        muted: Callable[[str], bool],
        call_id: str = "",
    ) -> None:
        self._sink = sink
        self._emit = emit
        self._playback = playback
        self._items_of = items_of
        self._muted = muted
        self._call_id = call_id
        self._open: dict[str, _Announcement] = {}  # response id -> what it carries
        self._held: set[int] = set()

    def report(
        self,
        result: LateResult,
        status: AnnouncementStatus,
        *,
        response_id: str | None = None,
        heard_ms: int = 0,
        audio_ms: int = 0,
        reason: str = "",
        item_ids: tuple[str, ...] = (),
    ) -> None:
        kind = _KINDS.get(status)
        if kind is not None:  # `spoken` is on the timeline as result_announced
            self._emit(
                kind,
                operation_id=result.operation_id,
                delivery_id=result.delivery_id,
                response_id=response_id,
                heard_ms=heard_ms,
                audio_ms=audio_ms,
                reason=reason,
            )
        if self._sink is None:
            return
        try:
            self._sink.report(
                AnnouncementReport(
                    operation_id=result.operation_id,
                    delivery_id=result.delivery_id,
                    status=status,
                    response_id=response_id,
                    heard_ms=heard_ms,
                    audio_ms=audio_ms,
                    reason=reason,
                    item_ids=item_ids,
                )
            )
        except Exception:
            log.exception("call %s: announcement report failed", self._call_id)

    def held(self, results: Iterable[LateResult], reason: str) -> None:
        """Results still waiting for a safe moment (each reported once)."""
        for result in results:
            if id(result) not in self._held:
                self._held.add(id(result))
                self.report(result, AnnouncementStatus.HELD, reason=reason)

    def spoken(self, response_id: str, results: tuple[LateResult, ...]) -> None:
        """A response carrying `results` was created."""
        self._open[response_id] = _Announcement(results)
        for result in results:
            self.report(result, AnnouncementStatus.SPOKEN, response_id=response_id)

    def done(self, response_id: str, status: str | None, why: str | None = None) -> None:
        """The response ended (response.done) with `status` (and its `status_details`
        reason `why`, when it did not complete)."""
        ann = self._open.get(response_id)
        if ann is not None:
            ann.done = True
            ann.status = status
            ann.why = why
            self.check(response_id)

    def check_all(self) -> None:
        """Look at every open announcement again (after a barge-in cut audio)."""
        for response_id in list(self._open):
            self.check(response_id)

    def _audio(self, response_id: str) -> tuple[list[ItemAudio], int, int, bool]:
        playback = self._playback()
        items = self._items_of(response_id)
        audio_ms = int(sum(i.received_ms for i in items))
        heard_ms = int(
            sum(
                i.cut_at_ms if i.cut_at_ms is not None else playback.confirmed_ms(i.item_id)
                for i in items
            )
        )
        cut = any(i.cut_at_ms is not None and i.cut_at_ms + 1 < i.received_ms for i in items)
        return items, audio_ms, heard_ms, cut

    def check(self, response_id: str) -> None:
        """Heard only when every item played out in full; cut as soon as any was cut;
        otherwise look again once the remaining audio should have played."""
        ann = self._open.get(response_id)
        if ann is None:
            return
        if ann.timer is not None:
            ann.timer.cancel()
            ann.timer = None
        items, audio_ms, heard_ms, cut = self._audio(response_id)
        if cut or self._muted(response_id):
            self._resolve(response_id, AnnouncementStatus.CUT, heard_ms, audio_ms, "barge-in")
            return
        if not ann.done:
            return
        if not items:
            if ann.status == "cancelled" and ann.why == TURN_DETECTED:
                # The caller began to speak before its first audio (no barge-in muted it:
                # nothing was playing) and the model stopped it: cut at 0 ms, not unspoken.
                self._resolve(response_id, AnnouncementStatus.CUT, 0, 0, "barge-in")
                return
            self._resolve(
                response_id, AnnouncementStatus.NOT_SPOKEN, 0, 0, f"response {ann.status}"
            )
            return
        if ann.status != "completed":
            self._resolve(
                response_id, AnnouncementStatus.CUT, heard_ms, audio_ms, f"response {ann.status}"
            )
            return
        playback = self._playback()
        remaining = max(i.received_ms - playback.confirmed_ms(i.item_id) for i in items)
        if remaining <= 1:
            self._resolve(response_id, AnnouncementStatus.HEARD, heard_ms, audio_ms, "played")
            return
        ann.checks += 1
        if ann.checks > MAX_CHECKS:
            self._resolve(
                response_id, AnnouncementStatus.CUT, heard_ms, audio_ms, "playout not confirmed"
            )
            return
        ann.timer = asyncio.get_running_loop().call_later(
            remaining / 1000 + 0.05, self.check, response_id
        )

    def _resolve(
        self,
        response_id: str,
        status: AnnouncementStatus,
        heard_ms: int,
        audio_ms: int,
        reason: str,
    ) -> None:
        ann = self._open.pop(response_id)
        if ann.timer is not None:
            ann.timer.cancel()
        item_ids = tuple(i.item_id for i in self._items_of(response_id))
        for result in ann.results:
            self.report(
                result,
                status,
                response_id=response_id,
                heard_ms=heard_ms,
                audio_ms=audio_ms,
                reason=reason,
                item_ids=item_ids,
            )

    def dropped(self) -> None:
        """The Realtime session dropped: an announcement that had not completed was not
        heard in full; a completed one may still play out (the leg keeps its audio)."""
        for response_id in list(self._open):
            ann = self._open[response_id]
            if ann.done and ann.status == "completed":
                self.check(response_id)
                continue
            items, audio_ms, heard_ms, _ = self._audio(response_id)
            status = AnnouncementStatus.CUT if items else AnnouncementStatus.NOT_SPOKEN
            self._resolve(response_id, status, heard_ms, audio_ms, "the Realtime session dropped")

    def settle(self, reason: str, unspoken: Iterable[LateResult]) -> None:
        """The call is over: nothing more will play. Settle every open announcement, and
        report the results that never made it into a response."""
        playback = self._playback()
        for response_id in list(self._open):
            ann = self._open[response_id]
            items, audio_ms, heard_ms, cut = self._audio(response_id)
            played = bool(items) and all(
                playback.confirmed_ms(i.item_id) + 1 >= i.received_ms for i in items
            )
            if ann.done and ann.status == "completed" and played and not cut:
                self._resolve(response_id, AnnouncementStatus.HEARD, heard_ms, audio_ms, "played")
            elif items:
                self._resolve(response_id, AnnouncementStatus.CUT, heard_ms, audio_ms, reason)
            else:
                self._resolve(response_id, AnnouncementStatus.NOT_SPOKEN, 0, 0, reason)
        for result in unspoken:
            self.report(result, AnnouncementStatus.NOT_SPOKEN, reason=reason)

    def close(self) -> None:
        for ann in self._open.values():
            if ann.timer is not None:
                ann.timer.cancel()

    def carries(self, delivery_id: str) -> bool:
        """Whether an open announcement carries this delivery."""
        return any(r.delivery_id == delivery_id for a in self._open.values() for r in a.results)

    def open_count(self) -> int:
        return len(self._open)

    def describe(self) -> dict[str, Any]:
        return {rid: [r.operation_id for r in a.results] for rid, a in self._open.items()}
