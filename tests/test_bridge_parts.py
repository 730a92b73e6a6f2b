"""The bridge's parts, each through its own seam: a fake model session (the ModelSession
Protocol), a real playback tracker on a fake clock, and a port that records what a part asks
of the call. The whole bridge over real sockets is tests/test_bridge.py."""

from __future__ import annotations

import asyncio
import base64
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from telephony.bridge.playout import LocalPlayout, ServerPlayout
from telephony.bridge.port import Port
from telephony.bridge.slot import CreateRequest, ResponseSlot, ResponseState
from telephony.bridge.tool_dispatch import ToolDispatch
from telephony.bridge.turns import Turns
from telephony.bridge.utterance import Utterances
from telephony.call_events import CallEventKind
from telephony.caller_evidence import EvidenceLog
from telephony.legs.sideband import SidebandLeg
from telephony.playback import PlaybackTracker
from telephony.session_config import BridgeConfig
from telephony.tool_gateway import CallContext, FunctionCallRequest, LateResult, ToolReply


@dataclass
class FakeSession:
    """A model connection that records each client event it is asked to send."""

    generation: int = 1
    slot: ResponseSlot = field(default_factory=ResponseSlot)
    items: set[str] = field(default_factory=set)
    sent: list[tuple[Any, ...]] = field(default_factory=list)
    voice: str | None = "marin"
    session_id: str = "sess_fake"
    server_turns: bool = False

    async def append(self, payload: str) -> bool:
        self.sent.append(("append", payload))
        return True

    def append_now(self, payload: str) -> bool:
        return False

    async def truncate(self, item_id: str, audio_end_ms: int) -> bool:
        self.sent.append(("truncate", item_id, audio_end_ms))
        return True

    async def cancel_response(self, response_id: str) -> bool:
        self.sent.append(("cancel", response_id))
        return True

    async def clear_output(self) -> bool:
        self.sent.append(("clear_output",))
        return True

    async def add_function_output(self, function_call_id: str, output: str) -> bool:
        self.sent.append(("function_output", function_call_id, output))
        return True

    async def add_note(self, text: str) -> bool:
        self.sent.append(("note", text))
        return True

    async def create_response(self, event_id: str, instructions: str | None) -> bool:
        self.sent.append(("create", event_id))
        return True

    def kinds(self) -> list[str]:
        return [s[0] for s in self.sent]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class PlayingLeg:
    """A leg that plays what it is given on a tracker driven by a fake clock."""

    audio_format = "audio/pcmu"

    def __init__(self, clock: Clock) -> None:
        self.playback = PlaybackTracker(clock)
        self.clears = 0

    async def play(self, item_id: str, payload: str) -> None:
        self.playback.queued(item_id, len(base64.b64decode(payload)) / 8)

    async def clear(self) -> None:
        self.clears += 1
        self.playback.cleared()


@dataclass
class Recorder:
    """The port's far side: what the parts asked of the call."""

    events: list[tuple[CallEventKind, dict[str, Any]]] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def port(self) -> Port:
        def emit(kind: CallEventKind, /, **data: Any) -> None:
            self.events.append((kind, data))

        def spawn(
            coro: Coroutine[Any, Any, None], name: str, *, tool: bool = False
        ) -> asyncio.Task[None]:
            task = asyncio.create_task(coro, name=name)
            self.tasks.append(task)
            return task

        return Port("call-1", emit, spawn, self.finished.append, lambda: bool(self.finished))

    def of(self, kind: CallEventKind) -> list[dict[str, Any]]:
        return [data for k, data in self.events if k is kind]


def audio_ms(ms: int) -> str:
    return base64.b64encode(b"\xff" * (ms * 8)).decode("ascii")


def parts(leg: Any = None) -> tuple[Recorder, Turns, LocalPlayout, Utterances]:
    recorder = Recorder()
    port = recorder.port()
    evidence = EvidenceLog()
    turns = Turns(evidence)
    history: deque[str] = deque(maxlen=20)
    box: list[Utterances] = []
    playout = LocalPlayout(
        port, leg or PlayingLeg(Clock()), turns, history, lambda r: box[0].audio_changed(r)
    )
    utterances = Utterances(port, turns, playout, evidence, None, max_queued=8)
    box.append(utterances)
    return recorder, turns, playout, utterances


async def test_queued_responses_coalesce_into_one_create_for_the_current_turn() -> None:
    _, turns, _, utterances = parts()
    session = FakeSession()
    utterances.session = session
    turns.speech_started("in_1")
    utterances.queue(CreateRequest("function_output", turn_id=0))  # the caller spoke since
    turns.speech_stopped()
    turns.speech_stopped_at = None  # the server's own answer is not awaited here
    utterances.queue(CreateRequest("function_output", turn_id=1))
    await utterances.drain()
    assert session.kinds() == ["create"]
    assert session.slot.state is ResponseState.REQUESTED
    assert session.slot.requested is not None and session.slot.requested.turn_id == 1
    utterances.close()


async def test_a_late_result_waits_for_the_active_response_and_is_announced_once() -> None:
    recorder, _, _, utterances = parts()
    session = FakeSession()
    utterances.session = session
    utterances.response_created(session, "resp_1")
    result = LateResult("op-1", "Your table is booked.", delivery_id="d-1")
    await utterances.deliver(result)
    await utterances.deliver(result)  # offered again while it waits
    assert session.sent == []  # a response is under way
    utterances.response_done(session, "resp_1", "completed")
    await utterances.drain()
    assert session.kinds() == ["note", "create"]
    assert "Your table is booked." in session.sent[0][1]
    utterances.response_created(session, "resp_2")
    announced = recorder.of(CallEventKind.RESULT_ANNOUNCED)
    assert announced == [{"response_id": "resp_2", "operation_ids": ["op-1"]}]
    utterances.close()


