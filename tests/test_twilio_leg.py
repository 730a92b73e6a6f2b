"""The Twilio leg over a real WebSocket pair: the test plays Twilio, the leg is the server side."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from telephony.call_events import CallEventKind, MemorySink
from telephony.legs.leg import AudioIn, CallLeg, DtmfIn, LegClosed, LegEvent
from telephony.legs.twilio.events import StartInfo
from telephony.legs.twilio.leg import BYTES_PER_MS, CHUNK_MS, TwilioLeg, mark_name, parse_mark_name

CHUNK_BYTES = CHUNK_MS * BYTES_PER_MS

WAIT_S = 5.0
SID = "MZ00000000000000000000000000000001"


class ServerSocket:
    """The `websockets` server connection with Starlette's method names (what the app hands in)."""

    def __init__(self, ws: ServerConnection, send_delay_s: float = 0.0) -> None:
        self.ws = ws
        self.sent: list[str] = []
        self.send_delay_s = send_delay_s

    async def receive_text(self) -> str:
        message = await self.ws.recv()
        return message if isinstance(message, str) else message.decode("utf-8", "replace")

    async def send_text(self, data: str) -> None:
        if self.send_delay_s:
            await asyncio.sleep(self.send_delay_s)  # a slow network in front of Twilio
        await self.ws.send(data)
        self.sent.append(data)

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason)


@dataclass
class Pair:
    leg: TwilioLeg
    twilio: ClientConnection
    sink: MemorySink
    socket: ServerSocket
    events: list[LegEvent]

    async def send(self, message: dict[str, Any] | str) -> None:
        await self.twilio.send(message if isinstance(message, str) else json.dumps(message))

    async def recv(self) -> dict[str, Any]:
        async with asyncio.timeout(WAIT_S):
            message = json.loads(await self.twilio.recv())
        assert isinstance(message, dict)
        return message

    async def event(self, predicate: Callable[[LegEvent], bool]) -> LegEvent:
        async with asyncio.timeout(WAIT_S):
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                await asyncio.sleep(0.005)

    async def sync(self) -> None:
        """Round trip: every frame sent before this has been handled by the leg."""
        digit = str(len(self.events) % 10)
        count = sum(1 for e in self.events if isinstance(e, DtmfIn))
        await self.send(dtmf(digit))
        async with asyncio.timeout(WAIT_S):
            while sum(1 for e in self.events if isinstance(e, DtmfIn)) <= count:  # noqa: ASYNC110
                await asyncio.sleep(0.005)


def b64(audio: bytes) -> str:
    """Agent audio as the Realtime API hands it to the leg."""
    return base64.b64encode(audio).decode()


def media(payload: bytes | str, timestamp: str = "20") -> dict[str, Any]:
    encoded = payload if isinstance(payload, str) else base64.b64encode(payload).decode()
    return {
        "event": "media",
        "sequenceNumber": "3",
        "streamSid": SID,
        "media": {"track": "inbound", "chunk": "1", "timestamp": timestamp, "payload": encoded},
    }


def dtmf(digit: str) -> dict[str, Any]:
    return {"event": "dtmf", "streamSid": SID, "dtmf": {"track": "inbound_track", "digit": digit}}


def mark(name: str) -> dict[str, Any]:
    return {"event": "mark", "streamSid": SID, "mark": {"name": name}}


STOP = {"event": "stop", "streamSid": SID, "stop": {"accountSid": "AC1", "callSid": "CA1"}}
START = StartInfo.model_validate(
    {"streamSid": SID, "callSid": "CA1", "accountSid": "AC1", "tracks": ["inbound"]}
)


