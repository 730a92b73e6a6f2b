"""Call recording: both sides of a call, tapped at the call-leg seam, as one stereo WAV.

`RecordingLeg` wraps any `CallLeg` (the Twilio leg today, a SIP leg tomorrow) between the leg
and the bridge, so neither knows about recording:
- caller audio is recorded as it arrives (each `AudioIn` the bridge reads);
- agent audio is recorded as it is handed to the leg to play (`play`), and a `clear` (barge-in)
  cuts whatever of it had not been played yet: the recording holds what the caller heard.

Per frame the tap only appends a record (when, and the audio as received: not decoded) to
the call's spool, which holds up to `SPILL_BYTES` in memory and writes the rest to an unlinked
temporary file as the call goes: what a call holds does not grow with its length, and is no
objects for the collector to walk. The tracks are laid out on one clock and encoded
(`CallRecorder.render`, pure and CPU-bound, run in a thread) when the call ends: caller on the
left channel, agent on the right, 16-bit PCM at 8 kHz, which every browser plays and seeks.

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

import binascii
import contextlib
import logging
import mmap
import os
import queue
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from telephony.audio import Codec, decode, silence_byte, wav_header
from telephony.legs.leg import (
    AudioFormat,
    AudioIn,
    AudioLane,
    CallLeg,
    LegClosed,
    LegEvent,
    lanes_of,
)
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
# Laid out and decoded 10 s at a time: each step holds the GIL about a millisecond, so a render
# in its thread delays the event loop's thread by no more than that at a time.
WINDOW_SAMPLES = 10 * RATE
# What a recorder holds in memory before it writes it to the call's spool file.
SPILL_BYTES = 32 * 1024
# A record in the spool: kind, at (s, the recorder's clock), the caller frame's timestamp (ms,
# or NO_STAMP), size of the audio after it (> 0: base64 text, < 0: G.711 bytes, 0: none).
_HEADER = struct.Struct("<Bddi")
_pack = _HEADER.pack
CALLER, AGENT = 0, 1  # an agent record with no audio is a clear
NO_STAMP = -1.0  # no timestamp to place the frame by
Piece = tuple[int, int, int]  # a piece of a track: start sample, offset in the G.711, samples

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Recording:
    """A rendered recording: the WAV in `parts` (its header, then the PCM a window at a time),
    stored piece by piece, never joined into one buffer on the way."""

    parts: tuple[bytes, ...]
    duration_ms: int
    started_at: datetime
    truncated: bool
    sample_rate: int = RATE
    channels: int = 2

    @property
    def size(self) -> int:
        """The WAV's length in bytes."""
        return sum(len(p) for p in self.parts)

    @property
    def wav(self) -> bytes:
        """The whole WAV in one buffer (a copy: for tests and tools, not the store)."""
        return b"".join(self.parts)


