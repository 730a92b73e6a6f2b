"""Warm transfer of a Twilio call to a person (`transfer_call` with mode warm).

The caller never leaves the agent until the person has heard who is calling and why:

1. `WarmTransfer.dial` (the call's replica, once the agent's sentence "I'm calling them, stay on
   the line" was heard): Twilio `Calls.create` to the target with answering-machine detection
   (`MachineDetection=Enable`: Twilio runs the TwiML once it knows who answered) and inline
   TwiML that `<Redirect>`s to `/twilio/warm-answered`, `Timeout` the ring timeout, and a signed
   `StatusCallback` (`/twilio/warm-status`). `answered` (that redirect, with `AnsweredBy`): a
   person gets `<Say>` the engine's briefing (kept on the row) then `<Redirect>` to
   `/twilio/warm-briefed`; a machine, a fax or nobody to tell is hung up unbriefed and the
   transfer fails `voicemail` as in 4 (the caller is never put through to a voicemail). The
   person's CallSid is recorded on the transfer's tool call row (`output.warm`) and on the
   timeline (`transfer_briefing`). A refused create leaves the caller with the agent, who is
   told.
2. `briefed` (`POST /twilio/warm-briefed`, the `<Redirect>` after the `<Say>`: Twilio asks it only
   once the briefing was played to its end): the row goes ringing -> briefed (once: a repeated
   request gets the same answer and nothing more), the person is put into the conference
   `warm-<call id>`, and the replica holding the caller hears `warm` `join` (`call_control`).
3. `WarmTransfer.join` (the holder): the agent says one sentence ("connecting you now"), heard to
   its end, then the caller's live call gets `<Dial><Conference>` of the same name through the
   REST API. Joined: `transfer_answered` (mode warm), "answered" on the tool call row, our part
   of the call ends "transferred to <target> (warm)". The conference ends when either leaves.
4. `person_status` (`POST /twilio/warm-status`, the person's call status): busy, no answer,
   failed, or a hang-up before being joined: the row goes to failed (once), and the holder hears
   `warm` `failed`: the agent, still with the caller, is told why and prompted to offer to
   arrange a call back (`schedule_callback`). Nothing ever tells the caller "connected" before
   the join.

A caller who hangs up while the person is rung or briefed: the person's call is ended, and a
briefing that finishes after that is answered "the caller is no longer on the line".
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import uuid
from typing import Any
from urllib.parse import urlencode

import sqlalchemy as sa

from app.calls import store as call_store
from app.calls.control import publish_warm
from app.legs.session import CallSession
from app.legs.twilio import twiml
from app.ops.twilio_rest import cancel_call, end_call, redirect_call
from app.runtime import Runtime
from app.settings import Settings
from telephony.call_events import CallEvent, CallEventKind
from telephony.tool_gateway import TransferOutcome, TransferRequest
from tools.ledger_models import tool_calls_table as calls_t
from tools.transfers import (
    TRANSFER_CALL,
    TransferTarget,
    dial_outcome_said,
    record_transfer_outcome,
)

log = logging.getLogger(__name__)

REST_TIMEOUT_S = 8.0
# How long the agent's "connecting you now" may take before the caller is joined anyway.
JOIN_SPEECH_WAIT_S = 12.0
# After the join's REST request, how long the stream's end waits to know how it went.
JOIN_SETTLE_S = 10.0
# Past the ring timeout, how long the holder waits for Twilio's word (the briefing, the
# status) before it acts on the row alone: a lost callback never leaves the caller waiting.
WATCH_MARGIN_S = 60.0
# The states of a warm transfer on its tool call row (`output.warm.state`).
RINGING, BRIEFED, JOINED, FAILED = "ringing", "briefed", "joined", "failed"
# The person's final call statuses (Twilio's CallStatus) that mean they were never joined.
NOT_JOINED = frozenset({"busy", "no-answer", "failed", "canceled", "completed"})
# Twilio's AnsweredBy values that are a person to brief (machine_start, fax and unknown are
# not: a voicemail must never hear the briefing, nor get the caller).
PERSON = frozenset({"human"})
# How long Twilio's detector may listen before it answers `unknown` (its minimum is 3 s).
AMD_TIMEOUT_S = 5
GONE_MESSAGE = "Sorry, the caller is no longer on the line. Goodbye."


def conference_name(call_id: str) -> str:
    """The room a warm transfer joins the two in (no personal data in it, as Twilio asks)."""
    return f"warm-{call_id}"


def url_key(settings: Settings, call_id: str, function_call_id: str) -> str:
    """What a warm transfer's webhook URLs carry beside its ids: only we make them."""
    mac = hmac.new(
        settings.stream_secret(), f"warm:{call_id}:{function_call_id}".encode(), hashlib.sha256
    )
    return mac.hexdigest()[:32]