@pytest.fixture
async def make_pair() -> AsyncIterator[Callable[..., Any]]:
    baseline = asyncio.all_tasks()
    cleanups: list[Any] = []

    async def make(send_delay_s: float = 0.0, chunk_ms: int = CHUNK_MS) -> Pair:
        ready: asyncio.Future[tuple[TwilioLeg, ServerSocket, list[LegEvent]]] = (
            asyncio.get_running_loop().create_future()
        )
        finished = asyncio.Event()
        sink = MemorySink()

        async def handler(ws: ServerConnection) -> None:
            socket = ServerSocket(ws, send_delay_s)
            leg = TwilioLeg(socket, START, sink, "call-1", chunk_ms=chunk_ms)
            _typed: CallLeg = leg  # mypy checks the protocol
            events: list[LegEvent] = []
            ready.set_result((leg, socket, events))
            async for event in leg.events():
                events.append(event)
            await leg.close("stream over")
            finished.set()

        server = await serve(handler, "127.0.0.1", 0)
        port = next(iter(server.sockets)).getsockname()[1]
        twilio = await connect(f"ws://127.0.0.1:{port}/twilio/media")

        async def cleanup() -> None:
            await twilio.close()
            async with asyncio.timeout(WAIT_S):
                await finished.wait()
            server.close()
            await server.wait_closed()

        cleanups.append(cleanup)
        async with asyncio.timeout(WAIT_S):
            leg, socket, events = await ready
        return Pair(leg, twilio, sink, socket, events)

    yield make
    for cleanup in cleanups:
        await cleanup()
    leftover = [t for t in asyncio.all_tasks() - baseline if t is not asyncio.current_task()]
    assert not leftover, leftover


async def test_media_dtmf_and_stop_become_leg_events(make_pair):
    pair = await make_pair()
    audio = bytes(range(160))
    await pair.send(media(audio, "40"))
    await pair.send(dtmf("5"))
    await pair.send(STOP)
    closed = await pair.event(lambda e: isinstance(e, LegClosed))
    assert pair.events == [AudioIn.of_bytes(audio, 40), DtmfIn("5"), closed]
    assert closed == LegClosed("stop")


async def test_malformed_frames_are_recorded_and_survived(make_pair):
    pair = await make_pair()
    oversized = json.dumps(media("A" * 80_000))
    await pair.send("this is not json")
    await pair.send(json.dumps({"event": "bogus", "streamSid": SID}))
    await pair.send(media("!!!not-base64!!!"))
    await pair.send(media(b"\x00" * 160, timestamp="soon"))
    await pair.send("[1, 2, 3]")
    await pair.send(oversized)
    await pair.send(mark("not-one-of-ours"))
    await pair.send(media(b"\x01" * 160))
    await pair.send(STOP)
    await pair.event(lambda e: isinstance(e, LegClosed))
    assert pair.events == [AudioIn.of_bytes(b"\x01" * 160, 20), LegClosed("stop")]
    malformed = [e for e in pair.sink.events if e.kind == CallEventKind.MALFORMED_FRAME]
    assert len(malformed) == 7
    assert pair.leg.malformed_frames == 7
    big = malformed[5].data
    assert big["length"] == len(oversized)
    assert len(big["excerpt"]) <= 120
    assert all(len(e.data["excerpt"]) <= 120 for e in malformed)
    assert malformed[0].data["excerpt"] == "this is not json"


async def test_play_sends_20ms_media_frames_each_followed_by_its_mark(make_pair):
    pair = await make_pair()
    audio = bytes(range(200)) * 2  # 50 ms
    await pair.leg.play("item:a", b64(audio))
    frames = [await pair.recv() for _ in range(6)]
    assert [f["event"] for f in frames] == ["media", "mark"] * 3
    payloads = [base64.b64decode(f["media"]["payload"]) for f in frames[::2]]
    assert [len(p) for p in payloads] == [CHUNK_BYTES, CHUNK_BYTES, 80]
    assert b"".join(payloads) == audio
    assert all(f["streamSid"] == SID for f in frames)
    marks = [parse_mark_name(f["mark"]["name"]) for f in frames[1::2]]
    assert marks == [(0, 20, "item:a"), (0, 40, "item:a"), (0, 50, "item:a")]
    assert pair.leg.playback.queued_ms("item:a") == 50


async def test_a_response_ending_in_a_short_tail_is_sent_whole_with_larger_chunks(make_pair):
    # 60 ms chunks; a 150 ms delta leaves a tail, and the response's last delta is shorter
    # than a chunk: neither may wait for audio that never comes.
    pair = await make_pair(chunk_ms=60)
    first = bytes(range(200)) * 6  # 150 ms
    last = b"\x55" * 8 * 10  # 10 ms
    await pair.leg.play("item:a", b64(first))
    await pair.sync()
    await pair.leg.play("item:a", b64(last))
    frames: list[dict[str, Any]] = []
    sent = b""
    async with asyncio.timeout(5):
        while len(sent) < len(first + last):
            frame = await pair.recv()
            frames.append(frame)
            if frame["event"] == "media":
                sent += base64.b64decode(frame["media"]["payload"])
        frames.append(await pair.recv())  # the mark after the last media
    assert sent == first + last
    sizes = [len(base64.b64decode(f["media"]["payload"])) for f in frames if f["event"] == "media"]
    assert sizes[:2] == [480, 480]  # whole chunks where the audio allows
    assert parse_mark_name(frames[-1]["mark"]["name"]) == (0, 160, "item:a")
    assert pair.leg.playback.queued_ms("item:a") == 160


