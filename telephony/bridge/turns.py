"""The caller's turns: which turn the call is in, and whether the caller is speaking.

A turn begins when the server's VAD hears speech start (or commits input that began without
it); the turn id survives reconnects and ties a function call, its answer and its response to
what the caller asked. What a barge-in does to the agent's audio is the playout's business
(telephony.bridge.playout); this only tracks the caller.
"""

from __future__ import annotations

import time

from telephony.caller_evidence import EvidenceLog


class Turns:
    """Turn tracking for one call (survives reconnects)."""

    __slots__ = ("_evidence", "_turn_item_id", "caller_speaking", "speech_stopped_at", "turn_id")

    def __init__(self, evidence: EvidenceLog) -> None:
        self._evidence = evidence
        self.turn_id = 0
        self._turn_item_id: str | None = None
        self.caller_speaking = False
        self.speech_stopped_at: float | None = None  # awaiting the server's own response

    def speech_started(self, item_id: str) -> None:
        self.caller_speaking = True
        self.speech_stopped_at = None
        self._evidence.speech_started(item_id)
        self.turn_id += 1
        self._turn_item_id = item_id

    def speech_stopped(self) -> None:
        self.caller_speaking = False
        self.speech_stopped_at = time.monotonic()

    def committed(self, item_id: str) -> None:
        self._evidence.speech_heard(item_id)
        if item_id != self._turn_item_id:
            # A turn that began without speech_started (e.g. a manual commit).
            self.turn_id += 1
            self._turn_item_id = item_id

    def caller_heard(self, item_id: str) -> None:
        """The server transcribed the caller's input item: they said something."""
        self._evidence.speech_heard(item_id)

    def response_started(self) -> None:
        """A response began: the server's own answer to the last utterance is no longer due."""
        self.speech_stopped_at = None

    def session_dropped(self) -> None:
        """The model connection dropped: its VAD's view of the caller is gone with it."""
        self.caller_speaking = False
        self.speech_stopped_at = None
