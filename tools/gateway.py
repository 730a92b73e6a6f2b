"""The tool pipeline: every function call from a live call goes through here.

parse and validate -> record the tool call -> policy -> reads inline within their deadline,
mutations admitted as operations (row + enqueue in one transaction) and answered at once
with their true state. Confirmation and spoken PIN entry are handled here as well.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from opentelemetry import trace
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from telephony.call_events import CallEvent, CallEventKind, CallEventSink
from telephony.tool_gateway import (
    CallContext,
    ConfirmationEvidence,
    FunctionCallRequest,
    KeypadEntry,
    SessionChange,
    ToolReply,
    TransferOutcome,
    TransferRequest,
)
from tools import faults, ledger, measures, tracing
from tools.agents import Agent, AgentSet
from tools.autocommit import autocommit
from tools.compensation import admit_compensation
from tools.conflicts import (
    conflict_key,
    find_earlier,
    held_output,
    held_still_output,
    keep_both_readback,
)
from tools.control import (
    HANDOFF_SPEC,
    HANDOFF_TO_AGENT,
    ConfirmOperationArgs,
    HandoffArgs,
    ResolveConflictArgs,
    VerifyPinArgs,
)
from tools.errors import IdempotencyConflict, InvalidArguments, ToolError, UnknownTool
from tools.identity import (
    CallerIdentity,
    CallerVerification,
    CallIdentities,
    IdentityStore,
    PinOutcome,
)
from tools.ledger import Enqueue, OperationRecord, ToolCallRecord
from tools.policy import Decision, LedgerFacts, Outcome, PolicyConfig, PolicyInput, evaluate
from tools.registry import Registry, ToolKind, ToolSpec
from tools.results import (
    awaiting_caller_output,
    bounded,
    cancelled_output,
    confirmation_output,
    denied_output,
    describe_operation,
    error_output,
    operation_output,
    read_output,
    verification_output,
)
from tools.states import IN_FLIGHT, OperationStatus, is_terminal
from tools.transfers import (
    DAY_NAMES,
    SCHEDULE_CALLBACK,
    SCHEDULE_CALLBACK_SPEC,
    SEND_DTMF,
    SEND_DTMF_SPEC,
    TRANSFER_CALL,
    TRANSFER_SPEC,
    CallbackScheduler,
    ScheduleCallbackArgs,
    SendDtmfArgs,
    TransferArgs,
    TransferTarget,
    briefing,
    masked_number,
    record_transfer_outcome,
    transfer_definition,
)
from tools.verification import LockoutPolicy, active_lock, record_check, subjects_of

log = logging.getLogger(__name__)

S = OperationStatus

# Runs a read against the provider: (spec, validated args) -> raw result.
ReadExecutor = Callable[[ToolSpec, BaseModel], Awaitable[Mapping[str, Any]]]
# Receives the operations still in flight when a call ends (late delivery decides: SMS).
PendingResultsSink = Callable[[CallContext, list[OperationRecord]], Awaitable[None]]

_MAX_GENERATIONS = 20


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _storable(text: str, limit: int | None = None) -> str:
    """Model-supplied text as Postgres takes it: no NUL, no lone surrogate, within `limit`.

    Without this a function call with a NUL in its arguments or an over-long name failed
    to insert, and the recovery insert failed the same way: no tool_calls row at all.
    """
    clean = text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    return clean if limit is None else clean[:limit]


def _reply(output: dict[str, Any], op: OperationRecord | None = None) -> ToolReply:
    return ToolReply(
        output=output,
        wants_response=True,
        operation_id=str(op.operation_id) if op else None,
        awaiting_confirmation=op is not None and op.status is S.AWAITING_CONFIRMATION,
    )


NO_EVIDENCE = ConfirmationEvidence(False, "this call cannot attest the caller's answer")


class ToolPipeline:
    """Implements `telephony.tool_gateway.ToolGateway` over the ledger and policy engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        registry: Registry,
        *,
        enqueue: Enqueue,
        read_executor: ReadExecutor,
        identities: IdentityStore,
        policy: PolicyConfig | None = None,
        clock: Callable[[], datetime] = _utcnow,
        pending_results: PendingResultsSink | None = None,
        max_pin_attempts: int = 3,
        handle_timeout_s: float = 15.0,
        lockout: LockoutPolicy | None = None,
        agents: AgentSet | None = None,
        transfers: Mapping[str, TransferTarget] | None = None,
        dtmf_out: bool = False,
        callbacks: CallbackScheduler | None = None,
    ) -> None:
        self._engine = engine
        # Arranges a call back to the caller (the app's outbound calls); offered with transfers.
        self.callbacks = callbacks
        # Where a caller may be transferred (TRANSFER_TARGETS); none: the tool is not offered.
        self.transfers: dict[str, TransferTarget] = dict(transfers or {})
        # Whether the agent may press keys on the line (DTMF_OUT): send_dtmf is offered.
        self.dtmf_out = dtmf_out
        # Agents declared (AGENTS_FILE): each call talks to one at a time, with its tools.
        self.agents = agents
        self._registry = registry
        self._enqueue = enqueue
        self._read = read_executor
        self._ids = CallIdentities(identities, max_attempts=max_pin_attempts)
        self._policy = policy or PolicyConfig()
        self._clock = clock
        # The app sets this to hand in-flight outcomes to late delivery when a call ends.
        self.pending_results = pending_results
        # Bounds the database work and an inline read together (reads have their own,
        # shorter deadline); on expiry the transaction rolls back and the model is told.
        self.handle_timeout_s = handle_timeout_s
        # PIN failures across calls (tools.verification); the app sets `events` so a lockout
        # shows on the call's timeline.
        self.lockout = lockout or LockoutPolicy()
        self.events: CallEventSink | None = None

    def definitions(self) -> list[dict[str, Any]]:
        defined = self._registry.definitions()
        if self.transfers:
            defined.append(transfer_definition(self.transfers))
        if self._offers_callbacks():
            defined.append(SCHEDULE_CALLBACK_SPEC.definition())
        if self.dtmf_out:
            defined.append(SEND_DTMF_SPEC.definition())
        return defined

    # --- agents --------------------------------------------------------------------------

    def starting_session(self, agent: str | None = None) -> SessionChange | None:
        """The session a call starts with when agents are declared: `agent`'s (a resumed
        call's), else the first one's (None: no agents, one agent with every tool)."""
        if self.agents is None:
            return None
        return self._session_of(self.agents.get(agent))

    def _offers(self, agent: Agent, name: str) -> bool:
        """Whether `agent` is offered the tool `name` (its own tools and the control tools)."""
        if name == HANDOFF_TO_AGENT:
            return bool(agent.handoffs)
        spec = self._spec(name)
        return spec is not None and (spec.kind is ToolKind.CONTROL or name in agent.tools)

    def _session_of(
        self, agent: Agent, *, from_agent: str | None = None, reason: str = "", note: str = ""
    ) -> SessionChange:
        tools = [s.definition() for s in self._registry if self._offers(agent, s.name)]
        if self.transfers:
            tools.append(transfer_definition(self.transfers))
        if self._offers_callbacks():
            tools.append(SCHEDULE_CALLBACK_SPEC.definition())
        if self.dtmf_out:
            tools.append(SEND_DTMF_SPEC.definition())
        if agent.handoffs:
            handoff = HANDOFF_SPEC.definition()
            # The model sees exactly whom this agent may hand to: its schema names them.
            agent_arg = handoff["parameters"]["properties"]["agent"]
            agent_arg["enum"] = list(agent.handoffs)
            tools.append(handoff)
        instructions = agent.instructions.strip() + (
            f"\n\nYou are the {agent.name} agent."
            + (
                f" Hand the caller to another agent ({', '.join(agent.handoffs)}) with "
                f"{HANDOFF_TO_AGENT} when what they want is that agent's job."
                if agent.handoffs
                else ""
            )
        )
        return SessionChange(
            agent=agent.name,
            instructions=instructions,
            tools=tools,
            from_agent=from_agent,
            reason=reason,
            note=note,
            voice=agent.voice,
        )

    async def _handoff(
        self,
        conn: AsyncConnection,
        ctx: CallContext,
        request: FunctionCallRequest,
        tc: ToolCallRecord,
        args: HandoffArgs,
    ) -> ToolReply:
        """Another agent takes the call; the operations still open stay the call's."""
        assert self.agents is not None
        current = self.agents.get(request.agent)
        norm = args.model_dump(mode="json")
        if args.agent not in current.handoffs:
            targets = ", ".join(current.handoffs) or "nobody"
            out = denied_output(
                f"You can hand the caller only to: {targets}. Carry on helping them yourself.",
                rule="handoff",
            )
            await ledger.complete_tool_call(
                conn, tc.id, decision="deny", reason="not a handoff target", arguments=norm,
                output=out,
            )  # fmt: skip
            return _reply(out)
        target = self.agents.get(args.agent)
        open_ops = await ledger.operations_for_call(
            conn, ctx.call_id, [S.AWAITING_CONFIRMATION, *IN_FLIGHT]
        )
        if open_ops:
            measures.HANDOFFS_WITH_PENDING.inc()
            lines = [
                f"- {self._describe(op)}: {op.status.value.replace('_', ' ')} "
                f"(operation_id {op.operation_id})"
                for op in open_ops
            ]
            note = (
                "Requests of this call still open (their results will reach you; never say "
                "one is done before you are told):\n" + "\n".join(lines)
            )
        else:
            note = "No request of this call is still open."
        out = {
            "status": "handed_off",
            "agent": target.name,
            "message": bounded(
                f"The caller is now with the {target.name} agent, who carries on from here."
            ),
        }
        await ledger.complete_tool_call(
            conn, tc.id, decision="handoff", reason=f"{current.name} -> {target.name}",
            arguments=norm, output=out,
        )  # fmt: skip
        change = self._session_of(target, from_agent=current.name, reason=args.reason, note=note)
        return ToolReply(output=out, wants_response=True, session_change=change)

    # --- transfers -------------------------------------------------------------------------

    async def _schedule_callback(
        self,
        conn: AsyncConnection,
        ctx: CallContext,
        tc: ToolCallRecord,
        args: ScheduleCallbackArgs,
    ) -> ToolReply:
        """A call back to the caller's number, admitted as an outbound call (its `place_call`
        operation scheduled for then) in this transaction: said as arranged only once it is."""
        norm = args.model_dump(mode="json")
        now = self._clock()
        target = self.transfers.get(args.target) if args.target else None
        at: datetime | None = None
        if args.minutes_from_now is not None:
            at = now + timedelta(minutes=args.minutes_from_now)
        elif target is not None and target.hours is not None and not target.hours.is_open(now):
            at = target.hours.next_opening(now)
        problem = None
        if not ctx.from_number:
            problem = "The caller's number is withheld, so there is no number to call back."
        elif at is None:
            problem = "Ask the caller when suits them (in how many minutes), then try again."
        if problem is not None or at is None or self.callbacks is None:
            out = denied_output(f"{problem} Nothing was arranged.", rule="callback")
            await ledger.complete_tool_call(
                conn, tc.id, decision="deny", reason=str(problem), arguments=norm, output=out
            )
            return _reply(out)
        wanted = f" They wanted {target.name.replace('_', ' ')}." if target else ""
        purpose = f"Calling back as arranged: {args.reason}.{wanted}"[:300]
        try:
            scheduled = await self.callbacks(conn, ctx, purpose, at, f"{ctx.call_id}:{tc.id}")
        except ValueError as exc:  # a number that cannot be called (not E.164)
            out = denied_output(
                "The caller's number cannot be called back from here. Nothing was arranged.",
                rule="callback",
            )
            await ledger.complete_tool_call(
                conn, tc.id, decision="deny", reason=_storable(str(exc)), arguments=norm,
                output=out,
            )  # fmt: skip
            return _reply(out)
        zone = target.hours.zone if target is not None and target.hours is not None else "UTC"
        when = scheduled.at.astimezone(ZoneInfo(zone))
        said = f"{DAY_NAMES[when.weekday()]} at {when:%H:%M} ({zone})"
        out = {
            "status": "callback_scheduled",
            "operation_id": scheduled.operation_id,
            "at": scheduled.at.isoformat(),
            "message": bounded(
                f"A call back to the number they are calling from is arranged for {said}. Tell "
                "the caller that, in one sentence; promise nothing more."
            ),
        }
        await ledger.complete_tool_call(
            conn, tc.id, decision="callback", reason=f"at {scheduled.at.isoformat()}",
            arguments=norm, output=out,
        )  # fmt: skip
        measures.CALLBACKS_ARRANGED.inc()
        return ToolReply(output=out, wants_response=True, operation_id=scheduled.operation_id)

    async def _transfer(
        self,
        conn: AsyncConnection,
        ctx: CallContext,
        request: FunctionCallRequest,
        tc: ToolCallRecord,
        args: TransferArgs,
        verification: CallerVerification,
    ) -> ToolReply:
        """A transfer to a person: checked here (the target, its hours, who may be put
        through), carried out by the call's leg, which reports the outcome back
        (`transfer_outcome`) to the same ledger row."""
        norm = args.model_dump(mode="json")
        target = self.transfers.get(args.target)
        if target is None:
            names = ", ".join(sorted(self.transfers)) or "nobody"
            out = denied_output(
                f"There is no transfer target called {_storable(args.target, 40)}; you can "
                f"transfer only to: {names}. Nothing was sent. Ask the caller which one they "
                "want, or help them yourself.",
                rule="transfer_target",
            )
            await ledger.complete_tool_call(
                conn, tc.id, decision="deny", reason="unknown transfer target", arguments=norm,
                output=out,
            )  # fmt: skip
            return _reply(out)
        closed = target.unavailable(self._clock(), verification.verified)
        if closed is not None:
            out = denied_output(closed, rule="transfer_hours")
            await ledger.complete_tool_call(
                conn, tc.id, decision="deny", reason=f"{target.name}: {closed[:200]}",
                arguments=norm, output=out,
            )  # fmt: skip
            return _reply(out)
        if args.mode == "warm" and not ctx.warm_transfer:
            out = denied_output(
                "A warm transfer (briefing the person first) is not available on this line. "
                "Nothing was sent. Offer the caller a direct transfer instead.",
                rule="transfer_mode",
            )
            await ledger.complete_tool_call(
                conn, tc.id, decision="deny", reason="warm transfer not available",
                arguments=norm, output=out,
            )  # fmt: skip
            return _reply(out)
        spoken = target.name.replace("_", " ")
        brief = ""
        if args.mode == "warm":
            account = verification.account
            who = (
                f"{account.name}, who has confirmed who they are"
                if verification.verified and account is not None and account.name
                else masked_number(ctx.from_number)
            )
            brief = await briefing(
                conn, ctx.call_id, who=who, reason=args.reason, describe=self._describe
            )
            message = (
                f"Tell the caller in one short sentence that you are calling {spoken} to brief "
                "them, and ask them to stay on the line with you. Never say they are connected: "
                f"you will be told when {spoken} answers, or that nobody could."
            )
        else:
            message = (
                f"Tell the caller in one short sentence that you are putting them through to "
                f"{spoken} now, and say nothing after it. If the transfer does not go through "
                "you will be told, and the caller stays with you."
            )
        out = {
            "status": "transferring" if args.mode == "cold" else "calling_person",
            "target": target.name,
            "mode": args.mode,
            "message": bounded(message),
        }
        await ledger.complete_tool_call(
            conn, tc.id, decision="transfer", reason=f"{args.mode} -> {target.name}",
            arguments=norm, output=out,
        )  # fmt: skip
        log.info("transfer to %s (%s) admitted", target.name, target.masked())
        return ToolReply(
            output=out,
            wants_response=True,
            transfer=TransferRequest(
                target=target.name,
                destination=target.destination,
                mode=args.mode,
                reason=args.reason,
                function_call_id=request.function_call_id,
                briefing=brief,
            ),
        )

    async def transfer_outcome(
        self, ctx: CallContext, function_call_id: str, outcome: TransferOutcome
    ) -> None:
        """What became of a transfer, on its tool call row (best effort: logged if not)."""
        await record_transfer_outcome(self._engine, ctx.call_id, function_call_id, outcome)

    # --- the ToolGateway surface ---------------------------------------------------------

    async def handle(self, ctx: CallContext, request: FunctionCallRequest) -> ToolReply:
        await faults.reach(
            "gateway.requested", call_id=ctx.call_id, function_call_id=request.function_call_id
        )
        started = time.perf_counter()
        # The GenAI conventions' tool span; the design's fields beside them.
        with tracing.tracer.start_as_current_span(
            f"execute_tool {request.name}",
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": request.name,
                "gen_ai.tool.call.id": request.function_call_id,
                "gen_ai.response.id": request.response_id,
                "gen_ai.conversation.id": ctx.call_id,
                tracing.CALL_ID: ctx.call_id,
                tracing.TURN_ID: request.turn_id,
                tracing.AGENT: request.agent or "",
                tracing.SESSION_ID: request.session_id or "",
            },
        ) as span:
            return await self._handle_measured(ctx, request, started, span)

    async def _handle_measured(
        self, ctx: CallContext, request: FunctionCallRequest, started: float, span: Any
    ) -> ToolReply:
        try:
            async with asyncio.timeout(self.handle_timeout_s):
                reply = await self._handle(ctx, request)
            spec = self._spec(request.name)
            measures.TOOL_ADMISSION.labels(spec.kind.value if spec else "unknown").observe(
                time.perf_counter() - started
            )
            if reply.operation_id:
                span.set_attribute(tracing.OPERATION_ID, reply.operation_id)
            status = reply.output.get("status") if isinstance(reply.output, dict) else None
            if status:
                span.add_event("answered", {"status": str(status)})
            return reply
        except Exception:
            # The call must survive any bug here; the model hears an honest non-answer.
            log.exception("tool call %s (%s) failed", request.function_call_id, request.name)
            out = error_output(
                "Something went wrong on our side with that request, so don't tell the "
                "caller it was done. Offer to try again.",
                retryable=True,
            )
            await self._record_failure(ctx, request, out)
            return _reply(out)

    async def _record_failure(
        self, ctx: CallContext, request: FunctionCallRequest, out: dict[str, Any]
    ) -> None:
        """Best effort: the failed call's transaction rolled back, so record it afresh."""
        try:
            async with self._engine.begin() as conn:
                tc, created = await self._record_call(conn, ctx, request)
                if created:
                    await ledger.complete_tool_call(
                        conn, tc.id, decision="error", reason="internal error", output=out
                    )
        except Exception:
            log.exception("could not record failed tool call %s", request.function_call_id)

    def _spec(self, name: str) -> ToolSpec | None:
        if name == HANDOFF_TO_AGENT and self.agents is not None:
            return HANDOFF_SPEC
        if name == TRANSFER_CALL and self.transfers:
            return TRANSFER_SPEC
        if name == SEND_DTMF and self.dtmf_out:
            return SEND_DTMF_SPEC
        if name == SCHEDULE_CALLBACK and self._offers_callbacks():
            return SCHEDULE_CALLBACK_SPEC
        return self._registry.get(name) if name in self._registry else None

    def _offers_callbacks(self) -> bool:
        """A call back is offered where a transfer can fail and the app can place calls."""
        return bool(self.transfers) and self.callbacks is not None

    async def _record_call(
        self, conn: AsyncConnection, ctx: CallContext, request: FunctionCallRequest
    ) -> tuple[ToolCallRecord, bool]:
        """The `tool_calls` row of this provider call (arguments redacted where declared)."""
        spec = self._spec(request.name)
        raw = request.arguments
        if spec is not None and spec.redact_arguments:
            raw = json.dumps({"redacted": True})
        # Column limits of tool_calls: tool varchar(64), ids varchar(128).
        return await ledger.record_tool_call(
            conn,
            call_id=ctx.call_id,
            function_call_id=_storable(request.function_call_id, 128),
            tenant_id=ctx.tenant_id,
            tool=_storable(request.name, 64),
            raw_arguments=_storable(raw),
            turn_id=request.turn_id,
            response_id=_storable(request.response_id, 128),
            item_id=_storable(request.item_id, 128),
        )

    def redacts_arguments(self, name: str) -> bool:
        spec = self._spec(name)
        return spec is not None and spec.redact_arguments

    async def on_dtmf(self, ctx: CallContext, digit: str) -> KeypadEntry | None:
        state = await self._ids.for_call(ctx.call_id, ctx.tenant_id, ctx.from_number)
        if not state.collecting():
            return None  # no PIN to enter: an ordinary key press
        entered = state.feed_keypad(digit)
        if entered is None:
            return KeypadEntry(pin=True)
        outcome = await self.check_pin(ctx, state, entered)
        log.info("call %s: keypad PIN entry %s", ctx.call_id, outcome.value)
        return KeypadEntry(pin=True, submitted_digits=len(entered), outcome=outcome.value)

    async def check_pin(
        self, ctx: CallContext, state: CallerVerification, entered: str
    ) -> PinOutcome:
        """One complete PIN, checked against the durable lockouts as well as this call's."""
        acc = state.account
        subjects = subjects_of(acc.account_id if acc else None, ctx.from_number)
        if acc is None or not acc.pin or state.verified or state.locked:
            return state.submit(entered)
        now = self._clock()
        async with self._engine.begin() as conn:
            lock = await active_lock(conn, ctx.tenant_id, subjects, now)
            if lock is not None:
                state.lock()
                return PinOutcome.LOCKED
            outcome = state.submit(entered)
            tripped = await record_check(
                conn,
                ctx.tenant_id,
                subjects,
                ctx.call_id,
                succeeded=outcome is PinOutcome.VERIFIED,
                policy=self.lockout,
                now=now,
            )
        if tripped is not None:
            state.lock()
            outcome = PinOutcome.LOCKED
            log.warning(
                "call %s: caller verification locked (%s, %d failures) until %s",
                ctx.call_id,
                tripped.subject.kind,
                tripped.failures,
                tripped.locked_until.isoformat(timespec="seconds"),
            )
            if self.events is not None:
                self.events.emit(
                    CallEvent(
                        ctx.call_id,
                        CallEventKind.VERIFICATION_LOCKED,
                        {
                            "subject": tripped.subject.kind,
                            "failures": tripped.failures,
                            "locked_until": tripped.locked_until.isoformat(),
                        },
                    )
                )
        return outcome

    async def _durably_locked(self, ctx: CallContext, state: CallerVerification) -> None:
        """Mark the call locked if its account or number is locked by earlier calls."""
        if state.verified or state.locked or state.account is None or not state.account.pin:
            return
        subjects = subjects_of(state.account.account_id, ctx.from_number)
        async with self._engine.connect() as conn:
            if await active_lock(conn, ctx.tenant_id, subjects, self._clock()) is not None:
                state.lock()

    async def on_call_end(self, ctx: CallContext) -> None:
        open_statuses = [S.AWAITING_CONFIRMATION, *IN_FLIGHT]
        # One read for both: what waited for a confirmation (cancelled now) and what is still
        # in flight (handed on below). Most calls leave neither: the read alone, no
        # transaction; one that left a confirmation waiting reads again in the cancelling one.
        async with autocommit(self._engine) as conn:
            open_ops = await ledger.operations_for_call(conn, ctx.call_id, open_statuses)
        if any(op.status is S.AWAITING_CONFIRMATION for op in open_ops):
            open_ops = await self._cancel_unconfirmed(ctx, open_statuses)
        pending = [op for op in open_ops if op.status in IN_FLIGHT]
        self._ids.drop(ctx.call_id)
        if pending and self.pending_results is not None:
            await self.pending_results(ctx, pending)

    async def _cancel_unconfirmed(
        self, ctx: CallContext, open_statuses: list[S]
    ) -> list[OperationRecord]:
        async with self._engine.begin() as conn:
            open_ops = await ledger.operations_for_call(conn, ctx.call_id, open_statuses)
            for op in open_ops:
                if op.status is not S.AWAITING_CONFIRMATION:
                    continue
                await ledger.transition(
                    conn,
                    op.operation_id,
                    S.AWAITING_CONFIRMATION,
                    S.CANCELLED,
                    actor="policy",
                    reason="call ended before confirmation",
                )
        return open_ops

    # --- dispatch ------------------------------------------------------------------------

    async def _handle(self, ctx: CallContext, request: FunctionCallRequest) -> ToolReply:
        spec = self._spec(request.name)
        # Known before the transaction: the identity store may do its own I/O.
        verification = await self._ids.for_call(ctx.call_id, ctx.tenant_id, ctx.from_number)
        if spec is not None and spec.needs_verification:
            await self._durably_locked(ctx, verification)
        async with self._engine.begin() as conn:
            tc, created = await self._record_call(conn, ctx, request)
            if not created:
                return await self._replay(conn, tc)
            if (
                spec is not None
                and self.agents is not None
                and not self._offers(self.agents.get(request.agent), spec.name)
            ):
                spec = None  # not this agent's tool: as unknown as any other
            if spec is None:
                name = _storable(request.name, 64)
                out = error_output(f"There is no tool called {name}. Use only the tools offered.")
                await ledger.complete_tool_call(
                    conn,
                    tc.id,
                    decision="invalid",
                    reason=str(UnknownTool(name)),
                    output=out,
                )
                return _reply(out)
            try:
                args = spec.parse(request.arguments)
            except InvalidArguments as exc:
                why = _storable(str(exc))  # may quote the model's own (unknown) keys
                out = error_output(
                    f"Those details didn't fit: {why}. Ask the caller for what is missing or "
                    "wrong, then try again."
                )
                await ledger.complete_tool_call(
                    conn, tc.id, decision="invalid", reason=why, output=out
                )
                return _reply(out)
            identity = verification.snapshot()
            if spec.kind is ToolKind.CONTROL:
                if isinstance(args, HandoffArgs) and self.agents is not None:
                    return await self._handoff(conn, ctx, request, tc, args)
                if isinstance(args, TransferArgs):
                    return await self._transfer(conn, ctx, request, tc, args, verification)
                if isinstance(args, ScheduleCallbackArgs):
                    return await self._schedule_callback(conn, ctx, tc, args)
                if isinstance(args, SendDtmfArgs):
                    out = {"status": "sending", "digits": args.digits}
                    await ledger.complete_tool_call(
                        conn, tc.id, decision="dtmf", arguments={"digits": args.digits}, output=out
                    )
                    return ToolReply(output=out, wants_response=True, dtmf=args.digits)
                if isinstance(args, ConfirmOperationArgs):
                    return await self._confirm(conn, ctx, request, tc, args, identity)
                if isinstance(args, ResolveConflictArgs):
                    return await self._resolve(conn, ctx, request, tc, args, identity)
                if isinstance(args, VerifyPinArgs):
                    outcome = await self.check_pin(ctx, verification, args.digits)
                    out = _pin_output(outcome, verification.attempts_left)
                    await ledger.complete_tool_call(conn, tc.id, decision=outcome.value, output=out)
                    return _reply(out)
                raise ToolError(f"no handler for control tool {spec.name}")
            norm = spec.normalize(args)
            if spec.kind is ToolKind.MUTATION:
                return await self._mutation(conn, ctx, request, tc, spec, args, norm, identity)
            decision = evaluate(self._input(ctx, spec, args, identity, LedgerFacts()))
            if not decision.allowed:
                return await self._refuse(conn, tc, norm, decision)
            await ledger.complete_tool_call(
                conn, tc.id, decision="allow", reason=decision.reason, arguments=norm
            )
        # Reads run outside any transaction: no connection is held across provider I/O.
        out = await self._run_read(spec, args)
        async with self._engine.begin() as conn:
            await ledger.complete_tool_call(
                conn, tc.id, decision="allow", reason=decision.reason, arguments=norm, output=out
            )
        return _reply(out)

    async def _run_read(self, spec: ToolSpec, args: BaseModel) -> dict[str, Any]:
        try:
            async with asyncio.timeout(spec.deadline_s):
                result = await self._read(spec, args)
        except TimeoutError:
            return error_output(
                "I couldn't get an answer in time. Say you'll check again, and try once more.",
                retryable=True,
            )
        except InvalidArguments as exc:
            # Refused before anything was sent (e.g. a path value of `..`): the caller can fix it.
            return error_output(
                f"Those details didn't fit: {_storable(str(exc), 120)}. Ask the caller for the "
                "right details, then try again."
            )
        except ToolError as exc:
            log.warning("read %s failed: %s", spec.name, exc)
            return error_output("I couldn't check that just now.", retryable=exc.retryable)
        except Exception:
            # A provider client's own errors: the caller hears a plain "couldn't check".
            log.exception("read %s failed", spec.name)
            return error_output("I couldn't check that just now.", retryable=True)
        return read_output(spec, result)

    # --- mutations -----------------------------------------------------------------------

    async def _mutation(
        self,
        conn: AsyncConnection,
        ctx: CallContext,
        request: FunctionCallRequest,
        tc: ToolCallRecord,
        spec: ToolSpec,
        args: BaseModel,
        norm: dict[str, Any],
        identity: CallerIdentity,
    ) -> ToolReply:
        resource = spec.resource(args) if spec.resource else None
        # Serialize admissions of one caller, then of one resource, so counts hold.
        await ledger.lock_scope(conn, ctx.tenant_id, "caller", ctx.from_number or ctx.call_id)
        if resource is not None:
            await ledger.lock_scope(conn, ctx.tenant_id, "resource", resource)
        key, existing = await self._intent(conn, ctx, spec, norm)
        trace.get_current_span().set_attribute(tracing.IDEMPOTENCY_KEY, key)
        if existing is not None:
            # The same human intent again (model retried, re-asked): one operation.
            measures.DUPLICATES_SUPPRESSED.labels(spec.kind.value).inc()
            out = self._state_output(spec, existing)
            await ledger.complete_tool_call(
                conn,
                tc.id,
                decision="duplicate",
                reason="same intent as an existing operation",
                arguments=norm,
                operation_id=existing.operation_id,
                output=out,
            )
            return _reply(out, existing)
        facts = await self._facts(conn, ctx, spec, args, resource)
        decision = evaluate(self._input(ctx, spec, args, identity, facts))
        if decision.outcome in (Outcome.DENY, Outcome.NEEDS_VERIFICATION):
            return await self._refuse(conn, tc, norm, decision)
        now = self._clock()
        awaiting = decision.outcome is Outcome.NEEDS_CONFIRMATION
        readback = decision.readback
        confirm_by = now + timedelta(seconds=spec.confirm_window_s)
        ckey = conflict_key(spec, args)
        held_by: OperationRecord | None = None
        reason = decision.reason
        if ckey is not None:
            earlier = await find_earlier(
                conn,
                tenant_id=ctx.tenant_id,
                caller=ctx.from_number,
                call_id=ctx.call_id,
                key=ckey,
            )
            if earlier.in_flight is not None:
                # Never both on the engine's own: this waits until the earlier one settles.
                held_by = earlier.in_flight
                awaiting = True
                readback = readback or f"Please confirm: {spec.describe_args(args)}."
                settles = held_by.expires_at or now
                confirm_by = max(confirm_by, settles + timedelta(seconds=spec.confirm_window_s))
                reason = "held: an earlier conflicting request is in flight"
            elif earlier.committed is not None:
                # Both may stand, but only on the caller's explicit yes.
                awaiting = True
                readback = keep_both_readback(spec, args, earlier.committed)
                reason = "an earlier conflicting request went through: keeping both needs a yes"
        try:
            adm = await ledger.admit_operation(
                conn,
                tenant_id=ctx.tenant_id,
                tool=spec.name,
                args=norm,
                idempotency_key=key,
                call_id=ctx.call_id,
                caller=ctx.from_number,
                turn_id=request.turn_id,
                resource=resource,
                status=S.AWAITING_CONFIRMATION if awaiting else S.ADMITTED,
                readback=readback,
                confirm_by=confirm_by if awaiting else None,
                expires_at=None
                if awaiting
                else now + timedelta(seconds=spec.retry.total_deadline_s),
                overflow=None if awaiting or decision.overflow is None else decision.overflow.value,
                conflict_key=ckey,
                held_by_operation_id=held_by.operation_id if held_by else None,
                agent=request.agent,
                actor="policy",
                reason=reason,
                # The trace goes on from here when a worker runs it (tools.tracing).
                data={
                    "rule": decision.rule,
                    "provider_call_id": request.function_call_id,
                    **tracing.carrier(),
                },
                enqueue=None if awaiting else self._enqueue,
            )
        except IdempotencyConflict as exc:
            out = error_output("That conflicts with an earlier request; nothing was done.")
            await ledger.complete_tool_call(
                conn, tc.id, decision="conflict", reason=str(exc), arguments=norm, output=out
            )
            return _reply(out)
        op = adm.operation
        verdict = decision.outcome.value
        if held_by is not None and op.held_by_operation_id is not None:
            verdict = "held"
            out = held_output(spec, op, self._describe(held_by))
        else:
            if awaiting and verdict != Outcome.NEEDS_CONFIRMATION.value:
                verdict = Outcome.NEEDS_CONFIRMATION.value
            out = self._state_output(spec, op)
        await ledger.complete_tool_call(
            conn,
            tc.id,
            decision=verdict,
            reason=reason,
            arguments=norm,
            operation_id=op.operation_id,
            output=out,
        )
        return _reply(out, op)

    async def _intent(
        self, conn: AsyncConnection, ctx: CallContext, spec: ToolSpec, norm: dict[str, Any]
    ) -> tuple[str, OperationRecord | None]:
        """The idempotency key for this intent, and its live (or committed) operation if any.

        An intent whose operation was declined, expired or failed for good starts a new
        generation, so asking again in the same call is a new request, not a dead end.
        """
        scope = ctx.call_id
        for generation in range(1, _MAX_GENERATIONS + 1):
            key = ledger.derive_idempotency_key(ctx.tenant_id, scope, spec.name, norm, generation)
            op = await ledger.find_by_idempotency_key(conn, ctx.tenant_id, key)
            if op is None:
                return key, None
            if op.status not in (S.CANCELLED, S.FAILED_FINAL):
                return key, op
        raise ToolError("too many attempts at the same request in one call")

    async def _facts(
        self,
        conn: AsyncConnection,
        ctx: CallContext,
        spec: ToolSpec,
        args: BaseModel,
        resource: str | None,
    ) -> LedgerFacts:
        window = self._policy.frequency_window
        caller_n = (
            await ledger.count_recent_mutations(
                conn, ctx.tenant_id, window=window, caller=ctx.from_number
            )
            if ctx.from_number
            else 0
        )
        tenant_n = await ledger.count_recent_mutations(conn, ctx.tenant_id, window=window)
        in_flight = await ledger.count_in_flight(conn, ctx.tenant_id, resource) if resource else 0
        owns = False
        ref = spec.target(args) if ctx.from_number else None
        if ref is not None:
            for creator in self._registry:
                if creator.compensated_by != spec.name:
                    continue
                op = await ledger.find_by_provider_ref(conn, ctx.tenant_id, creator.name, ref)
                if op is not None and op.caller == ctx.from_number:
                    owns = True
        return LedgerFacts(
            caller_recent_mutations=caller_n,
            tenant_recent_mutations=tenant_n,
            in_flight_on_resource=in_flight,
            caller_owns_target=owns,
        )

    def _input(
        self,
        ctx: CallContext,
        spec: ToolSpec,
        args: BaseModel,
        identity: CallerIdentity,
        facts: LedgerFacts,
        **extra: Any,
    ) -> PolicyInput:
        return PolicyInput(
            tenant_id=ctx.tenant_id,
            call_id=ctx.call_id,
            identity=identity,
            spec=spec,
            args=args,
            facts=facts,
            now=self._clock(),
            config=self._policy,
            **extra,
        )

    async def _refuse(
        self,
        conn: AsyncConnection,
        tc: ToolCallRecord,
        norm: dict[str, Any],
        decision: Decision,
    ) -> ToolReply:
        if decision.outcome is Outcome.NEEDS_VERIFICATION:
            out = verification_output(decision.prompt or "Please enter your PIN.")
        else:
            out = denied_output(decision.reason, rule=decision.rule)
        await ledger.complete_tool_call(
            conn,
            tc.id,
            decision=decision.outcome.value,
            reason=decision.reason,
            arguments=norm,
            output=out,
        )
        return _reply(out)

    # --- confirmation --------------------------------------------------------------------

    async def _caller_answered(
        self,
        conn: AsyncConnection,
        request: FunctionCallRequest,
        tc: ToolCallRecord,
        op: OperationRecord,
    ) -> ConfirmationEvidence:
        """What the call observed of the caller's answer to `op`'s readback.

        The model's word is not the caller's yes: without this evidence the operation stays
        awaiting confirmation, and the refusal is on the operation's trail.
        """
        port = request.evidence
        evidence = port.confirmation_evidence(str(op.operation_id)) if port else NO_EVIDENCE
        if not evidence.counts:
            log.info(
                "call %s: confirmation of %s without the caller's answer: %s",
                op.call_id,
                op.operation_id,
                evidence.reason,
            )
            await ledger.record_event(
                conn,
                op.operation_id,
                kind="decision",
                actor="policy",
                reason=f"confirmation refused: {evidence.reason}",
                data={
                    "rule": "caller_evidence",
                    "provider_call_id": tc.provider_call_id,
                    "requested_by": "model",
                    "evidence": evidence.record(),
                },
            )
        return evidence

    async def _confirm(
        self,
        conn: AsyncConnection,
        ctx: CallContext,
        request: FunctionCallRequest,
        tc: ToolCallRecord,
        args: ConfirmOperationArgs,
        identity: CallerIdentity,
    ) -> ToolReply:
        norm = args.model_dump(mode="json")
        op = await ledger.get_operation(conn, args.operation_id, for_update=True)

        async def finish(decision: str, reason: str, out: dict[str, Any]) -> ToolReply:
            await ledger.complete_tool_call(
                conn,
                tc.id,
                decision=decision,
                reason=reason,
                arguments=norm,
                operation_id=op.operation_id if op else None,
                output=out,
            )
            return _reply(out, op)

        if op is None or op.tenant_id != ctx.tenant_id:
            op = None
            return await finish(
                "deny",
                "no such operation",
                denied_output("I can't find that request. Make the request again first."),
            )
        if op.call_id != ctx.call_id:
            await ledger.record_event(
                conn,
                op.operation_id,
                kind="decision",
                actor="policy",
                reason="confirmation from another call refused",
                data={"call_id": ctx.call_id},
            )
            op = None  # the reply must not link another call's operation
            return await finish(
                "deny",
                "confirmation from another call",
                denied_output(
                    "That request belongs to a different call, so it can't be confirmed here.",
                    rule="confirmation",
                ),
            )
        spec = self._registry.get(op.tool)
        if op.status is not S.AWAITING_CONFIRMATION:
            measures.DUPLICATES_SUPPRESSED.labels(ToolKind.CONTROL.value).inc()
            return await finish(
                "duplicate", "not awaiting confirmation", self._state_output(spec, op)
            )

        async def withdraw(
            current: OperationRecord, decision: str, actor: str, reason: str, message: str
        ) -> ToolReply:
            """The unconfirmed request ends here: cancelled, nothing was sent anywhere."""
            moved = await ledger.transition(
                conn,
                current.operation_id,
                S.AWAITING_CONFIRMATION,
                S.CANCELLED,
                actor=actor,
                reason=reason,
            )
            return await finish(decision, reason, cancelled_output(moved or current, message))

        now = self._clock()
        if op.confirm_by is not None and now > op.confirm_by:
            return await withdraw(
                op,
                "expired",
                "policy",
                "confirmation expired",
                "The confirmation came too late, so the request was cancelled. Offer to make "
                "it again.",
            )
        if not args.confirmed:
            return await withdraw(
                op,
                "declined",
                "model",
                "caller declined",
                "The caller said no, so it was cancelled.",
            )
        if op.held_by_operation_id is not None:
            # A conflicting earlier request is not settled yet: this one waits for it.
            earlier = await ledger.get_operation(conn, op.held_by_operation_id)
            if earlier is not None and not is_terminal(earlier.status):
                return await finish(
                    "held",
                    "an earlier conflicting request is still in flight",
                    held_still_output(op, self._describe(earlier)),
                )
        evidence = await self._caller_answered(conn, request, tc, op)
        if not evidence.counts:
            return await finish(
                "needs_caller",
                evidence.reason,
                awaiting_caller_output(op, spec.confirm_window_s, evidence.reason),
            )
        verdict, reason, out, op = await self._admit_confirmed(
            conn, ctx, tc, op, spec, identity, reason="caller confirmed", evidence=evidence
        )
        return await finish(verdict, reason, out)

    async def _admit_confirmed(
        self,
        conn: AsyncConnection,
        ctx: CallContext,
        tc: ToolCallRecord,
        op: OperationRecord,
        spec: ToolSpec,
        identity: CallerIdentity,
        *,
        reason: str,
        evidence: ConfirmationEvidence,
        data: Mapping[str, Any] | None = None,
    ) -> tuple[str, str, dict[str, Any], OperationRecord]:
        """Admit an operation awaiting confirmation on the caller's yes, checking the
        limits again (admission happens at confirmation, not at request). Returns the
        tool-call decision, its reason, the output and the operation as it now is."""
        now = self._clock()
        op_args = spec.args_model.model_validate(op.args)
        await ledger.lock_scope(conn, ctx.tenant_id, "caller", ctx.from_number or ctx.call_id)
        if op.resource is not None:
            await ledger.lock_scope(conn, ctx.tenant_id, "resource", op.resource)
        facts = await self._facts(conn, ctx, spec, op_args, op.resource)
        decision = evaluate(
            self._input(ctx, spec, op_args, identity, facts, confirmed=True, admit_by=op.confirm_by)
        )
        if decision.outcome is not Outcome.ALLOW:
            moved = await ledger.transition(
                conn,
                op.operation_id,
                S.AWAITING_CONFIRMATION,
                S.CANCELLED,
                actor="policy",
                reason=f"refused at confirmation: {decision.reason}",
                data={"rule": decision.rule},
            )
            return (
                decision.outcome.value,
                decision.reason,
                denied_output(decision.reason, rule=decision.rule),
                moved or op,
            )
        admitted = await ledger.transition(
            conn,
            op.operation_id,
            S.AWAITING_CONFIRMATION,
            S.ADMITTED,
            # The model relayed the caller's yes, the call observed it (the readback heard,
            # the caller's answer after it), and the policy decision admitted the operation.
            actor="policy",
            reason=reason,
            data={
                "rule": decision.rule,
                "provider_call_id": tc.provider_call_id,
                "requested_by": "model",
                "confirmed_by": "caller",
                "evidence": evidence.record(),
                **(data or {}),
            },
            confirmed_by="caller",
            confirmation=evidence.record(),
            expires_at=now + timedelta(seconds=spec.retry.total_deadline_s),
            overflow=decision.overflow.value if decision.overflow else None,
        )
        if admitted is None:  # pragma: no cover - the row lock is held
            raise ToolError("operation changed while confirming")
        await self._enqueue(conn, admitted.operation_id)
        return "allow", decision.reason, self._state_output(spec, admitted), admitted

    def _describe(self, op: OperationRecord) -> str:
        if op.tool in self._registry:
            return describe_operation(self._registry.get(op.tool), op)
        return op.tool.replace("_", " ")

    # --- conflicting requests ------------------------------------------------------------

    async def _resolve(
        self,
        conn: AsyncConnection,
        ctx: CallContext,
        request: FunctionCallRequest,
        tc: ToolCallRecord,
        args: ResolveConflictArgs,
        identity: CallerIdentity,
    ) -> ToolReply:
        """The caller's choice about a request that contradicts an earlier one."""
        norm = args.model_dump(mode="json")
        op = await ledger.get_operation(conn, args.operation_id, for_update=True)

        async def finish(
            decision: str, reason: str, out: dict[str, Any], linked: OperationRecord | None
        ) -> ToolReply:
            await ledger.complete_tool_call(
                conn,
                tc.id,
                decision=decision,
                reason=reason,
                arguments=norm,
                operation_id=linked.operation_id if linked else None,
                output=out,
            )
            return _reply(out, linked)

        if op is None or op.tenant_id != ctx.tenant_id or op.call_id != ctx.call_id:
            return await finish(
                "deny",
                "no such request in this call",
                denied_output("I can't find that request in this call."),
                None,
            )
        spec = self._registry.get(op.tool)
        if op.status is not S.AWAITING_CONFIRMATION or op.conflict_key is None:
            measures.DUPLICATES_SUPPRESSED.labels(ToolKind.CONTROL.value).inc()
            return await finish(
                "duplicate", "nothing waiting to resolve", self._state_output(spec, op), op
            )
        if op.held_by_operation_id is not None:
            earlier = await ledger.get_operation(conn, op.held_by_operation_id)
        else:
            found = await find_earlier(
                conn,
                tenant_id=ctx.tenant_id,
                caller=op.caller,
                call_id=ctx.call_id,
                key=op.conflict_key,
                exclude=op.operation_id,
            )
            earlier = found.in_flight or found.committed
        if earlier is not None and not is_terminal(earlier.status):
            return await finish(
                "held",
                "the earlier request is still in flight",
                held_still_output(op, self._describe(earlier)),
                op,
            )
        if args.choice == "drop":
            moved = await ledger.transition(
                conn,
                op.operation_id,
                S.AWAITING_CONFIRMATION,
                S.CANCELLED,
                actor="model",
                reason="the caller kept the earlier request instead",
            )
            return await finish(
                "declined",
                "the caller kept the earlier request",
                cancelled_output(moved or op, "The caller kept the earlier request."),
                moved or op,
            )
        # Moving or keeping both admits a request: only on the caller's own, observed answer.
        evidence = await self._caller_answered(conn, request, tc, op)
        if not evidence.counts:
            return await finish(
                "needs_caller",
                evidence.reason,
                awaiting_caller_output(op, spec.confirm_window_s, evidence.reason),
                op,
            )
        data: dict[str, Any] = {"choice": args.choice}
        if earlier is not None:
            data["earlier_operation_id"] = str(earlier.operation_id)
        if args.choice == "move" and earlier is not None and earlier.status is S.COMMITTED:
            earlier_spec = self._registry.get(earlier.tool)
            if earlier_spec.compensated_by is None or earlier.provider_ref is None:
                return await finish(
                    "deny",
                    "the earlier request cannot be undone automatically",
                    denied_output(
                        "I can't undo the earlier request from here; staff can help.",
                        rule="conflict",
                    ),
                    op,
                )
            compensation = await admit_compensation(
                conn,
                earlier,
                earlier_spec.compensated_by,
                {"booking_id": earlier.provider_ref},
                enqueue=self._enqueue,
                actor="model",
                reason=f"the caller moved it to {self._describe(op)}",
            )
            data["compensation_operation_id"] = str(compensation.operation_id)
        why = {
            "move": "the caller chose to move the earlier request to this one",
            "keep_both": "the caller explicitly chose to keep both",
        }[args.choice]
        verdict, reason, out, op = await self._admit_confirmed(
            conn, ctx, tc, op, spec, identity, reason=why, evidence=evidence, data=data
        )
        if verdict == "allow" and "compensation_operation_id" in data:
            out = {**out, "compensation_operation_id": data["compensation_operation_id"]}
            out["message"] = bounded(
                f"{out.get('message', '')} The earlier request is being cancelled; that is "
                "not confirmed yet either."
            )
        return await finish(verdict, reason, out, op)

    # --- replies -------------------------------------------------------------------------

    def _state_output(self, spec: ToolSpec, op: OperationRecord) -> dict[str, Any]:
        if op.status is S.AWAITING_CONFIRMATION:
            return confirmation_output(op, spec.confirm_window_s)
        return operation_output(spec, op)

    async def _replay(self, conn: AsyncConnection, tc: ToolCallRecord) -> ToolReply:
        """The same provider call delivered again: the same answer, for the current state."""
        if tc.operation_id is not None:
            op = await ledger.get_operation(conn, tc.operation_id)
            if op is not None and op.call_id == tc.call_id and op.tool in self._registry:
                return _reply(self._state_output(self._registry.get(op.tool), op), op)
        if tc.output is not None:
            return _reply(dict(tc.output))
        return _reply({"status": "in_progress", "message": "Still working on that request."})


def _pin_output(outcome: PinOutcome, attempts_left: int) -> dict[str, Any]:
    messages = {
        PinOutcome.VERIFIED: "PIN accepted. Call the tool the caller wanted again.",
        PinOutcome.WRONG: f"That PIN didn't match. {attempts_left} tries left.",
        PinOutcome.LOCKED: ("Too many wrong PINs; verification is locked for now. Staff can help."),
        PinOutcome.NO_ACCOUNT: "There is no PIN registered for this number.",
        PinOutcome.INCOMPLETE: "I didn't get the full PIN.",
    }
    return {"status": outcome.value, "message": bounded(messages[outcome])}