async def test_a_tail_is_closed_by_the_caller_frames_that_stream_in_without_its_timer(
    make_pair, monkeypatch
):
    """While the caller streams (Twilio sends 50 frames a second for the whole call), the
    mark closing a short tail goes out at a caller frame once a chunk's time has passed; the
    backstop timer (made far too late here to matter) is only for a stream gone quiet."""
    monkeypatch.setattr("telephony.legs.twilio.leg.TAIL_BACKSTOP_S", 60.0)
    pair = await make_pair()
    await pair.leg.play("item:a", b64(b"\x55" * 8 * 10))  # 10 ms: less than a chunk
    first = await pair.recv()
    assert first["event"] == "media"

    async def stream() -> None:
        while True:
            await pair.send(media(b"\xff" * 160))
            await asyncio.sleep(0.02)

    streaming = asyncio.create_task(stream())
    try:
        closing = await pair.recv()
    finally:
        streaming.cancel()
    assert parse_mark_name(closing["mark"]["name"]) == (0, 10, "item:a")


async def test_echoed_marks_count_as_heard_but_marks_of_cleared_audio_do_not(make_pair):
    pair = await make_pair()
    await pair.leg.play("item_1", b64(b"\x7f" * 8 * 400))  # 400 ms
    frames = [await pair.recv() for _ in range(40)]
    names = [f["mark"]["name"] for f in frames if f["event"] == "mark"]
    for name in names[:3]:
        await pair.send(mark(name))
    await pair.sync()
    assert pair.leg.playback.confirmed_ms("item_1") == 60

    await pair.leg.clear()
    assert (await pair.recv()) == {"event": "clear", "streamSid": SID}
    frozen = pair.leg.playback.confirmed_ms("item_1")
    assert 60 <= frozen < 400
    # Twilio echoes the marks of the audio it dropped; none of it was heard.
    for name in names[3:]:
        await pair.send(mark(name))
    await pair.sync()
    assert pair.leg.playback.confirmed_ms("item_1") == frozen
    assert not pair.leg.playback.is_playing()

    # New audio after the clear belongs to the next epoch and is tracked again.
    await pair.leg.play("item_2", b64(b"\x7f" * CHUNK_BYTES))
    media_frame, mark_frame = await pair.recv(), await pair.recv()
    assert media_frame["event"] == "media"
    assert parse_mark_name(mark_frame["mark"]["name"]) == (1, 20, "item_2")
    await pair.send(mark(mark_frame["mark"]["name"]))
    await pair.sync()
    assert pair.leg.playback.confirmed_ms("item_2") == 20


async def test_clear_drops_audio_still_queued_behind_a_slow_socket(make_pair):
    pair = await make_pair(send_delay_s=0.01)
    await pair.leg.play("item_1", b64(b"\x7f" * 8 * 2000))  # 2 s: 200 frames to send
    first = await pair.recv()
    assert first["event"] == "media"
    await pair.leg.clear()
    sent = [json.loads(frame) for frame in pair.socket.sent]
    kinds = [f["event"] for f in sent]
    assert kinds[-1] == "clear"
    assert kinds.count("media") < 20  # the rest never left the process
    # Nothing is sent after the clear (ten slow sends' worth of waiting to prove an absence),
    # and what was dropped does not count as heard.
    await asyncio.sleep(0.1)
    await pair.sync()
    assert [json.loads(f)["event"] for f in pair.socket.sent] == kinds
    assert pair.leg.playback.queued_ms("item_1") < 200


async def test_socket_disconnect_ends_the_events(make_pair):
    pair = await make_pair()
    await pair.send(media(b"\x00" * 160))
    await pair.twilio.close()
    closed = await pair.event(lambda e: isinstance(e, LegClosed))
    assert isinstance(closed, LegClosed)
    assert closed.reason.startswith("disconnected")


