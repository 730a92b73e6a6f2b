"""The utterance handle: when the agent may speak next, and the late results it must say.

Owns the queue of response requests waiting for a safe moment (no response active, the caller
not speaking, the server's VAD not about to answer), the late results waiting to be announced,
the response slot's bookkeeping of the server's `response.created` / `response.done` / a lost
create race, and the announcement tracker that follows each response carrying late results
until it is heard or not (telephony.announcements).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Sequence

from telephony.announcements import AnnouncementTracker
from telephony.bridge.model_link import ModelSession
from telephony.bridge.playout import Playout
from telephony.bridge.port import Port
from telephony.bridge.slot import CreateRequest, ResponseState
from telephony.bridge.turns import Turns
from telephony.call_events import CallEventKind
from telephony.caller_evidence import EvidenceLog
from telephony.tool_gateway import AnnouncementSink, AnnouncementStatus, LateResult

log = logging.getLogger(__name__)

RECHECK_S = 0.25  # how often queued response work looks for a safe moment
AUTO_RESPONSE_WAIT_S = 2.0  # after speech stopped, how long the server's own response may take
# GPT-Live: how many of the agent's utterances after a late result's note may pass without one
# that says it before it counts as not spoken (the model says a note when it sees fit).
LIVE_UTTERANCES_TO_SAY_IT = 3
# Words by which an utterance says an outcome, by the operation's status (GPT-Live has no
# response to follow: an utterance carries a result only if it says how it ended).
_SAID = {
    "committed": ("confirm", "booked", "went through", "gone through", "done", "complete",
                  "success", "succeed", "all set", "placed", "made"),
    "cancelled": ("cancel",),
}  # fmt: skip
_SAID_FAILED = ("could not", "couldn't", "can't", "cannot", "unable", "fail", "didn't",
                "did not", "not able", "wasn't", "was not", "sorry", "problem")  # fmt: skip


_NEGATIONS = frozenset({"not", "no", "never", "isn't", "isnt", "wasn't", "hasn't", "haven't",
                        "aren't", "won't", "yet"})  # fmt: skip
_WORD = re.compile(r"[a-z']+")


def says_outcome(text: str, result: LateResult) -> bool:
    """Whether an agent's utterance says how `result` ended: its reference, or words of its
    status not negated ("it isn't confirmed yet" does not say it was confirmed)."""
    said = text.lower().replace("\u2019", "'")
    reference = result.data.get("reference")
    if isinstance(reference, str) and reference and reference.lower() in said:
        return True
    status = str(result.data.get("status"))
    words = _SAID.get(status, _SAID_FAILED)
    for word in words:
        start = said.find(word)
        while start >= 0:
            before = _WORD.findall(said[:start])[-3:]
            after = _WORD.findall(said[start + len(word) :])[:2]
            if status not in _SAID or not (_NEGATIONS & {*before, *after}):
                return True
            start = said.find(word, start + 1)
    return False


class Utterances:
    """Response scheduling and late-result announcements for one call."""

    def __init__(
        self,
        port: Port,
        turns: Turns,
        playout: Playout,
        evidence: EvidenceLog,
        announcements: AnnouncementSink | None,
        max_queued: int,
    ) -> None:
        self._port = port
        self._turns = turns
        self._evidence = evidence
        self._max_queued = max_queued
        # The live model session; set by the bridge while it is live, else None.
        self.session: ModelSession | None = None
        self._creates: deque[CreateRequest] = deque()
        self._late: deque[LateResult] = deque()
        self._response_turn: dict[str, int] = {}
        self._recheck: asyncio.TimerHandle | None = None
        self._event_seq = 0
        # GPT-Live: late results whose note was appended (when), waiting for an utterance begun
        # after it that says them (with how many such utterances have passed without).
        self._live_waiting: dict[int, tuple[LateResult, float, int]] = {}
        # Follows each response that announces late results until it is heard or not.
        self.announcing = AnnouncementTracker(
            announcements,
            lambda kind, **data: port.emit(kind, **data),
            lambda: playout.leg.playback,
            playout.item_audio,
            playout.is_muted,
            port.call_id,
        )

    def turn_of(self, response_id: str) -> int:
        """The caller's turn a response answers (the current one if it is not known)."""
        return self._response_turn.get(response_id, self._turns.turn_id)

    def audio_changed(self, response_id: str | None) -> None:
        """What was heard of a response changed (None: of any)."""
        if response_id is None:
            self.announcing.check_all()
        else:
            self.announcing.check(response_id)

    # Requests.

    def queue(self, request: CreateRequest) -> None:
        self._creates.append(request)
        while len(self._creates) > self._max_queued:
            dropped = self._creates.popleft()
            log.info("call %s: response queue full, dropped %s", self._port.call_id, dropped.reason)

    async def deliver(self, result: LateResult) -> None:
        """Speak a late result at the next safe moment (said once if offered again)."""
        if result.delivery_id is not None and self._carries(result.delivery_id):
            return  # offered again while still on its way
        self._late.append(result)
        await self.drain()
        self._report_held()

    def _carries(self, delivery_id: str) -> bool:
        """Whether this delivery is already queued or being announced."""
        queued = [*self._late, *(r for c in self._creates for r in c.late)]
        session = self.session
        if session is not None and session.slot.requested is not None:
            queued.extend(session.slot.requested.late)
        return any(r.delivery_id == delivery_id for r in queued) or self.announcing.carries(
            delivery_id
        )

    def _report_held(self) -> None:
        """Late results still queued after a look for a safe moment are held (and why)."""
        if not self._late:
            return
        session = self.session
        if session is None:
            reason = "the Realtime session is not ready (connecting)"
        elif self._turns.caller_speaking:
            reason = "the caller is speaking"
        elif session.slot.state is not ResponseState.IDLE:
            reason = "a response is under way"
        else:
            reason = "the caller just stopped speaking; the model answers first"
        self.announcing.held(self._late, reason)

    # Scheduling.

    def _safe_moment(self, session: ModelSession) -> bool:
        if session.slot.state is not ResponseState.IDLE or self._turns.caller_speaking:
            return False
        stopped = self._turns.speech_stopped_at
        # The server's VAD answers a finished utterance itself; do not race it.
        return stopped is None or time.monotonic() - stopped > AUTO_RESPONSE_WAIT_S

    async def drain(self) -> None:
        """Send at most one response.create if it is safe now; otherwise look again later."""
        session = self.session
        if session is None or (not self._creates and not self._late):
            return
        if not self._safe_moment(session):
            self._schedule_recheck()
            return
        request: CreateRequest | None = None
        if self._late:
            results = list(self._late)
            self._late.clear()
            for result in results:
                await session.add_note(
                    "An update arrived for the caller. Tell them briefly, in your own "
                    f"words: {result.text}"
                )
            # An announcement that lost its create race rides along with the new ones.
            late = tuple(r for c in self._creates for r in c.late) + tuple(results)
            request = CreateRequest(
                "late_result", operation_ids=tuple(r.operation_id for r in late), late=late
            )
            self._creates.clear()  # one response carries the queued work too
        else:
            # One response sees every item added so far: coalesce what is still current.
            turn_id = self._turns.turn_id
            while self._creates:
                candidate = self._creates.popleft()
                if candidate.turn_id is None or candidate.turn_id == turn_id:
                    request = candidate
            if request is None:
                return
        await self._create(session, request)

    async def _create(self, session: ModelSession, request: CreateRequest) -> None:
        self._event_seq += 1
        event_id = f"bridge_rc_{self._event_seq}"
        slot = session.slot
        slot.move(ResponseState.REQUESTED)
        slot.requested = request
        slot.requested_event_id = event_id
        if not await session.create_response(event_id, request.instructions):
            slot.move(ResponseState.IDLE)
            slot.forget_request()
            if request.late:
                # The socket is going; the next session gets them (with fresh notes).
                self._late.extendleft(reversed(request.late))
        elif request.late and session.server_turns:
            # GPT-Live answers nothing to a create: the notes wait for an utterance saying them.
            noted_at = time.monotonic()
            for result in request.late:
                self._live_waiting[id(result)] = (result, noted_at, 0)

    async def _drain_then_report(self) -> None:
        await self.drain()
        self._report_held()

    def _schedule_recheck(self) -> None:
        if self._recheck is not None or self._port.ended():
            return

        def fire() -> None:
            self._recheck = None
            if not self._port.ended():
                self._port.spawn(self._drain_then_report(), "drain")

        self._recheck = asyncio.get_running_loop().call_later(RECHECK_S, fire)

    # The server's side of the slot.

    def response_created(self, session: ModelSession, response_id: str) -> None:
        slot = session.slot
        request = slot.requested
        slot.move(ResponseState.ACTIVE)
        slot.active_response_id = response_id
        slot.forget_request()
        self._turns.response_started()
        self._response_turn[response_id] = self._turns.turn_id
        self._evidence.response_created(response_id)
        self._port.emit(
            CallEventKind.RESPONSE_CREATED,
            response_id=response_id,
            turn_id=self._turns.turn_id,
            reason=request.reason if request else "server",
        )
        if request is not None:
            self._told_by(response_id, request.operation_ids, request.late)

    def _told_by(
        self, response_id: str, operation_ids: Sequence[str], late: tuple[LateResult, ...]
    ) -> None:
        """The one entry point, on either model, for "response `response_id` tells these
        operations' outcomes": on the timeline, and to the heard accounting of late results."""
        if operation_ids:
            self._port.emit(
                CallEventKind.RESULT_ANNOUNCED,
                response_id=response_id,
                operation_ids=list(operation_ids),
            )
        if late:
            self.announcing.spoken(response_id, late)

    def response_done(
        self, session: ModelSession, response_id: str | None, status: str | None
    ) -> None:
        slot = session.slot
        # A late or duplicate done of another response leaves the slot as it is.
        if slot.state is ResponseState.ACTIVE and slot.active_response_id in (None, response_id):
            slot.move(ResponseState.IDLE)
            slot.active_response_id = None
        self._port.emit(
            CallEventKind.RESPONSE_DONE,
            response_id=response_id,
            status=status,
            turn_id=self.turn_of(response_id or ""),
        )

    def announced_done(self, response_id: str, status: str | None, why: str | None) -> None:
        self.announcing.done(response_id, status, why)

    def live_utterance_ended(self, response_id: str, text: str, started_at: float) -> None:
        """GPT-Live: the agent's utterance `response_id`, begun at `started_at` (monotonic),
        ended saying `text`. The late results noted before it began that it says are announced
        by it (heard once its audio played out in full, cut if the caller cut it); one the model
        has not said after a few utterances is not spoken."""
        if not self._live_waiting:
            return
        said: list[LateResult] = []
        for key, (result, noted_at, passed) in list(self._live_waiting.items()):
            if started_at < noted_at:
                continue  # under way when the note went up: it cannot be saying it
            if says_outcome(text, result):
                said.append(result)
                del self._live_waiting[key]
            elif passed + 1 >= LIVE_UTTERANCES_TO_SAY_IT:
                del self._live_waiting[key]
                self.announcing.report(
                    result, AnnouncementStatus.NOT_SPOKEN, reason="the model did not say it"
                )
            else:
                self._live_waiting[key] = (result, noted_at, passed + 1)
        if said:
            self._told_by(response_id, [r.operation_id for r in said], tuple(said))
            self.announcing.done(response_id, "completed")

    def create_refused(self, session: ModelSession, event_id: str | None) -> None:
        """An error event: if it answers our response.create, that lost a race; retry later."""
        slot = session.slot
        if event_id is None or event_id != slot.requested_event_id:
            return
        if slot.requested is not None:
            self._creates.appendleft(slot.requested)
        slot.forget_request()
        if slot.state is ResponseState.REQUESTED:
            slot.move(ResponseState.IDLE)
        self._schedule_recheck()

    # Ends.

    def session_dropped(self, session: ModelSession | None) -> None:
        """The session dropped: results it was about to announce go to the next session
        (their notes were in the old conversation); what it was saying was not heard."""
        pending = [c for c in self._creates if c.late]
        if session is not None and session.slot.requested is not None:
            if session.slot.requested.late:
                pending.insert(0, session.slot.requested)
        for request in pending:
            if request in self._creates:
                self._creates.remove(request)
            self._late.extendleft(reversed(request.late))
        # GPT-Live notes the dropped session never said: noted again in the next one.
        self._late.extend(result for result, _, _ in self._live_waiting.values())
        self._live_waiting.clear()
        self.announcing.dropped()

    def close(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
        self.announcing.close()

    def settle(self, reason: str, session: ModelSession | None) -> None:
        """The call ended: every result not yet said is settled (the delivery step goes on)."""
        unspoken = list(self._late)
        self._late.clear()
        for request in self._creates:
            unspoken.extend(request.late)
        if session is not None and session.slot.requested is not None:
            unspoken.extend(session.slot.requested.late)
        unspoken.extend(result for result, _, _ in self._live_waiting.values())
        self._live_waiting.clear()
        self.announcing.settle(reason, unspoken)


__all__ = ["Utterances"]
