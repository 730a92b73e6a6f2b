"""The call-leg seam: what the bridge needs from a phone leg (Twilio stream, SIP/RTP)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from telephony.playback import PlaybackTracker

AudioFormat = Literal["audio/pcmu", "audio/pcma"]


@dataclass(frozen=True, slots=True)
class AudioIn:
    """Caller audio in the leg's codec (8 kHz G.711), one frame."""

    audio: bytes
    timestamp_ms: int


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

    def events(self) -> AsyncIterator[LegEvent]:
        """Caller events until the leg closes (ends with LegClosed)."""
        ...

    async def play(self, item_id: str, audio: bytes) -> None:
        """Queue agent audio of `item_id` for the caller; returns without waiting for playout."""
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
