"""What the caller hears of the agent, and what a barge-in does to it: the playout strategy.

Owns the assistant items (audio received, where a barge-in cut them), the responses the
caller interrupted (muted: their audio must never reach the caller), the agent's transcripts
cut to what was heard, and the apology played when the model is gone for good. Two strategies:

- `LocalPlayout` (Twilio, our SIP UAS): we play the audio. A barge-in clears the leg first,
  then truncates each item at the audio the caller heard and cancels the active response.
  GPT-Live on OpenAI's SIP interconnect takes it too: its sideband leg plays the span of the
  agent's transcript by the clock (Live says nothing else about playout).
- `ServerPlayout` (OpenAI's SIP interconnect on Realtime): the server plays it and says so
  (`output_audio_buffer.started/stopped/cleared`). A barge-in cancels the response and clears
  the server's buffer; the server truncates. Lengths are estimated from the transcript.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from telephony import audio
from telephony.announcements import ItemAudio
from telephony.audio import base64_size
from telephony.bridge.model_link import ModelSession
from telephony.bridge.port import Port
from telephony.bridge.slot import ResponseState
from telephony.bridge.turns import Turns
from telephony.call_events import CallEventKind
from telephony.caller_evidence import READBACK_TOLERANCE_MS, SpokenItem
from telephony.legs.leg import AudioFormat, CallLeg
from telephony.legs.sideband import OPEN_PLAYOUT_MS, SidebandLeg
from telephony.session_config import BridgeConfig

BYTES_PER_MS = 8  # G.711 at 8 kHz, both directions (audio/pcmu and audio/pcma)
MAX_PLAYED_CHECKS = 20  # looks at an agent item's playout before its transcript is recorded
# Speech runs at ~15 characters a second: the length of an item cut before its transcript's
# audio was known (server playout has no audio to measure).
MS_PER_CHAR = 65


def apology_clip(audio_format: AudioFormat, duration_ms: int = 1200) -> bytes:
    """A short, gentle two-note chime in the leg's codec, played before giving up a call."""
    half = duration_ms / 2
    pcm = audio.tone_pcm16(660.0, half, amplitude=0.25) + audio.tone_pcm16(
        440.0, half, amplitude=0.25
    )
    return audio.encode(pcm, "pcma" if audio_format == "audio/pcma" else "pcmu")


def cut_text(text: str, fraction: float) -> str:
    """The part of `text` spoken in the first `fraction` of its audio (by characters)."""
    end = max(0, min(len(text), round(len(text) * fraction)))
    cut = text[:end]
    if end < len(text) and " " in cut:
        cut = cut[: cut.rfind(" ")]  # a word cut in half was not heard as a word
    return cut.rstrip()


def _unheard(response_id: str | None) -> None:
    return None


@dataclass(slots=True)
class AgentItem:
    """Audio and transcript of one assistant item, as received from the model."""

    response_id: str
    received_ms: float = 0.0
    transcript: str | None = None
    cut_at_ms: int | None = None  # heard ms when a barge-in cut it
    recorded: bool = False
    timer: asyncio.TimerHandle | None = None
    checks: int = 0