def webhook_url(settings: Settings, path: str, call_id: str, request: TransferRequest) -> str:
    return transfer_url(settings, path, call_id, request.function_call_id, request.target)


def transfer_url(settings: Settings, path: str, call_id: str, fc: str, target: str) -> str:
    key = url_key(settings, call_id, fc)
    query = urlencode({"call_id": call_id, "target": target, "fc": fc, "k": key})
    return f"{settings.public_base_url.rstrip('/')}{path}?{query}"


def checked(settings: Settings, call_id: str, fc: str, key: str) -> bool:
    """Whether a warm webhook's query names a transfer of ours."""
    try:
        uuid.UUID(call_id)
    except ValueError:
        return False
    if not fc or len(fc) > 128:
        return False
    return hmac.compare_digest(key.encode(), url_key(settings, call_id, fc).encode())


# ---- the transfer's state, on its tool call row ------------------------------------------


async def advance(
    runtime: Runtime,
    call_id: str,
    fc: str,
    expect: frozenset[str],
    to: str | None,
    **fields: str,
) -> dict[str, Any] | None:
    """Move the warm transfer of (call, function call) from one of `expect` to `to` (None: it
    stays), once: the new `warm` record, or None when it was not in `expect` (told already: a
    duplicate). A field already recorded (the person's CallSid) is kept."""
    async with runtime.engine.begin() as conn:
        row = (
            await conn.execute(
                sa.select(calls_t.c.id, calls_t.c.output)
                .where(
                    calls_t.c.call_id == call_id,
                    calls_t.c.provider_call_id == fc[:128],
                    calls_t.c.tool == TRANSFER_CALL,
                )
                .with_for_update()
            )
        ).first()
        if row is None:
            return None
        output = dict(row.output or {})
        warm = dict(output.get("warm") or {})
        if warm.get("state", "") not in expect:
            return None
        for name, value in fields.items():
            if value and not warm.get(name):
                warm[name] = value
        if to is not None:
            warm["state"] = to
        output["warm"] = warm
        await conn.execute(calls_t.update().where(calls_t.c.id == row.id).values(output=output))
    return warm


async def _state(runtime: Runtime, call_id: str, fc: str) -> dict[str, Any]:
    async with runtime.engine.connect() as conn:
        output = await conn.scalar(
            sa.select(calls_t.c.output).where(
                calls_t.c.call_id == call_id,
                calls_t.c.provider_call_id == fc[:128],
                calls_t.c.tool == TRANSFER_CALL,
            )
        )
    return dict((output or {}).get("warm") or {})


# ---- the webhooks (any replica) ----------------------------------------------------------


async def answered(
    runtime: Runtime, call_id: str, fc: str, target: str, person_sid: str, answered_by: str
) -> str:
    """The person's call was answered and Twilio's detector said by whom (see the module
    docstring, 1): the briefing for a person; a hang-up for anything else."""
    warm = await _state(runtime, call_id, fc)
    recorded = warm.get("person_call_sid")
    if recorded and recorded != person_sid:
        return twiml.hangup()  # not the call we placed
    if answered_by in PERSON:
        text = str(warm.get("briefing") or "")
        then = transfer_url(runtime.settings, "/twilio/warm-briefed", call_id, fc, target)
        return twiml.briefing(text, then) if text else twiml.hangup()
    await _not_joined(runtime, call_id, fc, person_sid, "voicemail")
    return twiml.hangup()


