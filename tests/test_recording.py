"""Call recordings: both sides tapped at the leg seam, laid out on one clock, cut where the
caller stopped hearing the agent, stored in Postgres or files, served by byte range."""

from __future__ import annotations

import base64
import io
import os
import threading
import time
import uuid
import wave
from array import array
from collections.abc import AsyncGenerator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from app.calls import recording
from app.calls.recording import SPILL_BYTES, WINDOW_SAMPLES, CallRecorder, RecordingLeg
from app.calls.recording_store import FileStore, LargeObjectStore, get_recording
from telephony import audio
from telephony.legs.leg import AudioIn, DtmfIn, LegClosed, LegEvent
from telephony.playback import PlaybackTracker
from tests.console_support import bearer
from tests.e2e_support import call_stack, wait_until
from tests.test_e2e_call import hear_greeting, scenario

RATE = 8000


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tone(ms: int) -> bytes:
    return audio.pcm16_to_mulaw(audio.tone_pcm16(440, ms, amplitude=0.4))


def channels(wav: bytes) -> tuple[array[int], array[int]]:
    with wave.open(io.BytesIO(wav)) as r:
        assert (r.getnchannels(), r.getsampwidth(), r.getframerate()) == (2, 2, RATE)
        frames = array("h", r.readframes(r.getnframes()))
    return frames[0::2], frames[1::2]


def active_ms(track: array[int], start_ms: int, end_ms: int) -> int:
    """Milliseconds (in 10 ms steps) of `track` within [start, end) that hold sound."""
    total = 0
    for ms in range(start_ms, end_ms, 10):
        window = track[ms * 8 : (ms + 10) * 8]
        if window and max(abs(v) for v in window) > 200:
            total += 10
    return total


def test_agent_audio_is_recorded_as_played_and_cut_where_a_clear_stopped_it() -> None:
    clock = FakeClock()
    rec = CallRecorder("audio/pcmu", max_ms=60_000, clock=clock)
    # Caller frames by the stream's timestamps, 20 ms each, from 0 to 1 s.
    clock.now = 100.05
    for n in range(50):
        rec.caller_audio(tone(20), n * 20)
    # Agent: 1 s handed over at 0.2 s, and a barge-in clears it at 0.6 s.
    clock.now = 100.2
    rec.agent_audio(tone(1000))
    clock.now = 100.6
    rec.cleared()
    # Then 300 ms more at 0.9 s (plays at once: nothing is queued before it).
    clock.now = 100.9
    rec.agent_audio(tone(300))
    recording = rec.render()
    caller, agent = channels(recording.wav)

    assert recording.duration_ms == 1200
    assert active_ms(caller, 50, 1050) == 1000
    assert active_ms(caller, 0, 50) == 0
    assert active_ms(agent, 200, 600) == 400  # what was heard before the clear
    assert active_ms(agent, 600, 900) == 0  # the other 600 ms were never heard
    assert active_ms(agent, 900, 1200) == 300
    assert active_ms(agent, 0, 200) == 0


def test_agent_audio_handed_over_faster_than_real_time_plays_back_to_back() -> None:
    clock = FakeClock()
    rec = CallRecorder("audio/pcma", max_ms=60_000, clock=clock)
    for _ in range(5):  # five 200 ms deltas arrive within one instant
        rec.agent_audio(audio.pcm16_to_alaw(audio.tone_pcm16(300, 200, amplitude=0.4)))
    _, agent = channels(rec.render().wav)
    assert active_ms(agent, 0, 1000) == 1000


def test_caller_frames_sent_as_base64_text_are_recorded_like_bytes() -> None:
    import base64

    clock = FakeClock()
    rec = CallRecorder("audio/pcmu", max_ms=60_000, clock=clock)
    for n in range(10):
        rec.caller_audio(base64.b64encode(tone(20)).decode(), n * 20)
    rec.caller_audio("not base64!", 200)
    caller, _ = channels(rec.render().wav)
    assert active_ms(caller, 0, 200) == 200