class Playout(ABC):
    """The agent's items and transcripts; subclasses decide how a barge-in stops the audio."""

    def __init__(
        self,
        port: Port,
        leg: CallLeg,
        turns: Turns,
        history: deque[str],
        audio_changed: Callable[[str | None], None],
    ) -> None:
        self._port = port
        self.leg = leg
        self._turns = turns
        self._history = history
        # What was heard of a response changed (None: of any): announcements look again.
        self._audio_changed = audio_changed
        self.items: dict[str, AgentItem] = {}
        self.muted: set[str] = set()  # responses the caller interrupted
        self.deltas_muted = 0

    # The strategy.

    @abstractmethod
    async def speech_started(self, session: ModelSession, received_at: float) -> None:
        """The caller began to speak: stop the agent's audio if it is still being heard."""

    def output_item_added(
        self, session: ModelSession, item_id: str, response_id: str, kind: str
    ) -> None:
        """`response.output_item.added` (server playout: an item the server will play)."""
        return  # nothing to do unless the strategy says otherwise

    def output_started(self, response_id: str) -> None:
        """`output_audio_buffer.started` (server playout)."""
        return  # nothing to do unless the strategy says otherwise

    def output_ended(self, response_id: str, *, cleared: bool) -> None:
        """`output_audio_buffer.stopped` / `cleared` (server playout)."""
        return  # nothing to do unless the strategy says otherwise

    @abstractmethod
    def transcript(self, item_id: str, text: str) -> None:
        """The model's transcript of one of its items: recorded once its playout is known."""

    async def apologise(self, config: BridgeConfig) -> None:
        """The model is gone for good: say so to the caller where we carry the audio."""
        return  # nothing to do unless the strategy says otherwise

    # Shared by both.

    def take_delta(self, session: ModelSession, response_id: str, item_id: str, delta: str) -> int:
        """Account for one audio delta: its size in bytes, or -1 if it must not be played."""
        if response_id in self.muted:
            # Audio of a response the caller interrupted: it must never reach them.
            self.deltas_muted += 1
            return -1
        item = self.items.get(item_id)
        if item is None:
            item = self.items[item_id] = AgentItem(response_id)
            session.items.add(item_id)
        size = base64_size(delta)
        item.received_ms += size / BYTES_PER_MS
        return size

    def is_muted(self, response_id: str) -> bool:
        return response_id in self.muted

    def playing(self) -> bool:
        """Whether the caller is still to hear audio of an item that was not cut."""
        return any(self._playing(item_id, item) for item_id, item in self.items.items())

    def item_playing(self, item_id: str) -> bool:
        """The same for one item only (a watcher of the current utterance, every few
        hundred ms, need not walk the whole call's items)."""
        item = self.items.get(item_id)
        return item is not None and self._playing(item_id, item)

    def _playing(self, item_id: str, item: AgentItem) -> bool:
        return (
            item.cut_at_ms is None
            and item.received_ms > 0
            and self.leg.playback.confirmed_ms(item_id) < item.received_ms - READBACK_TOLERANCE_MS
        )

    def item_audio(self, response_id: str) -> list[ItemAudio]:
        return [
            ItemAudio(item_id, item.received_ms, item.cut_at_ms)
            for item_id, item in self.items.items()
            if item.response_id == response_id
        ]

    def spoken(self, active_response_id: str | None) -> list[SpokenItem]:
        """Each item as the caller's evidence sees it: when it played and how much was heard."""
        playback = self.leg.playback
        spoken: list[SpokenItem] = []
        for item_id, item in self.items.items():
            audio_ms = int(item.received_ms)
            heard_ms = (
                item.cut_at_ms if item.cut_at_ms is not None else playback.confirmed_ms(item_id)
            )
            ended: float | None = None
            if (
                item.cut_at_ms is None
                and item.response_id != active_response_id  # all of its audio has arrived
                and audio_ms > 0
                and heard_ms >= audio_ms - READBACK_TOLERANCE_MS
            ):
                ended = playback.ended_at(item_id)
            spoken.append(
                SpokenItem(
                    item_id,
                    item.response_id,
                    playback.started_at(item_id),
                    ended,
                    heard_ms,
                    audio_ms,
                )
            )
        return spoken

    def release(self) -> None:
        """The call has ended: drop the hook back into the bridge (see Bridge._release)."""
        self._audio_changed = _unheard

    def close(self) -> None:
        """The call is ending: no more looks at playout."""
        for item in self.items.values():
            if item.timer is not None:
                item.timer.cancel()

    def record_rest(self) -> None:
        """The leg is closed: every transcript not yet recorded is, at what was heard."""
        for item_id, item in self.items.items():
            if not item.recorded and item.transcript is not None:
                self.record(item_id, item, final=True)

    def _unknown_transcript(self, item_id: str, text: str) -> None:
        # No audio reached us for it (text-only or fully muted): nothing was heard.
        self._port.emit(
            CallEventKind.AGENT_TRANSCRIPT,
            item_id=item_id,
            text="",
            full_text=text[:2000],
            cut=bool(text),
            heard_ms=0,
            audio_ms=0,
        )

    def _final_length(self, item: AgentItem, heard: int) -> None:
        """Adjust an item's length as the call ends (server playout: still open)."""
        return  # nothing to do unless the strategy says otherwise

    def record(self, item_id: str, item: AgentItem, final: bool = False) -> None:
        if item.recorded or item.transcript is None:
            return
        item.recorded = True
        if item.timer is not None:
            item.timer.cancel()
            item.timer = None
        text = item.transcript
        heard = item.cut_at_ms
        if heard is None:
            heard = self.leg.playback.heard_ms(item_id) if final else int(item.received_ms)
        self._final_length(item, heard)
        audio_ms = int(item.received_ms)
        cut = audio_ms > 0 and heard < audio_ms - 1
        if cut:
            text = cut_text(text, heard / audio_ms)
        started = self.leg.playback.started_at(item_id)
        self._port.emit(
            CallEventKind.AGENT_TRANSCRIPT,
            item_id=item_id,
            # Which response said it (replay rebuilds the model's script from it).
            response_id=item.response_id,
            text=text,
            cut=cut,
            heard_ms=heard,
            audio_ms=audio_ms,
            **({"full_text": item.transcript[:2000]} if cut else {}),
            # When the caller began hearing it (the timeline stamps speech at its start).
            **({"started_mono_ns": round(started * 1e9)} if started is not None else {}),
        )
        if text:
            self._history.append(f"Agent{' (interrupted)' if cut else ''}: {text}")