async def test_close_is_idempotent_and_closes_the_socket(make_pair):
    pair = await make_pair()
    await pair.leg.play("item_1", b64(b"\x7f" * 8 * 1000))
    await pair.leg.close("call ended")
    await pair.leg.close("again")
    await pair.leg.play("item_1", b64(b"\x7f" * 160))  # ignored once closed
    async with asyncio.timeout(WAIT_S):
        await pair.twilio.wait_closed()
    assert pair.twilio.close_code == 1000
    assert pair.twilio.close_reason == "call ended"


def test_mark_names_round_trip_item_ids_with_separators():
    assert parse_mark_name(mark_name(3, "item:with:colons", 120.5)) == (
        3,
        120.5,
        "item:with:colons",
    )
    assert parse_mark_name(mark_name(0, "item", 160.0)) == (0, 160, "item")
    assert mark_name(0, "item", 160.0) == "0:160:item"
    assert parse_mark_name("greeting") is None
    assert parse_mark_name("x:1:item") is None
    for bad in ("0:nan:item", "0:inf:item", "0:-5:item", "0:1e400:item"):
        assert parse_mark_name(bad) is None, bad


@pytest.mark.parametrize("extra_bytes", range(8))
async def test_a_line_of_any_byte_count_is_heard_to_its_end_once_its_marks_are_echoed(
    make_pair, extra_bytes
):
    """G.711 has 8 bytes a millisecond: a line of 900 ms plus 0-7 bytes ends when Twilio echoes
    its last mark (a mark rounded to a whole millisecond left .125-.375 ms unplayed for ever)."""
    pair = await make_pair()
    size = 900 * BYTES_PER_MS + extra_bytes
    await pair.leg.play("item_rb", b64(b"\x55" * size))
    names: list[str] = []
    sent = 0
    async with asyncio.timeout(WAIT_S):
        while not names or sent < size:
            frame = await pair.recv()
            if frame["event"] == "media":
                sent += len(base64.b64decode(frame["media"]["payload"]))
            elif frame["event"] == "mark":
                names.append(frame["mark"]["name"])
    if parse_mark_name(names[-1])[1] * BYTES_PER_MS < size:  # type: ignore[index]
        names.append((await pair.recv())["mark"]["name"])  # the tail's closing mark
    for name in names:
        await pair.send(mark(name))
    await pair.sync()
    playback = pair.leg.playback
    assert parse_mark_name(names[-1])[1] == size / BYTES_PER_MS  # type: ignore[index]
    assert not playback.is_playing()
    assert playback.ended_at("item_rb") is not None


async def test_an_item_queued_behind_another_starts_counting_when_that_one_ends(make_pair):
    pair = await make_pair()
    await pair.leg.play("item_a", b64(b"\x7f" * 8 * 100))
    await pair.leg.play("item_b", b64(b"\x7f" * 8 * 200))
    frames = [await pair.recv() for _ in range(30)]
    names = [f["mark"]["name"] for f in frames if f["event"] == "mark"]
    assert [parse_mark_name(n)[2] for n in names] == ["item_a"] * 5 + ["item_b"] * 10  # type: ignore[index]
    await asyncio.sleep(0.15)  # Twilio plays item_a meanwhile (and the caller waits for b)
    for name in names[:5]:
        await pair.send(mark(name))
    await pair.sync()
    playback = pair.leg.playback
    assert playback.confirmed_ms("item_a") == 100
    assert playback.current_item() == "item_b"
    # item_b began when item_a's last mark came back, not when it was queued 150 ms ago.
    assert playback.heard_ms("item_b") < 60


async def test_clear_counts_nothing_of_items_that_had_not_started(make_pair):
    pair = await make_pair()
    await pair.leg.play("item_a", b64(b"\x7f" * 8 * 300))
    await pair.leg.play("item_b", b64(b"\x7f" * 8 * 300))
    frames = [await pair.recv() for _ in range(60)]
    first_mark = next(f["mark"]["name"] for f in frames if f["event"] == "mark")
    await pair.send(mark(first_mark))
    await pair.sync()
    await asyncio.sleep(0.1)  # the caller hears more of item_a
    await pair.leg.clear()
    playback = pair.leg.playback
    assert 20 <= playback.heard_ms("item_a") < 300
    assert playback.heard_ms("item_b") == 0
    assert playback.queued_ms("item_b") == 0
    assert not playback.is_playing()