async def test_local_playout_cuts_in_at_the_audio_heard_and_mutes_the_rest() -> None:
    clock = Clock()
    leg = PlayingLeg(clock)
    recorder, turns, playout, utterances = parts(leg)
    session = FakeSession()
    utterances.response_created(session, "resp_1")
    size = playout.take_delta(session, "resp_1", "item_1", audio_ms(1000))
    assert size == 8000
    await leg.play("item_1", audio_ms(1000))
    clock.now += 0.4  # the caller has heard 400 ms of it
    turns.speech_started("in_1")
    await playout.speech_started(session, 0.0)
    assert leg.clears == 1
    assert session.sent == [("truncate", "item_1", 400), ("cancel", "resp_1")]
    assert playout.take_delta(session, "resp_1", "item_1", audio_ms(20)) == -1
    (barge,) = recorder.of(CallEventKind.BARGE_IN)
    assert (barge["audio_end_ms"], barge["received_ms"], barge["turn_id"]) == (400, 1000, 1)
    utterances.close()


async def test_server_playout_cancels_and_clears_the_servers_buffer_without_truncating() -> None:
    recorder = Recorder()
    port = recorder.port()
    evidence = EvidenceLog()
    turns = Turns(evidence)
    leg = SidebandLeg("rtc_1")
    playout = ServerPlayout(port, leg, turns, deque(), lambda r: None)
    session = FakeSession()
    session.slot.move(ResponseState.ACTIVE)
    session.slot.active_response_id = "resp_1"
    playout.output_item_added(session, "item_1", "resp_1", "message")
    playout.output_started("resp_1")
    turns.speech_started("in_1")
    await playout.speech_started(session, 0.0)
    assert session.sent == [("cancel", "resp_1"), ("clear_output",)]
    (barge,) = recorder.of(CallEventKind.BARGE_IN)
    assert barge["truncated"] is False and barge["output_cleared"] is True
    assert playout.is_muted("resp_1")


@dataclass
class AnsweringGateway:
    requests: list[FunctionCallRequest] = field(default_factory=list)

    def definitions(self) -> list[dict[str, Any]]:
        return []

    async def handle(self, ctx: CallContext, request: FunctionCallRequest) -> ToolReply:
        self.requests.append(request)
        return ToolReply({"tables": ["21:00"]})

    async def on_dtmf(self, ctx: CallContext, digit: str) -> None:
        return None

    async def on_call_end(self, ctx: CallContext) -> None:
        return None


@dataclass
class StillLink:
    keeps_conversation: bool = False
    ended_remotely: bool = False
    deltas_by_lane: int = 0


async def test_tool_dispatch_runs_a_completed_call_once_and_answers_the_session_that_asked() -> (
    None
):
    recorder, turns, playout, utterances = parts()
    gateway = AnsweringGateway()
    session = FakeSession()
    utterances.session = session
    evidence = EvidenceLog()
    dispatch = ToolDispatch(
        recorder.port(),
        CallContext("call-1", "CA1", "t1", "+15550001111", "+15550002222"),
        gateway,
        BridgeConfig(),
        StillLink(),  # type: ignore[arg-type]
        turns,
        utterances,
        playout,
        evidence,
        lambda: session,
    )
    # A cancelled response's arguments are no request; a completed one is acted on once.
    dispatch.function_call(session, "fc_1", "check", "{}", "item_1", "incomplete", "resp_1")
    dispatch.function_call(session, "fc_1", "check", "{}", "item_1", "completed", "resp_1")
    dispatch.function_call(session, "fc_1", "check", "{}", "item_1", "completed", "resp_1")
    await asyncio.gather(*recorder.tasks)
    assert [r.call_id for r in gateway.requests] == ["fc_1"]
    assert session.sent[0] == ("function_output", "fc_1", '{"tables":["21:00"]}')
    assert session.kinds() == ["function_output", "create"]
    (output,) = recorder.of(CallEventKind.FUNCTION_OUTPUT)
    assert (output["sent"], output["response"]) == (True, "requested")
    utterances.close()


@pytest.mark.parametrize(
    ("text", "status", "reference", "says"),
    [
        ("Good news: the restaurant has confirmed your table.", "committed", None, True),
        ("I've requested it; it isn't confirmed yet.", "committed", None, False),
        ("It is not confirmed yet, I'll let you know.", "committed", None, False),
        ("Your booking reference is BK123.", "committed", "BK123", True),
        ("Anything else?", "committed", None, False),
        ("Sorry, the restaurant could not take the booking.", "failed_final", None, True),
        ("Your table is booked.", "failed_final", None, False),
        ("The request was cancelled; nothing was done.", "cancelled", None, True),
    ],
)
def test_a_gpt_live_utterance_says_a_result_only_with_its_outcome_not_negated(
    text: str, status: str, reference: str | None, says: bool
) -> None:
    from telephony.bridge.utterance import says_outcome
    from telephony.tool_gateway import LateResult

    result = LateResult("op-1", "note", {"status": status, "reference": reference})
    assert says_outcome(text, result) is says