class LocalPlayout(Playout):
    """We play the audio (Twilio, SIP): truncate at what the caller heard."""

    async def speech_started(self, session: ModelSession, received_at: float) -> None:
        playback = self.leg.playback
        # Audio whose end the caller has heard, its last confirmation still on its way, is
        # not interrupted: nothing of it to clear, truncate or count as cut.
        playback.settle()
        if playback.is_playing():
            await self._barge_in(session, received_at)

    async def _barge_in(self, session: ModelSession, received_at: float) -> None:
        playback = self.leg.playback
        item_id = playback.current_item()
        # First the caller stops hearing us; everything else can take a moment longer.
        await self.leg.clear()
        clear_ms = (time.perf_counter() - received_at) * 1000
        # clear() froze every item at what the caller heard.
        played_ms = playback.heard_ms(item_id) if item_id else 0
        item = self.items.get(item_id) if item_id else None
        received_ms = int(item.received_ms) if item else 0
        audio_end_ms = min(played_ms, received_ms)
        truncated = False
        if item is not None and item_id is not None:
            self.muted.add(item.response_id)
            if item_id in session.items:
                truncated = await session.truncate(item_id, audio_end_ms)
            item.cut_at_ms = audio_end_ms
            if item.transcript is not None and not item.recorded:
                self.record(item_id, item)
        # Items queued behind the head were cleared before a word of them was heard.
        for other_id, other in self.items.items():
            if other_id == item_id or other.cut_at_ms is not None or other.recorded:
                continue
            heard = playback.heard_ms(other_id)
            if heard + 1 >= other.received_ms:
                continue
            other.cut_at_ms = min(heard, int(other.received_ms))
            self.muted.add(other.response_id)
            if other_id in session.items:
                await session.truncate(other_id, other.cut_at_ms)
            if other.transcript is not None:
                self.record(other_id, other)
        cancelled = False
        slot = session.slot
        response_id = slot.active_response_id
        if slot.state is ResponseState.ACTIVE and response_id:
            self.muted.add(response_id)
            cancelled = await session.cancel_response(response_id)
        self._audio_changed(None)
        self._port.emit(
            CallEventKind.BARGE_IN,
            item_id=item_id,
            played_ms=played_ms,
            received_ms=received_ms,
            audio_end_ms=audio_end_ms,
            truncated=truncated,
            cancelled=cancelled,
            turn_id=self._turns.turn_id,
            clear_latency_ms=round(clear_ms, 3),
        )

    def transcript(self, item_id: str, text: str) -> None:
        item = self.items.get(item_id)
        if item is None:
            self._unknown_transcript(item_id, text)
            return
        item.transcript = text
        if item.cut_at_ms is not None:
            self.record(item_id, item)
        else:
            self._check_played(item_id)

    def _check_played(self, item_id: str) -> None:
        """Record an item's transcript once its audio has played out, or look again later."""
        item = self.items[item_id]
        item.timer = None
        if item.recorded or self._port.ended():
            return
        remaining_ms = item.received_ms - self.leg.playback.heard_ms(item_id)
        item.checks += 1
        # A leg that stops confirming playout must not keep this polling for the whole call.
        if remaining_ms <= 1 or item.cut_at_ms is not None or item.checks > MAX_PLAYED_CHECKS:
            self.record(item_id, item)
            return
        loop = asyncio.get_running_loop()
        item.timer = loop.call_later(remaining_ms / 1000 + 0.05, self._check_played, item_id)

    async def apologise(self, config: BridgeConfig) -> None:
        leg = self.leg
        if not getattr(leg, "carries_audio", True):
            return  # GPT-Live on OpenAI's SIP leg: no audio of ours reaches the caller
        clip = apology_clip(leg.audio_format)
        clip_ms = len(clip) // BYTES_PER_MS
        with contextlib.suppress(Exception):
            await leg.clear()
            await leg.play("apology", base64.b64encode(clip).decode("ascii"))
            async with asyncio.timeout(clip_ms / 1000 + 3.0):
                # Wait for observable playout: the leg confirms what the caller heard.
                # The tracker has no notification; playout is observed by polling it.
                while leg.playback.is_playing() and not self._port.ended():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        self._port.emit(
            CallEventKind.APOLOGY_PLAYED,
            text=config.apology_text,
            clip_ms=clip_ms,
            heard_ms=leg.playback.heard_ms("apology"),
        )


