"""The Twilio Media Streams leg: one accepted `/twilio/media` WebSocket as a CallLeg."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import secrets
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Protocol

from telephony import dtmf_out
from telephony.audio import base64_size
from telephony.call_events import CallEvent, CallEventKind, CallEventSink
from telephony.errors import MalformedFrame
from telephony.legs.leg import AudioFormat, AudioIn, AudioLane, DtmfIn, LegClosed, LegEvent
from telephony.legs.twilio.budget import BATCH, StreamBudget
from telephony.legs.twilio.events import (
    Connected,
    Dtmf,
    Mark,
    MarkFrame,
    Media,
    MediaFrame,
    OutboundFrames,
    Start,
    StartInfo,
    Stop,
    hot_frame,
    parse_frame,
)
from telephony.playback import PlaybackTracker
from telephony.watchdog import Watchdog

log = logging.getLogger(__name__)

BYTES_PER_MS = 8  # 8 kHz G.711: one byte per sample
# One Twilio frame by default. Every chunk is followed by a mark, so at 20 ms confirmations
# come every frame and the tracker never interpolates across more than one frame. Larger
# chunks send fewer messages (bench/bridge.py compares them) at the price of coarser marks.
CHUNK_MS = 20
# A Twilio frame is ~300 bytes; anything near this is not a media stream talking.
MAX_FRAME_CHARS = 64 * 1024
EXCERPT_CHARS = 120
INBOUND_TRACKS = ("inbound", "inbound_track")
# How late a tail's mark may go out when no caller frame comes to check it (see _tail_check):
# Twilio streams caller frames all through a call, so this is for a stream gone quiet.
TAIL_BACKSTOP_S = 0.5


class TextWebSocket(Protocol):
    """The slice of a WebSocket the leg uses (Starlette's WebSocket fits)."""

    async def receive_text(self) -> str: ...

    async def send_text(self, data: str) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


# WebSocket close codes that mean the peer broke the protocol (RFC 6455 7.4.1: protocol
# error, unacceptable data, inconsistent data, policy, message too big): not a lost stream.
BROKE_THE_PROTOCOL = frozenset({1002, 1003, 1007, 1008, 1009})


def mark_name(epoch: int, item_id: str, end_ms: float) -> str:
    """Mark names carry what the echo confirms: playback epoch, end offset, item id.

    The end offset is exact: the tracker counts audio per G.711 byte (an eighth of a
    millisecond), so an offset rounded to a whole millisecond would leave a line whose length
    ends in .125 ms short of its end for ever (never finished, and the caller's next words
    taken as a barge-in on it).
    """
    if end_ms == int(end_ms):
        return f"{epoch}:{int(end_ms)}:{item_id}"
    return f"{epoch}:{end_ms:.3f}:{item_id}"


def parse_mark_name(name: str) -> tuple[int, float, str] | None:
    """(epoch, end_ms, item_id) from a mark name we sent; None for anything else."""
    parts = name.split(":", 2)
    if len(parts) != 3:
        return None
    try:
        epoch, end_ms = int(parts[0]), float(parts[1])
    except ValueError:
        return None
    if not 0.0 <= end_ms < 1e12:  # also refuses nan and inf
        return None
    return epoch, end_ms, parts[2]


class TwilioLeg:
    """Caller audio in, agent audio out over a Twilio Media Stream.

    Outbound audio goes out as it arrives, in `media` frames of at most `chunk_ms`, and every
    `chunk_ms` of audio is closed by a `mark` named `epoch:end_ms:item_id`; Twilio echoes the
    mark once the audio before it has played, which the PlaybackTracker turns into heard
    milliseconds (interpolating between marks). Audio shorter than a chunk is not held back
    for its mark: the mark follows once a chunk's worth has gone out, or, after the last audio
    of an item, at the next item or after `chunk_ms` with no more audio (whichever is first).
    So a Realtime delta of 20 ms costs one write, not two, and marks come every `chunk_ms`
    whatever the delta sizes. Frames wait in a local queue drained by one sender task, so `play`
    never blocks and a slow socket never stalls the receive side; `clear` drops whatever is
    still queued locally before sending Twilio's `clear`.
    """

    audio_format: AudioFormat = "audio/pcmu"

    def __init__(
        self,
        ws: TextWebSocket,
        start: StartInfo,
        sink: CallEventSink,
        call_id: str,
        *,
        playback: PlaybackTracker | None = None,
        idle_timeout_s: float = 15.0,
        send_timeout_s: float = 5.0,
        chunk_ms: int = CHUNK_MS,
        budget: StreamBudget | None = None,
    ) -> None:
        if chunk_ms < 20 or chunk_ms % 20:
            raise ValueError("chunk_ms must be a positive multiple of 20 ms")
        self._chunk_bytes = chunk_ms * BYTES_PER_MS
        self._ws = ws
        self.start = start
        self.stream_sid = start.stream_sid
        self._frames = OutboundFrames(start.stream_sid)
        self._sink = sink
        self.call_id = call_id
        self.playback = playback if playback is not None else PlaybackTracker()
        self._idle_timeout_s = idle_timeout_s
        self._send_timeout_s = send_timeout_s
        # Frames received (both ways: the lane, the reader); the budget hears of them in
        # batches, and the idle deadline looks at the count, so a frame costs no call to them.
        self.frames_in = 0
        # Deadlines for the per-frame receive and sends, one timer each for the whole call.
        self._idle = Watchdog(idle_timeout_s, progress=self._frames_seen)
        self._send_watch = Watchdog(send_timeout_s)
        self._outbox: deque[str] = deque()
        self._outbox_ready = asyncio.Event()
        self._generation = 0  # bumped by clear(): a frame popped before it must not go out
        self._send_lock = asyncio.Lock()
        self._sends = 0  # awaited sends holding or waiting for the lock: the lane waits too
        self._sender: asyncio.Task[None] | None = None
        self._pending: bytes = b""  # tail shorter than a chunk, per item
        self._pending_item: str | None = None
        # Audio sent since the last mark: its size, and the mark that would close it.
        self._unmarked = 0
        # (epoch, item id, end ms) of the mark that would close it; named when it is sent.
        self._tail_mark: tuple[int, str, float] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tail_at = 0.0  # loop.time() when the last unmarked audio was queued
        self._tail_grace_s = chunk_ms / 1000
        self._tail_closes_at = 0.0  # _tail_at + _tail_grace_s: no more audio by then closes it
        # The timer that closes a tail where no caller frame comes to check it (_tail_check).
        self._tail_backstop_s = max(TAIL_BACKSTOP_S, 2 * self._tail_grace_s)
        self._tail_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._close_reason: str | None = None
        # The socket went away under us without Twilio's `stop` (the call may well be up:
        # Twilio then asks the `<Connect action>` URL, and the call can resume elsewhere).
        self.stream_lost = False
        self.malformed_frames = 0
        self.budget = budget
        # The lane (app/legs/twilio/media_ws.py): where the socket offers it, a frame that
        # arrives while `events()` waits is handled where it is received, and agent audio is
        # written at once while nothing is queued; either falls back to the task-driven path.
        self._waiting = False  # events() is awaiting the next frame
        self._audio_lane: AudioLane | None = None
        self._audio_tap: Callable[[str, int], object] | None = None  # a recorder, say
        self._play_tap: Callable[[str], object] | None = None  # sees audio handed to play
        sender = getattr(ws, "nowait_sender", None)
        self._send_now: Callable[[Iterable[str]], bool] | None = (
            sender() if callable(sender) else None
        )

    # Receive side.

    def set_audio_lane(self, lane: AudioLane | None) -> None:
        """`LaneLeg.set_audio_lane`: offered as the socket receives each frame."""
        self._audio_lane = lane

    def set_taps(
        self,
        audio: Callable[[str, int], object] | None = None,
        play: Callable[[str], object] | None = None,
    ) -> None:
        """`LaneLeg.set_taps`."""
        self._audio_tap = audio
        self._play_tap = play

    def _lane(self, raw: bytes | str) -> bool:
        """One frame as the socket receives it; True if it was handled here."""
        if not self._waiting or self._closed:
            return False  # the reader is busy with an earlier frame: order first
        hot = hot_frame(raw)
        if hot is None:
            return False  # not media or a mark, or a doubtful one: the reader names it
        budget = self.budget
        if budget is not None and budget.tripped is not None:
            return False
        if isinstance(hot, str):
            self._on_mark(hot)
        else:
            track, payload, timestamp_ms = hot
            if track in INBOUND_TRACKS:
                lane = self._audio_lane
                if lane is None or not lane(payload, timestamp_ms):
                    return False
                tap = self._audio_tap
                if tap is not None:
                    tap(payload, timestamp_ms)
        self.frames_in += 1
        if not self.frames_in & (BATCH - 1) and budget is not None:
            budget.batch()  # a trip sends the next frame the reader's way, which ends the stream
        if self._tail_mark is not None:  # _tail_check, inline
            loop = self._loop
            if loop is not None and loop.time() >= self._tail_closes_at:
                self._close_tail()
        return True

    def _frames_seen(self) -> int:
        return self.frames_in

    async def events(self) -> AsyncGenerator[LegEvent, None]:
        """Caller audio, digits and finally LegClosed; malformed frames are recorded, skipped."""
        set_lane = getattr(self._ws, "set_lane", None)
        if set_lane is not None:
            set_lane(self._lane)
        try:
            async with contextlib.aclosing(self._read_events()) as events:  # closed with this one
                async for event in events:
                    yield event
        finally:
            if set_lane is not None:
                set_lane(None)

    async def _read_events(self) -> AsyncGenerator[LegEvent, None]:
        while not self._closed:
            try:
                self._waiting = True
                try:
                    with self._idle:
                        raw = await self._ws.receive_text()
                finally:
                    self._waiting = False
            except TimeoutError:
                yield LegClosed(f"no frames for {self._idle_timeout_s:g} s")
                return
            except KeyError:
                # Starlette's receive_text() raises KeyError for a binary frame.
                self._malformed("binary frame", "")
                if self._over_budget():
                    yield LegClosed(f"abusive stream: {self._over_budget()}")
                    return
                continue
            except Exception as exc:  # the socket is gone, whatever the server library says
                if self._over_budget():
                    yield LegClosed(f"abusive stream: {self._over_budget()}")
                    return
                code = getattr(exc, "code", None)
                if code in BROKE_THE_PROTOCOL:
                    # The transport refused what the peer sent (a frame over its limit, bad
                    # UTF-8): ended for cause, never resumed elsewhere.
                    yield LegClosed(f"stream refused by the transport (close code {code})")
                    return
                if self._close_reason is None:
                    self.stream_lost = True
                yield LegClosed(self._close_reason or f"disconnected: {type(exc).__name__}")
                return
            budget = self.budget
            self.frames_in += 1
            if not self.frames_in & (BATCH - 1) and budget is not None:
                budget.batch()
            event = self._parse(raw)
            if self._tail_mark is not None:
                self._tail_check()
            if budget is not None:
                if isinstance(event, DtmfIn):
                    budget.dtmf()
                if budget.tripped is not None:
                    yield LegClosed(f"abusive stream: {budget.tripped}")
                    return
            if event is not None:
                yield event
                if isinstance(event, LegClosed):
                    return
        yield LegClosed(self._close_reason or "closed")

    def _parse(self, raw: str) -> LegEvent | None:
        if len(raw) > MAX_FRAME_CHARS:
            self._malformed(f"oversized frame ({len(raw)} chars)", raw)
            return None
        try:
            message = parse_frame(raw)
            match message:
                case MediaFrame():
                    if message.track not in INBOUND_TRACKS:
                        return None
                    # Checked as base64, passed on as such: the bridge never decodes it.
                    return AudioIn(message.payload, message.timestamp_ms)
                case MarkFrame():
                    self._on_mark(message.name)
                    return None
                case Media():
                    # A media frame the hot path doubted: the model's checks name the fault.
                    if message.media.track not in INBOUND_TRACKS:
                        return None
                    message.media.audio()
                    return AudioIn(message.media.payload, message.media.timestamp_ms())
                case Mark():
                    self._on_mark(message.mark.name)
                    return None
                case Dtmf():
                    return DtmfIn(message.dtmf.digit)
                case Stop():
                    return LegClosed("stop")
                case Connected() | Start():
                    return None  # already handled by whoever accepted the stream
        except MalformedFrame as exc:
            self._malformed(str(exc), raw)
        return None

    def _on_mark(self, name: str) -> None:
        parsed = parse_mark_name(name)
        if parsed is None:
            self._malformed("mark we did not send", name)
            return
        epoch, end_ms, item_id = parsed
        # Twilio echoes marks for cleared audio too; the epoch check discards those.
        self.playback.played(epoch, item_id, end_ms)

    def _over_budget(self) -> str | None:
        return self.budget.tripped if self.budget is not None else None

    def _malformed(self, why: str, raw: str) -> None:
        self.malformed_frames += 1
        budget = self.budget
        if budget is not None:
            # Within budget each is logged and recorded; beyond it the stream is ended.
            record = budget.may_record()
            budget.malformed()
            if not record:
                return
        if self.malformed_frames <= 5:
            log.info("malformed Twilio frame on call %s: %s", self.call_id, why)
        self._sink.emit(
            CallEvent(
                self.call_id,
                CallEventKind.MALFORMED_FRAME,
                {"reason": why[:200], "excerpt": raw[:EXCERPT_CHARS], "length": len(raw)},
            )
        )

    # Send side.

    async def send_digits(self, digits: str) -> str:
        """Send DTMF to the far side as in-band tones (a media stream carries audio only);
        returns once they have played."""
        if self._closed:
            return "not sent: the call is over"
        audio = dtmf_out.tones(digits, self.audio_format)
        self.play_nowait(f"dtmf-{secrets.token_hex(4)}", base64.b64encode(audio).decode("ascii"))
        self._flush_pending()
        self._close_tail()  # all of it goes out now, its mark after it
        await asyncio.sleep(dtmf_out.duration_ms(digits) / 1000)
        return "inband"

    async def play(self, item_id: str, payload: str) -> None:
        """Queue agent audio in frames of at most a chunk, a mark closing every chunk of it;
        never waits on the socket."""
        self.play_nowait(item_id, payload)

    def play_nowait(self, item_id: str, payload: str, size: int = -1) -> None:
        """`LaneLeg.play_nowait` (from the Realtime lane): chunked and marked as `play`."""
        tap = self._play_tap
        if tap is not None:
            tap(payload)
        if self._closed or not payload:
            return
        if self._pending_item != item_id:
            self._flush_pending()
            self._close_tail()  # the item before this one has had all its audio
            self._pending_item = item_id
        if size < 0:
            size = base64_size(payload)
        if not self._pending and size <= self._chunk_bytes and not self._outbox:
            # One chunk or less with nothing queued: forward Twilio the delta's own base64,
            # written now where the socket takes it (as `_flush_outbox` would, without the
            # outbox in between).
            frames = self._frames_for(item_id, payload, size)
            send_now = self._send_now
            if send_now is not None and not self._sends:
                try:
                    if send_now(frames):
                        return
                except Exception as exc:  # a dead socket; the sender's send reports it too
                    log.info("Twilio send failed on call %s: %r", self.call_id, exc)
            self._outbox.extend(frames)
            self._outbox_ready.set()
            self._ensure_sender()
            return
        data = self._pending + base64.b64decode(payload)
        chunk = self._chunk_bytes
        whole = len(data) - len(data) % chunk
        for offset in range(0, whole, chunk):
            self._enqueue_bytes(item_id, data[offset : offset + chunk])
        self._pending = data[whole:]
        if self._pending and (not self._outbox or not self.playback.is_playing()):
            # Nothing is waiting to be sent (or played): a short tail must not wait for audio
            # that may never come (the last delta of a response).
            self._flush_pending()
        self._flush_outbox()

    def _flush_pending(self) -> None:
        if self._pending and self._pending_item is not None:
            self._enqueue_bytes(self._pending_item, self._pending)
        self._pending = b""

    def _enqueue_bytes(self, item_id: str, chunk: bytes) -> None:
        self._enqueue(item_id, base64.b64encode(chunk).decode("ascii"), len(chunk))

    def _enqueue(self, item_id: str, payload: str, size: int) -> None:
        self._outbox.extend(self._frames_for(item_id, payload, size))

    def _frames_for(self, item_id: str, payload: str, size: int) -> tuple[str, ...]:
        """The `media` frame for `size` bytes of `item_id` (base64 `payload`), and the `mark`
        after it when it completes a chunk; the audio counts as queued for playout."""
        epoch, end_ms = self.playback.queued(item_id, size / BYTES_PER_MS)
        media = self._frames.media(payload)
        unmarked = self._unmarked + size
        if unmarked >= self._chunk_bytes:
            self._unmarked = 0
            self._tail_mark = None
            return (media, self._frames.mark(mark_name(epoch, item_id, end_ms)))
        self._unmarked = unmarked
        self._tail_mark = (epoch, item_id, end_ms)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._tail_at = loop.time()
        self._tail_closes_at = self._tail_at + self._tail_grace_s
        if self._tail_timer is None:
            self._tail_timer = loop.call_at(self._tail_at + self._tail_backstop_s, self._tail_due)
        return (media,)

    def _close_tail(self) -> None:
        """Send the mark that closes audio sent since the last one."""
        if self._tail_mark is not None:
            self._outbox.append(self._frames.mark(mark_name(*self._tail_mark)))
            self._flush_outbox()
        self._tail_mark = None
        self._unmarked = 0

    def _tail_check(self) -> None:
        """Close the tail once no audio came for a chunk's time: checked at each caller frame
        (Twilio streams 50 a second for the whole call), so a steady call arms no timer per
        chunk; `_tail_due` is the backstop for a stream that goes quiet."""
        loop = self._loop
        if loop is not None and loop.time() >= self._tail_closes_at:
            # No more audio came: the item's last audio must not go unconfirmed.
            self._close_tail()

    def _tail_due(self) -> None:
        self._tail_timer = None
        loop = self._loop  # set where the timer was armed
        if self._tail_mark is None or self._closed or loop is None:
            return
        if loop.time() >= self._tail_closes_at:
            self._close_tail()
        else:
            self._tail_timer = loop.call_at(self._tail_at + self._tail_backstop_s, self._tail_due)

    def _flush_outbox(self) -> None:
        """Send what is queued: at once where the socket takes it now, else by the sender."""
        send_now = self._send_now
        outbox = self._outbox
        if send_now is not None and not self._closed and not self._sends:
            try:
                if outbox and self._pending:
                    # As in the sender: a short tail waits only while frames are queued.
                    self._flush_pending()
                if outbox and send_now(outbox):  # one write for a media and its mark
                    outbox.clear()
                    return
            except Exception as exc:  # a dead socket; the sender's send reports it too
                log.info("Twilio send failed on call %s: %r", self.call_id, exc)
        if outbox:
            self._outbox_ready.set()
            self._ensure_sender()

    def _ensure_sender(self) -> None:
        if self._sender is None and not self._closed:
            self._sender = asyncio.create_task(
                self._send_loop(), name=f"twilio-send-{self.call_id}"
            )

    async def _send_loop(self) -> None:
        while not self._closed:
            if not self._outbox:
                self._outbox_ready.clear()
                await self._outbox_ready.wait()
                continue
            frame = self._outbox.popleft()
            # Short tails are held for the next delta; once the queue runs dry, send them.
            if not self._outbox and self._pending:
                self._flush_pending()
            if not await self._send(frame, self._generation):
                return

    async def _send(self, frame: str, generation: int | None = None) -> bool:
        self._sends += 1
        try:
            async with self._send_lock:
                if generation is not None and generation != self._generation:
                    return True  # popped before a clear: this audio must never be heard
                with self._send_watch:
                    await self._ws.send_text(frame)
        except Exception as exc:  # a dead or stuck socket; the receive side reports the end
            log.info("Twilio send failed on call %s: %r", self.call_id, exc)
            self._outbox.clear()
            return False
        finally:
            self._sends -= 1
        return True

    async def clear(self) -> None:
        """Stop agent audio now: drop the local queue, send Twilio `clear`, start a new epoch."""
        # Frames still queued here never reached Twilio; they were never heard.
        self._generation += 1
        self._outbox.clear()
        self._pending = b""
        self._pending_item = None
        self._tail_mark = None  # its audio was dropped with the rest
        self._unmarked = 0
        if not self._closed:
            await self._send(self._frames.clear)
        self.playback.cleared()

    async def close(self, reason: str) -> None:
        """Close the stream (idempotent); Twilio then ends the `<Connect>`."""
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        self._idle.close()
        self._send_watch.close()
        if self._tail_timer is not None:
            self._tail_timer.cancel()
            self._tail_timer = None
        self._outbox.clear()
        self._outbox_ready.set()
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
            self._sender = None
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._send_timeout_s):
                await self._ws.close(1000, reason[:120])
