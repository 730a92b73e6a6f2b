"""The SIP leg: one answered SIP call as a CallLeg (RTP media, signalling through the core)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import secrets
from collections.abc import AsyncGenerator, Callable
from typing import Any

from telephony import dtmf_out
from telephony.legs.leg import AudioFormat, AudioIn, AudioLane, DtmfIn, LegClosed, LegEvent
from telephony.legs.sip.pacer import PacedStream, PacerClock
from telephony.legs.sip.rtp import MediaPolicy, MediaStats, RtpClock, RtpStream, SentPlayback
from telephony.legs.sip.sdp import PTIME_MS, Codec, Direction, RemoteMedia
from telephony.playback import PlaybackTracker

log = logging.getLogger(__name__)

# Caller audio waiting for the bridge; beyond this the oldest frames go (2 s of audio).
MAX_PENDING_EVENTS = 100


class SipLeg:
    """Caller audio and digits from RTP in, agent audio out through our paced playout queue.

    Hanging up from our side (`close`) asks the signalling side for a BYE through `hang_up`; a
    BYE from the caller arrives as `remote_ended` and ends `events()` with LegClosed.

    The lanes, as the Twilio leg has them: while `events()` waits with nothing queued, a
    caller frame is offered to the audio lane (`set_audio_lane`: the bridge appends it to the
    model session) in the RTP socket's callback, with no queue and no task woken per frame;
    agent audio is queued for the pacer in the model socket's callback (`play_nowait`). The
    taps (`set_taps`: a recorder) see each frame either way.
    """

    def __init__(
        self,
        call_id: str,
        codec: Codec,
        dtmf_pt: int | None,
        clock: RtpClock,
        hang_up: Callable[[str], None],
        *,
        policy: MediaPolicy | None = None,
        stats: MediaStats | None = None,
        on_foreign: Callable[[tuple[str, int]], None] | None = None,
        ptime_ms: int = PTIME_MS,
    ) -> None:
        self.call_id = call_id
        self.codec = codec
        self.audio_format: AudioFormat = codec.audio_format
        self.playback: PlaybackTracker = SentPlayback()
        self._hang_up = hang_up
        self._events: asyncio.Queue[LegEvent] = asyncio.Queue()
        self._closed = False
        self._close_reason: str | None = None
        self.dropped_audio = 0
        self.frames_by_lane = 0  # caller frames the audio lane took (benchmarks, tests)
        self._waiting = False  # events() awaits the next event: nothing is queued before it
        self._audio_lane: Callable[[str, int], bool] | None = None
        self._audio_tap: Callable[[str, int], object] | None = None
        self._play_tap: Callable[[str], object] | None = None
        # Hears the caller's audio (codec bytes) as it arrives, beside the bridge: the
        # answering-machine detector of an outbound call.
        self.listener: Callable[[bytes], None] | None = None
        stream = PacedStream if isinstance(clock, PacerClock) else RtpStream
        self.rtp = stream(
            codec, dtmf_pt, self.playback, clock, self._on_audio, self._on_digit,
            policy=policy, stats=stats, on_foreign=on_foreign, ptime_ms=ptime_ms,
        )  # fmt: skip

    # ---- from the media and signalling sides --------------------------------------------

    def set_audio_lane(self, lane: AudioLane | None) -> None:
        """`LaneLeg.set_audio_lane`: offered in the RTP socket's callback."""
        self._audio_lane = lane

    def set_taps(
        self,
        audio: Callable[[str, int], object] | None = None,
        play: Callable[[str], object] | None = None,
    ) -> None:
        """`LaneLeg.set_taps`."""
        self._audio_tap = audio
        self._play_tap = play

    def _on_audio(self, audio: bytes, timestamp_ms: int) -> None:
        if self._closed:
            return
        if self.listener is not None:
            self.listener(audio)
        payload = base64.b64encode(audio).decode("ascii")  # as AudioIn.of_bytes
        lane = self._audio_lane
        if lane is not None and self._waiting and lane(payload, timestamp_ms):
            self.frames_by_lane += 1
            tap = self._audio_tap
            if tap is not None:
                tap(payload, timestamp_ms)
            return
        if self._events.qsize() >= MAX_PENDING_EVENTS:
            # The bridge is behind: old caller audio is worth less than new.
            try:
                self._events.get_nowait()
                self.dropped_audio += 1
            except asyncio.QueueEmpty:
                pass
        self._queue(AudioIn(payload, timestamp_ms))

    def _queue(self, event: LegEvent) -> None:
        # Queued for events(): the lane waits until the reader has taken it (order first).
        self._waiting = False
        self._events.put_nowait(event)

    def _on_digit(self, digit: str) -> None:
        if not self._closed:
            self._queue(DtmfIn(digit))

    def digit(self, digit: str) -> None:
        """A digit that came as SIP INFO."""
        self._on_digit(digit)

    def answered(self, remote: RemoteMedia | None, direction: Direction) -> None:
        """The 200 OK is out: start pacing toward the offer's address."""
        if remote is not None:
            self.rtp.set_remote(remote, direction)
        self.rtp.start()

    def media_updated(self, remote: RemoteMedia, direction: Direction) -> None:
        """Hold, resume or a new address (re-INVITE, UPDATE, the ACK's answer)."""
        self.rtp.set_remote(remote, direction)

    def remote_ended(self, reason: str) -> None:
        """The caller hung up (BYE) or the dialog died (no ACK, session expired)."""
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        self.rtp.close()
        self._queue(LegClosed(reason))

    # ---- CallLeg ------------------------------------------------------------------------

    async def events(self) -> AsyncGenerator[LegEvent, None]:
        queue = self._events
        while True:
            if queue.empty():
                self._waiting = True
                try:
                    event = await queue.get()
                finally:
                    self._waiting = False
            else:
                event = queue.get_nowait()
            yield event
            if isinstance(event, LegClosed):
                return

    async def play(self, item_id: str, payload: str) -> None:
        self.play_nowait(item_id, payload)

    def play_nowait(self, item_id: str, payload: str, size: int = -1) -> None:
        """`LaneLeg.play_nowait` (from the model socket's lane); `size` is not needed here
        (the payload is decoded for the pacer anyway)."""
        tap = self._play_tap
        if tap is not None:
            tap(payload)
        if self._closed or not payload:
            return
        try:
            audio = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            log.warning("call %s: agent audio that is not base64 was dropped", self.call_id)
            return
        self.rtp.enqueue(item_id, audio)

    async def clear(self) -> None:
        # Frames still queued never left: the caller never heard them.
        self.rtp.flush(then=self.playback.cleared)

    async def send_digits(self, digits: str) -> str:
        """Send DTMF to the far side: RFC 4733 events where the peer offered them, else
        in-band tones; returns how they went out, once they have."""
        if self._closed:
            return "not sent: the call is over"
        if self.rtp.dtmf_pt is not None:
            packet = self.rtp.ptime_ms  # events go out one per packet time
            tone, gap = -(-dtmf_out.TONE_MS // packet), -(-dtmf_out.GAP_MS // packet)
            pause = -(-dtmf_out.PAUSE_MS // packet)
            self.rtp.send_events(
                [(-1, pause, 0) if d in ",w" else (dtmf_out.EVENT_CODES[d], tone, gap)
                 for d in digits]
            )  # fmt: skip
            how = "rfc4733"
        else:
            self.rtp.enqueue(
                f"dtmf-{secrets.token_hex(4)}", dtmf_out.tones(digits, self.audio_format)
            )
            how = "inband"
        await asyncio.sleep(dtmf_out.duration_ms(digits) / 1000)
        return how

    def media_report(self) -> dict[str, Any]:
        """The caller's media as received (RFC 3550 receiver statistics: loss, jitter), the
        RTCP reports exchanged, and what the peer's last report said of our audio."""
        rtp = self.rtp
        report: dict[str, Any] = dict(rtp.reception.report())
        report["rtcp_sent"] = rtp.rtcp_sent
        report["rtcp_received"] = rtp.rtcp_reports_received
        if rtp.remote_report is not None:
            report["remote"] = dict(rtp.remote_report)
        return report

    async def close(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        self.rtp.close()
        try:
            self._hang_up(reason)
        except Exception:
            log.exception("SIP hang-up of call %s failed", self.call_id)
        self._queue(LegClosed(reason))