class ServerPlayout(Playout):
    """The server plays the audio (OpenAI's SIP interconnect) and says what was heard."""

    def __init__(
        self,
        port: Port,
        leg: SidebandLeg,
        turns: Turns,
        history: deque[str],
        audio_changed: Callable[[str | None], None],
    ) -> None:
        super().__init__(port, leg, turns, history, audio_changed)
        self._sideband = leg

    async def speech_started(self, session: ModelSession, received_at: float) -> None:
        if self.leg.playback.is_playing() or session.slot.state is ResponseState.ACTIVE:
            await self._barge_in(session, received_at)

    async def _barge_in(self, session: ModelSession, received_at: float) -> None:
        """Stop the model (response.cancel) and the server's playout (output_audio_buffer.clear).

        The server truncates the item at what it played; we freeze ours at the same moment.
        """
        cancelled = False
        slot = session.slot
        response_id = slot.active_response_id
        if slot.state is ResponseState.ACTIVE and response_id:
            self.muted.add(response_id)
            cancelled = await session.cancel_response(response_id)
        playback = self.leg.playback
        item_id = playback.current_item()
        cleared = await session.clear_output()
        clear_ms = (time.perf_counter() - received_at) * 1000
        played_ms = playback.heard_ms(item_id) if item_id else 0
        await self.leg.clear()
        item = self.items.get(item_id) if item_id else None
        if item is not None and item_id is not None:
            self.muted.add(item.response_id)
            item.cut_at_ms = played_ms
            item.received_ms = max(played_ms + 2.0, _estimated_ms(item))
            if item.transcript is not None and not item.recorded:
                self.record(item_id, item)
        self._audio_changed(None)
        self._port.emit(
            CallEventKind.BARGE_IN,
            item_id=item_id,
            played_ms=played_ms,
            received_ms=int(item.received_ms) if item else 0,
            audio_end_ms=played_ms,
            truncated=False,  # the server truncates on output_audio_buffer.clear
            cancelled=cancelled,
            output_cleared=cleared,
            turn_id=self._turns.turn_id,
            clear_latency_ms=round(clear_ms, 3),
        )

    def output_item_added(
        self, session: ModelSession, item_id: str, response_id: str, kind: str
    ) -> None:
        if kind != "message" or not item_id or item_id in self.items:
            return
        # Its length is known only once the server stops playing it; until then it counts as
        # not heard in full (an announcement in it is not yet heard).
        self.items[item_id] = AgentItem(response_id, received_ms=OPEN_PLAYOUT_MS)
        session.items.add(item_id)

    def _items_of(self, response_id: str) -> list[tuple[str, AgentItem]]:
        return [(i, item) for i, item in self.items.items() if item.response_id == response_id]

    def output_started(self, response_id: str) -> None:
        if response_id in self.muted:
            return
        items = [(i, it) for i, it in self._items_of(response_id) if it.cut_at_ms is None]
        for _, item in items:
            item.received_ms = OPEN_PLAYOUT_MS  # playing, length unknown: not heard in full yet
        self._sideband.output_started(i for i, _ in items)

    def output_ended(self, response_id: str, *, cleared: bool) -> None:
        leg = self._sideband
        items = [
            (i, it)
            for i, it in self._items_of(response_id)
            if it.cut_at_ms is None and not it.recorded and leg.playback.queued_ms(i) > 0
        ]
        if not items:
            return
        heard = {item_id: leg.playback.heard_ms(item_id) for item_id, _ in items}
        leg.output_ended()
        for item_id, item in items:
            if cleared:
                self.muted.add(item.response_id)
                item.cut_at_ms = heard[item_id]
                item.received_ms = max(heard[item_id] + 2.0, _estimated_ms(item))
            else:
                item.received_ms = float(heard[item_id])
            if item.transcript is not None:
                self.record(item_id, item)
        self._audio_changed(response_id)

    def transcript(self, item_id: str, text: str) -> None:
        item = self.items.get(item_id)
        if item is None:
            self._unknown_transcript(item_id, text)
            return
        item.transcript = text
        if item.cut_at_ms is not None:
            item.received_ms = max(item.received_ms, _estimated_ms(item))
            self.record(item_id, item)
        elif not self.leg.playback.is_playing() and self.leg.playback.queued_ms(item_id) > 0:
            # Otherwise recorded when the server says its playout stopped (or was cut).
            self.record(item_id, item)

    def _final_length(self, item: AgentItem, heard: int) -> None:
        if item.received_ms >= OPEN_PLAYOUT_MS:
            # The call ended while the server was still playing it.
            item.received_ms = max(heard + 2.0, _estimated_ms(item))


def _estimated_ms(item: AgentItem) -> float:
    return float(len(item.transcript or "") * MS_PER_CHAR)
