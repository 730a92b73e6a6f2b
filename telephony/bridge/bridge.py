"""The bridge: one live call, its parts composed, its life (connect, live, reconnect, end).

Owns the call's state machine, the tasks of the call (the leg loop, the model loop, tool
tasks), the routing of each model event to the part that owns it, the failure path (the
apology, then the app's hang-up) and the end (every part closed, in order, exactly once).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from enum import StrEnum
from typing import Any

from openai import AsyncOpenAI
from openai.types.realtime import (
    ConversationItemInputAudioTranscriptionCompletedEvent,
    InputAudioBufferCommittedEvent,
    InputAudioBufferSpeechStartedEvent,
    InputAudioBufferSpeechStoppedEvent,
    RealtimeConversationItemFunctionCall,
    RealtimeErrorEvent,
    ResponseAudioDeltaEvent,
    ResponseAudioTranscriptDoneEvent,
    ResponseCreatedEvent,
    ResponseDoneEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
)
from openai.types.realtime.input_audio_buffer_dtmf_event_received_event import (
    InputAudioBufferDtmfEventReceivedEvent,
)

from telephony.bridge.agent import ActiveAgent
from telephony.bridge.audio_path import AudioPath
from telephony.bridge.live_events import LIVE_EVENTS_HANDLED, LiveEvents
from telephony.bridge.live_link import LiveLink
from telephony.bridge.model_link import ModelLink, ModelSession
from telephony.bridge.playout import LocalPlayout, Playout, ServerPlayout
from telephony.bridge.port import Port
from telephony.bridge.realtime_link import RealtimeLink
from telephony.bridge.slot import CreateRequest, IllegalTransition
from telephony.bridge.spans import CallSpans
from telephony.bridge.tool_dispatch import ToolDispatch, TransferHook
from telephony.bridge.turns import Turns
from telephony.bridge.utterance import Utterances
from telephony.call_events import CallEvent, CallEventKind, CallEventSink
from telephony.caller_evidence import EvidenceLog
from telephony.legs.leg import AudioIn, CallLeg, DtmfIn, LegClosed
from telephony.legs.sideband import LiveSidebandLeg, SidebandLeg
from telephony.realtime_wire import AudioDelta
from telephony.redaction import mask_spoken_pins
from telephony.session_config import BridgeConfig, instructions_text
from telephony.tool_gateway import (
    AnnouncementSink,
    CallContext,
    ConfirmationEvidence,
    LateResult,
    ToolGateway,
    TransferRequest,
)

log = logging.getLogger(__name__)

# Errors that races between the caller, the server's VAD and us make unavoidable.
EXPECTED_ERROR_CODES = frozenset(
    {"response_cancel_not_active", "conversation_already_has_active_response"}
)
# Errors after which the session cannot continue; treated like a dropped socket.
FATAL_ERROR_CODES = frozenset({"session_expired", "session_closed"})
# The Realtime server events `Bridge._on_event` acts on (its `case`s, which
# tests/test_hot_path.py checks against this): the link drops every other type unparsed
# (transcript deltas, content parts, item notices, rate limits: most of what is not audio).
REALTIME_EVENTS_HANDLED = frozenset(
    {
        "response.output_audio.delta",
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "response.created",
        "response.done",
        "response.output_item.added",
        "output_audio_buffer.started",
        "output_audio_buffer.stopped",
        "output_audio_buffer.cleared",
        "input_audio_buffer.dtmf_event_received",
        "response.output_item.done",
        "response.output_audio_transcript.done",
        "conversation.item.input_audio_transcription.completed",
        "error",
    }
)
# What the bridge's GPT-Live handler acts on: the Live router's and the caller's keypad.
LIVE_EVENTS_READ = LIVE_EVENTS_HANDLED | {"transport.dtmf.received"}
HISTORY_LINES = 20
TOOL_GRACE_S = 2.0  # how long a running tool call may finish after the call ends
TIMEOUT_S = 10.0  # bound for housekeeping awaits (hooks, closes)


def _emit_ended(sink: CallEventSink, call_id: str, kind: CallEventKind, /, **data: Any) -> None:
    """An ended call's events (a part's last word after the bridge closed), to its sink."""
    sink.emit(CallEvent(call_id, kind, data))


class BridgeState(StrEnum):
    """Where the bridge is in a call's life."""

    CONNECTING = "connecting"
    LIVE = "live"
    RECONNECTING = "reconnecting"
    FAILING = "failing"  # the model is gone for good: apologise, then end
    ENDED = "ended"


