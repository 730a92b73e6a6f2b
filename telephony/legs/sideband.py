"""The leg of a call whose audio OpenAI carries itself (its SIP interconnect).

No audio crosses this leg: OpenAI answers the SIP side and plays the model's speech to the
caller; we hold a sideband WebSocket for control only. What the caller heard therefore comes
from the server's `output_audio_buffer.started` / `stopped` / `cleared` events, which the
bridge hands to `output_started` / `output_ended`; the playback tracker then runs on the
server's word instead of on marks or an RTP clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable

from telephony.audio import base64_size
from telephony.legs.leg import AudioFormat, LegClosed, LegEvent
from telephony.playback import PlaybackTracker

# While the server plays an item we do not know its length: it counts as queued this long,
# and is frozen at what was heard when the server says the playout stopped or was cleared.
OPEN_PLAYOUT_MS = 600_000.0


class SidebandLeg:
    """A CallLeg with no audio path: the phone side is OpenAI's SIP leg."""

    carries_audio = False

    def __init__(
        self,
        call_sid: str,
        audio_format: AudioFormat = "audio/pcmu",
        on_close: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.call_sid = call_sid  # OpenAI's id of the call (rtc_…): the carrier's id
        self.audio_format = audio_format
        self.playback = PlaybackTracker()
        self._on_close = on_close
        self._ended = asyncio.Event()
        self._reason = ""
        self._closed = False
        self._next: list[str] = []  # items whose playout started while another still played

    async def events(self) -> AsyncGenerator[LegEvent, None]:
        """Nothing but the end: DTMF and speech arrive as server events on the sideband."""
        await self._ended.wait()
        yield LegClosed(self._reason)

    def remote_ended(self, reason: str) -> None:
        """The call is over on OpenAI's side (or was transferred away)."""
        if not self._ended.is_set():
            self._reason = reason
            self._ended.set()

    async def play(self, item_id: str, payload: str) -> None:
        """Audio never reaches us on a sideband; a stray delta has nowhere to go."""
        return

    async def clear(self) -> None:
        """The bridge sent `output_audio_buffer.clear`: freeze each item at what was heard."""
        self._next.clear()
        self.playback.cleared()

    def output_started(self, item_ids: Iterable[str]) -> None:
        """`output_audio_buffer.started`: the caller starts hearing these items now."""
        ids = list(item_ids)
        if self.playback.is_playing():
            self._next.extend(ids)  # one buffer: they play once the current item stops
            return
        for item_id in ids:
            self.playback.queued(item_id, OPEN_PLAYOUT_MS)

    def output_ended(self) -> None:
        """`output_audio_buffer.stopped` or `cleared`: nothing more of it will be heard."""
        self.playback.cleared()
        waiting, self._next = self._next, []
        for item_id in waiting:
            self.playback.queued(item_id, OPEN_PLAYOUT_MS)

    async def close(self, reason: str) -> None:
        """Our side is done with the call; the hook (hang-up through the API) runs once."""
        self.remote_ended(reason)
        if self._closed:
            return
        self._closed = True
        # Dropped once taken: the hook holds the app's record of the call, which holds this
        # leg, a reference cycle that would leave the ended call to a full collection.
        hook, self._on_close = self._on_close, None
        if hook is not None:
            await hook(reason)


class LiveSidebandLeg(SidebandLeg):
    """The sideband leg of a GPT-Live session on OpenAI's SIP interconnect.

    Live's sideband says nothing about playout (no `output_audio_buffer` events): the link
    hands over each transcript fragment as the audio it stands for, and this leg plays it out
    by the clock (from when it arrived, one utterance after the other, as the RTP leg's clock
    does), so the playout tracker knows what was heard. A clear (the caller began to speak:
    the model stopped talking over them) freezes each utterance at what was heard by then.
    """

    def __init__(
        self,
        call_sid: str,
        audio_format: AudioFormat = "audio/pcmu",
        on_close: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(call_sid, audio_format, on_close)
        self._busy_until = 0.0  # monotonic: when what was handed over has played out
        self._timers: list[asyncio.TimerHandle] = []

    async def play(self, item_id: str, payload: str) -> None:
        if self._ended.is_set():
            return
        ms = base64_size(payload) / 8  # G.711: 8 bytes a millisecond
        epoch, end_ms = self.playback.queued(item_id, ms)
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._busy_until = max(self._busy_until, now) + ms / 1000
        self._timers = [t for t in self._timers if not t.cancelled() and t.when() > now]
        self._timers.append(
            loop.call_at(self._busy_until, self.playback.played, epoch, item_id, end_ms)
        )

    async def clear(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        self._busy_until = 0.0
        await super().clear()

    async def close(self, reason: str) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        await super().close(reason)
