"""The Realtime bridge over real sockets: a scripted Realtime server and a real-time fake leg."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from openai import AsyncOpenAI
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from telephony import audio
from telephony.bridge import Bridge, BridgeConfig, apology_clip
from telephony.call_events import CallEvent, CallEventKind, MemorySink
from telephony.legs.leg import AudioFormat, AudioIn, CallLeg, DtmfIn, LegClosed, LegEvent
from telephony.playback import PlaybackTracker
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import RealtimeSimulator
from telephony.tool_gateway import (
    CallContext,
    FunctionCallRequest,
    LateResult,
    LiveCall,
    ToolGateway,
    ToolReply,
)

FRAME = 160  # 20 ms of G.711
WAIT_S = 5.0


async def wait_until(predicate: Callable[[], Any], within: float = WAIT_S, what: str = "") -> Any:
    """Poll observable state until `predicate` is truthy (returns its value)."""
    try:
        async with asyncio.timeout(within):
            while not (value := predicate()):  # noqa: ASYNC110 - state without an Event
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what or predicate}") from None
    return value


# A scripted Realtime server: records what the bridge sends; the test decides what it answers.


class ScriptedConnection:
    def __init__(self, ws: ServerConnection, log: list[tuple[str, Any]]) -> None:
        self.ws = ws
        self.received: list[dict[str, Any]] = []
        self._log = log
        self._seq = 0

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [e for e in self.received if e.get("type") == type_]

    async def wait_for(self, type_: str, count: int = 1) -> dict[str, Any]:
        found = await wait_until(lambda: len(self.of_type(type_)) >= count, what=type_)
        assert found
        return self.of_type(type_)[count - 1]

    async def send(self, type_: str, **data: Any) -> None:
        self._seq += 1
        await self.ws.send(json.dumps({"type": type_, "event_id": f"ev_{self._seq}", **data}))

    async def audio(self, response_id: str, item_id: str, ms: int, chunk_ms: int = 100) -> None:
        """Agent audio as the model sends it: faster than real time, in arbitrary chunks."""
        for _ in range(ms // chunk_ms):
            delta = base64.b64encode(bytes([0x7F]) * (chunk_ms * 8)).decode()
            await self.send(
                "response.output_audio.delta",
                response_id=response_id,
                item_id=item_id,
                output_index=0,
                content_index=0,
                delta=delta,
            )

    async def response_created(self, response_id: str) -> None:
        await self.send(
            "response.created",
            response={"id": response_id, "object": "realtime.response", "status": "in_progress"},
        )

    async def response_done(
        self, response_id: str, status: str = "completed", output: list[Any] | None = None
    ) -> None:
        await self.send(
            "response.done",
            response={
                "id": response_id,
                "object": "realtime.response",
                "status": status,
                "output": output or [],
            },
        )

    async def speech_started(self, item_id: str, at_ms: int = 0) -> None:
        await self.send("input_audio_buffer.speech_started", item_id=item_id, audio_start_ms=at_ms)

    async def speech_stopped(self, item_id: str, at_ms: int = 0) -> None:
        await self.send("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=at_ms)


class ScriptedRealtime:
    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.connections: list[ScriptedConnection] = []
        self.reject_connects = 0
        self.reject_session = False
        self.hold_session = False  # never confirm session.update (a slow server)
        self.handshakes = 0
        self._log = log
        self._server: Server | None = None

    async def start(self) -> None:
        self._server = await serve(
            self._handle, "127.0.0.1", 0, process_request=self._process_request
        )
        port = next(iter(self._server.sockets)).getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def _process_request(self, ws: ServerConnection, request: Request) -> Response | None:
        self.handshakes += 1
        assert request.path.startswith("/v1/realtime?model=")
        if self.reject_connects:
            self.reject_connects -= 1
            return Response(503, "Service Unavailable", Headers(), b"busy")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        conn = ScriptedConnection(ws, self._log)
        self.connections.append(conn)
        async for raw in ws:
            event = json.loads(raw)
            conn.received.append(event)
            if event.get("type") != "input_audio_buffer.append":
                self._log.append(("server_got", event["type"]))
            if event.get("type") == "session.update":
                if self.hold_session:
                    continue
                if self.reject_session:
                    await conn.send(
                        "error",
                        error={
                            "type": "invalid_request_error",
                            "code": "invalid_value",
                            "message": "Invalid value: 'audio/pcmx'.",
                            "param": "session.audio.input.format.type",
                            "event_id": event.get("event_id"),
                        },
                    )
                else:
                    await conn.send("session.updated", session=event["session"])

    async def connection(self, index: int = 0) -> ScriptedConnection:
        await wait_until(lambda: len(self.connections) > index, what=f"connection {index}")
        conn = self.connections[index]
        await conn.wait_for("session.update")
        return conn


# A fake leg with a wall-clock playout, like Twilio's: chunks play back to back at 20 ms each
# whatever our event loop is doing, and each chunk's end is confirmed to the tracker the way
# Twilio's mark echo confirms it (late when the loop is busy, as echoes are).


@dataclass
class Played:
    item_id: str
    audio: bytes
    at: float


@dataclass
class Chunk:
    epoch: int
    item_id: str
    end_ms: float  # offset in the item where this chunk ends
    starts: float  # wall clock when the caller starts hearing it
    ends: float


class FakeLeg:
    audio_format: AudioFormat = "audio/pcmu"

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.playback = PlaybackTracker()
        self.inbox: asyncio.Queue[LegEvent] = asyncio.Queue()
        self.plays: list[Played] = []
        self.clears: list[dict[str, Any]] = []
        self.closed: str | None = None
        self.played_log: list[tuple[str, int, float]] = []  # (item, end_ms, at) confirmed
        self._log = log
        self._timeline: list[Chunk] = []
        self._cursor = 0.0  # wall clock when the queued audio runs out
        self._chunks: asyncio.Queue[Chunk] = asyncio.Queue()
        self._player: asyncio.Task[None] | None = None

    async def events(self) -> AsyncGenerator[LegEvent, None]:
        while True:
            event = await self.inbox.get()
            yield event
            if isinstance(event, LegClosed):
                return

    async def play(self, item_id: str, payload: str) -> None:
        audio = base64.b64decode(payload)  # as an RTP leg would
        now = time.monotonic()
        self.plays.append(Played(item_id, audio, now))
        for offset in range(0, len(audio), FRAME):
            ms = len(audio[offset : offset + FRAME]) / 8
            epoch, end = self.playback.queued(item_id, ms)
            starts = max(now, self._cursor)
            self._cursor = starts + ms / 1000
            chunk = Chunk(epoch, item_id, end, starts, self._cursor)
            self._timeline.append(chunk)
            self._chunks.put_nowait(chunk)
        if self._player is None:
            self._player = asyncio.create_task(self._playout())

    def heard_ms(self, item_id: str, at: float) -> float:
        """Ground truth: how much of `item_id` the caller had heard at wall clock `at`."""
        heard = 0.0
        for chunk in self._timeline:
            if chunk.item_id == item_id and chunk.starts < at:
                length = (chunk.ends - chunk.starts) * 1000
                heard = max(heard, chunk.end_ms - length + min(length, (at - chunk.starts) * 1000))
        return heard

    async def _playout(self) -> None:
        while True:
            chunk = await self._chunks.get()
            if chunk.epoch != self.playback.epoch:
                continue  # cleared before it played
            await asyncio.sleep(max(0.0, chunk.ends - time.monotonic()))
            if self.playback.played(chunk.epoch, chunk.item_id, chunk.end_ms):
                self.played_log.append((chunk.item_id, int(chunk.end_ms), time.monotonic()))

    async def clear(self) -> None:
        now = time.monotonic()
        self._log.append(("leg_clear", None))
        current = self.playback.current_item()
        self.clears.append(
            {
                "at": now,
                "item_id": current,
                "confirmed_ms": self.playback.confirmed_ms(current) if current else 0,
                "heard_ms": self.heard_ms(current, now) if current else 0,
                "plays_before": len(self.plays),
            }
        )
        # Whatever had not started playing is gone (heard_ms is only asked up to this moment).
        self._timeline = [c for c in self._timeline if c.starts < now]
        self._cursor = now
        while not self._chunks.empty():
            self._chunks.get_nowait()
        self.playback.cleared()

    async def close(self, reason: str) -> None:
        if self.closed is None:
            self.closed = reason
        if self._player is not None:
            self._player.cancel()
            await asyncio.gather(self._player, return_exceptions=True)
            self._player = None

    def speak(self, ms: int) -> None:
        for i in range(ms // 20):
            self.inbox.put_nowait(AudioIn.of_bytes(bytes([0x10]) * FRAME, i * 20))

    def say(self, speech_ms: int, then_silence_ms: int = 800) -> None:
        """Speech-like caller audio then silence, which the simulator's VAD detects."""
        clip = audio.speech_like_mulaw(speech_ms) + audio.silence(then_silence_ms)
        for offset in range(0, len(clip) - FRAME + 1, FRAME):
            self.inbox.put_nowait(AudioIn.of_bytes(clip[offset : offset + FRAME], offset // 8))


@dataclass
class FakeGateway:
    """The tool layer as the bridge sees it; `gate` holds replies until the test opens it."""

    requests: list[FunctionCallRequest] = field(default_factory=list)
    digits: list[str] = field(default_factory=list)
    ended: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    reply: ToolReply = field(default_factory=lambda: ToolReply({"tables": ["19:00", "21:00"]}))

    def definitions(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "name": "check_availability",
                "description": "Find free tables. Call when the caller asks for a time.",
                "parameters": {"type": "object", "properties": {"time": {"type": "string"}}},
            }
        ]

    async def handle(self, ctx: CallContext, request: FunctionCallRequest) -> ToolReply:
        self.requests.append(request)
        await self.gate.wait()
        return self.reply

    async def on_dtmf(self, ctx: CallContext, digit: str) -> None:
        self.digits.append(digit)

    async def on_call_end(self, ctx: CallContext) -> None:
        self.ended += 1


@dataclass
class Call:
    bridge: Bridge
    leg: FakeLeg
    server: ScriptedRealtime
    sink: MemorySink
    gateway: FakeGateway
    log: list[tuple[str, Any]]
    run: asyncio.Task[None]
    fatal: list[str]

    def events(self, kind: CallEventKind) -> list[CallEvent]:
        return [e for e in self.sink.events if e.kind == kind]

    async def event(self, kind: CallEventKind, count: int = 1) -> CallEvent:
        await wait_until(lambda: len(self.events(kind)) >= count, what=str(kind))
        return self.events(kind)[count - 1]

    async def hang_up(self) -> None:
        self.leg.inbox.put_nowait(LegClosed("stop"))
        async with asyncio.timeout(WAIT_S):
            await self.run


CTX = CallContext("call-1", "CA123", "tenant-1", "+15550001111", "+15550002222")


@pytest.fixture
async def make_call() -> AsyncIterator[Callable[..., Awaitable[Call]]]:
    started: list[Call] = []
    servers: list[ScriptedRealtime] = []
    baseline = asyncio.all_tasks()

    async def make(
        simulator: RealtimeSimulator | None = None,
        reject_session: bool = False,
        hold_session: bool = False,
        **config: Any,
    ) -> Call:
        log: list[tuple[str, Any]] = []
        server = ScriptedRealtime(log)
        server.reject_session = reject_session
        server.hold_session = hold_session
        await server.start()
        servers.append(server)
        base_url = simulator.base_url if simulator is not None else server.base_url
        leg = FakeLeg(log)
        sink = MemorySink()
        gateway = FakeGateway()
        _gateway: ToolGateway = gateway
        fatal: list[str] = []

        async def on_fatal(reason: str) -> None:
            log.append(("on_fatal", time.monotonic()))
            fatal.append(reason)

        client = AsyncOpenAI(api_key="test-key", base_url=base_url)
        settings = {"greeting": False, "reconnect_budget_s": 2.0, **config}
        bridge = Bridge(leg, CTX, gateway, sink, BridgeConfig(**settings), client, on_fatal)
        _typed: tuple[LiveCall, CallLeg] = (bridge, leg)  # mypy checks both protocols
        run = asyncio.create_task(bridge.run())
        call = Call(bridge, leg, server, sink, gateway, log, run, fatal)
        started.append(call)
        return call

    yield make
    for call in started:
        if not call.run.done():
            await call.bridge.end("test over")
        await asyncio.wait_for(call.run, WAIT_S)
        await call.leg.close("test over")
    for server in servers:
        await server.stop()
    # No task of a call outlives it.
    leftover = [t for t in asyncio.all_tasks() - baseline if t is not asyncio.current_task()]
    assert not leftover, leftover


async def test_session_update_is_ga_shaped_with_pcmu_vad_transcription_and_tools(make_call):
    call = await make_call(vad_eagerness="low")
    conn = await call.server.connection()
    update = conn.of_type("session.update")
    assert len(update) == 1
    session = update[0]["session"]
    assert session["type"] == "realtime"
    assert session["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert session["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    assert session["audio"]["output"]["voice"] == "marin"
    assert session["audio"]["input"]["turn_detection"] == {
        "type": "semantic_vad",
        "eagerness": "low",
        "create_response": True,
        "interrupt_response": True,
    }
    assert session["audio"]["input"]["transcription"]["model"]
    assert [t["name"] for t in session["tools"]] == ["check_availability"]
    assert session["tool_choice"] == "auto"
    assert "never mention tools" in session["instructions"].lower()
    assert "one short" in session["instructions"]
    await call.event(CallEventKind.REALTIME_CONNECTED)


async def test_greeting_asks_for_a_first_response(make_call):
    call = await make_call(greeting=True)
    conn = await call.server.connection()
    create = await conn.wait_for("response.create")
    assert "Greet" in create["response"]["instructions"]


async def test_normal_turn_streams_audio_both_ways_and_records_transcripts(make_call):
    call = await make_call()
    conn = await call.server.connection()
    call.leg.speak(200)
    await wait_until(lambda: len(conn.of_type("input_audio_buffer.append")) >= 10)
    sent = base64.b64decode(conn.of_type("input_audio_buffer.append")[0]["audio"])
    assert sent == bytes([0x10]) * FRAME

    await conn.speech_started("user_1")
    await conn.speech_stopped("user_1", 200)
    await conn.send("input_audio_buffer.committed", item_id="user_1", previous_item_id=None)
    await conn.send(
        "conversation.item.input_audio_transcription.completed",
        item_id="user_1",
        content_index=0,
        transcript="A table for two tonight?",
        usage={"type": "duration", "seconds": 1.0},
    )
    await conn.response_created("resp_1")
    await conn.audio("resp_1", "agent_1", 300)
    await conn.send(
        "response.output_audio_transcript.done",
        response_id="resp_1",
        item_id="agent_1",
        output_index=0,
        content_index=0,
        transcript="Sure, for what time?",
    )
    await conn.response_done("resp_1")

    agent = await call.event(CallEventKind.AGENT_TRANSCRIPT)
    assert agent.data["text"] == "Sure, for what time?"
    assert agent.data["cut"] is False
    # Recorded only once the caller had heard it all.
    assert call.leg.playback.confirmed_ms("agent_1") == 300
    assert sum(len(p.audio) for p in call.leg.plays) == 300 * 8
    caller = await call.event(CallEventKind.CALLER_TRANSCRIPT)
    assert caller.data["text"] == "A table for two tonight?"
    assert not call.leg.clears
    assert not call.events(CallEventKind.BARGE_IN)
    await call.hang_up()
    assert call.events(CallEventKind.CALL_ENDED)[0].data["reason"] == "leg closed: stop"
    assert call.gateway.ended == 1


async def test_barge_in_clears_first_then_truncates_at_heard_audio_then_cancels(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_1")
    await conn.audio("resp_1", "agent_1", 2000)
    await conn.send(
        "response.output_audio_transcript.done",
        response_id="resp_1",
        item_id="agent_1",
        output_index=0,
        content_index=0,
        transcript="Our opening hours are from noon until eleven every day of the week.",
    )
    await wait_until(lambda: call.leg.playback.confirmed_ms("agent_1") >= 500)

    await conn.speech_started("user_2", 900)
    truncate = await conn.wait_for("conversation.item.truncate")
    cancel = await conn.wait_for("response.cancel")
    # It names the response it stops: one that began meanwhile is not stopped in its place.
    assert cancel["response_id"] == "resp_1"
    # The model keeps streaming until it sees the cancel: none of that may reach the caller.
    await conn.audio("resp_1", "agent_1", 300)
    await conn.response_done("resp_1", status="cancelled")
    await call.event(CallEventKind.RESPONSE_DONE)  # every delta before it was handled
    barge = await call.event(CallEventKind.BARGE_IN)

    assert call.log.index(("leg_clear", None)) < call.log.index(
        ("server_got", "conversation.item.truncate")
    )
    assert call.log.index(("server_got", "conversation.item.truncate")) < call.log.index(
        ("server_got", "response.cancel")
    )
    clear = call.leg.clears[0]
    assert truncate["item_id"] == "agent_1"
    assert truncate["content_index"] == 0
    # Never more than the caller had heard when the leg was cleared (within one 20 ms frame)
    # and never less than the leg had confirmed. Where it lands in between depends on how late
    # confirmations arrive (a loaded machine delays them; the tracker then errs low, by
    # design): a speed, measured in bench/, not asserted here.
    assert clear["confirmed_ms"] <= truncate["audio_end_ms"] <= clear["heard_ms"] + 20
    assert truncate["audio_end_ms"] < 2000
    assert len(call.leg.plays) == clear["plays_before"]
    assert barge.data["truncated"] is True
    assert barge.data["cancelled"] is True
    assert barge.data["received_ms"] == 2000
    assert barge.data["audio_end_ms"] == truncate["audio_end_ms"]
    assert barge.data["clear_latency_ms"] >= 0
    agent = await call.event(CallEventKind.AGENT_TRANSCRIPT)
    assert agent.data["cut"] is True
    assert agent.data["heard_ms"] == truncate["audio_end_ms"]
    assert 0 < len(agent.data["text"]) < len(agent.data["full_text"])


async def test_barge_in_without_active_response_truncates_but_does_not_cancel(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_1")
    await conn.audio("resp_1", "agent_1", 1500)
    await conn.response_done("resp_1")
    await call.event(CallEventKind.RESPONSE_DONE)
    await wait_until(lambda: call.leg.playback.confirmed_ms("agent_1") >= 200)
    await conn.speech_started("user_2")
    await conn.wait_for("conversation.item.truncate")
    barge = await call.event(CallEventKind.BARGE_IN)
    assert barge.data["cancelled"] is False
    assert not conn.of_type("response.cancel")


async def test_interruption_after_playback_finished_sends_no_truncate(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_1")
    await conn.audio("resp_1", "agent_1", 100)
    await conn.response_done("resp_1")
    await wait_until(lambda: call.leg.playback.confirmed_ms("agent_1") == 100)
    await wait_until(lambda: not call.leg.playback.is_playing())

    await conn.speech_started("user_2")
    started = await call.event(CallEventKind.SPEECH_STARTED)
    assert started.data["turn_id"] == 1
    assert not call.leg.clears
    assert not conn.of_type("conversation.item.truncate")
    assert not conn.of_type("response.cancel")
    assert not call.events(CallEventKind.BARGE_IN)


async def test_response_create_waits_for_active_response_to_finish(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_1")
    await call.event(CallEventKind.RESPONSE_CREATED)

    assert await call.bridge.deliver_result(LateResult("op-1", "Your table at 21:00 is booked."))
    assert await call.bridge.deliver_result(
        LateResult("op-2", "An SMS confirmation is on its way.")
    )
    # deliver_result decides before returning: while resp_1 is active nothing is sent.
    assert not conn.of_type("response.create")
    assert not conn.of_type("conversation.item.create")

    await conn.response_done("resp_1")
    create = await conn.wait_for("response.create")
    notes = conn.of_type("conversation.item.create")
    assert len(notes) == 2
    assert notes[0]["item"]["role"] == "system"
    assert "21:00 is booked" in notes[0]["item"]["content"][0]["text"]
    assert conn.received.index(notes[1]) < conn.received.index(create)
    assert create["event_id"].startswith("bridge_rc_")
    await conn.response_created("resp_2")
    announced = await call.event(CallEventKind.RESULT_ANNOUNCED)
    assert announced.data == {"response_id": "resp_2", "operation_ids": ["op-1", "op-2"]}
    # One response carries both results: exactly one create, none while resp_1 was active.
    assert len(conn.of_type("response.create")) == 1


async def test_lost_create_race_is_retried_after_the_servers_response(make_call):
    call = await make_call()
    conn = await call.server.connection()
    assert await call.bridge.deliver_result(LateResult("op-1", "It is booked."))
    create = await conn.wait_for("response.create")
    # The server's VAD started a response first: our create is refused, quietly.
    await conn.response_created("resp_vad")
    await conn.send(
        "error",
        error={
            "type": "invalid_request_error",
            "code": "conversation_already_has_active_response",
            "message": "Conversation already has an active response",
            "event_id": create["event_id"],
        },
    )
    await conn.response_done("resp_vad")
    await call.event(CallEventKind.RESPONSE_DONE)
    assert not call.events(CallEventKind.REALTIME_ERROR)


async def _function_call_item(call_id: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": f"fc_{call_id}",
        "type": "function_call",
        "object": "realtime.item",
        "status": status,
        "name": "check_availability",
        "call_id": call_id,
        "arguments": '{"time": "21:00"}',
    }


async def test_function_call_runs_off_the_audio_path_and_answers_with_a_response(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.speech_started("user_1")
    await conn.speech_stopped("user_1")
    await conn.response_created("resp_1")
    item = await _function_call_item("call_a")
    await conn.send("response.output_item.done", response_id="resp_1", output_index=0, item=item)
    await conn.response_done("resp_1", output=[item])
    await wait_until(lambda: call.gateway.requests)

    # The tool is slow; caller audio keeps flowing meanwhile.
    before = len(conn.of_type("input_audio_buffer.append"))
    call.leg.speak(100)
    await wait_until(lambda: len(conn.of_type("input_audio_buffer.append")) >= before + 5)

    call.gateway.gate.set()
    output = await conn.wait_for("conversation.item.create")
    assert output["item"] == {
        "type": "function_call_output",
        "call_id": "call_a",
        "output": '{"tables":["19:00","21:00"]}',
    }
    await conn.wait_for("response.create")
    assert conn.received.index(output) < conn.received.index(conn.of_type("response.create")[0])
    request = call.gateway.requests[0]
    assert (request.call_id, request.turn_id, request.response_id) == ("call_a", 1, "resp_1")
    assert len(call.gateway.requests) == 1  # output_item.done and response.done: one call
    sent = await call.event(CallEventKind.FUNCTION_OUTPUT)
    assert sent.data["response"] == "requested"


async def test_function_output_while_caller_speaks_is_sent_but_response_deferred(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_1")
    item = await _function_call_item("call_b")
    await conn.send("response.output_item.done", response_id="resp_1", output_index=0, item=item)
    await conn.response_done("resp_1", output=[item])
    await wait_until(lambda: call.gateway.requests)

    await conn.speech_started("user_2")
    await call.event(CallEventKind.SPEECH_STARTED)
    call.gateway.gate.set()
    await conn.wait_for("conversation.item.create")
    output = await call.event(CallEventKind.FUNCTION_OUTPUT)
    assert output.data["response"].startswith("deferred")
    assert output.data["sent"] is True
    assert not conn.of_type("response.create")


async def test_cancelled_response_arguments_do_not_run_the_tool(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_1")
    await conn.send(
        "response.function_call_arguments.done",
        response_id="resp_1",
        item_id="fc_call_x",
        output_index=0,
        call_id="call_x",
        name="check_availability",
        arguments='{"time": "21:00"}',
    )
    incomplete = await _function_call_item("call_x", status="incomplete")
    await conn.send(
        "response.output_item.done", response_id="resp_1", output_index=0, item=incomplete
    )
    await conn.response_done("resp_1", status="cancelled", output=[incomplete])
    # A later, completed call proves the events before it were processed.
    await conn.response_created("resp_2")
    done = await _function_call_item("call_y")
    await conn.response_done("resp_2", output=[done])
    await wait_until(lambda: call.gateway.requests)
    assert [r.call_id for r in call.gateway.requests] == ["call_y"]


async def test_barge_in_during_a_tool_call_stops_speech_but_not_the_tool(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_1")
    await conn.audio("resp_1", "agent_1", 1500)
    item = await _function_call_item("call_c")
    await conn.send("response.output_item.done", response_id="resp_1", output_index=1, item=item)
    await wait_until(lambda: call.gateway.requests)
    await wait_until(lambda: call.leg.playback.confirmed_ms("agent_1") >= 100)
    await conn.speech_started("user_2")
    await call.event(CallEventKind.BARGE_IN)
    call.gateway.gate.set()
    output = await conn.wait_for("conversation.item.create")
    assert output["item"]["call_id"] == "call_c"


async def test_dtmf_is_recorded_and_offered_to_the_tool_layer(make_call):
    call = await make_call()
    await call.server.connection()
    call.leg.inbox.put_nowait(DtmfIn("7"))
    event = await call.event(CallEventKind.DTMF)
    assert event.data == {"digit": "7"}
    await wait_until(lambda: call.gateway.digits == ["7"])


async def test_realtime_drop_reconnects_and_resends_the_session(make_call):
    call = await make_call()
    first = await call.server.connection(0)
    await call.event(CallEventKind.REALTIME_CONNECTED)
    await first.send(
        "conversation.item.input_audio_transcription.completed",
        item_id="user_1",
        content_index=0,
        transcript="Do you have a table at nine?",
        usage={"type": "duration", "seconds": 1.0},
    )
    await call.event(CallEventKind.CALLER_TRANSCRIPT)
    await first.ws.close(1011, "gone")

    second = await call.server.connection(1)
    resumed = second.of_type("session.update")[0]["session"]
    assert resumed["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert "Do you have a table at nine?" in resumed["instructions"]
    dropped = await call.event(CallEventKind.REALTIME_DROPPED)
    assert "1011" in dropped.data["reason"]
    await call.event(CallEventKind.REALTIME_RECONNECTED)
    call.leg.speak(100)
    await wait_until(lambda: len(second.of_type("input_audio_buffer.append")) >= 5)
    assert not call.fatal
    assert not call.run.done()


async def test_reconnect_retries_refused_handshakes_within_the_budget(make_call):
    call = await make_call(reconnect_budget_s=5.0)
    first = await call.server.connection(0)
    await call.event(CallEventKind.REALTIME_CONNECTED)
    call.server.reject_connects = 2
    await first.ws.close(1011, "gone")
    await call.server.connection(1)
    reconnected = await call.event(CallEventKind.REALTIME_RECONNECTED)
    assert reconnected.data["attempts"] == 3


async def test_reconnect_failure_plays_the_apology_then_calls_on_fatal(make_call):
    call = await make_call(reconnect_budget_s=0.5)
    first = await call.server.connection(0)
    await call.event(CallEventKind.REALTIME_CONNECTED)
    call.server.reject_connects = 1000
    await first.ws.close(1011, "gone")
    async with asyncio.timeout(WAIT_S):
        await call.run
    assert len(call.fatal) == 1
    assert call.events(CallEventKind.REALTIME_FAILED)
    apology = call.events(CallEventKind.APOLOGY_PLAYED)[0]
    clip = apology_clip("audio/pcmu")
    assert [p.item_id for p in call.leg.plays] == ["apology"]
    assert call.leg.plays[0].audio == clip
    # The whole clip was confirmed played before the app was asked to hang up.
    assert apology.data["heard_ms"] == len(clip) // 8
    played_at = max(at for item, _, at in call.leg.played_log if item == "apology")
    fatal_at = next(value for name, value in call.log if name == "on_fatal")
    assert played_at <= fatal_at
    assert call.events(CallEventKind.CALL_ENDED)[0].data["reason"].startswith("realtime failed")
    kinds = call.sink.kinds()
    assert kinds.index(CallEventKind.APOLOGY_PLAYED) < kinds.index(CallEventKind.CALL_ENDED)


async def test_end_from_outside_closes_the_leg_and_the_session(make_call):
    call = await make_call()
    conn = await call.server.connection()
    st = (call.bridge.state, call.bridge.utterances.session is not None)
    await call.bridge.end("status callback: completed")
    st2 = (conn.ws.state,)
    assert call.run.done(), (st, st2)
    assert call.leg.closed == "status callback: completed"
    await wait_until(lambda: conn.ws.close_code is not None, what=repr((st, st2)))
    assert not await call.bridge.deliver_result(LateResult("op-9", "Too late."))
    assert call.gateway.ended == 1
    ended = call.events(CallEventKind.CALL_ENDED)
    assert [e.data["reason"] for e in ended] == ["status callback: completed"]


async def test_end_while_the_session_is_being_configured_closes_its_socket(make_call):
    # The socket is opened but session.updated has not come: the bridge holds no session yet,
    # and the half-open connection must still be closed (not leaked to the server).
    call = await make_call(hold_session=True)
    conn = await call.server.connection()
    assert call.bridge.state == "connecting"
    await call.bridge.end("status callback: completed")
    assert call.run.done()
    await wait_until(lambda: conn.ws.close_code is not None, what="server-side close")
    ended = call.events(CallEventKind.CALL_ENDED)
    assert [e.data["reason"] for e in ended] == ["status callback: completed"]


async def test_hang_up_during_a_slow_tool_call_leaves_no_task_behind(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_1")
    item = await _function_call_item("call_d")
    await conn.response_done("resp_1", output=[item])
    await wait_until(lambda: call.gateway.requests)
    baseline_ok = not call.run.done()
    await call.hang_up()
    assert baseline_ok
    output = [e for e in call.events(CallEventKind.FUNCTION_OUTPUT)]
    assert not output or output[0].data["sent"] is False
    # make_call's teardown asserts that no task survived the call.


# Against the Realtime simulator: the same SDK code path, a server with its own VAD and rules.


@pytest.fixture
async def simulator() -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[RealtimeSimulator]]]:
    started: list[RealtimeSimulator] = []

    async def start(scenario: dict[str, Any]) -> RealtimeSimulator:
        sim = RealtimeSimulator(Scenario.model_validate(scenario), realtime_factor=1.0)
        await sim.start()
        started.append(sim)
        return sim

    yield start
    for sim in started:
        await sim.stop()


async def test_simulated_call_greets_hears_the_caller_and_answers(make_call, simulator):
    sim = await simulator(
        {
            "greeting": {"text": "Thanks for calling. How can I help?", "audio_ms": 600},
            "steps": [
                {
                    "caller_transcript": "A table for two, please.",
                    "reply": {"text": "Of course, for what time?", "audio_ms": 700},
                }
            ],
        }
    )
    call = await make_call(simulator=sim, greeting=True)
    greeting = await call.event(CallEventKind.AGENT_TRANSCRIPT)
    assert greeting.data["text"] == "Thanks for calling. How can I help?"
    assert greeting.data["cut"] is False
    await wait_until(lambda: not call.leg.playback.is_playing())

    call.leg.say(900)
    caller = await call.event(CallEventKind.CALLER_TRANSCRIPT)
    assert caller.data["text"] == "A table for two, please."
    reply = await call.event(CallEventKind.AGENT_TRANSCRIPT, 2)
    assert reply.data == {
        "item_id": reply.data["item_id"],
        "text": "Of course, for what time?",
        "cut": False,
        "heard_ms": 700,
        "audio_ms": 700,
        "started_mono_ns": reply.data["started_mono_ns"],
        # The response that said it (replay rebuilds the model's script from it).
        "response_id": reply.data["response_id"],
    }
    said_by = [e.data["response_id"] for e in call.events(CallEventKind.RESPONSE_CREATED)]
    assert reply.data["response_id"] == said_by[1]  # the reply, not the greeting
    # Stamped when its playout began: before the caller's words were transcribed, and at
    # least its heard audio before it was recorded.
    assert caller.mono_ns < reply.data["started_mono_ns"] <= reply.mono_ns - 700 * 1_000_000
    assert not call.leg.clears
    assert not call.events(CallEventKind.REALTIME_ERROR)
    session = sim.sessions[0]
    assert len(session.received_events("session.update")) == 1
    assert not session.sent_events("error")


async def test_simulated_barge_in_truncates_between_confirmed_and_heard_audio(make_call, simulator):
    sim = await simulator(
        {
            "greeting": {
                "text": "Welcome to Luigi's, home of the finest pizza in town.",
                "audio_ms": 4000,
            }
        }
    )
    call = await make_call(simulator=sim, greeting=True)
    session = await sim.wait_for_session()
    await wait_until(lambda: call.leg.plays)
    await wait_until(lambda: call.leg.playback.confirmed_ms(call.leg.plays[0].item_id) >= 700)

    call.leg.say(800)
    truncate = await session.wait_for_received("conversation.item.truncate")
    barge = await call.event(CallEventKind.BARGE_IN)
    clear = call.leg.clears[0]
    # As above: bounded by what was confirmed and what was heard, whatever the load.
    assert clear["confirmed_ms"] <= truncate["audio_end_ms"] <= clear["heard_ms"] + 20
    assert barge.data["audio_end_ms"] == truncate["audio_end_ms"]
    await session.wait_for_sent("conversation.item.truncated")
    # The simulator accepted it: the truncation fits the audio it sent for the item.
    assert not call.events(CallEventKind.REALTIME_ERROR)
    agent = await call.event(CallEventKind.AGENT_TRANSCRIPT)
    assert agent.data["cut"] is True
    # Nothing of the interrupted greeting reached the caller after the clear.
    await session.wait_for_sent("response.done")
    assert len(call.leg.plays) == clear["plays_before"]


async def test_simulated_function_call_round_trip(make_call, simulator):
    sim = await simulator(
        {
            "steps": [
                {
                    "caller_transcript": "Any table at nine?",
                    "function_call": {
                        "name": "check_availability",
                        "arguments": {"time": "21:00"},
                        "preamble": {"text": "Let me check that for you.", "audio_ms": 600},
                    },
                },
                {"reply": {"text": "Free: {output[tables]}.", "audio_ms": 600}},
            ]
        }
    )
    call = await make_call(simulator=sim)
    session = await sim.wait_for_session()
    call.gateway.gate.set()
    call.leg.say(900)
    await wait_until(lambda: session.function_outputs)
    assert session.function_outputs[0][1] == '{"tables":["19:00","21:00"]}'
    answer = await call.event(CallEventKind.AGENT_TRANSCRIPT, 2)
    assert "21:00" in answer.data["text"]
    assert call.gateway.requests[0].arguments == '{"time":"21:00"}'
    assert not session.sent_events("error")


async def test_simulated_drop_reconnects_and_the_call_goes_on(make_call, simulator):
    sim = await simulator({"steps": [{"reply": {"text": "Yes?", "audio_ms": 600}}]})
    call = await make_call(simulator=sim)
    await call.event(CallEventKind.REALTIME_CONNECTED)
    await sim.drop_all()
    second = await sim.wait_for_session(1)
    await second.wait_for_received("session.update")
    await call.event(CallEventKind.REALTIME_RECONNECTED)
    call.leg.say(900)
    reply = await call.event(CallEventKind.AGENT_TRANSCRIPT)
    assert reply.data["text"] == "Yes?"


async def test_simulated_reconnect_failure_apologises_and_hangs_up(make_call, simulator):
    sim = await simulator({})
    call = await make_call(simulator=sim, reconnect_budget_s=0.5)
    await call.event(CallEventKind.REALTIME_CONNECTED)
    sim.fail_next_connects(1000)
    await sim.drop_all()
    async with asyncio.timeout(WAIT_S):
        await call.run
    assert len(call.fatal) == 1
    assert call.events(CallEventKind.APOLOGY_PLAYED)
    assert sim.connect_attempts > 2


async def test_an_odd_server_event_is_recorded_and_the_call_goes_on(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.send("response.output_audio.delta", item_id="agent_1")  # no delta, no response
    await conn.send("some.future.event", detail=1)
    error = await call.event(CallEventKind.ERROR)
    assert error.data["where"] == "realtime:response.output_audio.delta"
    await conn.response_created("resp_1")
    await conn.audio("resp_1", "agent_2", 100)
    await wait_until(lambda: call.leg.plays)
    assert not call.run.done()


async def test_a_rejected_session_config_is_not_retried_and_ends_the_call(make_call):
    call = await make_call(reject_session=True, reconnect_budget_s=5.0)
    async with asyncio.timeout(WAIT_S):
        await call.run
    assert call.server.handshakes == 1
    error = call.events(CallEventKind.REALTIME_ERROR)[0]
    assert error.data["param"] == "session.audio.input.format.type"
    failed = call.events(CallEventKind.REALTIME_FAILED)[0]
    assert failed.data["reason"].startswith("session.update rejected")
    assert len(call.fatal) == 1


async def test_a_stray_response_done_does_not_free_the_slot_of_the_active_response(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_2")
    await conn.response_done("resp_old")  # late, from before
    await conn.response_done("resp_old")  # and duplicated
    await call.event(CallEventKind.RESPONSE_DONE, 2)
    assert await call.bridge.deliver_result(LateResult("op-1", "Booked."))
    assert not conn.of_type("response.create")
    await conn.response_done("resp_2")
    await conn.wait_for("response.create")
    assert not call.events(CallEventKind.ERROR)


async def test_barge_in_also_cuts_an_item_queued_behind_the_one_playing(make_call):
    call = await make_call()
    conn = await call.server.connection()
    await conn.response_created("resp_1")
    await conn.audio("resp_1", "agent_1", 600)
    await conn.audio("resp_1", "agent_2", 600)
    for item_id, text in (("agent_1", "First part."), ("agent_2", "Second part.")):
        await conn.send(
            "response.output_audio_transcript.done",
            response_id="resp_1",
            item_id=item_id,
            output_index=0,
            content_index=0,
            transcript=text,
        )
    await conn.response_done("resp_1")
    await wait_until(lambda: call.leg.playback.confirmed_ms("agent_1") >= 200)
    await conn.speech_started("user_2")
    await call.event(CallEventKind.BARGE_IN)
    await wait_until(lambda: len(conn.of_type("conversation.item.truncate")) == 2)
    truncates = {
        t["item_id"]: t["audio_end_ms"] for t in conn.of_type("conversation.item.truncate")
    }
    assert 200 <= truncates["agent_1"] < 600
    assert truncates["agent_2"] == 0
    transcripts = {e.data["item_id"]: e.data for e in call.events(CallEventKind.AGENT_TRANSCRIPT)}
    assert transcripts["agent_2"]["cut"] is True
    assert transcripts["agent_2"]["text"] == ""
    assert transcripts["agent_1"]["cut"] is True