async def briefed(runtime: Runtime, call_id: str, fc: str, person_sid: str) -> str:
    """The person heard the briefing (see the module docstring, 2): the TwiML for them."""
    row = await call_store.get_call(runtime.engine, call_id)
    if row is None or row.status in call_store.TERMINAL:
        await advance(
            runtime, call_id, fc, frozenset({"", RINGING, BRIEFED}), FAILED,
            status="caller-gone",
        )  # fmt: skip
        return twiml.say_and_hang_up(GONE_MESSAGE)
    warm = await _state(runtime, call_id, fc)
    recorded = warm.get("person_call_sid")
    if recorded and recorded != person_sid:
        return twiml.hangup()  # not the call we placed
    moved = await advance(
        runtime, call_id, fc, frozenset({"", RINGING}), BRIEFED, person_call_sid=person_sid
    )
    if moved is not None:
        await publish_warm(runtime.engine, row.call_sid, "join", fc)
        return twiml.conference(conference_name(call_id))
    state = (await _state(runtime, call_id, fc)).get("state")
    if state in (BRIEFED, JOINED):
        return twiml.conference(conference_name(call_id))  # Twilio asking again: the same
    return twiml.say_and_hang_up(GONE_MESSAGE)


async def person_status(
    runtime: Runtime, call_id: str, fc: str, person_sid: str, call_status: str
) -> None:
    """The person's call status (see the module docstring, 4); idempotent."""
    if call_status not in NOT_JOINED:
        return
    warm = await _state(runtime, call_id, fc)
    recorded = warm.get("person_call_sid")
    if recorded and recorded != person_sid:
        return
    status = "person-hung-up" if call_status == "completed" else call_status
    await _not_joined(runtime, call_id, fc, person_sid, status)


async def _not_joined(
    runtime: Runtime, call_id: str, fc: str, person_sid: str, status: str
) -> None:
    """The person will not be joined: the row fails once, the caller's agent is told."""
    moved = await advance(
        runtime, call_id, fc, frozenset({"", RINGING, BRIEFED}), FAILED,
        status=status, person_call_sid=person_sid,
    )  # fmt: skip
    if moved is None:
        return  # joined (the conference carries on), or told already
    said = said_of(status)
    await record_transfer_outcome(
        runtime.engine, call_id, fc, TransferOutcome(False, status[:40], said)
    )
    row = await call_store.get_call(runtime.engine, call_id)
    if row is not None and row.status not in call_store.TERMINAL:
        await publish_warm(runtime.engine, row.call_sid, "failed", fc, status)


async def say_connecting(bridge: Any, target: str) -> bool:
    """The agent's one sentence before the join ("connecting you now"), heard to its end; False
    when the caller left (or there is no bridge) first. Either leg's warm transfer says it."""
    if bridge is None:
        return False
    spoken = target.replace("_", " ")
    return bool(
        await bridge.tools.say_and_wait(
            f"{spoken} has answered and has been told about this call. Tell the caller in one "
            "short sentence that you are connecting them now, and say nothing after it.",
            "warm_transfer_join",
            JOIN_SPEECH_WAIT_S,
        )
    )


def said_of(status: str) -> str:
    if status == "person-hung-up":
        return "they hung up before the caller could be joined"
    return dial_outcome_said(status)


# ---- the call's replica --------------------------------------------------------------------


async def act_here(runtime: Runtime, call_sid: str, action: str, fc: str, status: str) -> None:
    """`call_control` `warm`: the warm transfer of `call_sid`, if this process holds it, acts."""
    entry = runtime.registry.get(call_sid)
    warm = entry.warm if entry is not None else None
    if not isinstance(warm, WarmTransfer) or warm.request.function_call_id != fc:
        return
    if action == "join":
        await warm.join()
    elif action == "failed":
        await warm.failed(status)


