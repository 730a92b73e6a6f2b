"""Call recording: both sides of a call, tapped at the call-leg seam, as one stereo WAV.

`RecordingLeg` wraps any `CallLeg` (the Twilio leg today, a SIP leg tomorrow) between the leg
and the bridge, so neither knows about recording:
- caller audio is recorded as it arrives (each `AudioIn` the bridge reads);
- agent audio is recorded as it is handed to the leg to play (`play`), and a `clear` (barge-in)
  cuts whatever of it had not been played yet: the recording holds what the caller heard.

Per frame the tap only appends a tuple to a list (the audio is not copied or decoded). The
tracks are laid out on one clock and encoded (`CallRecorder.render`, pure and CPU-bound, run
in a thread) when the call ends: caller on the left channel, agent on the right, 16-bit PCM at
8 kHz, which every browser plays and seeks.

Caller frames are placed by the stream's own timestamps (Twilio's `timestamp`, ms since the
stream started; the SIP leg's from RTP), anchored at the first frame's arrival; agent audio
plays from when it was handed over or when the audio before it ends, whichever is later (Twilio
plays a stream's media back to back in real time), up to the moment of a clear.

A timestamp is the peer's word, so it only places a frame near its arrival: one further than
`MAX_SKEW_MS` from it (a jump, a regression, a new stream, a hostile peer) re-anchors the
stream there, and the recording never holds more samples than the call lasted on our own clock
(plus `END_MARGIN_MS`). The tracks are laid out window by window (`WINDOW_SAMPLES`), so no
buffer of the render is larger than a window besides the recording itself.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from telephony.audio import Codec, decode, pcm16_to_wav, silence_byte
from telephony.legs.leg import AudioFormat, AudioIn, CallLeg, LegClosed, LegEvent
from telephony.playback import PlaybackTracker

RATE = 8000
SAMPLES_PER_MS = RATE // 1000
CONTENT_TYPE = "audio/wav"
# A frame's stream time may be this far from its arrival (jitter, a burst after a stall).
MAX_SKEW_MS = 2000
# The recording may run this far past the last moment of the call the recorder saw.
END_MARGIN_MS = 1000
# Twilio's `timestamp` is any integer string; beyond float precision it places nothing.
MAX_STAMP_MS = 1 << 53
WINDOW_SAMPLES = 30 * RATE  # laid out and decoded 30 s at a time


@dataclass(frozen=True, slots=True)
class Recording:
    """A rendered recording."""

    wav: bytes
    duration_ms: int
    started_at: datetime
    truncated: bool
    sample_rate: int = RATE
    channels: int = 2


class CallRecorder:
    """Collects one call's audio as it passes, cheaply; renders it once the call is over."""

    def __init__(
        self,
        audio_format: AudioFormat,
        *,
        max_ms: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.audio_format = audio_format
        self._clock = clock
        self.started = clock()
        self.started_at = datetime.now(UTC)
        self._max_s = max_ms / 1000.0
        # (arrival s, stream timestamp ms or None, payload bytes or base64 text)
        self._caller: list[tuple[float, int | None, bytes | str]] = []
        # (at s, audio bytes); empty audio marks a clear
        self._agent: list[tuple[float, bytes | str]] = []
        self.truncated = False
        self.largest_window_bytes = 0  # the largest buffer a render laid out (tests, memory)
        self.ended: float | None = None

    def caller_audio(self, payload: bytes | str, timestamp_ms: int | None) -> None:
        """One caller frame, as received (G.711 bytes, or the stream's base64 text)."""
        now = self._clock()
        if now - self.started <= self._max_s:
            self._caller.append((now, timestamp_ms, payload))
        else:
            self.truncated = True

    def agent_audio(self, audio: bytes | str) -> None:
        """Agent audio handed to the leg to play (G.711 bytes, or the delta's base64 text)."""
        now = self._clock()
        if audio:
            if now - self.started <= self._max_s:
                self._agent.append((now, audio))
            else:
                self.truncated = True

    def cleared(self) -> None:
        """The leg dropped all agent audio not yet played (barge-in)."""
        self._agent.append((self._clock(), b""))

    @property
    def frames(self) -> int:
        return len(self._caller) + len(self._agent)

    # Rendering: pure, CPU-bound, run in a thread. The tracks are laid out and interleaved in
    # G.711 (one byte a sample: plain copies) and decoded once, in C, so rendering a long call
    # holds the GIL for little time while other calls' audio runs on the event loop.

    def _g711(self, payload: bytes | str) -> bytes:
        if isinstance(payload, str):
            try:
                return base64.b64decode(payload)
            except (binascii.Error, ValueError):
                return b""
        return payload

    def _caller_track(self) -> list[tuple[int, bytes]]:
        """(start sample, G.711 bytes) of every caller frame."""
        placed: list[tuple[int, bytes]] = []
        anchor: tuple[float, int] | None = None  # (arrival ms, stream timestamp ms)
        cursor = 0
        for arrival, stamp, payload in self._caller:
            data = self._g711(payload)
            arrival_ms = (arrival - self.started) * 1000.0
            if stamp is not None and 0 <= stamp < MAX_STAMP_MS:
                if anchor is None or abs(anchor[0] + (stamp - anchor[1]) - arrival_ms) > (
                    MAX_SKEW_MS
                ):
                    anchor = (arrival_ms, stamp)  # the first frame, or a discontinuity
                at_ms = anchor[0] + (stamp - anchor[1])
            else:
                at_ms = max(arrival_ms, cursor / SAMPLES_PER_MS)
            start = max(0, round(at_ms * SAMPLES_PER_MS))
            placed.append((start, data))
            cursor = start + len(data)
        return placed

    def _agent_track(self) -> list[tuple[int, bytes]]:
        """(start sample, G.711 bytes) of agent audio as played, cut at each clear."""
        placed: list[tuple[int, bytes]] = []
        cursor = 0  # where the audio queued so far ends, in samples
        for at, payload in self._agent:
            now = max(0, round((at - self.started) * RATE))
            data = self._g711(payload)
            if not data:  # a clear: nothing after `now` was ever heard
                placed = [
                    (start, chunk if start + len(chunk) <= now else chunk[: now - start])
                    for start, chunk in placed
                    if start < now
                ]
                cursor = min(cursor, now)
                continue
            start = max(cursor, now)
            placed.append((start, data))
            cursor = start + len(data)
        return placed

    def stop(self) -> None:
        """The call is over (its leg closed): the recording ends here, whatever comes after."""
        if self.ended is None:
            self.ended = self._clock()

    def limit_samples(self) -> int:
        """The most samples the recording may hold: the call's length on our clock."""
        end = self.ended if self.ended is not None else self._clock()
        lasted = min(end - self.started, self._max_s)
        return max(0, round((lasted * 1000 + END_MARGIN_MS) * SAMPLES_PER_MS))

    def render(self) -> Recording:
        """The stereo WAV: caller left, agent right, on the recorder's clock."""
        caller = self._caller_track()
        agent = self._agent_track()
        samples = max([s + len(d) for s, d in caller] + [s + len(d) for s, d in agent] + [0])
        samples = min(samples, self.limit_samples())
        codec: Codec = "pcma" if self.audio_format == "audio/pcma" else "pcmu"
        silence = silence_byte(codec)
        caller_bins, agent_bins = _bins(caller, samples), _bins(agent, samples)
        pcm: list[bytes] = []
        for index, first in enumerate(range(0, samples, WINDOW_SAMPLES)):
            size = min(WINDOW_SAMPLES, samples - first)
            stereo = bytearray(2 * size)
            stereo[0::2] = _lay(caller_bins.get(index, ()), first, size, silence)
            stereo[1::2] = _lay(agent_bins.get(index, ()), first, size, silence)
            # G.711 decodes sample by sample, so the interleaved bytes decode to stereo PCM.
            pcm.append(decode(bytes(stereo), codec))
            self.largest_window_bytes = max(self.largest_window_bytes, len(stereo))
        return Recording(
            wav=pcm16_to_wav(b"".join(pcm), RATE, channels=2),
            duration_ms=samples // SAMPLES_PER_MS,
            started_at=self.started_at,
            truncated=self.truncated,
        )


def _bins(pieces: list[tuple[int, bytes]], samples: int) -> dict[int, list[tuple[int, bytes]]]:
    """The pieces that fall in each window (a piece across a boundary in both); none past the
    end."""
    bins: dict[int, list[tuple[int, bytes]]] = {}
    for start, data in pieces:
        end = min(samples, start + len(data))
        if start >= end:
            continue
        for index in range(start // WINDOW_SAMPLES, (end - 1) // WINDOW_SAMPLES + 1):
            bins.setdefault(index, []).append((start, data))
    return bins


def _lay(pieces: Iterable[tuple[int, bytes]], first: int, size: int, silence: int) -> bytes:
    """One window of a track: samples [first, first + size)."""
    track = bytearray([silence]) * size
    for start, data in pieces:
        lo, hi = max(start, first), min(start + len(data), first + size)
        if lo < hi:
            track[lo - first : hi - first] = data[lo - start : hi - start]
    return bytes(track)


class RecordingLeg:
    """A `CallLeg` that records what passes through it (see the module docstring)."""

    def __init__(self, inner: CallLeg, recorder: CallRecorder) -> None:
        self.inner = inner
        self.recorder = recorder
        self.audio_format: AudioFormat = inner.audio_format
        self.playback: PlaybackTracker = inner.playback
        # The synchronous lanes (TwilioLeg's): the leg calls the recorder itself on them (its
        # taps), so a frame costs no layer here; play() is then recorded by the same tap.
        self.set_audio_lane: Callable[[Callable[[str, int], bool] | None], None] | None = None
        self.play_nowait: Callable[[str, str, int], None] | None = None
        self._tapped = False
        set_taps = getattr(inner, "set_taps", None)
        if (
            callable(set_taps)
            and callable(getattr(inner, "set_audio_lane", None))
            and callable(getattr(inner, "play_nowait", None))
        ):
            set_taps(audio=recorder.caller_audio, play=recorder.agent_audio)
            self._tapped = True
            self.set_audio_lane = inner.set_audio_lane  # type: ignore[attr-defined]
            self.play_nowait = inner.play_nowait  # type: ignore[attr-defined]
        # What the leg measured of its media (the SIP leg's RTP reception), passed through.
        self.media_report: Callable[[], dict[str, float | int]] | None = getattr(
            inner, "media_report", None
        )
        # Digits to the far side (the leg's own way: RFC 4733 or tones), passed through; tones
        # the Twilio leg plays go through its play tap, so the recording has them.
        self.send_digits: Callable[[str], Awaitable[str]] | None = getattr(
            inner, "send_digits", None
        )

    async def events(self) -> AsyncIterator[LegEvent]:
        record = self.recorder.caller_audio
        async for event in self.inner.events():
            if type(event) is AudioIn:
                record(event.payload, event.timestamp_ms)  # decoded at the end, off the loop
            elif type(event) is LegClosed:
                self.recorder.stop()
            yield event

    async def play(self, item_id: str, payload: str) -> None:
        if not self._tapped:
            self.recorder.agent_audio(payload)
        await self.inner.play(item_id, payload)

    async def clear(self) -> None:
        self.recorder.cleared()
        await self.inner.clear()

    async def close(self, reason: str) -> None:
        self.recorder.stop()
        await self.inner.close(reason)

    def __getattr__(self, name: str) -> Any:
        # Anything else a leg offers (its stream sid, counters) reads through.
        return getattr(self.inner, name)
