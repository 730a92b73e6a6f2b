"""Cold transfer of a call on our own SIP leg (`transfer_call`): REFER, then its NOTIFYs.

Called by the bridge once the agent's sentence was heard (`put_through`, the leg's transfer
hook). It does not return until the transfer's outcome is known, so the model is never told
more than what happened:

1. REFER (telephony/legs/sip/refer.py: `Refer-To` the target, `Referred-By` us). Refused
   (403, 405, 501, 603...) or unanswered within 64*T1: the call stays with the agent, who is
   told (`accepted=False`: the bridge tells the model and writes the outcome).
2. 202 Accepted: `transfer_started` on the timeline, "referred" on the tool call row; the
   caller's side is now calling the target, and reports through NOTIFY `message/sipfrag`.
3. A final sipfrag `SIP/2.0 200`: the person answered; `transfer_answered`, "answered" on the
   row, and only now our side ends the call with BYE, "transferred to <target>". A final
   failure (486 busy, 480 no answer, 603 declined, 503...), or no final NOTIFY within
   TRANSFER_RING_TIMEOUT_S (later ones are refused), leaves the caller with the agent, who is
   told why.

A warm transfer (app/legs/sip_warm.py) ends with the same REFER, whose Refer-To replaces our
dialog with the person (RFC 3891), so the same steps decide it; its row then ends
"transferred to <target> (warm)".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from app.legs.session import CallSession
from app.runtime import Runtime
from telephony.call_events import CallEvent, CallEventKind
from telephony.tool_gateway import TransferOutcome, TransferRequest
from tools.transfers import TransferTarget, dial_outcome_said, record_transfer_outcome

log = logging.getLogger(__name__)

# Beyond the core's own 64*T1 for the REFER's answer: only a lost event could need it.
ANSWER_MARGIN_S = 5.0

# What the futures hold when the call ended under the transfer.
ENDED = -1

# A failed sipfrag status as the dial outcomes the agent says (tools.transfers.DIAL_SAID).
_BUSY = frozenset({486, 600})
_NO_ANSWER = frozenset({408, 480, 487})
_DECLINED = frozenset({603})


def sipfrag_outcome(status: int) -> str:
    """A final non-2xx sipfrag status as a dial outcome name ("busy", "no-answer"...)."""
    if status in _BUSY:
        return "busy"
    if status in _NO_ANSWER:
        return "no-answer"
    if status in _DECLINED:
        return "declined"
    return "failed"


@dataclass(eq=False)
class SipTransfer:
    """One REFER of a call, from the hook's call until its outcome; fed by the SIP events."""

    request: TransferRequest
    answered: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    final: asyncio.Future[tuple[int, str]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    progress: list[int] = field(default_factory=list)
    ended: str | None = None

    def on_answered(self, status: int) -> None:
        if not self.answered.done():
            self.answered.set_result(status)

    def on_notified(self, status: int, reason: str, final: bool) -> None:
        # A NOTIFY may overtake the 202: the subscription exists, so the REFER was taken.
        self.on_answered(202)
        self.progress.append(status)
        if final and not self.final.done():
            self.final.set_result((status, reason))

    def on_ended(self, reason: str) -> None:
        """The call ended under the transfer (the caller hung up, the dialog died)."""
        self.ended = reason
        if not self.answered.done():
            self.answered.set_result(ENDED)
        if not self.final.done():
            self.final.set_result((ENDED, reason))


@dataclass(frozen=True, slots=True)
class ReferPort:
    """What the hook needs of the SIP service: send the REFER (False: not sent), stop
    waiting for it, and end the call from our side with a reason; `on_answered`, what else
    to record once the transfer was answered."""

    send: Callable[[str], bool]
    give_up: Callable[[], None]
    end_call: Callable[[str], None]
    answer_timeout_s: float
    # Recorded before our side ends the call (whose end cancels the caller of put_through).
    on_answered: Callable[[], Awaitable[None]] | None = None


async def put_through(
    runtime: Runtime, session: CallSession, transfer: SipTransfer, port: ReferPort
) -> TransferOutcome:
    """Carry out `transfer` on this SIP call (see the module docstring)."""
    request = transfer.request
    call_id = session.call_id
    target = TransferTarget(request.target, request.destination)
    if not port.send(request.destination):
        return TransferOutcome(False, "failed", "the call cannot be transferred right now")
    gone = TransferOutcome(
        False, "unknown", "the caller's line ended before the transfer's outcome was reported"
    )
    try:
        status = await asyncio.wait_for(
            asyncio.shield(transfer.answered), port.answer_timeout_s + ANSWER_MARGIN_S
        )
    except TimeoutError:
        status = 0
    if status == ENDED:
        return gone
    if not 200 <= status < 300:
        port.give_up()
        log.info("call %s: REFER to %s refused (%s)", call_id, target.masked(), status or "none")
        detail = (
            f"the phone system refused the transfer (SIP {status})"
            if status
            else "the phone system did not answer the transfer request"
        )
        return TransferOutcome(False, "refused", detail)
    runtime.events.emit(
        CallEvent(
            call_id,
            CallEventKind.TRANSFER_STARTED,
            {
                "target": request.target,
                "refer_to": target.masked(),
                "by": "transfer_call",
                "mode": request.mode,
            },
        )
    )
    await record_transfer_outcome(
        runtime.engine,
        call_id,
        request.function_call_id,
        TransferOutcome(True, "referred", f"ringing {request.target}"),
    )
    ring_s = runtime.settings.transfer_ring_timeout_s
    try:
        code, reason = await asyncio.wait_for(asyncio.shield(transfer.final), ring_s)
    except TimeoutError:
        port.give_up()
        log.info("call %s: no outcome of the transfer to %s within %d s",
                 call_id, request.target, ring_s)  # fmt: skip
        return TransferOutcome(
            False, "no-answer", f"no answer within {ring_s} s; the caller is still on this line"
        )
    if code == ENDED:
        return gone
    if 200 <= code < 300:
        warm = request.mode == "warm"
        end = f"transferred to {request.target}" + (" (warm)" if warm else "")
        runtime.events.emit(
            CallEvent(
                call_id,
                CallEventKind.TRANSFER_ANSWERED,
                {"target": request.target, "status": code, "mode": request.mode},
            )
        )
        said = f"{request.target} was briefed and joined" if warm else f"{request.target} answered"
        outcome = TransferOutcome(True, "answered", said)
        await record_transfer_outcome(runtime.engine, call_id, request.function_call_id, outcome)
        if port.on_answered is not None:
            await port.on_answered()
        session.ended_by(end)
        log.info("call %s: %s", call_id, end)
        port.end_call(end)
        return outcome
    if code < 200:
        return TransferOutcome(
            False, "failed", f"the transfer's progress reports stopped at SIP {code}"
        )
    name = sipfrag_outcome(code)
    said = f"{dial_outcome_said(name)} (SIP {code} {reason})".replace(" )", ")")
    log.info("call %s: transfer to %s failed: %s", call_id, request.target, said)
    return TransferOutcome(False, name, said)
