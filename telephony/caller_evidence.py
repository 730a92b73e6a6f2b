"""The caller's evidence for a confirmation: was the readback heard, and did the caller answer?

The bridge notes what it observes (an operation waiting for a yes, responses created, the
caller's speech and keypad) and, when the tool layer asks, judges one operation's readback
against it: the latest agent item that began after the model was told to read back, and before
the caller's latest answer, must have been heard to its end (playback position, not audio sent,
not cut by a barge-in) and must have ended before that answer began.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from telephony.tool_gateway import ConfirmationEvidence

# One 20 ms frame: the playout position is confirmed per chunk, the item's length per byte.
READBACK_TOLERANCE_MS = 20
MAX_ANSWERS = 64  # caller utterances and digits kept per call (older ones cannot matter)
MAX_RESPONSES = 512


@dataclass(frozen=True, slots=True)
class SpokenItem:
    """One agent item as the caller heard it."""

    item_id: str
    response_id: str
    started_at: float | None  # clock() when the caller began hearing it (None: never)
    ended_at: float | None  # clock() when it was heard to its end (None: not, or not yet)
    heard_ms: int
    audio_ms: int


@dataclass(slots=True)
class _Answer:
    at: float  # clock() when the caller's speech began (or the key was pressed)
    item_id: str | None = None  # the caller's input item
    digit: str | None = None
    heard: bool = False  # the utterance was committed or transcribed (not only begun)


class EvidenceLog:
    """What one call observed that a caller's yes can rest on."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._asked: dict[str, float] = {}  # operation_id -> readback asked for at
        self._responses: dict[str, float] = {}  # response_id -> created at
        self._answers: deque[_Answer] = deque(maxlen=MAX_ANSWERS)

    def readback_asked(self, operation_id: str) -> None:
        """The model was told to read `operation_id` back: what it says next is the readback."""
        self._asked.setdefault(operation_id, self._clock())

    def response_created(self, response_id: str) -> None:
        self._responses.setdefault(response_id, self._clock())
        while len(self._responses) > MAX_RESPONSES:
            self._responses.pop(next(iter(self._responses)))

    def speech_started(self, item_id: str | None) -> None:
        """The caller began speaking (the server's VAD); `item_id` is the input item to be."""
        self._answers.append(_Answer(self._clock(), item_id=item_id or None))

    def speech_heard(self, item_id: str) -> None:
        """The caller's input item was committed or transcribed: a whole utterance."""
        for answer in reversed(self._answers):
            if answer.item_id == item_id:
                answer.heard = True
                return

    def digit(self, digit: str) -> None:
        """A keypad digit that is not part of a PIN."""
        self._answers.append(_Answer(self._clock(), digit=digit, heard=True))

    def judge(self, operation_id: str, spoken: Iterable[SpokenItem]) -> ConfirmationEvidence:
        """Whether the caller's own answer to `operation_id`'s readback was observed."""
        asked = self._asked.get(operation_id)
        if asked is None:
            return ConfirmationEvidence(False, "the caller was never read this request back")
        answer = self._answers[-1] if self._answers else None
        if answer is None or answer.at <= asked:
            return ConfirmationEvidence(False, "the caller has not answered the readback yet")
        if not answer.heard:
            # Their latest words are not in yet (a "no, wait" may be on its way).
            return ConfirmationEvidence(False, "the caller is still speaking")
        candidates = [
            s
            for s in spoken
            if s.started_at is not None
            and s.started_at < answer.at
            and self._responses.get(s.response_id, float("-inf")) >= asked
        ]
        if not candidates:
            return ConfirmationEvidence(
                False,
                "the caller spoke before hearing the readback",
                caller_item_id=answer.item_id,
                digit=answer.digit,
            )
        readback = max(candidates, key=lambda s: s.started_at or 0.0)
        found = ConfirmationEvidence(
            False,
            "",
            readback_item_id=readback.item_id,
            readback_heard_ms=readback.heard_ms,
            readback_audio_ms=readback.audio_ms,
            caller_item_id=answer.item_id,
            digit=answer.digit,
        )
        if readback.ended_at is None:
            return replace(found, counts=False, reason="the readback was not heard to its end")
        if readback.ended_at > answer.at:
            return replace(found, counts=False, reason="the caller spoke before the readback ended")
        how = "pressed a key" if answer.digit is not None else "spoke"
        return replace(
            found,
            counts=True,
            reason=f"the readback was heard in full and the caller {how} after it",
        )
