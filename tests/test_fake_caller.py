"""The fake Twilio caller: Twilio's webhook, stream messages and playout, over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from twilio.request_validator import RequestValidator
from twilio.twiml.voice_response import Connect, VoiceResponse
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request as WsRequest
from websockets.http11 import Response as WsResponse

from telephony import audio
from telephony.legs.twilio.events import (
    Connected,
    Dtmf,
    Mark,
    Media,
    Start,
    Stop,
    clear_message,
    mark_message,
    media_message,
    parse_inbound,
)
from telephony.sim.fake_caller import (
    CallerError,
    FakeTwilioCaller,
    PlayoutBuffer,
    add_arguments,
    parse_twiml,
    run_call,
)
from telephony.sim.fake_twilio_api import InProcessServer

TOKEN = "test-auth-token"
PUBLIC = "https://voice.example.com"


# PlayoutBuffer: Twilio's playout as a model on an explicit clock.


def test_mark_is_released_only_when_the_audio_before_it_has_played() -> None:
    p = PlayoutBuffer()
    assert p.push_audio(bytes(800), now=0.0) == []  # 100 ms
    assert p.push_mark("m1", now=0.0) == []
    assert p.advance(0.099) == []
    assert p.advance(0.100) == ["m1"]
    assert p.played_bytes == 800
    assert not p.playing


def test_mark_with_nothing_queued_is_released_at_once() -> None:
    p = PlayoutBuffer()
    assert p.push_mark("idle", now=5.0) == ["idle"]


def test_clear_drops_unplayed_audio_and_flushes_pending_marks() -> None:
    p = PlayoutBuffer()
    p.push_audio(bytes(1600), now=0.0)
    p.push_mark("a", now=0.0)
    p.push_audio(bytes(1600), now=0.0)
    p.push_mark("b", now=0.0)
    dropped, reached, flushed = p.clear(now=0.25)
    assert reached == ["a"]  # 200 ms had played by then
    assert flushed == ["b"]
    assert dropped == 3200 - 2000
    assert p.played_bytes == 2000
    # Nothing plays after the clear.
    assert p.advance(10.0) == []
    assert p.played_bytes == 2000
    assert sum(len(c.audio) for c in p.heard) == 2000


def test_audio_after_an_underrun_starts_playing_when_it_arrives() -> None:
    p = PlayoutBuffer()
    p.push_audio(bytes(160), now=0.0)
    p.advance(1.0)
    p.push_audio(bytes(160), now=2.0)
    p.advance(3.0)
    assert [c.t for c in p.heard] == [0.0, 2.0]
    assert p.next_due() is None


def test_next_due_points_at_the_next_mark_then_the_end_of_audio() -> None:
    p = PlayoutBuffer()
    p.push_audio(bytes(400), now=1.0)
    p.push_mark("m", now=1.0)
    p.push_audio(bytes(400), now=1.0)
    assert p.next_due() == pytest.approx(1.05)
    p.advance(1.06)
    assert p.next_due() == pytest.approx(1.1)


# TwiML.


def _stream_twiml(url: str, **params: str) -> str:
    response = VoiceResponse()
    connect = Connect()
    stream = connect.stream(url=url)
    for name, value in params.items():
        stream.parameter(name=name, value=value)
    response.append(connect)
    return str(response)


def test_twiml_with_connect_stream_yields_url_and_parameters() -> None:
    outcome = parse_twiml(_stream_twiml("wss://x.example/twilio/media", token="abc", n="1"))
    assert outcome.kind == "stream"
    assert outcome.stream_url == "wss://x.example/twilio/media"
    assert outcome.parameters == {"token": "abc", "n": "1"}


def test_twiml_busy_message_with_hangup_is_not_a_stream() -> None:
    response = VoiceResponse()
    response.say("All lines are busy.")
    response.hangup()
    outcome = parse_twiml(str(response))
    assert outcome.kind == "hangup"
    assert outcome.says == ("All lines are busy.",)
    assert outcome.stream_url is None
    assert parse_twiml("<Response><Reject/></Response>").kind == "reject"
    assert parse_twiml("forbidden", 403).kind == "http_error"


# A tiny stream server: records what the caller sends, runs a script against it.


@dataclass
class StreamPeer:
    frames: list[str | bytes] = field(default_factory=list)
    got: asyncio.Event = field(default_factory=asyncio.Event)

    def _json(self) -> list[str]:
        return [f for f in self.frames if isinstance(f, str) and f.startswith('{"')]

    def events(self) -> list[str]:
        return [json.loads(f)["event"] for f in self._json()]

    def parsed(self) -> list[object]:
        return [parse_inbound(f) for f in self._json()]

    async def wait_event(self, event: str, count: int = 1) -> None:
        async with asyncio.timeout(5):
            while self.events().count(event) < count:
                self.got.clear()
                await self.got.wait()


@dataclass
class StreamServer:
    url: str
    peer: StreamPeer
    sockets: list[ServerConnection]


Script = Callable[[ServerConnection, StreamPeer], Awaitable[None]]


@contextlib.asynccontextmanager
async def stream_server(script: Script | None = None) -> AsyncIterator[StreamServer]:
    peer = StreamPeer()
    conns: list[ServerConnection] = []

    async def handler(ws: ServerConnection) -> None:
        conns.append(ws)

        async def read() -> None:
            async for frame in ws:
                peer.frames.append(frame)
                peer.got.set()

        reader = asyncio.create_task(read())
        try:
            if script is not None:
                await script(ws, peer)
            await reader
        finally:
            reader.cancel()

    async with serve(handler, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield StreamServer(f"ws://127.0.0.1:{port}/twilio/media", peer, conns)


def _stream_sid(peer: StreamPeer) -> str:
    start = next(m for m in peer.parsed() if isinstance(m, Start))
    return start.start.stream_sid


async def test_caller_sends_twilio_stream_messages_in_order_with_counters() -> None:
    async with (
        stream_server() as srv,
        FakeTwilioCaller(auth_token=TOKEN, idle_audio=False) as caller,
    ):
        assert await caller.open_stream(srv.url, {"token": "t1"})
        assert await caller.play_speech(200) == 200
        await caller.send_dtmf("5")
        await caller.hangup()
        await srv.peer.wait_event("stop")
    messages = srv.peer.parsed()
    assert isinstance(messages[0], Connected)
    assert messages[0].protocol == "Call" and messages[0].version == "1.0.0"
    start = messages[1]
    assert isinstance(start, Start)
    assert start.start.call_sid == caller.call_sid and caller.call_sid.startswith("CA")
    assert len(caller.call_sid) == 34 and len(start.stream_sid) == 34
    assert start.stream_sid.startswith("MZ")
    assert start.start.custom_parameters == {"token": "t1"}
    assert start.start.tracks == ["inbound"]
    assert start.start.media_format.encoding == "audio/x-mulaw"
    assert start.start.media_format.sample_rate == 8000
    media = [m for m in messages if isinstance(m, Media)]
    assert len(media) == 10
    assert [m.media.chunk for m in media] == [str(i) for i in range(1, 11)]
    stamps = [m.media.timestamp_ms() for m in media]
    assert stamps == sorted(stamps) and stamps[1] - stamps[0] == 20
    assert all(len(m.media.audio()) == 160 and m.media.track == "inbound" for m in media)
    assert b"".join(m.media.audio() for m in media) == audio.speech_like_mulaw(200)
    dtmf = next(m for m in messages if isinstance(m, Dtmf))
    assert dtmf.dtmf.digit == "5" and dtmf.dtmf.track == "inbound_track"
    assert isinstance(messages[-1], Stop)
    assert messages[-1].stop.call_sid == caller.call_sid
    sequence = [int(json.loads(f)["sequenceNumber"]) for f in srv.peer.frames[1:]]
    assert sequence == list(range(1, len(sequence) + 1))
    assert caller.closed_by == "caller"


async def test_caller_streams_silence_between_scripted_audio_like_a_phone_line() -> None:
    async with (
        stream_server() as srv,
        FakeTwilioCaller(auth_token=TOKEN, speed=4.0) as caller,
    ):
        await caller.open_stream(srv.url)
        await srv.peer.wait_event("media", count=5)
    media = [m for m in srv.peer.parsed() if isinstance(m, Media)]
    assert all(m.media.audio() == audio.silence(20) for m in media)


async def test_speech_queued_back_to_back_stays_continuous_when_the_loop_stalls() -> None:
    """Behind its clock after a stall, the stream catches up in a burst; a caller still talking
    queues its next words before any catch-up silence (a pause would end its turn)."""
    async with (
        stream_server() as srv,
        FakeTwilioCaller(auth_token=TOKEN) as caller,
    ):
        await caller.open_stream(srv.url)

        async def talk() -> None:
            for _ in range(4):
                await caller.play_speech(100)

        talking = asyncio.create_task(talk())
        # 50 ms into the first words the whole loop blocks for 300 ms (a loaded machine).
        asyncio.get_running_loop().call_later(0.05, time.sleep, 0.3)
        await talking
        await caller.hangup()
        await srv.peer.wait_event("stop")
    frames = [m.media.audio() for m in srv.peer.parsed() if isinstance(m, Media)]
    spoken = [i for i, f in enumerate(frames) if f != audio.silence(20)]
    assert len(spoken) == 20  # 4 x 100 ms
    assert spoken == list(range(spoken[0], spoken[0] + 20)), "silence inside the speech"


async def test_playout_echoes_marks_at_playback_pace_and_clear_flushes_the_rest() -> None:
    played_before_clear = asyncio.Event()

    async def script(ws: ServerConnection, peer: StreamPeer) -> None:
        await peer.wait_event("start")
        sid = _stream_sid(peer)
        speech = audio.speech_like_mulaw(1000)
        # 1 s of audio, a mark after every 200 ms.
        for i, frame in enumerate(audio.split_frames(speech)):
            await ws.send(media_message(sid, frame))
            if i % 10 == 9:
                await ws.send(mark_message(sid, f"m{i // 10}"))
        await peer.wait_event("mark", count=2)
        played_before_clear.set()
        await ws.send(clear_message(sid))

    async with (
        stream_server(script) as srv,
        FakeTwilioCaller(auth_token=TOKEN, idle_audio=False) as caller,
    ):
        await caller.open_stream(srv.url)
        await caller.wait_for(lambda c: len(c.clears) == 1, timeout=5)
        await srv.peer.wait_event("mark", count=5)
        clear_t = caller.clears[0].t
        # Time passes after the clear; nothing more is heard.
        await caller.play_silence(100)
        heard_after_clear = caller.heard_ms_after(clear_t)

    echoes = caller.marks_echoed
    assert [m.name for m in echoes] == ["m0", "m1", "m2", "m3", "m4"]
    assert [m.cleared for m in echoes] == [False, False, True, True, True]
    # Playback pace: a mark after k*200 ms of audio is echoed no sooner than that.
    first_media_t = caller.messages("media")[0].t
    for k, echo in enumerate(echoes[:2], start=1):
        assert echo.t_echoed - first_media_t >= k * 0.2 - 0.005
    # Pending marks were echoed at the clear, not when their audio would have played.
    assert all(m.t_echoed >= clear_t for m in echoes[2:])
    assert heard_after_clear == 0
    clear = caller.clears[0]
    assert clear.marks_flushed == ("m2", "m3", "m4")
    # Everything sent was either heard or dropped by the clear.
    assert caller.heard_ms + clear.dropped_ms == pytest.approx(1000)
    assert caller.media_received_ms == pytest.approx(1000)
    assert 400 <= caller.heard_ms < 1000
    # What was heard is the start of what was sent, byte for byte.
    heard = caller.heard_audio()
    assert heard == audio.speech_like_mulaw(1000)[: len(heard)]
    # What played after a moment: the same bytes from that moment's place in playout on.
    began = caller.heard[0].t
    assert caller.heard_audio(after=began + 0.2) == heard[1600:]
    assert caller.heard_audio(after=began - 1.0) == heard
    # The server saw the echoes in the same order, with the caller's stream sid.
    server_marks = [m for m in srv.peer.parsed() if isinstance(m, Mark)]
    assert [m.mark.name for m in server_marks] == ["m0", "m1", "m2", "m3", "m4"]
    assert all(m.stream_sid == caller.stream_sid for m in server_marks)
    assert caller.received_events()[-1] == "clear"


async def test_heard_wav_is_time_aligned_to_the_call() -> None:
    async def script(ws: ServerConnection, peer: StreamPeer) -> None:
        await peer.wait_event("media", count=11)  # frame 11 is sent 200 ms into the call
        sid = _stream_sid(peer)
        await ws.send(media_message(sid, audio.speech_like_mulaw(200)))
        await ws.send(mark_message(sid, "done"))

    async with (
        stream_server(script) as srv,
        FakeTwilioCaller(auth_token=TOKEN) as caller,
    ):
        await caller.open_stream(srv.url)
        await caller.wait_for(lambda c: len(c.marks_echoed) == 1, timeout=5)
        await caller.hangup()
    pcm = audio.wav_to_pcm16(caller.heard_wav())
    total_ms = audio.duration_ms(len(pcm), "pcm16")
    # Silence until the reply arrived, then the reply, at its arrival offset.
    arrival_ms = (caller.heard[0].t - caller.stream_started_at) * 1000  # type: ignore[operator]
    assert arrival_ms >= 195
    assert total_ms >= arrival_ms + 199
    lead = pcm[: int(arrival_ms - 5) * 16]
    assert audio.rms(lead, "pcm16") == 0
    reply = pcm[int(arrival_ms + 5) * 16 : int(arrival_ms + 150) * 16]
    assert audio.rms(reply, "pcm16") > 1000


async def test_server_closing_the_stream_ends_the_call_cleanly_with_its_code() -> None:
    async def script(ws: ServerConnection, peer: StreamPeer) -> None:
        await peer.wait_event("start")
        await ws.close(1008, "bad stream token")

    async with (
        stream_server(script) as srv,
        FakeTwilioCaller(auth_token=TOKEN) as caller,
    ):
        await caller.open_stream(srv.url)
        await caller.wait_closed(timeout=5)
        with pytest.raises(CallerError):
            await caller.play_silence(20)
        await caller.hangup()  # a no-op now
    assert caller.close_code == 1008
    assert caller.close_reason == "bad stream token"
    assert caller.closed_by == "server"
    assert "1008" in (caller.closed_reason or "")
    assert "stop" not in srv.peer.events()


async def test_stream_closed_at_once_by_the_server_ends_the_call_without_errors() -> None:
    async def script(ws: ServerConnection, peer: StreamPeer) -> None:
        await ws.close(1008, "no token")

    async with (
        stream_server(script) as srv,
        FakeTwilioCaller(auth_token=TOKEN) as caller,
    ):
        await caller.open_stream(srv.url)
        await caller.wait_closed(timeout=5)
    assert (caller.closed_by, caller.close_code) == ("server", 1008)


async def test_refused_stream_handshake_is_recorded_not_raised() -> None:
    def refuse(connection: ServerConnection, request: WsRequest) -> WsResponse:
        return connection.respond(403, "forbidden")

    async with (
        serve(lambda ws: asyncio.sleep(0), "127.0.0.1", 0, process_request=refuse) as server,
        FakeTwilioCaller(auth_token=TOKEN) as caller,
    ):
        port = next(iter(server.sockets)).getsockname()[1]
        assert await caller.open_stream(f"ws://127.0.0.1:{port}/twilio/media") is False
    assert caller.handshake_status == 403
    assert caller.closed and caller.closed_by is None


async def test_raw_frames_reach_the_server_untouched_and_bad_server_frames_are_recorded() -> None:
    async def script(ws: ServerConnection, peer: StreamPeer) -> None:
        await peer.wait_event("start")
        await ws.send("{not json")
        await ws.send(json.dumps({"event": "clear", "streamSid": "MZ" + "0" * 32}))

    async with (
        stream_server(script) as srv,
        FakeTwilioCaller(auth_token=TOKEN, idle_audio=False) as caller,
    ):
        await caller.open_stream(srv.url)
        await caller.send_raw("{oops")
        await caller.send_raw(b"\x00\x01")
        async with asyncio.timeout(5):
            while len(srv.peer.frames) < 4:
                srv.peer.got.clear()
                await srv.peer.got.wait()
        await caller.wait_for(lambda c: len(c.protocol_errors) == 2, timeout=5)
    assert srv.peer.frames[2:4] == ["{oops", b"\x00\x01"]
    assert caller.received_events() == [None, "clear"]
    # A clear for another stream is ignored, as Twilio does.
    assert caller.clears == []


# Dialing: the signed webhook, TwiML, and the stream it names.


@dataclass
class VoiceApp:
    busy: bool = False
    webhook_forms: list[dict[str, str]] = field(default_factory=list)
    starts: list[Start] = field(default_factory=list)
    ws_signatures: list[bool] = field(default_factory=list)

    def build(self) -> Starlette:
        validator = RequestValidator(TOKEN)

        async def voice(request: Request) -> Response:
            form = {k: str(v) for k, v in (await request.form()).items()}
            signature = request.headers.get("x-twilio-signature", "")
            if not validator.validate(PUBLIC + "/twilio/voice", form, signature):
                return Response("bad signature", status_code=403)
            self.webhook_forms.append(form)
            response = VoiceResponse()
            if self.busy:
                response.say("All our lines are busy.")
                response.hangup()
                return Response(str(response), media_type="application/xml")
            twiml = _stream_twiml("wss://voice.example.com/twilio/media", token="tok-1")
            return Response(twiml, media_type="application/xml")

        async def media(ws: WebSocket) -> None:
            signature = ws.headers.get("x-twilio-signature", "")
            self.ws_signatures.append(
                validator.validate("wss://voice.example.com/twilio/media", {}, signature)
            )
            await ws.accept()
            try:
                while True:
                    message = parse_inbound(await ws.receive_text())
                    if isinstance(message, Start):
                        self.starts.append(message)
                        await ws.send_text(
                            media_message(message.stream_sid, audio.speech_like_mulaw(100))
                        )
                        await ws.send_text(mark_message(message.stream_sid, "greeting"))
            except WebSocketDisconnect:
                pass

        return Starlette(
            routes=[
                Route("/twilio/voice", voice, methods=["POST"]),
                WebSocketRoute("/twilio/media", media),
            ]
        )


@pytest.fixture
async def voice_app() -> AsyncIterator[tuple[VoiceApp, str]]:
    app = VoiceApp()
    server = InProcessServer(app.build())
    url = await server.start()
    try:
        yield app, url
    finally:
        await server.stop()


async def test_dial_posts_a_signed_webhook_for_the_public_url_and_opens_the_stream(
    voice_app: tuple[VoiceApp, str],
) -> None:
    app, url = voice_app
    async with FakeTwilioCaller(
        url, public_url=PUBLIC, auth_token=TOKEN, from_number="+15557654321"
    ) as caller:
        outcome = await caller.dial()
        assert outcome.kind == "stream"
        await caller.wait_for(lambda c: len(c.marks_echoed) == 1, timeout=5)
        await caller.hangup()
    form = app.webhook_forms[0]
    assert form["CallSid"] == caller.call_sid
    assert form["CallStatus"] == "ringing"
    assert form["Direction"] == "inbound"
    assert form["ApiVersion"] == "2010-04-01"
    assert form["From"] == "+15557654321"
    assert form["AccountSid"].startswith("AC")
    assert app.ws_signatures == [True]
    assert app.starts[0].start.custom_parameters == {"token": "tok-1"}
    assert app.starts[0].start.call_sid == caller.call_sid
    assert caller.heard_ms == pytest.approx(100)


async def test_dial_with_the_wrong_auth_token_is_refused_without_a_stream(
    voice_app: tuple[VoiceApp, str],
) -> None:
    app, url = voice_app
    async with FakeTwilioCaller(url, public_url=PUBLIC, auth_token="wrong") as caller:
        outcome = await caller.dial()
    assert outcome.kind == "http_error" and outcome.http_status == 403
    assert caller.closed and app.starts == []


async def test_busy_twiml_is_the_outcome_and_no_stream_is_opened(
    voice_app: tuple[VoiceApp, str],
) -> None:
    app, url = voice_app
    app.busy = True
    async with FakeTwilioCaller(url, public_url=PUBLIC, auth_token=TOKEN) as caller:
        outcome = await caller.dial()
    assert caller.twiml_outcome is outcome
    assert outcome.kind == "hangup"
    assert outcome.says == ("All our lines are busy.",)
    assert app.ws_signatures == []
    assert caller.closed and caller.stream_started_at is None


async def test_cli_call_speaks_listens_and_writes_what_it_heard(
    voice_app: tuple[VoiceApp, str], tmp_path: object
) -> None:
    import argparse
    from pathlib import Path

    _, url = voice_app
    out = Path(str(tmp_path)) / "heard.wav"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    wav = Path(str(tmp_path)) / "say.wav"
    wav.write_bytes(audio.pcm16_to_wav(audio.speech_like_pcm16(300)))
    args = parser.parse_args(
        [
            "--server", url, "--public-url", PUBLIC, "--auth-token", TOKEN,
            "--wav", str(wav), "--out", str(out), "--tail-ms", "200", "--lead-ms", "100",
        ]
    )  # fmt: skip
    caller = await run_call(args)
    assert caller.summary()["marks_echoed"] == 1
    assert caller.media_frames_sent >= 20  # 100 ms lead + 300 ms speech
    pcm = audio.wav_to_pcm16(out.read_bytes())
    assert audio.duration_ms(len(pcm), "pcm16") >= 400
