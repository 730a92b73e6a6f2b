"""The lanes of the audio hot path (app/legs/twilio/media_ws.py, telephony/realtime_wire.py): frames
handled in the socket's callback, never out of order with what goes the task way, and the
task way taken whenever the lane cannot."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from sqlalchemy.ext.asyncio import AsyncEngine
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from app.legs.twilio.media_ws import LANE_EXTENSION, MediaWebSocketProtocol
from telephony.legs.leg import LANE_METHODS, LaneLeg
from telephony.legs.sip.leg import SipLeg
from telephony.legs.twilio.leg import TwilioLeg
from telephony.realtime_wire import LaneConnection
from telephony.sim.scenario import Scenario
from telephony.ws_frames import MaskSource, client_text_frame, server_text_frame
from tests.e2e_support import call_stack, wait_until
from tests.server_proc import free_port

WAIT_S = 10.0


class LaneApp:
    """A raw ASGI app on MediaWebSocketProtocol: its lane takes texts starting with "L" while
    the app waits for its next message (as TwilioLeg's does); the app reads only when told."""

    def __init__(self) -> None:
        self.by_lane: list[str] = []
        self.by_asgi: list[str] = []
        self.read = asyncio.Semaphore(0)  # one release: read one message
        self.waiting = False
        self.protocol: MediaWebSocketProtocol | None = None
        self.sent_nowait: list[bool] = []
        self.send_now = asyncio.Event()
        self.closed = asyncio.Event()

    def lane(self, data: bytes) -> bool:
        if not self.waiting or not data.startswith(b"L"):
            return False
        try:
            text = data.decode()  # a lane takes only what it has parsed (see media_ws)
        except UnicodeDecodeError:
            return False
        self.by_lane.append(text)
        if text == "L-reply":
            assert self.protocol is not None
            self.sent_nowait.append(self.protocol.send_text_nowait(["r1", "r2", "r3"]))
        return True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "websocket"
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        self.protocol = scope["extensions"][LANE_EXTENSION]
        self.protocol.set_lane(self.lane)
        while True:
            await self.read.acquire()
            self.waiting = True
            message = await receive()
            self.waiting = False
            if message["type"] == "websocket.disconnect":
                break
            self.by_asgi.append(message["text"])
            if message["text"] == "close":
                await send({"type": "websocket.close", "code": 1000})
                self.sent_nowait.append(self.protocol.send_text_nowait(["after close"]))
                break
            await asyncio.sleep(0.05)  # the app is busy with it: the lane must not jump ahead
        self.closed.set()


@contextlib.asynccontextmanager
async def lane_server(app: Any, **config: Any) -> AsyncIterator[str]:
    """uvicorn on MediaWebSocketProtocol serving `app`; yields its ws:// URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, ws=MediaWebSocketProtocol, log_config=None, **config
        )
    )
    task = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started, WAIT_S, "server started")
        yield f"ws://127.0.0.1:{port}/"
    finally:
        if isinstance(app, LaneApp):
            for _ in range(10):
                app.read.release()  # let the app read its disconnect
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)


@contextlib.asynccontextmanager
async def lane_client(handler: Any, lane: Any) -> AsyncIterator[LaneConnection]:
    """A websockets server running `handler`, and a LaneConnection to it with `lane` set."""
    async with serve(handler, "127.0.0.1", 0, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(
            f"ws://127.0.0.1:{port}/", compression=None, create_connection=LaneConnection
        ) as conn:
            assert isinstance(conn, LaneConnection)
            conn.lane = lane
            yield conn


async def test_the_server_lane_takes_a_frame_only_when_nothing_waits_before_it() -> None:
    app = LaneApp()
    async with lane_server(app) as url, connect(url, compression=None) as ws:
        # The app is not reading: "A1" waits for it, so "L2" must wait behind it.
        await ws.send("A1")
        await ws.send("L2")
        await asyncio.sleep(0.1)
        assert app.by_lane == [] and app.by_asgi == []
        app.read.release()  # takes A1, busy with it while L2 comes in
        await wait_until(lambda: app.by_asgi == ["A1"], WAIT_S, "A1 read")
        app.read.release()
        await wait_until(lambda: app.by_asgi == ["A1", "L2"], WAIT_S, "L2 read in order")
        # Now the app waits for its next message: a lane frame is taken where it arrives.
        app.read.release()
        await wait_until(lambda: app.waiting, WAIT_S, "app waiting")
        await ws.send("L3")
        await wait_until(lambda: app.by_lane == ["L3"], WAIT_S, "L3 by the lane")
        await ws.send("A4")  # refused by the lane: the app gets it
        await wait_until(lambda: app.by_asgi == ["A1", "L2", "A4"], WAIT_S, "A4 read")
        # Two frames in one write while the app waits: A5 is queued for it (the app has not
        # run yet), so L6, right behind it, must not be taken ahead of it.
        app.read.release()
        await wait_until(lambda: app.waiting, WAIT_S, "app waiting")
        ws.protocol.send_text(b"A5")
        ws.protocol.send_text(b"L6")
        ws.transport.write(b"".join(ws.protocol.data_to_send()))
        app.read.release()
        await wait_until(lambda: len(app.by_asgi) == 5, WAIT_S, "A5 and L6 read")
    assert app.by_asgi == ["A1", "L2", "A4", "A5", "L6"]
    assert app.by_lane == ["L3"]


async def test_the_server_lane_writes_several_messages_at_once_and_nothing_after_a_close() -> None:
    app = LaneApp()
    async with lane_server(app) as url, connect(url, compression=None) as ws:
        app.read.release()
        await wait_until(lambda: app.waiting, WAIT_S, "app waiting")
        await ws.send("L-reply")
        got = [await asyncio.wait_for(ws.recv(), WAIT_S) for _ in range(3)]
        assert got == ["r1", "r2", "r3"]
        await wait_until(lambda: app.waiting, WAIT_S, "app waiting again")
        await ws.send("close")
        await asyncio.wait_for(app.closed.wait(), WAIT_S)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), WAIT_S)
    assert app.sent_nowait == [True, False]  # the write after the close was refused
    assert ws.close_code == 1000


async def test_a_protocol_error_on_the_lane_server_still_tells_the_peer_why() -> None:
    app = LaneApp()
    async with lane_server(app) as url, connect(url, compression=None, max_size=None) as ws:
        app.read.release()
        await wait_until(lambda: app.waiting, WAIT_S, "app waiting")
        # Over uvicorn's ws_max_size (16 MiB by default), sent while the server reads it.
        with contextlib.suppress(ConnectionClosed):
            await ws.send("x" * (17 * 1024 * 1024))
        with contextlib.suppress(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), WAIT_S)
    assert ws.close_code == 1009


async def test_a_text_frame_that_is_not_utf8_closes_the_lane_server_with_1007() -> None:
    """The lane is offered a frame's bytes before they are checked as UTF-8; one it leaves
    is checked, and a bad one closes the socket as websockets would (1007), reaching
    neither the lane nor the app."""
    app = LaneApp()
    async with lane_server(app) as url, connect(url, compression=None) as ws:
        app.read.release()
        await wait_until(lambda: app.waiting, WAIT_S, "app waiting")
        await ws.send("L1")
        await wait_until(lambda: app.by_lane == ["L1"], WAIT_S, "L1 by the lane")
        ws.transport.write(client_text_frame(b"L\xff\xfe" + b"x" * 200, MaskSource().next()))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), WAIT_S)
    assert ws.close_code == 1007
    assert app.by_lane == ["L1"] and app.by_asgi == []


async def test_a_realtime_text_frame_that_is_not_utf8_ends_the_connection_with_1007() -> None:
    """LaneConnection reading frames itself: a server text frame that is not UTF-8 goes to
    websockets' parser, which fails the connection (1007); recv() never sees it."""
    hello, sent = asyncio.Event(), asyncio.Event()

    async def handler(peer: ServerConnection) -> None:
        await hello.wait()  # once the client's lane is in place
        await peer.send("hello")
        await sent.wait()
        # A raw text frame (server side: unmasked) of invalid UTF-8.
        peer.transport.write(server_text_frame(b"audio-\xff\xfe" + b"x" * 200))
        with contextlib.suppress(ConnectionClosed):
            await peer.wait_closed()

    offered: list[bytes] = []

    def lane(data: bytes) -> bool:
        offered.append(data)
        return False

    async with lane_client(handler, lane) as conn:
        try:
            hello.set()
            assert await asyncio.wait_for(conn.recv(), WAIT_S) == "hello"
            assert conn._own  # between frames: the connection reads them itself now
        finally:
            sent.set()
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(conn.recv(), WAIT_S)
    assert conn.protocol.close_sent is not None and conn.protocol.close_sent.code == 1007
    # Offered to the lane (which left it, as a lane that parses it does), never delivered.
    assert offered[0] == b"hello" and all(o.startswith(b"audio-\xff") for o in offered[1:])


async def test_a_lane_that_raises_is_removed_and_the_frame_reaches_the_app(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A frame read in one piece (the inline read): a lane that raises must not break the
    socket; it is logged and removed, and that frame and the ones after it reach the app in
    order."""
    app = LaneApp()

    def broken(data: bytes) -> bool:
        raise RuntimeError("lane bug")

    async with lane_server(app) as url, connect(url, compression=None) as ws:
        app.read.release()
        await wait_until(lambda: app.waiting, WAIT_S, "app waiting")
        assert app.protocol is not None
        app.protocol.set_lane(broken, 64 * 1024)
        await ws.send("L1")
        await wait_until(lambda: app.by_asgi == ["L1"], WAIT_S, "L1 by the app")
        assert app.protocol.lane is None
        app.read.release()
        await ws.send("L2")
        await wait_until(lambda: app.by_asgi == ["L1", "L2"], WAIT_S, "L2 by the app")
    assert app.by_lane == []
    assert "a hot-path lane failed" in caplog.text


async def test_a_realtime_lane_that_raises_is_removed_and_recv_gets_the_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hello, go = asyncio.Event(), asyncio.Event()

    async def handler(peer: ServerConnection) -> None:
        await hello.wait()  # once the client's lane is in place
        await peer.send("hello")
        await go.wait()
        await peer.send("audio-1")
        await peer.send("audio-2")
        with contextlib.suppress(ConnectionClosed):
            await peer.wait_closed()

    calls = 0

    def broken(data: bytes) -> bool:
        nonlocal calls
        calls += 1
        if data.startswith(b"audio"):
            raise RuntimeError("lane bug")
        return False

    async with lane_client(handler, broken) as conn:
        try:
            hello.set()
            assert await asyncio.wait_for(conn.recv(), WAIT_S) == "hello"
            assert conn._own  # the inline read is the one that meets the failing lane
        finally:
            go.set()
        got = [await asyncio.wait_for(conn.recv(), WAIT_S) for _ in range(2)]
    assert got == ["audio-1", "audio-2"]
    assert conn.lane is None and calls == 2  # hello (left), audio-1 (raised); then removed
    assert "a hot-path lane failed" in caplog.text


async def test_the_realtime_lane_keeps_server_messages_in_order() -> None:
    """LaneConnection: an "audio" message is taken by the lane only while nothing waits for
    recv() and the reader is idle; everything else reaches recv() in the order sent."""
    go = asyncio.Queue[list[str]]()

    async def handler(peer: ServerConnection) -> None:
        while True:
            batch = await go.get()
            if not batch:
                return
            for text in batch:
                await peer.send(text)

    taken: list[str] = []
    reader_waiting = False

    def lane(data: bytes) -> bool:
        text = data.decode()
        if not reader_waiting or not text.startswith("audio"):
            return False
        taken.append(text)
        return True

    async with lane_client(handler, lane) as conn:
        read: list[str] = []

        async def recv() -> None:
            nonlocal reader_waiting
            reader_waiting = True
            try:
                read.append(str(await asyncio.wait_for(conn.recv(), WAIT_S)))
            finally:
                reader_waiting = False

        # All in one go: the event waits for recv(), so the audio after it waits too.
        await go.put(["audio-1", "event-2", "audio-3"])
        await recv()
        await asyncio.sleep(0.1)  # the reader is busy with event-2
        await recv()
        assert read == ["event-2", "audio-3"]
        assert taken == ["audio-1"]
        # The reader idle and nothing queued: audio goes by the lane, events do not.
        waiting = asyncio.create_task(recv())
        await wait_until(lambda: reader_waiting, WAIT_S, "reader waiting")
        await go.put(["audio-4", "audio-5", "event-6"])
        await waiting
        assert read == ["event-2", "audio-3", "event-6"]
        assert taken == ["audio-1", "audio-4", "audio-5"]
        await go.put([])


def steady_scenario() -> Scenario:
    return Scenario.model_validate(
        {
            "name": "lanes",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": 1000},
            "steps": [
                {
                    "caller_transcript": "Is the terrace open?",
                    "reply": {"text": "It is, until ten.", "audio_ms": 1500},
                }
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )


async def test_a_steady_call_runs_on_the_lanes_and_outlives_the_idle_timeout(
    engine: AsyncEngine,
) -> None:
    """Through the service: with audio flowing both ways, caller frames are appended and the
    agent's audio played in the sockets' callbacks; the stream's idle watchdog (1 s here)
    still sees those frames, so a call that streams for 3 s is not ended as idle."""
    async with call_stack(engine, steady_scenario(), media_idle_timeout_s=1.0) as stack:
        caller = stack.caller()
        await caller.dial()
        await caller.wait_for(lambda c: c.media_received_ms >= 1000 and c.buffered_ms == 0, 10)
        await caller.play_speech(800)
        await caller.wait_for(lambda c: c.media_received_ms >= 2500, 10)
        await caller.play_silence(1500)
        entry = stack.service.runtime.registry.get(caller.call_sid)
        assert entry is not None and entry.end_reason is None, "ended while audio flowed"
        bridge: Any = entry.live
        frames_up, by_lane = bridge.frames_up, bridge.frames_up_by_lane
        deltas_by_lane = bridge.deltas_by_lane
        await caller.hangup()
    # Three seconds at 50 frames a second; a few go the task way (the first, before live).
    assert frames_up >= 150 and by_lane >= 0.8 * frames_up, (frames_up, by_lane)
    assert deltas_by_lane > 0
    assert caller.media_received_ms >= 2500


class EchoApp:
    """Records every message the app receives (no lane), to compare the server's own frame
    reading with websockets' on the same bytes."""

    def __init__(self) -> None:
        self.got: list[str | bytes] = []
        self.protocol: MediaWebSocketProtocol | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        self.protocol = scope["extensions"][LANE_EXTENSION]
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            self.got.append(
                message.get("text") if message.get("text") is not None else message["bytes"]
            )


@pytest.mark.parametrize("seed", range(6))
async def test_frames_split_anywhere_read_the_same_as_websockets_reads_them(seed: int) -> None:
    """The server reads plain text frames itself; split at random points, mixed with a ping
    (answered), a 126+ byte frame and a fragmented message (which hand reading over to
    websockets for good), every message still reaches the app whole and in order."""
    import random

    rng = random.Random(seed)
    app = EchoApp()
    async with lane_server(app) as url:
        async with connect(url, compression=None) as ws:
            texts = [
                f"media-{i}-" + "x" * rng.choice([0, 10, 124, 125, 200, 300, 1000])
                for i in range(40)
            ]
            for text in texts:
                ws.protocol.send_text(text.encode())
            raw = b"".join(ws.protocol.data_to_send())
            # Written in random pieces, with pauses, so frames straddle reads.
            at = 0
            while at < len(raw):
                step = rng.randint(1, 700)
                ws.transport.write(raw[at : at + step])
                at += step
                if rng.random() < 0.3:
                    await asyncio.sleep(0.002)
            await wait_until(lambda: len(app.got) == len(texts), WAIT_S, "texts read")
            assert app.got == texts
            assert app.protocol is not None and app.protocol._own  # still reading them itself
            # A ping is answered; websockets reads from here on.
            pong = await ws.ping(b"hello")
            await asyncio.wait_for(pong, WAIT_S)
            assert not app.protocol._own
            await ws.send(["frag", "mented"])
            await ws.send("after")
            await wait_until(lambda: len(app.got) == len(texts) + 2, WAIT_S, "the rest read")
            assert app.got[len(texts) :] == ["fragmented", "after"]


@pytest.mark.parametrize("seed", range(4))
async def test_realtime_frames_split_anywhere_read_the_same_once_the_client_reads_them(
    seed: int,
) -> None:
    """LaneConnection reads plain server frames itself once websockets' parser is between
    frames (after a whole message): then frames split at random points (a 70 KB one too), a
    ping from the server (answered), and a fragmented message that hands reading back to
    websockets; recv() sees every message whole and in order."""
    import random

    rng = random.Random(seed)
    texts = [f"event-{i}-" + "y" * rng.choice([0, 100, 125, 126, 500, 70_000]) for i in range(30)]
    ready = asyncio.Event()
    burst = asyncio.Event()
    checked = asyncio.Event()
    pinged = asyncio.Event()

    async def handler(peer: ServerConnection) -> None:
        await peer.send("hello")  # read by websockets: the lane is not set yet
        await ready.wait()
        await peer.send("warm")  # a whole message: after it websockets is between frames
        await burst.wait()
        for text in texts:
            peer.protocol.send_text(text.encode())
        raw = b"".join(peer.protocol.data_to_send())
        at = 0
        while at < len(raw):
            step = rng.randint(1, 3000)
            peer.transport.write(raw[at : at + step])
            at += step
            if rng.random() < 0.3:
                await asyncio.sleep(0.002)
        await checked.wait()
        await asyncio.wait_for(await peer.ping(b"are you there"), WAIT_S)
        pinged.set()
        await peer.send(["frag", "mented"])
        await peer.send("last")
        await peer.wait_closed()

    async with serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(
            f"ws://127.0.0.1:{port}/",
            compression=None,
            create_connection=LaneConnection,
            max_size=None,
        ) as conn:
            assert isinstance(conn, LaneConnection)
            assert await asyncio.wait_for(conn.recv(), WAIT_S) == "hello"
            conn.lane = lambda data: False  # takes nothing: every message goes to recv()
            ready.set()
            assert await asyncio.wait_for(conn.recv(), WAIT_S) == "warm"
            assert conn._own  # from here the connection reads frames itself
            burst.set()
            got = [await asyncio.wait_for(conn.recv(), WAIT_S) for _ in texts]
            assert got == texts
            assert conn._own  # read by the connection itself
            checked.set()
            await asyncio.wait_for(pinged.wait(), WAIT_S)  # the ping was answered
            assert await asyncio.wait_for(conn.recv(), WAIT_S) == "fragmented"
            assert await asyncio.wait_for(conn.recv(), WAIT_S) == "last"
            assert not conn._own  # websockets reads again


async def test_keepalive_pings_are_answered_on_both_sockets_while_frames_are_read_here() -> None:
    """Both sockets read plain frames themselves; the keepalive pings of each side (uvicorn's
    on the media socket, websockets' on the Realtime one) still get their pongs read, so a
    call is not dropped as dead after ping_timeout."""
    app = EchoApp()

    async def quiet(peer: ServerConnection) -> None:
        await peer.send("hello")
        await peer.wait_closed()

    async with lane_server(app, ws_ping_interval=0.1, ws_ping_timeout=0.3) as url:
        async with (
            connect(url, compression=None) as media,
            serve(quiet, "127.0.0.1", 0, compression=None) as realtime_server,
        ):
            rt_port = next(iter(realtime_server.sockets)).getsockname()[1]
            async with connect(
                f"ws://127.0.0.1:{rt_port}/",
                compression=None,
                create_connection=LaneConnection,
                ping_interval=0.1,
                ping_timeout=0.3,
            ) as realtime:
                assert isinstance(realtime, LaneConnection)
                realtime.lane = lambda data: False
                assert await asyncio.wait_for(realtime.recv(), WAIT_S) == "hello"
                await media.send("one")
                await wait_until(lambda: app.got == ["one"], WAIT_S, "media read")
                await asyncio.sleep(1.5)  # 15 pings each way, 5x the pong deadline
                assert app.protocol is not None and app.protocol._own and realtime._own
                await media.send("two")  # both still open
                await wait_until(lambda: app.got == ["one", "two"], WAIT_S, "still open")
                assert realtime.state.name == "OPEN" and realtime.latency > 0


@pytest.mark.parametrize("leg_class", [TwilioLeg, SipLeg])
def test_the_twilio_and_sip_legs_offer_every_lane_as_the_protocol_names_it(
    leg_class: type,
) -> None:
    # The bridge and the recorder take a leg's lanes only when it has all three (lanes_of):
    # a leg whose method drifted from the protocol would silently lose its lanes.
    for name in LANE_METHODS:
        assert inspect.signature(getattr(leg_class, name)) == inspect.signature(
            getattr(LaneLeg, name)
        ), name