class WarmTransfer:
    """One warm transfer of a live Twilio call, on its registry entry, on its holder."""

    def __init__(self, runtime: Runtime, session: CallSession, request: TransferRequest) -> None:
        self.runtime = runtime
        self.session = session
        self.request = request
        self.person_sid: str | None = None
        self.joining = False
        self.joined = False
        self._acted = False
        self.settled = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None

    @property
    def target(self) -> TransferTarget:
        return TransferTarget(self.request.target, self.request.destination)

    def _emit(self, kind: CallEventKind, data: dict[str, Any]) -> None:
        self.session.sink.emit(CallEvent(self.session.call_id, kind, data))

    async def dial(self) -> TransferOutcome:
        """Ring the person with the briefing (see the module docstring, 1)."""
        runtime, session, request = self.runtime, self.session, self.request
        entry = session.entry
        if entry is None or runtime.twilio is None:
            return TransferOutcome(False, "unsupported", "this service cannot reach Twilio's API")
        if entry.warm is not None and not entry.warm.settled.is_set():
            return TransferOutcome(False, "refused", "another transfer is already under way")
        s = runtime.settings
        call_id = session.call_id
        await advance(
            runtime, call_id, request.function_call_id, frozenset({""}), RINGING,
            briefing=request.briefing or request.reason,
        )  # fmt: skip
        then = webhook_url(s, "/twilio/warm-answered", call_id, request)
        entry.warm = self
        try:
            async with asyncio.timeout(REST_TIMEOUT_S):
                call = await runtime.twilio.calls.create_async(
                    to=request.destination,
                    from_=s.twilio_from_number,
                    twiml=twiml.redirect(then),
                    machine_detection="Enable",
                    machine_detection_timeout=AMD_TIMEOUT_S,
                    timeout=int(s.transfer_ring_timeout_s),
                    status_callback=webhook_url(s, "/twilio/warm-status", call_id, request),
                    status_callback_method="POST",
                    status_callback_event=["initiated", "ringing", "answered", "completed"],
                )
        except Exception as exc:
            # Not placed, or its answer lost: a person who picks up hears the briefing, and then
            # `briefed` finds the transfer failed and tells them the caller is gone.
            entry.warm = None
            self.settled.set()
            await advance(
                runtime, call_id, request.function_call_id, frozenset({"", RINGING}), FAILED,
                status="refused",
            )  # fmt: skip
            log.warning("call %s: warm transfer to %s not placed: %r", call_id, request.target, exc)
            return TransferOutcome(False, "refused", "the phone system did not place the call")
        self.person_sid = call.sid
        await self._bind(call.sid or "")
        self._watch = asyncio.create_task(
            self._watchdog(s.transfer_ring_timeout_s + WATCH_MARGIN_S), name=f"warm-{call_id}"
        )
        self._emit(
            CallEventKind.TRANSFER_BRIEFING,
            {"target": request.target, "mode": "warm", "person_call_sid": call.sid},
        )
        log.info("call %s: calling %s (%s) to brief them", call_id, request.target,
                 self.target.masked())  # fmt: skip
        return TransferOutcome(True, "calling", f"calling {request.target} to brief them")

    async def _watchdog(self, after_s: float) -> None:
        """Twilio's callbacks lost: the row decides. Briefed: join; still ringing: give up."""
        await asyncio.sleep(after_s)
        call_id, fc = self.session.call_id, self.request.function_call_id
        state = (await _state(self.runtime, call_id, fc)).get("state")
        if state == BRIEFED:
            await self.join()
            return
        moved = await advance(
            self.runtime, call_id, fc, frozenset({RINGING}), FAILED, status="no-answer"
        )
        if moved is None:
            return
        log.warning("call %s: no word from Twilio on the warm transfer; given up", call_id)
        await record_transfer_outcome(
            self.runtime.engine, call_id, fc,
            TransferOutcome(False, "no-answer", said_of("no-answer")),
        )  # fmt: skip
        await self._end_person()
        await self.failed("no-answer")

    def _stop_watching(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()

    async def _bind(self, person_sid: str) -> None:
        """The person's CallSid on the transfer's row (the briefing's webhook may have come
        first and recorded it already: that one stands)."""
        await advance(
            self.runtime, self.session.call_id, self.request.function_call_id,
            frozenset({RINGING, BRIEFED, JOINED, FAILED}), None, person_call_sid=person_sid,
        )  # fmt: skip

    async def join(self) -> None:
        """The person was briefed: the agent's sentence, then the caller into the conference."""
        if self._acted:
            return
        self._acted = True
        self._stop_watching()
        runtime, session, request = self.runtime, self.session, self.request
        call_id, fc = session.call_id, request.function_call_id
        bridge, entry = session.bridge, session.entry
        said = await say_connecting(bridge, request.target)
        reason = f"transferred to {request.target} (warm)"
        placed = False
        if said and entry is not None and runtime.twilio is not None:
            # Marked first: Twilio stops the stream as soon as it takes the new instructions.
            self.joining = True
            try:
                async with asyncio.timeout(REST_TIMEOUT_S):
                    placed = await redirect_call(
                        runtime.twilio, session.call_sid, twiml.conference(conference_name(call_id))
                    )
            except Exception as exc:
                log.warning("call %s: joining the caller failed: %r", call_id, exc)
        if not placed:
            self.joining = False
            await advance(runtime, call_id, fc, frozenset({BRIEFED}), FAILED, status="not-joined")
            await self._end_person()
            outcome = TransferOutcome(
                False, "not-joined", "the caller could not be joined to the person"
            )
            self.settled.set()
            if bridge is not None:
                await bridge.tools.transfer_failed(request, outcome)
            return
        await advance(runtime, call_id, fc, frozenset({BRIEFED}), JOINED)
        self.joined = True
        session.ended_by(reason)
        self._emit(
            CallEventKind.TRANSFER_ANSWERED,
            {"target": request.target, "mode": "warm", "person_call_sid": self.person_sid},
        )
        await record_transfer_outcome(
            runtime.engine, call_id, fc,
            TransferOutcome(True, "answered", f"{request.target} was briefed and joined"),
        )  # fmt: skip
        self.settled.set()
        log.info("call %s: %s", call_id, reason)

    async def failed(self, status: str) -> None:
        """The person was never joined (busy, no answer, hung up): the agent tells the caller."""
        if self._acted:
            return
        self._acted = True
        self._stop_watching()
        self.settled.set()
        bridge = self.session.bridge
        if self.session.entry is not None and self.session.entry.warm is self:
            self.session.entry.warm = None
        if bridge is not None:
            outcome = TransferOutcome(False, status[:40], said_of(status))
            await bridge.tools.transfer_failed(self.request, outcome)

    async def settle(self) -> None:
        """The caller's stream ended: a join in flight is waited for (its outcome decides how
        the row ends); a person still rung or briefed is hung up, the transfer failed."""
        self._stop_watching()
        if self.joining and not self.settled.is_set():
            try:
                async with asyncio.timeout(JOIN_SETTLE_S):
                    await self.settled.wait()
            except TimeoutError:
                pass
        if self.joined or self._acted:
            return
        self._acted = True
        self.settled.set()
        moved = await advance(
            self.runtime, self.session.call_id, self.request.function_call_id,
            frozenset({"", RINGING, BRIEFED}), FAILED, status="caller-gone",
        )  # fmt: skip
        if moved is not None:
            await record_transfer_outcome(
                self.runtime.engine, self.session.call_id, self.request.function_call_id,
                TransferOutcome(False, "caller-gone", "the caller left before the join"),
            )  # fmt: skip
            await self._end_person()

    async def _end_person(self) -> None:
        if self.person_sid is None or self.runtime.twilio is None:
            return
        try:
            async with asyncio.timeout(REST_TIMEOUT_S):
                # Still ringing: cancelled; answered (the briefing, the room): hung up.
                await cancel_call(self.runtime.twilio, self.person_sid)
                await end_call(self.runtime.twilio, self.person_sid)
        except Exception as exc:
            log.warning("call %s: ending the person's call failed: %r", self.session.call_id, exc)
