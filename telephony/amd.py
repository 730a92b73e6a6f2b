"""Answering-machine detection for our own outbound SIP calls, from the callee's first audio.

Twilio answers `AnsweredBy` for its calls; on our SIP leg nobody does, so the callee's audio
is judged here, the way a person picking up differs from a recorded greeting (the rules of
Asterisk's `AMD()` application, which carriers have tuned against real lines for years):

- a person says a short "Hello?" and waits: speech, then `after_greeting_silence_ms` of
  silence, within `greeting_ms` of speech and at most `max_words` words: `human`;
- a greeting speaks on: more than `greeting_ms` of it or more than `max_words` words:
  `machine_start`; then the message's end is awaited as Twilio's `DetectMessageEnd` does: the
  beep once it stops (`machine_end_beep`), or `end_silence_ms` of silence after the greeting
  (`machine_end_silence`), or `max_message_ms` since the answer (`machine_end_other`);
- a steady tone before any speech (a fax's CNG at 1100 Hz or its answer tone at 2100 Hz): `fax`;
- nothing said for `initial_silence_ms`, or no decision within `total_analysis_ms`: `unknown`
  (the caller of this module treats it like a machine: only what a voicemail may hear).

The values are Twilio's `AnsweredBy` names, so one `OutboundLine` acts on either leg.

Speech is a frame whose RMS reaches `silence_rms` (16-bit linear). A tone is a frame whose crest
factor (peak / RMS) is that of a sine (1.41; speech is above 2), with a zero-crossing count
steady from frame to frame; its frequency is read from those crossings. All of it is C (audioop
on the decoded frame): a few microseconds per 20 ms frame.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

if sys.version_info >= (3, 13):  # pragma: no cover - the PyPI port of the removed module
    import audioop
else:  # pragma: no cover
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop

HUMAN = "human"
MACHINE_START = "machine_start"
MACHINE_END_BEEP = "machine_end_beep"
MACHINE_END_SILENCE = "machine_end_silence"
MACHINE_END_OTHER = "machine_end_other"
FAX = "fax"
UNKNOWN = "unknown"

# A sine's peak is 1.414 times its RMS (through G.711 too); speech's is above 2.
TONE_CREST_MAX = 1.75
# Zero crossings of consecutive tone frames, per 20 ms, differ by at most this.
TONE_CROSSINGS_STEADY = 3
TONE_HZ = (350.0, 2600.0)  # beeps; below or above it is not one
FAX_HZ = ((1050.0, 1150.0), (2050.0, 2150.0))  # CNG, CED
MIN_TONE_MS = 80
MAX_BEEP_MS = 2000  # a tone this long is taken as the beep without waiting for its end


@dataclass(frozen=True)
class AmdSettings:
    """The detector's thresholds (Asterisk's defaults, Twilio's end-of-message wait)."""

    initial_silence_ms: int = 2500
    greeting_ms: int = 1500
    after_greeting_silence_ms: int = 800
    total_analysis_ms: int = 5000
    min_word_ms: int = 100
    between_words_silence_ms: int = 50
    max_words: int = 3
    end_silence_ms: int = 1500
    max_message_ms: int = 30000
    silence_rms: int = 400


@dataclass(frozen=True)
class Verdict:
    answered_by: str  # one of the names above
    at_ms: int  # into the callee's audio
    reason: str  # in words, for the timeline