def test_a_recording_longer_than_its_limit_keeps_its_start_and_says_so() -> None:
    clock = FakeClock()
    rec = CallRecorder("audio/pcmu", max_ms=1000, clock=clock)
    for n in range(100):
        clock.now = 100 + n * 0.02
        rec.caller_audio(tone(20), n * 20)
    recording = rec.render()
    assert recording.truncated
    assert recording.duration_ms <= 1020


@pytest.mark.parametrize(
    "stamps",
    [
        [0, -160, *range(20, 2000, 20)],  # regressing
        [0, 20, 2**32 // 8, 40, 60],  # a jump of 149 hours, then back
        [0, 20, 10**15, 10**15 + 20, 3, 10**4000],  # hours, then nonsense of any size
        [2**31, 0, 2**31 + 20, 5 * 3600 * 1000],  # a new stream, then a jump of hours
    ],
)
def test_timestamps_place_caller_audio_only_near_its_arrival_and_never_past_the_call(
    stamps: list[int],
) -> None:
    clock = FakeClock()
    rec = CallRecorder("audio/pcmu", max_ms=4 * 3600 * 1000, clock=clock)
    for n, stamp in enumerate(stamps):
        clock.now = 100 + n * 0.02
        rec.caller_audio(tone(20), stamp)
    clock.now += 0.5
    rec.stop()  # the hang-up
    lasted_ms = (clock.now - 100) * 1000
    clock.now += 30  # the end-of-call work before the render is not part of the call
    recording = rec.render()
    caller, _ = channels(recording.wav)
    assert recording.duration_ms <= lasted_ms + 1000
    assert rec.largest_window_bytes <= 2 * 8 * (lasted_ms + 1000)
    assert active_ms(caller, 0, recording.duration_ms) >= 20  # the audio is there


def test_a_long_recording_is_laid_out_in_windows_not_one_buffer() -> None:
    clock = FakeClock()
    rec = CallRecorder("audio/pcmu", max_ms=4 * 3600 * 1000, clock=clock)
    for n in range(5000):  # 100 s of caller audio
        clock.now = 100 + n * 0.02
        rec.caller_audio(tone(20), n * 20)
    recording = rec.render()
    caller, _ = channels(recording.wav)
    assert 100_000 <= recording.duration_ms <= 101_000
    assert rec.largest_window_bytes == 2 * WINDOW_SAMPLES  # 30 s of stereo G.711 at a time
    assert active_ms(caller, 0, 100_000) == 100_000  # no gap at a window boundary


def spool_files(directory: Path) -> int:
    """Files of `directory` this process holds open (the spool's are unlinked at once)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        held += target.startswith(str(directory))
    return held


def feed_a_minute(rec: CallRecorder, clock: FakeClock, *, check_held: bool = False) -> bytes:
    """60 s of Twilio-like traffic (base64 caller frames by timestamp, agent deltas, a clear);
    returns the caller's G.711 as sent."""
    sent = bytearray()
    for n in range(3000):
        clock.now = 100 + n * 0.02
        frame = bytes((n + i) % 256 for i in range(160))
        sent += frame
        rec.caller_audio(base64.b64encode(frame).decode(), n * 20)
        if n % 5 == 0 and (n // 250) % 2:  # the agent talks every other 5 s, 100 ms deltas
            rec.agent_audio(base64.b64encode(tone(100)).decode())
        if n % 1000 == 999:
            rec.cleared()
        if check_held:
            assert rec._spool.settle(timeout=10)  # the writer's thread has written its spills
            assert rec.held_bytes < SPILL_BYTES + 1200  # at most one record past the limit
    return bytes(sent)


def test_a_recording_holds_little_in_memory_and_the_rest_in_a_spool_file_gone_after(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    rec = CallRecorder("audio/pcmu", max_ms=3_600_000, clock=clock, spool_dir=tmp_path)
    sent = feed_a_minute(rec, clock, check_held=True)
    assert spool_files(tmp_path) == 1 and os.listdir(tmp_path) == []  # open, unlinked
    recording = rec.render()
    # Rendered in pieces (a header, then a window of PCM at a time), the same WAV as one buffer.
    wav = recording.wav
    assert len(recording.parts) > 2 and recording.size == len(wav)
    assert wav == audio.pcm16_to_wav(wav[44:], 8000, channels=2)
    caller, agent = channels(wav)
    # Every caller sample is there, where its timestamp put it.
    assert caller[: len(sent)] == array("h", audio.mulaw_to_pcm16(sent))
    assert active_ms(agent, 5000, 10_000) > 0 and active_ms(agent, 0, 5000) == 0
    rec.discard()
    assert spool_files(tmp_path) == 0


def test_a_spool_file_that_cannot_be_made_leaves_the_audio_in_memory_and_the_recording_whole(
    tmp_path: Path,
) -> None:
    recordings = []
    for directory in (tmp_path, tmp_path / "missing"):
        clock = FakeClock()
        rec = CallRecorder("audio/pcmu", max_ms=3_600_000, clock=clock, spool_dir=directory)
        feed_a_minute(rec, clock)
        recordings.append(rec.render())
        rec.discard()
    spilled, unspilled = recordings
    assert spilled.wav == unspilled.wav and spilled.duration_ms == 60_000


def test_a_slow_disk_holds_up_the_spool_writer_not_the_recorder_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event loop records; the writes wait in the spool writer's thread."""
    disk_free = threading.Event()
    writes: list[str] = []

    def slow_pwrite(fd: int, data: memoryview, offset: int) -> int:
        writes.append(threading.current_thread().name)
        disk_free.wait(10)
        return os.pwrite(fd, data, offset)

    monkeypatch.setattr(recording, "_pwrite", slow_pwrite)
    clock = FakeClock()
    rec = CallRecorder("audio/pcmu", max_ms=3_600_000, clock=clock, spool_dir=tmp_path)
    started = time.monotonic()
    sent = feed_a_minute(rec, clock)  # every spill handed over while the disk takes nothing
    fed_in = time.monotonic() - started
    assert fed_in < 5  # not one 10 s wait on the recording thread
    assert rec.held_bytes > 2 * SPILL_BYTES  # what waits for the disk is in memory meanwhile
    assert writes and threading.current_thread().name not in writes
    disk_free.set()
    assert rec._spool.settle(timeout=10)
    assert rec.held_bytes < SPILL_BYTES + 1200
    caller, _ = channels(rec.render().wav)
    assert caller[: len(sent)] == array("h", audio.mulaw_to_pcm16(sent))
    rec.discard()
    assert spool_files(tmp_path) == 0


def test_a_spool_file_that_fails_midway_keeps_the_rest_in_memory_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0

    def filling_pwrite(fd: int, data: memoryview, offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise OSError(28, "No space left on device")
        return os.pwrite(fd, data, offset)

    clock = FakeClock()
    whole = CallRecorder("audio/pcmu", max_ms=3_600_000, clock=clock, spool_dir=tmp_path)
    feed_a_minute(whole, clock)
    expected = whole.render().wav
    whole.discard()
    monkeypatch.setattr(recording, "_pwrite", filling_pwrite)
    clock = FakeClock()
    rec = CallRecorder("audio/pcmu", max_ms=3_600_000, clock=clock, spool_dir=tmp_path)
    feed_a_minute(rec, clock)
    assert rec.render().wav == expected and calls > 3
    rec.discard()
    assert spool_files(tmp_path) == 0


def test_a_discard_during_a_render_waits_for_it(tmp_path: Path) -> None:
    clock = FakeClock()
    rec = CallRecorder("audio/pcmu", max_ms=3_600_000, clock=clock, spool_dir=tmp_path)
    feed_a_minute(rec, clock)
    rec.seal()
    with rec._spool.read() as spooled:  # what a render in a thread holds
        rec.discard()  # the call's end gave up waiting for it
        assert spool_files(tmp_path) >= 1 and len(spooled) > 60 * 8000  # still readable
    assert spool_files(tmp_path) == 0
    rec.caller_audio(base64.b64encode(tone(20)).decode(), 60_000)  # nothing taken now
    with pytest.raises(RuntimeError):
        rec.render()


class FakeLeg:
    """A CallLeg that plays back what the test gives it."""

    audio_format = "audio/pcmu"

    def __init__(self, events: list[LegEvent]) -> None:
        self._events = events
        self.playback = PlaybackTracker()
        self.played: list[tuple[str, bytes]] = []
        self.clears = 0
        self.closed: str | None = None
        self.stream_sid = "MZ1"

    async def events(self) -> AsyncGenerator[LegEvent, None]:
        for e in self._events:
            yield e

    async def play(self, item_id: str, data: bytes) -> None:
        self.played.append((item_id, data))

    async def clear(self) -> None:
        self.clears += 1

    async def close(self, reason: str) -> None:
        self.closed = reason


async def test_the_recording_leg_passes_everything_through_and_taps_audio_only() -> None:
    inner = FakeLeg([AudioIn(tone(20), 0), DtmfIn("5"), AudioIn(tone(20), 20), LegClosed("stop")])
    rec = CallRecorder("audio/pcmu", max_ms=10_000)
    leg = RecordingLeg(inner, rec)  # type: ignore[arg-type]
    seen = [e async for e in leg.events()]
    await leg.play("item_1", tone(100))
    await leg.clear()
    await leg.close("bye")

    assert [type(e).__name__ for e in seen] == ["AudioIn", "DtmfIn", "AudioIn", "LegClosed"]
    assert inner.played == [("item_1", tone(100))] and inner.clears == 1
    assert inner.closed == "bye"
    assert leg.playback is inner.playback and leg.stream_sid == "MZ1"
    assert rec.frames == 4  # two caller frames, one agent delta, one clear


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("kind", ["postgres", "file"])
async def test_stores_keep_recordings_and_read_them_back_by_byte_range(
    engine: AsyncEngine, tmp_path: Path, kind: str, pieces: bool
) -> None:
    store = (
        LargeObjectStore(engine, chunk_bytes=1000) if kind == "postgres" else FileStore(tmp_path)
    )
    data = bytes(range(256)) * 20  # 5120 bytes: several large-object chunks
    # A rendered recording comes in pieces that do not line up with the store's chunks.
    given = [data[:44], data[44:700], b"", data[700:2999], data[2999:]] if pieces else data
    locator = await store.put(str(uuid.uuid4()), given)
    assert await store.read(locator, 0, 10) == data[:10]
    assert await store.read(locator, 2500, 1000) == data[2500:3500]
    assert await store.read(locator, 5000, 1000) == data[5000:]
    await store.delete(locator)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 1000])
async def test_a_saved_recording_is_one_large_object_and_a_second_save_keeps_the_first(
    engine: AsyncEngine, tmp_path: Path, chunk_bytes: int
) -> None:
    """Whether the object and its row go in one statement (fits one chunk) or not."""
    from datetime import UTC, datetime

    import sqlalchemy as sa

    from app.calls import store as call_store
    from app.calls.recording import Recording
    from app.calls.recording_store import Recordings
    from app.settings import Settings

    row, _ = await call_store.create_call(
        engine, call_sid="CArecsave", tenant_id="default", from_number=None, to_number=None
    )
    recordings = Recordings(engine, Settings(data_dir=tmp_path))
    recordings.store = recordings.stores["postgres"] = LargeObjectStore(engine, chunk_bytes)
    wav = bytes(range(256)) * 20  # 5120 bytes
    first = Recording((wav[:44], wav[44:]), 320, datetime.now(UTC), False)
    second = Recording((b"RIFF", wav), 321, datetime.now(UTC), True)

    async def objects() -> int:
        async with engine.connect() as conn:
            return int(await conn.scalar(sa.text("SELECT count(*) FROM pg_largeobject_metadata")))

    before = await objects()
    info = await recordings.save(row.id, first)
    assert (info.call_id, info.store, info.bytes, info.duration_ms) == (
        row.id,
        "postgres",
        5120,
        320,
    )
    assert await recordings.read(info, 0, 6000) == wav
    assert await objects() == before + 1
    again = await recordings.save(row.id, second)
    assert again == info  # the first is kept and the second's object is gone
    assert await objects() == before + 1
    assert await get_recording(engine, row.id) == info


async def test_the_file_store_reads_only_its_own_directory(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "recordings")
    with pytest.raises(ValueError):
        await store.read("../secrets.wav", 0, 10)


@pytest.fixture(params=["postgres", "file"])
def recording_store(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    if request.param == "file":
        return {"recording_store": "file", "recording_dir": tmp_path / "rec"}
    return {"recording_store": "postgres"}


async def test_a_call_with_a_barge_in_is_recorded_as_the_caller_heard_it_and_served_by_range(
    engine: AsyncEngine, recording_store: dict[str, object]
) -> None:
    async with call_stack(engine, scenario(reply_ms=4000), **recording_store) as stack:
        caller = stack.caller()
        await caller.dial()
        before = await hear_greeting(caller)
        await caller.play_speech(800)
        await caller.wait_for(lambda c: c.heard_ms >= before + 1500, 10)
        await caller.play_speech(600)  # barge-in: most of the 4 s reply is never heard
        await caller.wait_for(lambda c: len(c.clears) == 1, 10)
        await caller.play_silence(1500)
        await caller.hangup()
        await stack.events(caller)
        call_id = await stack.call_id(caller)
        await wait_until(lambda: get_recording(engine, call_id), 20, "recording stored")
        headers = await bearer(engine, Role.VIEWER)
        async with httpx.AsyncClient(base_url=stack.service.url, headers=headers) as http:
            whole = await http.get(f"/api/calls/{call_id}/recording")
            head = await http.get(
                f"/api/calls/{call_id}/recording", headers={"Range": "bytes=0-43"}
            )
            tail = await http.get(
                f"/api/calls/{call_id}/recording", headers={"Range": "bytes=-100"}
            )
            beyond = await http.get(
                f"/api/calls/{call_id}/recording", headers={"Range": "bytes=99999999-"}
            )
            timeline = (await http.get(f"/api/calls/{call_id}/timeline")).json()
        heard = caller.heard_timeline_mulaw()
        dropped_ms = caller.clears[0].dropped_ms
    caller_track, agent_track = channels(whole.content)
    # The caller heard `heard` from the stream's start; the agent channel holds the same.
    heard_pcm = array("h", audio.mulaw_to_pcm16(heard))
    heard_active = active_ms(heard_pcm, 0, len(heard_pcm) // 8)
    recorded_active = active_ms(agent_track, 0, len(agent_track) // 8)
    size = len(whole.content)

    assert whole.status_code == 200 and whole.headers["content-type"] == "audio/wav"
    assert whole.headers["accept-ranges"] == "bytes"
    assert abs(recorded_active - heard_active) <= 200, (recorded_active, heard_active)
    assert dropped_ms > 1000  # …and none of what the clear dropped is in the recording
    assert active_ms(caller_track, 0, len(caller_track) // 8) >= 1300  # 800 + 600 ms spoken
    assert head.status_code == 206 and head.content == whole.content[:44]
    assert head.headers["content-range"] == f"bytes 0-43/{size}"
    assert tail.status_code == 206 and tail.content == whole.content[-100:]
    assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{size}"
    recording = timeline["recording"]
    assert recording["url"] == f"/api/calls/{call_id}/recording" and recording["channels"] == 2
    assert 0 < recording["offset_ms"] < 2000  # it starts with the media stream, after the webhook


async def test_recording_can_be_switched_off(engine: AsyncEngine) -> None:
    async with call_stack(engine, scenario(reply_ms=800), recording_enabled=False) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        await caller.hangup()
        await stack.events(caller)
        call_id = await stack.call_id(caller)
    assert await get_recording(engine, call_id) is None