_TRANSITIONS: dict[BridgeState, frozenset[BridgeState]] = {
    BridgeState.CONNECTING: frozenset({BridgeState.LIVE, BridgeState.FAILING, BridgeState.ENDED}),
    BridgeState.LIVE: frozenset({BridgeState.RECONNECTING, BridgeState.ENDED}),
    BridgeState.RECONNECTING: frozenset({BridgeState.LIVE, BridgeState.FAILING, BridgeState.ENDED}),
    BridgeState.FAILING: frozenset({BridgeState.ENDED}),
    BridgeState.ENDED: frozenset(),
}


class Bridge:
    """One live call: a CallLeg bridged to a model session. Implements LiveCall."""

    def __init__(
        self,
        leg: CallLeg,
        ctx: CallContext,
        gateway: ToolGateway,
        sink: CallEventSink,
        config: BridgeConfig,
        client: AsyncOpenAI,
        on_fatal: Callable[[str], Awaitable[None]] | None = None,
        announcements: AnnouncementSink | None = None,
        transfer: TransferHook | None = None,
    ) -> None:
        self.leg = leg
        self.ctx = ctx
        self._gateway = gateway
        self._sink = sink
        self.config = config
        self._on_fatal = on_fatal
        self._state = BridgeState.CONNECTING
        self._session: ModelSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._tool_tasks: set[asyncio.Task[Any]] = set()
        self._ended = asyncio.Event()
        self._closed = asyncio.Event()
        self._end_reason = ""
        self._running = False
        self.port = Port(ctx.call_id, self._emit, self._spawn, self._finish, self._ended.is_set)
        # The parts. Conversation state in them survives reconnects.
        history: deque[str] = deque(maxlen=HISTORY_LINES)
        self._history = history
        evidence = EvidenceLog()  # what the caller's yes to a readback rests on
        self.turns = Turns(evidence)
        sideband = leg if isinstance(leg, SidebandLeg) else None
        live = config.model_api == "live"
        # Where Realtime plays the audio itself (the interconnect), it also says what was
        # heard. GPT-Live's sideband does not: its leg plays the transcript's span by the clock.
        self.playout: Playout = (
            ServerPlayout(self.port, sideband, self.turns, history, self._audio_changed)
            if sideband is not None and not live
            else LocalPlayout(self.port, leg, self.turns, history, self._audio_changed)
        )
        # The agent talking (agents declared: the first one, until a handoff).
        starting = getattr(gateway, "starting_session", None)
        self.active_agent = ActiveAgent(
            starting(config.start_agent) if starting is not None else None, gateway.definitions
        )
        if live and sideband is not None and not isinstance(sideband, LiveSidebandLeg):
            raise ValueError("GPT-Live on OpenAI's SIP interconnect needs a LiveSidebandLeg")
        self.link: ModelLink = (
            LiveLink(
                self.port,
                config,
                client,
                leg.audio_format,
                self.active_agent.tools,
                history,
                persona=self.active_agent.persona,
                voice=self.active_agent.voice,
                sideband_session_id=sideband.call_sid if sideband is not None else None,
            )
            if live
            else RealtimeLink(
                self.port,
                config,
                client,
                leg.audio_format,
                self.active_agent.tools,
                history,
                sideband_call_sid=sideband.call_sid if sideband is not None else None,
                persona=self.active_agent.persona,
                voice=self.active_agent.voice,
            )
        )
        self.audio = AudioPath(self.port, leg, self.playout, ctx, gateway, evidence)
        self.audio.deaf = not config.listen_at_start
        self.utterances = Utterances(
            self.port,
            self.turns,
            self.playout,
            evidence,
            announcements,
            config.max_queued_response_creates,
        )
        # The call's turns and model responses as spans (under the call's span).
        self.spans = CallSpans(ctx.call_id, config.model)
        self.tools = ToolDispatch(
            self.port,
            ctx,
            gateway,
            config,
            self.link,
            self.turns,
            self.utterances,
            self.playout,
            evidence,
            lambda: self._session,
            self.active_agent,
            history,
            self.spans,
            transfer,
            getattr(leg, "send_digits", None),
        )
        # GPT-Live's events go to the same parts through their own router (a strategy).
        self._live = (
            LiveEvents(
                self.port, self.turns, self.playout, self.tools, history, evidence, self.utterances
            )
            if live
            else None
        )

    async def _on_live_event(self, session: Any, event: Any) -> str | None:
        """A GPT-Live server event: the caller's keypad (a SIP leg's sideband) here, the rest
        to the Live router."""
        if event.type == "transport.dtmf.received":
            self.audio.digit(str(event.event))
            return None
        assert self._live is not None
        return await self._live.on_event(session, event)

    async def transfer(self, request: TransferRequest, by: str) -> None:
        """Staff transfer the caller (see ToolDispatch.staff_transfer)."""
        await self.tools.staff_transfer(request, by)

    async def open_line(self, opening: str, *, listen: bool, wait_s: float = 0.0) -> bool:
        """An outbound call's first words, once it is known who answered: the agent (deaf and
        silent until now) says them. With `listen` the conversation goes on from there;
        without, the caller's audio stays unheard and this returns once the words were heard
        to their end (or `wait_s` passed). False when the call is ending."""
        loop = asyncio.get_running_loop()
        until = loop.time() + max(wait_s, TIMEOUT_S)
        while self._state is BridgeState.CONNECTING and loop.time() < until:
            if self._ended.is_set():
                return False
            await asyncio.sleep(0.05)  # the model session is being opened
        if self._ended.is_set() or self._state is not BridgeState.LIVE:
            return False
        self.audio.deaf = not listen
        instructions = instructions_text(self.config, persona=self.active_agent.persona())
        self.utterances.queue(
            CreateRequest("outbound_opening", instructions=f"{instructions}\n\n{opening}")
        )
        await self.utterances.drain()
        if not listen:
            await self.tools.until_said(wait_s)
        return not self._ended.is_set()

    @property
    def agent(self) -> str | None:
        """The agent talking now (None: no agents declared); late results ask who it is."""
        return self.active_agent.name

    # Counters for benchmarks and tests.

    @property
    def frames_up(self) -> int:
        return self.audio.frames_up

    @property
    def frames_up_by_lane(self) -> int:
        return self.audio.frames_up_by_lane

    @property
    def frames_dropped_up(self) -> int:
        return self.audio.frames_dropped_up

    @property
    def deltas_by_lane(self) -> int:
        return self.link.deltas_by_lane

    @property
    def deltas_muted(self) -> int:
        return self.playout.deltas_muted

    @property
    def turn_id(self) -> int:
        return self.turns.turn_id

    @property
    def ended_remotely(self) -> bool:
        """The sideband was refused: the call ended on OpenAI's side."""
        return self.link.ended_remotely

    # Lifecycle.

    @property
    def state(self) -> BridgeState:
        return self._state

    def _transition(self, new: BridgeState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise IllegalTransition(f"bridge cannot go from {self._state} to {new}")
        log.debug("call %s: bridge %s -> %s", self.ctx.call_id, self._state, new)
        self._state = new
        # Audio and responses go to the session only while it is live.
        live = self._session if new is BridgeState.LIVE else None
        self.audio.session = live
        self.utterances.session = live

    async def run(self) -> None:
        """Bridge the call until it ends from any side; everything is closed on return."""
        self._running = True
        self.audio.open()
        try:
            self._spawn(self._leg_loop(), "leg")
            self._spawn(self._model_loop(), "realtime")
            await self._ended.wait()
        finally:
            self.spans.close()
            await self._shutdown()

    async def end(self, reason: str) -> None:
        """End the call from outside (status callback, shutdown); returns once closed."""
        self._finish(reason)
        if self._running:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TIMEOUT_S):
                    await self._closed.wait()

    def _finish(self, reason: str) -> None:
        if not self._ended.is_set():
            self._end_reason = reason
            self._ended.set()

    async def _shutdown(self) -> None:
        if self._state is not BridgeState.ENDED:
            self._transition(BridgeState.ENDED)
        if not self._end_reason:
            self._end_reason = "bridge stopped"
        self._ended.set()
        self.audio.close()
        self.utterances.close()
        self.playout.close()
        await self._cancel(self._tasks)
        if self._tool_tasks:
            # A tool call is not undone by hanging up: let it answer briefly, then stop waiting.
            await asyncio.wait(self._tool_tasks, timeout=TOOL_GRACE_S)
        await self._cancel(self._tool_tasks)
        await self._close_session()
        with contextlib.suppress(Exception):
            await self.leg.close(self._end_reason)
        if self._live is not None:
            self._live.flush()
        self.playout.record_rest()
        self.utterances.settle(f"call ended: {self._end_reason}", self._session)
        try:
            async with asyncio.timeout(TIMEOUT_S):
                await self._gateway.on_call_end(self.ctx)
        except Exception:
            log.exception("call %s: on_call_end failed", self.ctx.call_id)
        # A leg that measures its media (SIP: RTP loss and jitter) reports it with the end.
        media_report = getattr(self.leg, "media_report", None)
        media = {"media": media_report()} if callable(media_report) else {}
        self._emit(CallEventKind.CALL_ENDED, reason=self._end_reason, **media)
        self._closed.set()
        self._release()

    def _release(self) -> None:
        """Cut what refers back to the bridge (its parts' port, the playout's hook, the app's
        fatal hook), so the ended call is freed by reference counting: left in reference
        cycles, its few hundred objects wait for a full collection, which at 200 live calls
        stops all of them for 20-50 ms. What the bridge refers to stays for readers."""
        self.port.cut(functools.partial(_emit_ended, self._sink, self.ctx.call_id))
        self.playout.release()
        self.tools.release()
        self._on_fatal = None

    @staticmethod
    async def _cancel(tasks: set[asyncio.Task[Any]]) -> None:
        current = asyncio.current_task()
        pending = [t for t in tasks if t is not current]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        tasks.clear()

    def _spawn(
        self, coro: Coroutine[Any, Any, None], name: str, *, tool: bool = False
    ) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"bridge-{self.ctx.call_id}-{name}")
        owner = self._tool_tasks if tool else self._tasks
        owner.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._tool_tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("call %s: task %s failed", self.ctx.call_id, task.get_name(), exc_info=exc)
            self._emit(CallEventKind.ERROR, where=task.get_name(), error=repr(exc)[:200])
            self._finish(f"internal error in {task.get_name()}")

    def _emit(self, kind: CallEventKind, /, **data: Any) -> None:
        self._sink.emit(CallEvent(self.ctx.call_id, kind, data))

    def _audio_changed(self, response_id: str | None) -> None:
        self.utterances.audio_changed(response_id)

    # The leg.

    async def _leg_loop(self) -> None:
        audio = self.audio
        # Closed here when the loop leaves it: a generator left suspended is closed by the
        # event loop's finalizer hook instead, a wake-up and a task of its own (per level).
        async with contextlib.aclosing(self.leg.events()) as events:
            async for event in events:
                match event:
                    case AudioIn():
                        await audio.send(event.payload)
                    case DtmfIn():
                        audio.digit(event.digit)
                    case LegClosed():
                        self._finish(f"leg closed: {event.reason}")
                        return
        self._finish("leg closed")

    # The model: connection lifecycle.

    async def _model_loop(self) -> None:
        first = True
        while True:
            started = time.monotonic()
            session, attempts, error = await self.link.connect(resumed=not first)
            if session is None and self.link.ended_remotely:
                # Not a failure: the call is over (a hang-up, a transfer) on OpenAI's side.
                self._finish(f"ended on OpenAI's side: {error}")
                return
            if session is None:
                await self._fail(error or "could not connect")
                return
            self._session = session
            self._transition(BridgeState.LIVE)
            if self.audio.has_down_lane:
                self.link.open_lane(session, self.audio.take_delta_now)
            if first:
                self._emit(
                    CallEventKind.REALTIME_CONNECTED,
                    attempts=attempts,
                    connect_ms=round((time.monotonic() - started) * 1000, 1),
                )
                # On GPT-Live the server takes the first turn itself.
                if self.config.greeting and self._live is None:
                    self.utterances.queue(
                        CreateRequest(
                            "greeting",
                            instructions=instructions_text(
                                self.config, persona=self.active_agent.persona()
                            )
                            + "\n\n"
                            + self.config.greeting_instructions,
                        )
                    )
            else:
                self._emit(
                    CallEventKind.REALTIME_RECONNECTED,
                    attempts=attempts,
                    down_ms=round((time.monotonic() - started) * 1000),
                )
            first = False
            await self.audio.flush_backlog(session)
            await self.utterances.drain()
            if self._live is not None:
                reason = await self.link.read(
                    session, self.audio.play, self._on_live_event, LIVE_EVENTS_READ
                )
            else:
                reason = await self.link.read(
                    session, self.audio.play, self._on_event, REALTIME_EVENTS_HANDLED
                )
            if self._ended.is_set():
                return
            self._emit(CallEventKind.REALTIME_DROPPED, reason=reason)
            if self._live is not None:
                # GPT-Live names no items: the utterance under way closes with the session, so
                # the next one starts with it in the conversation so far.
                self._live.flush()
            self._transition(BridgeState.RECONNECTING)
            await self._close_session()
            self.turns.session_dropped()
            self.utterances.session_dropped(session)

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await self.link.close(session)

    async def _fail(self, reason: str) -> None:
        """The model is gone for good: apologise to the caller, hand the hang-up to the app."""
        if self._ended.is_set():
            return
        self._transition(BridgeState.FAILING)
        self._emit(CallEventKind.REALTIME_FAILED, reason=reason)
        # Where we carry no audio, there is nothing to apologise on: the app hangs up.
        await self.playout.apologise(self.config)
        if self._on_fatal is not None:
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    await self._on_fatal(reason)
            except Exception:
                log.exception("call %s: on_fatal failed", self.ctx.call_id)
        self._finish(f"realtime failed: {reason}")

    # The model: events, each to the part that owns it.

    async def _on_event(self, session: ModelSession, event: Any) -> str | None:
        """Apply one server event; returns a reason when the session must be given up."""
        match event.type:
            case "response.output_audio.delta":
                # Only a delta whose fields the wire check doubted gets here.
                assert isinstance(event, ResponseAudioDeltaEvent)
                await self.audio.play(
                    session, AudioDelta(event.response_id, event.item_id, event.delta)
                )
            case "input_audio_buffer.speech_started":
                assert isinstance(event, InputAudioBufferSpeechStartedEvent)
                received_at = time.perf_counter()
                self.turns.speech_started(event.item_id)
                self.spans.turn(self.turns.turn_id)
                await self.playout.speech_started(session, received_at)
                self._emit(
                    CallEventKind.SPEECH_STARTED,
                    turn_id=self.turns.turn_id,
                    audio_start_ms=event.audio_start_ms,
                )
            case "input_audio_buffer.speech_stopped":
                assert isinstance(event, InputAudioBufferSpeechStoppedEvent)
                self.turns.speech_stopped()
                self._emit(
                    CallEventKind.SPEECH_STOPPED,
                    turn_id=self.turns.turn_id,
                    audio_end_ms=event.audio_end_ms,
                )
            case "input_audio_buffer.committed":
                assert isinstance(event, InputAudioBufferCommittedEvent)
                self.turns.committed(event.item_id)
                self.spans.turn(self.turns.turn_id)
            case "response.created":
                assert isinstance(event, ResponseCreatedEvent)
                response_id = event.response.id or ""
                self.utterances.response_created(session, response_id)
                self.spans.response_created(
                    response_id, self.utterances.turn_of(response_id), self.active_agent.name
                )
            case "response.done":
                assert isinstance(event, ResponseDoneEvent)
                response = event.response
                response_id = response.id or ""
                self.utterances.response_done(session, response.id, response.status)
                self.spans.response_done(response.id, response.status, response.usage)
                for output in response.output or []:
                    if isinstance(output, RealtimeConversationItemFunctionCall):
                        self._function_call(session, output, response_id)
                self.tools.response_done(response_id)
                details = response.status_details
                self.utterances.announced_done(
                    response_id, response.status, details.reason if details else None
                )
                await self.utterances.drain()
            case "response.output_item.added":
                assert isinstance(event, ResponseOutputItemAddedEvent)
                item = event.item
                self.playout.output_item_added(
                    session, item.id or "", event.response_id, item.type or ""
                )
            case "output_audio_buffer.started":
                self.playout.output_started(str(getattr(event, "response_id", "")))
            case "output_audio_buffer.stopped" | "output_audio_buffer.cleared":
                self.playout.output_ended(
                    str(getattr(event, "response_id", "")),
                    cleared=event.type == "output_audio_buffer.cleared",
                )
            case "input_audio_buffer.dtmf_event_received":
                assert isinstance(event, InputAudioBufferDtmfEventReceivedEvent)
                self.audio.digit(event.event)
            case "response.output_item.done":
                assert isinstance(event, ResponseOutputItemDoneEvent)
                if isinstance(event.item, RealtimeConversationItemFunctionCall):
                    self._function_call(session, event.item, event.response_id)
            case "response.output_audio_transcript.done":
                assert isinstance(event, ResponseAudioTranscriptDoneEvent)
                self.playout.transcript(event.item_id, event.transcript)
            case "conversation.item.input_audio_transcription.completed":
                assert isinstance(event, ConversationItemInputAudioTranscriptionCompletedEvent)
                self._caller_transcript(event.item_id, event.transcript)
            case "error":
                assert isinstance(event, RealtimeErrorEvent)
                return self._on_error(session, event)
        return None

    def _function_call(
        self, session: ModelSession, item: RealtimeConversationItemFunctionCall, response_id: str
    ) -> None:
        # The Realtime item's `call_id` is the model's function call id.
        self.tools.function_call(
            session,
            item.call_id,
            item.name,
            item.arguments,
            item.id or "",
            item.status,
            response_id,
        )

    def _caller_transcript(self, item_id: str, transcript: str) -> None:
        self.turns.caller_heard(item_id)
        # A PIN spoken aloud is in the transcript too: never stored or re-sent.
        said = mask_spoken_pins(transcript)
        self._emit(
            CallEventKind.CALLER_TRANSCRIPT, item_id=item_id, text=said, turn_id=self.turns.turn_id
        )
        self._history.append(f"Caller: {said}")

    def _on_error(self, session: ModelSession, event: RealtimeErrorEvent) -> str | None:
        error = event.error
        self.utterances.create_refused(session, error.event_id)
        if error.code in EXPECTED_ERROR_CODES:
            log.debug("call %s: expected Realtime error %s", self.ctx.call_id, error.code)
            return None
        self._emit(
            CallEventKind.REALTIME_ERROR,
            code=error.code,
            type=error.type,
            message=error.message[:200],
            event_id=error.event_id,
        )
        if error.code in FATAL_ERROR_CODES:
            return f"fatal error: {error.code}"
        return None

    # LiveCall and CallerEvidence.

    async def deliver_result(self, result: LateResult) -> bool:
        """Speak a late result at the next safe moment; False if the call is ending."""
        if self._ended.is_set() or self._state in (BridgeState.FAILING, BridgeState.ENDED):
            return False
        await self.utterances.deliver(result)
        return True

    def confirmation_evidence(self, operation_id: str) -> ConfirmationEvidence:
        """`CallerEvidence`: the caller's answer to `operation_id`'s readback, as observed."""
        return self.tools.confirmation_evidence(operation_id)
