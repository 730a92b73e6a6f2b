"""Tool dispatch: the model's function calls to the tool gateway, and their answers back.

Owns which function calls were seen (a call is acted on once, and only when its item is
completed), the caps (per response, in flight), the tool tasks, the answer sent back to the
model (as a function call output on the session that asked, or as a note on a new one), the
decision whether that answer wants a response now, and the caller's evidence the gateway asks
for when a confirmation rests on it (`CallerEvidence`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from opentelemetry import context as otel_context

from telephony.bridge.agent import ActiveAgent, handoff_note
from telephony.bridge.model_link import ModelLink, ModelSession
from telephony.bridge.playout import Playout
from telephony.bridge.port import Port
from telephony.bridge.slot import CreateRequest, ResponseState
from telephony.bridge.spans import CallSpans
from telephony.bridge.turns import Turns
from telephony.bridge.utterance import Utterances
from telephony.call_events import CallEventKind
from telephony.caller_evidence import EvidenceLog
from telephony.session_config import BridgeConfig
from telephony.tool_gateway import (
    CallContext,
    ConfirmationEvidence,
    FunctionCallRequest,
    SessionChange,
    ToolGateway,
    ToolReply,
    TransferOutcome,
    TransferRequest,
)

log = logging.getLogger(__name__)

# How a leg puts a caller through to a person (Twilio <Dial>, SIP REFER, the interconnect).
TransferHook = Callable[[TransferRequest], Awaitable[TransferOutcome]]
# A transfer waits for the agent's sentence at most this long, polling at this pace; with no
# response at all after NO_RESPONSE_S it goes ahead.
TRANSFER_SPEECH_WAIT_S = 12.0
NO_RESPONSE_S = 2.0
SAID_POLL_S = 0.05


def _no_session() -> ModelSession | None:
    return None


class ToolDispatch:
    """Function calls of one call, from the model to the gateway and back."""

    def __init__(
        self,
        port: Port,
        ctx: CallContext,
        gateway: ToolGateway,
        config: BridgeConfig,
        link: ModelLink,
        turns: Turns,
        utterances: Utterances,
        playout: Playout,
        evidence: EvidenceLog,
        current: Callable[[], ModelSession | None],
        agent: ActiveAgent | None = None,
        history: Iterable[str] = (),
        spans: CallSpans | None = None,
        transfer: TransferHook | None = None,
        send_digits: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self._port = port
        self._ctx = ctx
        self._gateway = gateway
        self._config = config
        self._link = link
        self._turns = turns
        self._utterances = utterances
        self._playout = playout
        self._evidence = evidence
        self._current = current  # the bridge's session now (None between sessions)
        self._agent = agent or ActiveAgent(None, gateway.definitions)
        self._spans = spans
        # How this call's leg transfers a caller (None: it cannot).
        self._transfer_hook = transfer
        # How this call's leg presses keys on the line (None: it cannot).
        self._send_digits = send_digits
        self._history = history  # the conversation so far, for a new agent's note
        self._seen: set[str] = set()  # function_call_ids acted on
        # Function calls per response, and those running now (bounded by the config).
        self._calls_per_response: dict[str, int] = {}
        self._running = 0

    def release(self) -> None:
        """The call has ended: drop the hooks into the bridge and the app (see
        Bridge._release); no session is current and the line transfers no more."""
        self._current = _no_session
        self._transfer_hook = None

    def function_call(
        self,
        session: ModelSession,
        function_call_id: str | None,
        name: str,
        arguments: str,
        item_id: str,
        status: str | None,
        response_id: str,
    ) -> None:
        """A function call item from the model (`response.output_item.done`, `response.done`)."""
        # Only a completed item is proof: a cancelled response's arguments are not a request.
        if status != "completed" or not function_call_id or function_call_id in self._seen:
            return
        self._seen.add(function_call_id)
        request = FunctionCallRequest(
            call_id=function_call_id,
            name=name,
            arguments=arguments,
            item_id=item_id,
            response_id=response_id,
            turn_id=self._utterances.turn_of(response_id),
            evidence=self,
            agent=self._agent.name,
            session_id=session.session_id,
        )
        redacts = getattr(self._gateway, "redacts_arguments", None)
        secret = redacts is not None and redacts(request.name)
        self._port.emit(
            CallEventKind.FUNCTION_CALL,
            call_id=function_call_id,
            name=request.name,
            # A tool that declares `redact_arguments` (a spoken PIN): never stored.
            arguments={"redacted": True} if secret else request.arguments[:500],
            turn_id=request.turn_id,
            response_id=response_id,
        )
        refusal = self._over_limits(response_id)
        if refusal is None:
            self._running += 1
        self._port.spawn(
            self._run(request, session.generation, refusal),
            f"tool-{function_call_id}",
            tool=True,
        )

    def response_done(self, response_id: str) -> None:
        """The response makes no more calls."""
        self._calls_per_response.pop(response_id, None)

    def _over_limits(self, response_id: str) -> ToolReply | None:
        """A refusal when this call may not reach the tool layer now, else None.

        A model that asks for dozens of calls at once must not turn into dozens of requests
        at a provider: past the caps, each call is answered at once and goes nowhere.
        """
        count = self._calls_per_response.get(response_id, 0) + 1
        self._calls_per_response[response_id] = count
        if count > self._config.max_tool_calls_per_response:
            why = (
                f"Too many requests at once: at most {self._config.max_tool_calls_per_response} "
                "per turn."
            )
        elif self._running >= self._config.max_tool_calls_in_flight:
            why = (
                f"Too many requests at once: at most {self._config.max_tool_calls_in_flight} "
                "can run together."
            )
        else:
            return None
        log.info("call %s: function call refused (%s)", self._port.call_id, why)
        return ToolReply(
            {
                "status": "error",
                "message": f"{why} This one was not run, so nothing was done. Make one "
                "request at a time and wait for its answer.",
                "retryable": True,
            }
        )

    def confirmation_evidence(self, operation_id: str) -> ConfirmationEvidence:
        """`CallerEvidence`: the caller's answer to `operation_id`'s readback, as observed."""
        session = self._current()
        active = session.slot.active_response_id if session is not None else None
        return self._evidence.judge(operation_id, self._playout.spoken(active))

    async def _run(
        self, request: FunctionCallRequest, generation: int, refusal: ToolReply | None = None
    ) -> None:
        function_call_id = request.call_id
        if refusal is not None:
            reply = refusal
        else:
            # The tool call's span goes under its turn's (this task's context only).
            if self._spans is not None:
                otel_context.attach(self._spans.context_of(request.turn_id))
            try:
                reply = await self._gateway.handle(self._ctx, request)
            except Exception as exc:
                log.exception(
                    "call %s: tool gateway failed on %s", self._port.call_id, request.name
                )
                self._port.emit(CallEventKind.ERROR, where="tool_gateway", error=repr(exc)[:200])
                reply = ToolReply({"error": "The request could not be completed right now."})
            finally:
                self._running -= 1
        if reply.dtmf is not None:
            reply = await self._press(reply, reply.dtmf)
        if reply.awaiting_confirmation and reply.operation_id is not None:
            # What the model says after this output is the readback the caller must hear.
            self._evidence.readback_asked(reply.operation_id)
        session = self._current()
        if self._port.ended() or session is None:
            self._port.emit(
                CallEventKind.FUNCTION_OUTPUT,
                call_id=function_call_id,
                operation_id=reply.operation_id,
                sent=False,
                response="call_ended",
            )
            return
        if reply.session_change is not None:
            await self._hand_off(session, reply.session_change)
        output = json.dumps(reply.output, separators=(",", ":"), default=str)
        # A re-attached sideband joins the same conversation: the function call is still there.
        if session.generation == generation or self._link.keeps_conversation:
            sent = await session.add_function_output(function_call_id, output)
        else:
            # The session that asked is gone; tell the new one what came back.
            sent = await session.add_note(
                f"Result of the earlier request ({request.name}): {output}"
            )
        decision = self._decide(request, reply)
        if reply.transfer is not None:
            # Said before the caller leaves: the sentence the output asks for, then the leg.
            self._port.spawn(self._carry_out(reply.transfer), f"transfer-{function_call_id}")
        extra: dict[str, Any] = {"limited": True} if refusal is not None else {}
        self._port.emit(
            CallEventKind.FUNCTION_OUTPUT,
            call_id=function_call_id,
            operation_id=reply.operation_id,
            sent=sent,
            response=decision,
            turn_id=request.turn_id,
            # Refused by the per-response / in-flight caps: it reached no tool or provider.
            **extra,
        )
        await self._utterances.drain()

    async def staff_transfer(self, transfer: TransferRequest, by: str) -> None:
        """Staff put the caller through: the agent says so in one sentence, then the leg
        transfers as for the model's own `transfer_call` (the outcome on the timeline)."""
        if not self._port.ended():
            await self._say_after_note(
                f"A member of staff ({by[:60]}) is transferring this caller to "
                f"{transfer.target.replace('_', ' ')} now. Tell the caller in one short sentence "
                "that you are putting them through, and say nothing after it.",
                "staff_transfer",
            )
        await self._carry_out(transfer)

    async def _say_after_note(self, note: str, reason: str) -> None:
        """A note to the model, then a response (at the next safe moment) that says it."""
        session = self._current()
        if session is None:
            return
        await session.add_note(note)
        self._utterances.queue(CreateRequest(reason, turn_id=None))
        await self._utterances.drain()

    async def _carry_out(self, transfer: TransferRequest) -> None:
        """A transfer the engine admitted: once the agent's sentence has been heard (or the
        wait is over), the leg puts the caller through; the outcome goes to the ledger row,
        the timeline and, when the caller stays, to the model."""
        await self._until_said(TRANSFER_SPEECH_WAIT_S)
        if self._port.ended():
            return
        self._port.emit(
            CallEventKind.TRANSFER_REQUESTED,
            target=transfer.target,
            mode=transfer.mode,
            reason=transfer.reason[:300],
        )
        if self._transfer_hook is None:
            outcome = TransferOutcome(False, "unsupported", "this line cannot transfer calls")
        else:
            try:
                outcome = await self._transfer_hook(transfer)
            except Exception as exc:
                log.exception("call %s: transfer to %s failed", self._port.call_id, transfer.target)
                outcome = TransferOutcome(False, "failed", f"the transfer failed: {exc!r}"[:200])
        if outcome.accepted:
            # The leg moves the caller (its stream may be gone already): it records the start
            # when the caller leaves, and the outcome when the person answers or does not.
            return
        await self.transfer_failed(transfer, outcome)

    async def transfer_failed(self, transfer: TransferRequest, outcome: TransferOutcome) -> None:
        """A transfer that did not go through (refused, or a warm transfer's person never
        joined): the outcome on its row and the timeline, and the model, with the caller still
        on the line, told to say so and offer to arrange a call back."""
        if self._port.ended():
            return
        record = getattr(self._gateway, "transfer_outcome", None)
        if record is not None:
            await record(self._ctx, transfer.function_call_id, outcome)
        self._port.emit(
            CallEventKind.TRANSFER_FAILED,
            target=transfer.target,
            status=outcome.status,
            detail=outcome.detail[:300],
        )
        await self._say_after_note(
            f"The transfer to {transfer.target.replace('_', ' ')} did not go through "
            f"({outcome.status}: {outcome.detail}). The caller is still with you: tell them in "
            "one sentence, and offer to arrange a call back (schedule_callback) at a time that "
            "suits them; promise nothing else.",
            "transfer_failed",
        )

    async def say_and_wait(self, note: str, reason: str, wait_s: float) -> bool:
        """A note the agent says now (at the next safe moment), heard to its end (or `wait_s`
        passed); False when the call ended meanwhile."""
        if self._port.ended():
            return False
        await self._say_after_note(note, reason)
        await self._until_said(wait_s)
        return not self._port.ended()

    async def _press(self, reply: ToolReply, digits: str) -> ToolReply:
        """Send the keys on the leg; the model hears back once they have gone out."""
        if self._send_digits is None or self._port.ended():
            how = "not sent: this line cannot send keys"
        else:
            try:
                how = await self._send_digits(digits)
            except Exception as exc:
                log.warning("call %s: sending keys failed: %r", self._port.call_id, exc)
                how = "not sent: the line did not take them"
        sent = not how.startswith("not sent")
        self._port.emit(CallEventKind.DTMF_SENT, digits=digits, how=how, sent=sent)
        output = (
            {"status": "sent", "digits": digits, "message": "The keys were pressed."}
            if sent
            else {"status": "error", "digits": digits, "message": f"The keys were {how}."}
        )
        return dataclasses.replace(reply, output=output)

    async def until_said(self, wait_s: float) -> None:
        """Until the response asked for last has been created, done and heard (or `wait_s`)."""
        await self._until_said(wait_s)

    async def _until_said(self, wait_s: float) -> None:
        """Until the response after a tool's output has been created, done and heard (a
        sentence cut by the caller counts as said), or `wait_s` has passed."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        seen = False
        while loop.time() - start < wait_s and not self._port.ended():
            session = self._current()
            busy = session is not None and (
                session.slot.state is not ResponseState.IDLE or session.slot.requested is not None
            )
            seen = seen or busy
            if not busy and (seen or loop.time() - start > NO_RESPONSE_S):
                if not self._playout.playing():
                    return
            await asyncio.sleep(SAID_POLL_S)

    async def _hand_off(self, session: ModelSession, change: SessionChange) -> None:
        """Another agent takes the call on the same session: its instructions and tools
        (session.update), then a note with the conversation so far and the operations still
        open; the function output and a response follow as for any call."""
        before = self._agent.take(change)
        updated = await session.update_session(change.instructions, change.tools)
        noted = await session.add_note(handoff_note(change, self._history))
        log.info("call %s: handed off %s -> %s", self._port.call_id, before, change.agent)
        # The Realtime API refuses a voice change once the session has spoken
        # (`cannot_update_voice`): the new agent keeps this session's voice, and a reconnect's
        # new session speaks with its own.
        voice: dict[str, Any] = {}
        if change.voice is not None and change.voice != session.voice:
            voice = {"voice": session.voice, "voice_from_next_session": change.voice}
        self._port.emit(
            CallEventKind.AGENT_HANDOFF,
            from_agent=before,
            to_agent=change.agent,
            reason=change.reason[:300],
            tools=[str(t.get("name")) for t in change.tools],
            session_updated=updated,
            noted=noted,
            **voice,
        )

    def _decide(self, request: FunctionCallRequest, reply: ToolReply) -> str:
        """Whether the answer is spoken now: only for the current turn, caller not speaking."""
        if not reply.wants_response:
            return "not_wanted"
        if request.turn_id != self._turns.turn_id:
            return "deferred_stale_turn"
        if self._turns.caller_speaking:
            return "deferred_caller_speaking"
        # If the response that asked is still finishing, this waits for its response.done.
        self._utterances.queue(CreateRequest("function_output", turn_id=request.turn_id))
        return "requested"