class CallRecorder:
    """Collects one call's audio as it passes, cheaply; renders it once the call is over."""

    def __init__(
        self,
        audio_format: AudioFormat,
        *,
        max_ms: float,
        clock: Callable[[], float] = time.monotonic,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.audio_format = audio_format
        self._clock = clock
        self.started = clock()
        self.started_at = datetime.now(UTC)
        self._max_s = max_ms / 1000.0
        self._spool = _Spool(spool_dir)
        self._sealed = False
        self.frames = 0  # caller frames, agent audio and clears recorded
        self.truncated = False
        self.largest_window_bytes = 0  # the largest buffer a render laid out (tests, memory)
        self.ended: float | None = None

    # The taps: the hot path (50 caller frames a second a call), so each appends one record
    # to the spool and nothing else, inline; the render decodes.

    def caller_audio(self, payload: bytes | str, timestamp_ms: int | None) -> None:
        """One caller frame, as received (G.711 bytes, or the stream's base64 text)."""
        if not self._sealed:
            stamp = (
                timestamp_ms
                if timestamp_ms is not None and 0 <= timestamp_ms < MAX_STAMP_MS
                else NO_STAMP
            )
            self._record(CALLER, stamp, payload)

    def agent_audio(self, audio: bytes | str) -> None:
        """Agent audio handed to the leg to play (G.711 bytes, or the delta's base64 text)."""
        if audio and not self._sealed:
            self._record(AGENT, NO_STAMP, audio)

    def _record(self, kind: int, stamp: float, payload: bytes | str) -> None:
        """One record on the spool: base64 text kept as received (its size positive), G.711
        bytes as they are (negative); text that is not ASCII is no audio."""
        now = self._clock()
        if now - self.started > self._max_s:
            self.truncated = True
            return
        if isinstance(payload, str):
            try:
                data = payload.encode("ascii")
            except UnicodeEncodeError:
                data = b""
            size = len(data)
        else:
            data = payload
            size = -len(data)
        buf = self._spool.buf
        buf += _pack(kind, now, stamp, size)
        buf += data
        self.frames += 1
        if len(buf) >= SPILL_BYTES:
            self._spool.spill()

    def cleared(self) -> None:
        """The leg dropped all agent audio not yet played (barge-in)."""
        if not self._sealed:
            self._spool.buf += _pack(AGENT, self._clock(), NO_STAMP, 0)
            self.frames += 1

    @property
    def held_bytes(self) -> int:
        """What the recorder holds in memory now (the rest of the call is in its spool file)."""
        return self._spool.held_bytes

    # Rendering: pure, CPU-bound, run in a thread. The spool's frames are decoded once, in C,
    # into one buffer of G.711 (the recording itself, a byte a sample); the tracks are laid out
    # and interleaved from it window by window (plain copies) and decoded to PCM once, in C, so
    # rendering a long call holds the GIL for little time while other calls' audio runs on the
    # event loop. A piece is (start sample, offset in that buffer, samples).

    def _caller_track(self, frames: list[tuple[float, float, int, int]]) -> list[Piece]:
        """Every caller frame, placed."""
        placed: list[Piece] = []
        anchor: tuple[float, float] | None = None  # (arrival ms, stream timestamp ms)
        cursor = 0
        started = self.started
        for arrival, stamp, offset, length in frames:
            arrival_ms = (arrival - started) * 1000.0
            if stamp != NO_STAMP:
                if anchor is None or abs(anchor[0] + (stamp - anchor[1]) - arrival_ms) > (
                    MAX_SKEW_MS
                ):
                    anchor = (arrival_ms, stamp)  # the first frame, or a discontinuity
                at_ms = anchor[0] + (stamp - anchor[1])
            else:
                at_ms = max(arrival_ms, cursor / SAMPLES_PER_MS)
            start = max(0, round(at_ms * SAMPLES_PER_MS))
            placed.append((start, offset, length))
            cursor = start + length
        return placed

    def _agent_track(self, frames: list[tuple[float, float, int, int]]) -> list[Piece]:
        """Agent audio as played, cut at each clear."""
        placed: list[Piece] = []
        cursor = 0  # where the audio queued so far ends, in samples
        for at, _, offset, length in frames:
            now = max(0, round((at - self.started) * RATE))
            if not length:  # a clear (or audio that is none): nothing after `now` was heard
                # The pieces lie in order without overlap, so only the last can reach past it.
                while placed and placed[-1][0] >= now:
                    placed.pop()
                if placed:
                    start, off, size = placed[-1]
                    if start + size > now:
                        placed[-1] = (start, off, now - start)
                cursor = min(cursor, now)
                continue
            start = max(cursor, now)
            placed.append((start, offset, length))
            cursor = start + length
        return placed

    def stop(self) -> None:
        """The call is over (its leg closed): the recording ends here, whatever comes after."""
        if self.ended is None:
            self.ended = self._clock()

    def seal(self) -> None:
        """Take no more audio, so a render reads all there is (call it on the thread that
        records before rendering in another; render seals too)."""
        self._sealed = True

    def discard(self) -> None:
        """Release the recorded audio (its spool file), now or once a render in progress ends."""
        self._sealed = True
        self._spool.discard()

    def limit_samples(self) -> int:
        """The most samples the recording may hold: the call's length on our clock."""
        end = self.ended if self.ended is not None else self._clock()
        lasted = min(end - self.started, self._max_s)
        return max(0, round((lasted * 1000 + END_MARGIN_MS) * SAMPLES_PER_MS))

    def render(self) -> Recording:
        """The stereo WAV: caller left, agent right, on the recorder's clock."""
        self.seal()
        with self._spool.read() as spooled:
            g711, caller_frames, agent_frames = _decode(spooled)
        caller = self._caller_track(caller_frames)
        agent = self._agent_track(agent_frames)
        del caller_frames, agent_frames
        samples = max([s + n for s, _, n in caller] + [s + n for s, _, n in agent] + [0])
        samples = min(samples, self.limit_samples())
        codec: Codec = "pcma" if self.audio_format == "audio/pcma" else "pcmu"
        silence = silence_byte(codec)
        caller_bins, agent_bins = _bins(caller, samples), _bins(agent, samples)
        pcm: list[bytes] = [b""]  # the header's place
        for index, first in enumerate(range(0, samples, WINDOW_SAMPLES)):
            size = min(WINDOW_SAMPLES, samples - first)
            stereo = bytearray(2 * size)
            stereo[0::2] = _lay(g711, caller_bins.get(index, ()), first, size, silence)
            stereo[1::2] = _lay(g711, agent_bins.get(index, ()), first, size, silence)
            # G.711 decodes sample by sample, so the interleaved bytes decode to stereo PCM.
            pcm.append(decode(bytes(stereo), codec))
            self.largest_window_bytes = max(self.largest_window_bytes, len(stereo))
        pcm[0] = wav_header(sum(len(p) for p in pcm), RATE, channels=2)
        return Recording(
            parts=tuple(pcm),
            duration_ms=samples // SAMPLES_PER_MS,
            started_at=self.started_at,
            truncated=self.truncated,
        )


def _decode(
    spooled: memoryview,
) -> tuple[bytearray, list[tuple[float, float, int, int]], list[tuple[float, float, int, int]]]:
    """The spool's audio as G.711, and (at s, stream timestamp ms, offset in it, samples) of
    each caller frame and each agent record; base64 that is not is no audio."""
    g711 = bytearray()
    caller: list[tuple[float, float, int, int]] = []
    agent: list[tuple[float, float, int, int]] = []
    tracks = (caller, agent)
    a2b, error, unpack, header = (
        binascii.a2b_base64,
        binascii.Error,
        _HEADER.unpack_from,
        _HEADER.size,
    )
    pos, end = 0, len(spooled)
    while pos < end:
        kind, at, stamp, size = unpack(spooled, pos)
        pos += header
        offset = len(g711)
        if size > 0:
            try:
                g711 += a2b(spooled[pos : pos + size])
            except error:
                pass
            pos += size
        elif size < 0:
            g711 += spooled[pos : pos - size]
            pos -= size
        tracks[kind].append((at, stamp, offset, len(g711) - offset))
    return g711, caller, agent


def _bins(pieces: list[Piece], samples: int) -> dict[int, list[Piece]]:
    """The pieces that fall in each window (a piece across a boundary in both); none past the
    end."""
    bins: dict[int, list[Piece]] = {}
    for piece in pieces:
        start, _, length = piece
        end = min(samples, start + length)
        if start >= end:
            continue
        for index in range(start // WINDOW_SAMPLES, (end - 1) // WINDOW_SAMPLES + 1):
            bins.setdefault(index, []).append(piece)
    return bins


def _lay(g711: bytearray, pieces: Iterable[Piece], first: int, size: int, silence: int) -> bytes:
    """One window of a track: samples [first, first + size)."""
    track = bytearray([silence]) * size
    for start, offset, length in pieces:
        lo, hi = max(start, first), min(start + length, first + size)
        if lo < hi:
            at = offset - start
            track[lo - first : hi - first] = g711[at + lo : at + hi]
    return bytes(track)


class _SpoolWriter:
    """The process's one thread that writes spools to their files, in the order handed over,
    so a disk that is slow to take a write (its cache full of dirty pages, a busy device)
    holds up no call's audio on the event loop: the write releases the GIL as it waits."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[_Spool, bytearray]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, spool: _Spool, data: bytearray) -> None:
        thread = self._thread
        if thread is None or not thread.is_alive():  # first use, or a forked child
            with self._start_lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(
                        target=self._run, name="call-recording-spool", daemon=True
                    )
                    self._thread.start()
        self._queue.put((spool, data))

    def _run(self) -> None:
        get = self._queue.get
        while True:
            spool, data = get()
            spool.write_out(data)
            del spool, data


_writer = _SpoolWriter()
_pwrite = os.pwrite  # the spool's one write (tests stand in a slow or full disk here)


class _Spool:
    """A call's records, back to back, append-only: up to `SPILL_BYTES` of them in memory
    (`buf`, where the recorder appends), the rest handed to the spool writer's thread, which
    writes them to an unlinked temporary file (in TMPDIR, or `directory`, made at the first
    spill) that is gone once the spool is discarded or collected, or the process ends. Should
    the file fail (no space), the records stay in memory, in order: the recording is still
    saved."""

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self._directory = directory
        self.buf = bytearray()
        self._written = 0  # bytes in the file: the spool's first ones
        self._kept: list[bytearray] = []  # handed over after the file failed: next in order
        self._fd: int | None = None
        self._close: weakref.finalize[[int], _Spool] | None = None
        self._failed = False
        # Guards the counts below: a spill's write in the writer's thread, a render's read in
        # another, a discard on the event loop's.
        self._cond = threading.Condition(threading.Lock())
        self._pending = 0  # spills handed to the writer, not yet written
        self.pending_bytes = 0
        self._reading = 0
        self._discarded = False

    def spill(self) -> None:
        """Hand what is in memory to the writer's thread (kept in memory if the file failed)."""
        if self._failed:
            return
        data, self.buf = self.buf, bytearray()
        with self._cond:
            self._pending += 1
            self.pending_bytes += len(data)
        _writer.submit(self, data)

    def write_out(self, data: bytearray) -> None:
        """In the writer's thread: append `data` to the file (or keep it, if the file failed)."""
        try:
            if self._discarded:
                pass  # nobody will read it; the file is closed once this is counted
            elif self._failed:
                self._kept.append(data)
            else:
                try:
                    if self._fd is None:
                        fd, path = tempfile.mkstemp(prefix="call-recording-", dir=self._directory)
                        self._close = weakref.finalize(self, os.close, fd)
                        self._fd = fd
                        os.unlink(path)
                    self._write(self._fd, data)
                except Exception as e:  # OSError (no space, no directory), or anything else
                    self._failed = True
                    self._kept.append(data)
                    log.warning(
                        "call recording: the audio stays in memory, its spool file failed: %s", e
                    )
        finally:
            with self._cond:
                self._pending -= 1
                self.pending_bytes -= len(data)
                release = self._discarded and not self._pending and not self._reading
                self._cond.notify_all()
            if release:
                self._release()

    def _write(self, fd: int, data: bytearray) -> None:
        with memoryview(data) as view:
            done = 0
            while done < len(view):
                done += _pwrite(fd, view[done:], self._written + done)
        self._written += len(data)

    @property
    def held_bytes(self) -> int:
        """Bytes in memory: the buffer, spills not yet written, and what the file did not take."""
        return len(self.buf) + self.pending_bytes + sum(len(part) for part in self._kept)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every spill handed over is written (or kept); False if it timed out."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    @contextlib.contextmanager
    def read(self) -> Iterator[memoryview]:
        """All of the spool; nothing may be appended meanwhile. Waits for the writer's thread to
        write what it was handed (call it from a thread of its own, as a render is)."""
        with self._cond:
            if self._discarded:
                raise RuntimeError("the recording was discarded")
            self._reading += 1
            self._cond.wait_for(lambda: not self._pending)
        try:
            fd = self._fd
            if fd is not None and self.buf and not self._failed:
                try:
                    self._write(fd, self.buf)
                    self.buf = bytearray()
                except OSError:
                    self._failed = True
            rest = b"".join([*self._kept, self.buf]) if self._kept else self.buf
            if fd is None or not self._written:
                with memoryview(rest) as view:
                    yield view
            elif rest:  # the file stopped taking it: both parts, in memory
                with memoryview(os.pread(fd, self._written, 0) + rest) as view:
                    yield view
            else:
                with (
                    mmap.mmap(fd, self._written, access=mmap.ACCESS_READ) as mapped,
                    memoryview(mapped) as view,
                ):
                    yield view
        finally:
            with self._cond:
                self._reading -= 1
                release = self._discarded and not self._reading and not self._pending
            if release:
                self._release()

    def discard(self) -> None:
        with self._cond:
            self._discarded = True
            if self._reading or self._pending:
                return  # the read or the write in progress releases it
        self._release()

    def _release(self) -> None:
        if self._close is not None:
            self._close()  # closes the file, once
        self.buf = bytearray()
        self._kept = []


class RecordingLeg:
    """A `CallLeg` that records what passes through it (see the module docstring)."""

    def __init__(self, inner: CallLeg, recorder: CallRecorder) -> None:
        self.inner = inner
        self.recorder = recorder
        self.audio_format: AudioFormat = inner.audio_format
        self.playback: PlaybackTracker = inner.playback
        # The synchronous lanes (a LaneLeg: the Twilio and SIP legs): the leg calls the recorder
        # itself on them (its taps), so a frame costs no layer here; play() is then recorded by
        # the same tap.
        self.set_audio_lane: Callable[[AudioLane | None], None] | None = None
        self.play_nowait: Callable[[str, str, int], None] | None = None
        self._tapped = False
        lanes = lanes_of(inner)
        if lanes is not None:
            lanes.set_taps(audio=recorder.caller_audio, play=recorder.agent_audio)
            self._tapped = True
            self.set_audio_lane = lanes.set_audio_lane
            self.play_nowait = lanes.play_nowait
        # What the leg measured of its media (the SIP leg's RTP reception), passed through.
        self.media_report: Callable[[], dict[str, float | int]] | None = getattr(
            inner, "media_report", None
        )
        # Digits to the far side (the leg's own way: RFC 4733 or tones), passed through; tones
        # the Twilio leg plays go through its play tap, so the recording has them.
        self.send_digits: Callable[[str], Awaitable[str]] | None = getattr(
            inner, "send_digits", None
        )

    async def events(self) -> AsyncGenerator[LegEvent, None]:
        record = self.recorder.caller_audio
        async with contextlib.aclosing(self.inner.events()) as events:  # closed with this one
            async for event in events:
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
