"""The call-leg seam: what the bridge needs from a phone leg (Twilio stream, SIP/RTP).

Audio crosses this seam as base64 text in both directions, because that is what the Realtime
API carries (`input_audio_buffer.append.audio`, `response.output_audio.delta.delta`): a leg
whose wire is base64 too (Twilio Media Streams) passes it through without decoding or
re-encoding, and a leg whose wire is bytes (RTP) converts exactly once each way, which it would
have to do anyway. Payloads are canonical base64 of G.711 in the leg's `audio_format`.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, cast

from telephony.playback import PlaybackTracker

AudioFormat = Literal["audio/pcmu", "audio/pcma"]


@dataclass(slots=True)  # not frozen: one per 20 ms frame, and a frozen one costs 3x to build
class AudioIn:
    """Caller audio in the leg's codec (8 kHz G.711), one frame, as base64 text.

    The bridge splices `payload` into the append frame as is, so it must be canonical base64
    (its alphabet needs no JSON escaping): a Twilio payload that decoded cleanly, or what
    `AudioIn.of_bytes` makes from an RTP payload.
    """

    payload: str
    timestamp_ms: int

    @classmethod
    def of_bytes(cls, audio: bytes, timestamp_ms: int) -> AudioIn:
        """A frame from raw G.711 bytes (an RTP payload): encoded once, here."""
        return cls(base64.b64encode(audio).decode("ascii"), timestamp_ms)

    @property
    def audio(self) -> bytes:
        """The G.711 bytes (decoded on each access: not for the hot path)."""
        return base64.b64decode(self.payload)


@dataclass(frozen=True, slots=True)
class DtmfIn:
    """A keypad digit from the caller."""

    digit: str


@dataclass(frozen=True, slots=True)
class LegClosed:
    """The leg ended (stop frame, BYE, dead socket)."""

    reason: str


LegEvent = AudioIn | DtmfIn | LegClosed


class CallLeg(Protocol):
    """A phone leg. The bridge reads caller events and writes agent audio through it."""

    audio_format: AudioFormat
    playback: PlaybackTracker

    def events(self) -> AsyncGenerator[LegEvent, None]:
        """Caller events until the leg closes (ends with LegClosed)."""
        ...

    async def play(self, item_id: str, payload: str) -> None:
        """Queue agent audio of `item_id` for the caller; returns without waiting for playout.

        `payload` is canonical base64 of G.711 in `audio_format`, as the Realtime API sends
        it: Twilio forwards it untouched when it fits one outbound chunk; an RTP leg decodes
        it once (`base64.b64decode`) into its playout queue. `telephony.audio.base64_size`
        gives its length in bytes without decoding.
        """
        ...

    async def clear(self) -> None:
        """Stop all agent audio at once (Twilio `clear`, RTP queue flush).

        Drops audio queued locally, then calls `playback.cleared()`, so that afterwards
        `playback.heard_ms(item)` is what the caller heard (the bridge truncates at it) and
        confirmations of the dropped audio no longer count.
        """
        ...

    async def close(self, reason: str) -> None:
        """Hang up / close the leg; idempotent."""
        ...


# The audio lane: (base64 payload, timestamp ms) -> taken.
AudioLane = Callable[[str, int], bool]


class LaneLeg(Protocol):
    """A leg that also works the synchronous lanes (the Twilio and SIP legs): caller audio
    offered to the bridge in its socket's callback, agent audio queued from the model
    socket's callback, and observers (a recorder) called in the same step, with no layer
    and no task per frame. `events()` and `play()` still carry whatever a lane does not."""

    def set_audio_lane(self, lane: AudioLane | None) -> None:
        """Offer caller audio to `lane(payload, timestamp_ms)` as it arrives; where it returns
        False (it cannot take the frame now) the frame comes from `events()` as usual, and
        later frames queue behind it, in order."""
        ...

    def set_taps(
        self,
        audio: Callable[[str, int], object] | None = None,
        play: Callable[[str], object] | None = None,
    ) -> None:
        """Observers called in the same step: `audio(payload, timestamp_ms)` for each caller
        frame the audio lane took, `play(payload)` for each piece of agent audio handed to
        `play` or `play_nowait`."""
        ...

    def play_nowait(self, item_id: str, payload: str, size: int = -1) -> None:
        """`play`, from synchronous code; `size`, when known, is the bytes `payload` encodes
        (`telephony.audio.base64_size`)."""
        ...


LANE_METHODS = ("set_audio_lane", "set_taps", "play_nowait")


def lanes_of(leg: object) -> LaneLeg | None:
    """`leg` as a `LaneLeg` if it has all three lane methods, else None (the bridge then uses
    `events()` and `play()` alone)."""
    if all(callable(getattr(leg, name, None)) for name in LANE_METHODS):
        return cast(LaneLeg, leg)
    return None