class MachineDetector:
    """Fed the callee's audio frames (16-bit linear, 8 kHz) in order; `feed` returns a Verdict
    once for who answered (`human`, `machine_start`, `fax`, `unknown`) and, after
    `machine_start`, once more for the end of the message (`machine_end_*`). `elapsed` lets a
    silent line (no packets at all) reach its verdict by the clock."""

    def __init__(self, settings: AmdSettings | None = None) -> None:
        self.settings = settings or AmdSettings()
        self.at_ms = 0
        self.first: Verdict | None = None
        self.end: Verdict | None = None
        self._heard_voice = False
        self._voiced_ms = 0  # the current voiced run
        self._silent_ms = 0  # the current silent run
        self._in_word = False
        self.words = 0
        self._greeting_ms = 0  # voiced, in all
        self._tone_ms = 0
        self._tone_crossings: int | None = None
        self._tone_hz = 0.0

    @property
    def done(self) -> bool:
        return self.end is not None or (
            self.first is not None and self.first.answered_by != MACHINE_START
        )

    def feed(self, pcm: bytes) -> Verdict | None:
        """One frame of the callee's audio; a Verdict when this frame decided something."""
        if self.done or len(pcm) < 4:
            return None
        frame_ms = max(1, len(pcm) // 16)
        self.at_ms += frame_ms
        rms = audioop.rms(pcm, 2)
        voiced = rms >= self.settings.silence_rms
        tone_hz = self._tone(pcm, rms, frame_ms) if voiced else None
        if tone_hz is not None:
            self._tone_ms += frame_ms
            self._tone_hz = tone_hz
        else:
            verdict = self._tone_ended()
            if verdict is not None:
                return verdict
        if self.first is None:
            return self._first(voiced, tone_hz is not None, frame_ms)
        return self._message_end(voiced, frame_ms)

    def elapsed(self, ms: int) -> Verdict | None:
        """`ms` of wall-clock time with no audio at all: counted as silence."""
        verdict = None
        while ms > 0 and verdict is None and not self.done:
            step = min(ms, 20)
            ms -= step
            verdict = self.feed(b"\x00\x00" * (8 * step))
        return verdict

    # ---- who answered --------------------------------------------------------------------

    def _first(self, voiced: bool, tonal: bool, frame_ms: int) -> Verdict | None:
        s = self.settings
        if tonal:
            # Neither speech nor silence: a fax's tone, or a beep whose end decides.
            if self._tone_ms >= MIN_TONE_MS and not self._heard_voice and _is_fax(self._tone_hz):
                return self._decide(FAX, f"a fax tone at {self._tone_hz:.0f} Hz")
        elif voiced:
            self._voiced_ms += frame_ms
            self._greeting_ms += frame_ms
            self._silent_ms = 0
            self._heard_voice = True
            if not self._in_word and self._voiced_ms >= s.min_word_ms:
                self._in_word = True
                self.words += 1
                if self.words > s.max_words:
                    return self._decide(MACHINE_START, f"{self.words} words of greeting")
        else:
            self._silent_ms += frame_ms
            if self._silent_ms >= s.between_words_silence_ms:
                self._in_word = False
                self._voiced_ms = 0
            if not self._heard_voice and self._silent_ms >= s.initial_silence_ms:
                return self._decide(UNKNOWN, f"nothing said for {self._silent_ms} ms")
            if self._heard_voice and self._silent_ms >= s.after_greeting_silence_ms:
                return self._decide(HUMAN, f"{self.words} word(s), then silence")
        if self._greeting_ms > s.greeting_ms:
            return self._decide(MACHINE_START, f"a greeting longer than {s.greeting_ms} ms")
        if self.at_ms >= s.total_analysis_ms:
            return self._decide(UNKNOWN, f"no decision within {s.total_analysis_ms} ms")
        return None

    # ---- the end of a machine's greeting ----------------------------------------------------

    def _message_end(self, voiced: bool, frame_ms: int) -> Verdict | None:
        s = self.settings
        if self._tone_ms >= MAX_BEEP_MS:
            return self._end(MACHINE_END_BEEP, f"a tone at {self._tone_hz:.0f} Hz")
        if voiced:
            self._silent_ms = 0
        else:
            self._silent_ms += frame_ms
            if self._silent_ms >= s.end_silence_ms:
                return self._end(MACHINE_END_SILENCE, f"{self._silent_ms} ms of silence")
        if self.at_ms >= s.max_message_ms:
            return self._end(MACHINE_END_OTHER, f"no end heard within {s.max_message_ms} ms")
        return None

    def _tone_ended(self) -> Verdict | None:
        """A tone that just stopped: the beep, if it was one after a greeting."""
        tone_ms, self._tone_ms, self._tone_crossings = self._tone_ms, 0, None
        if tone_ms < MIN_TONE_MS:
            return None
        if self.first is not None and self.first.answered_by == MACHINE_START:
            return self._end(MACHINE_END_BEEP, f"a {tone_ms} ms tone at {self._tone_hz:.0f} Hz")
        if self.first is None and self._heard_voice:
            # A short greeting and its beep before the greeting rule fired.
            self.first = Verdict(MACHINE_START, self.at_ms, "a beep after a greeting")
            return self._end(MACHINE_END_BEEP, f"a {tone_ms} ms tone at {self._tone_hz:.0f} Hz")
        return None

    def _tone(self, pcm: bytes, rms: int, frame_ms: int) -> float | None:
        """The frame's frequency if it is part of a steady tone, else None."""
        if audioop.max(pcm, 2) > TONE_CREST_MAX * rms:
            self._tone_crossings = None
            return None
        crossings = audioop.cross(pcm, 2)
        hz = crossings * 1000.0 / (2 * frame_ms)
        previous, self._tone_crossings = self._tone_crossings, crossings
        per_20 = 20.0 / frame_ms
        if not TONE_HZ[0] <= hz <= TONE_HZ[1]:
            return None
        if previous is not None and abs(previous - crossings) * per_20 > TONE_CROSSINGS_STEADY:
            return None
        return hz

    def _decide(self, answered_by: str, reason: str) -> Verdict:
        self.first = Verdict(answered_by, self.at_ms, reason)
        self._silent_ms = 0 if answered_by == MACHINE_START else self._silent_ms
        return self.first

    def _end(self, answered_by: str, reason: str) -> Verdict:
        self.end = Verdict(answered_by, self.at_ms, reason)
        return self.end


def _is_fax(hz: float) -> bool:
    return any(low <= hz <= high for low, high in FAX_HZ)


# Packets this late are not jitter: the line sends nothing (a phone that mutes, a gateway that
# suppresses silence), and the time without them counts as silence.
GAP_S = 1.0


class LineListener:
    """Runs a MachineDetector on a live line: `hear` is called with each decoded frame of the
    callee's audio (from a socket callback), `verdict()` waits for who answered (a machine's
    verdict only once its message ended). A line that sends no packets is judged by the
    clock: once none came for GAP_S, the time since the last one counts as silence (packets
    that are merely late, jitter or a busy loop, are judged as they come, in order)."""

    def __init__(
        self,
        settings: AmdSettings | None = None,
        *,
        tick_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        message_end: bool = True,
    ) -> None:
        # message_end: a machine's verdict once its greeting ended (to leave a message after
        # it); False: as soon as it is known to be a machine (nothing will be said to it).
        self._message_end = message_end
        self.detector = MachineDetector(settings)
        self.verdicts: list[Verdict] = []
        self._tick_s = tick_s
        self._clock = clock
        self._last_heard = clock()  # the answer, then each packet
        self._gap_fed_ms = 0  # silence counted for the current gap
        self._decided: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()

    def hear(self, pcm: bytes) -> None:
        self._last_heard = self._clock()
        self._gap_fed_ms = 0
        if not self._decided.done():
            self._take(self.detector.feed(pcm))

    async def verdict(self) -> Verdict:
        while not self._decided.done():
            try:
                return await asyncio.wait_for(asyncio.shield(self._decided), self._tick_s)
            except TimeoutError:
                gap_ms = int((self._clock() - self._last_heard) * 1000)
                if gap_ms >= GAP_S * 1000 and gap_ms > self._gap_fed_ms:
                    self._take(self.detector.elapsed(gap_ms - self._gap_fed_ms))
                    self._gap_fed_ms = gap_ms
        return self._decided.result()

    def _take(self, verdict: Verdict | None) -> None:
        if verdict is None:
            return
        self.verdicts.append(verdict)
        final = verdict.answered_by != MACHINE_START or not self._message_end
        if final and not self._decided.done():
            self._decided.set_result(verdict)
