"""GPT-Live server events, each to the part of the bridge that owns it (the Live counterpart
of `Bridge._on_event`, which stays the Realtime one).

Turns are the server's, so the bridge observes them instead of driving them:

- The caller's turn begins with its first `session.input_transcript.delta` and ends when the
  model answers (its transcript, a delegation). If our leg is still playing agent audio when the
  caller begins, the model has stopped talking over them (full duplex): the leg's playback is
  cleared at once (Twilio `clear`, SIP flush) and the agent's utterance is cut at what the
  caller heard, by the same local playout as on Realtime (no truncate: the model decides).
- The agent's utterances are named by the session (`LiveSession.item_id`) and closed at each
  turn boundary, or once all their audio played and no more came for `QUIET_S`, when their
  transcript goes to playout, which records what was heard.
- A late result goes up as a note (`session.commentary.append`); GPT-Live says it when it sees
  fit, so the result counts as announced by the first utterance that says how it ended, and as
  heard once that utterance played out in full (cut if the caller cut it; not spoken if the
  model never says it).
- A delegated function call (`response.event` carrying a completed `function_call` item) goes
  to the tool dispatch, so it meets the same engine as a Realtime call: policy, confirmation,
  ledger, idempotency. Its output comes back through `LiveSession`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from telephony.bridge.live_link import LiveSession
from telephony.bridge.playout import Playout
from telephony.bridge.port import Port
from telephony.bridge.tool_dispatch import ToolDispatch
from telephony.bridge.turns import Turns
from telephony.bridge.utterance import Utterances
from telephony.call_events import CallEventKind
from telephony.caller_evidence import EvidenceLog
from telephony.redaction import mask_spoken_pins

log = logging.getLogger(__name__)

FATAL_ERROR_CODES = frozenset({"session_expired", "session_closed"})
# The GPT-Live server events `LiveEvents.on_event` acts on (its `case`s, which
# tests/test_realtime_read.py checks against this).
LIVE_EVENTS_HANDLED = frozenset(
    {
        "session.input_transcript.delta",
        "session.output_transcript.delta",
        "session.delegation.created",
        "response.event",
        "session.commentary.appended",
        "session.closed",
        "error",
    }
)
# Live marks no end of an utterance: one whose audio all played and none came for this long is
# over (so what it said counts as heard now, not at the caller's next words).
QUIET_S = 0.8
WATCH_S = 0.2


class LiveEvents:
    """Applies GPT-Live server events to the bridge's parts."""

    def __init__(
        self,
        port: Port,
        turns: Turns,
        playout: Playout,
        tools: ToolDispatch,
        history: deque[str],
        evidence: EvidenceLog,
        utterances: Utterances,
    ) -> None:
        self._port = port
        self._utterances = utterances
        self._evidence = evidence
        self._turns = turns
        self._playout = playout
        self._tools = tools
        self._history = history
        self._session: LiveSession | None = None
        self._agent_text = ""  # the transcript of the agent's current utterance
        self._agent_began = 0.0  # when it began (monotonic: its first words)
        self._watching: str | None = None  # the utterance the quiet watch follows
        self._caller_item: str | None = None  # the caller's turn in progress
        self._caller_text = ""
        self._caller_turns = 0
        self._responses: dict[str, str] = {}  # delegation id -> its Responses response id

    async def on_event(self, session: Any, event: Any) -> str | None:
        """Apply one server event; returns a reason when the session must be given up."""
        assert isinstance(session, LiveSession)
        self._session = session
        match event.type:
            case "session.input_transcript.delta":
                await self._caller_said(session, event.delta)
            case "session.output_transcript.delta":
                self._caller_turn_ended()
                # The utterance began now (its first words): a readback asked for before
                # this is what it says, as a Realtime response created after the ask.
                self._evidence.response_created(session.response_id)
                if not self._agent_text:
                    self._agent_began = time.monotonic()
                self._agent_text += event.delta
                self._watch_quiet(session)
            case "session.delegation.created":
                self._caller_turn_ended()
                self._utterance_ended(session)
                delegation = event.delegation
                response_id = delegation.response_id or f"{session.session_id}/{delegation.id}"
                self._responses[delegation.id] = response_id
                if delegation.target == "client" and session.backend is not None:
                    session.backend.delegated(
                        session, delegation.id, response_id, self._tools.function_call
                    )
            case "response.event":
                self._backend_event(session, event.delegation_id, event.event)
            case "session.commentary.appended":
                self._utterance_ended(session)
            case "session.closed":
                return f"session closed: {event.reason}"
            case "error":
                error = event.error
                self._port.emit(
                    CallEventKind.REALTIME_ERROR,
                    code=error.code,
                    type=error.type,
                    message=error.message[:200],
                    event_id=error.client_event_id,
                )
                if error.code in FATAL_ERROR_CODES:
                    return f"fatal error: {error.code}"
        return None

    def flush(self) -> None:
        """The call is ending: the agent's last utterance goes to playout with its text."""
        if self._session is not None:
            self._utterance_ended(self._session)

    # The caller.

    async def _caller_said(self, session: LiveSession, delta: str) -> None:
        if self._caller_item is None:
            received_at = time.perf_counter()
            self._caller_turns += 1
            self._caller_item = f"{session.session_id}/in{self._caller_turns}"
            self._utterance_ended(session)
            self._turns.speech_started(self._caller_item)
            # Still playing to the caller: the model stopped talking over them; so do we.
            await self._playout.speech_started(session, received_at)
            self._port.emit(CallEventKind.SPEECH_STARTED, turn_id=self._turns.turn_id)
        self._caller_text += delta

    def _caller_turn_ended(self) -> None:
        item_id = self._caller_item
        if item_id is None:
            return
        self._caller_item = None
        text, self._caller_text = self._caller_text, ""
        self._turns.speech_stopped()
        self._port.emit(CallEventKind.SPEECH_STOPPED, turn_id=self._turns.turn_id)
        self._turns.caller_heard(item_id)
        said = mask_spoken_pins(text)
        self._port.emit(
            CallEventKind.CALLER_TRANSCRIPT,
            item_id=item_id,
            text=said,
            turn_id=self._turns.turn_id,
        )
        self._history.append(f"Caller: {said}")
        # The model answers the turn itself: no response of ours is due.
        self._turns.response_started()

    # The agent.

    def _utterance_ended(self, session: LiveSession) -> None:
        """Close the agent's current utterance (if it had audio) and name the next one."""
        if session.item_id not in self._playout.items:
            return  # no audio yet: its text belongs to the audio still to come
        text, self._agent_text = self._agent_text, ""
        self._playout.transcript(session.item_id, text)
        # The late results it says are announced by it (heard as far as it was heard).
        self._utterances.live_utterance_ended(session.response_id, text, self._agent_began)
        session.next_utterance()

    def _watch_quiet(self, session: LiveSession) -> None:
        """Close the current utterance once it went quiet (see QUIET_S)."""
        if self._watching == session.item_id or self._port.ended():
            return
        self._watching = session.item_id
        self._port.spawn(self._until_quiet(session, session.item_id), "live-utterance-quiet")

    async def _until_quiet(self, session: LiveSession, item_id: str) -> None:
        quiet_since: float | None = None
        received = -1.0
        try:
            while session.item_id == item_id and not self._port.ended():
                await asyncio.sleep(WATCH_S)
                item = self._playout.items.get(item_id)
                now_received = item.received_ms if item is not None else 0.0
                if item is None or self._playout.item_playing(item_id) or now_received != received:
                    received, quiet_since = now_received, None
                    continue
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= QUIET_S and session.item_id == item_id:
                    self._utterance_ended(session)
                    return
        finally:
            if self._watching == item_id:
                self._watching = None

    # The backend: delegated function calls.

    def _backend_event(
        self, session: LiveSession, delegation_id: str | None, event: dict[str, object]
    ) -> None:
        if event.get("type") != "response.output_item.done":
            return
        item = event.get("item")
        if not isinstance(item, dict) or item.get("type") != "function_call":
            return
        response_id = self._responses.get(delegation_id or "", f"delegation:{delegation_id}")
        self._tools.function_call(
            session,
            str(item.get("call_id") or "") or None,
            str(item.get("name") or ""),
            str(item.get("arguments") or "{}"),
            str(item.get("id") or ""),
            str(item.get("status") or ""),
            response_id,
        )


__all__ = ["LiveEvents"]
