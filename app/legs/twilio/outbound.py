"""An outbound call on the Twilio leg: its webhooks, who answered, and what the agent says.

1. `answer` (`POST /twilio/outbound-answer?call_id&k`, the `url` of Calls.create): someone or
   something picked up. The row gets its CallSid and the answer is `<Connect action><Stream>`
   as for an inbound call, but the stream's agent is silent and deaf (no greeting, the
   callee's audio dropped) until it is known who answered.
2. `amd_result` (`POST /twilio/amd?call_id&k`, Twilio's AsyncAmdStatusCallback): stored on the
   row (the first result wins) and told to the replica holding the call (`call_control`
   `amd`, app/calls/control.py); a stream that starts later reads it from the row.
3. `OutboundLine.answered_by`, on the holder, once per call. The rule:
   - `human`: the agent speaks first: the purpose and, when the call is about an operation,
     where that operation stands; then the conversation goes on;
   - `machine_end_beep` / `machine_end_silence` / `machine_end_other` (after the greeting and
     its beep), and `unknown` (nobody could tell: it may be a machine recording): a short
     message that names only the purpose (never an operation's details: anyone may play a
     voicemail), then the call is hung up once the message was heard to its end;
   - `fax`: hung up at once, nothing said.
4. `unanswered` (the status callback: busy, no answer, failed, canceled before anyone picked
   up): recorded on the row, the timeline and the placing operation.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from typing import Any

import sqlalchemy as sa

from app.calls import store as call_store
from app.calls.control import publish_amd
from app.calls.store import CallRow, CallStatus, calls
from app.errors import BadRequest
from app.legs.session import CallSession
from app.legs.twilio import twiml
from app.legs.twilio.resume import stream_twiml
from app.models import LegKind
from app.ops.callback import voicemail_left
from app.ops.outbound import ANSWERED_BY, bind_sid, note_on_placing, url_key
from app.ops.twilio_rest import end_call
from app.runtime import Runtime
from telephony.bridge import Bridge
from telephony.call_events import CallEvent, CallEventKind
from tools import deliveries, ledger
from tools.errors import UnknownTool
from tools.results import status_message

log = logging.getLogger(__name__)

# How long a voicemail message may take to be said and heard before the call is hung up.
MESSAGE_WAIT_S = 30.0
HANGUP_TIMEOUT_S = 8.0
UNANSWERED = frozenset({"busy", "no-answer", "failed", "canceled"})


def checked_call_id(runtime: Runtime, call_id: str, key: str) -> str:
    """The call id of an outbound webhook's query, if its key is ours; else BadRequest."""
    try:
        call_id = str(uuid.UUID(call_id))
    except ValueError:
        raise BadRequest("no call_id") from None
    if not hmac.compare_digest(key.encode(), url_key(runtime.settings, call_id).encode()):
        raise BadRequest("not a call of ours")
    return call_id


async def answer(runtime: Runtime, call_id: str, call_sid: str) -> str:
    """The TwiML for an outbound call someone (or something) picked up (see the docstring)."""
    if not await bind_sid(runtime.engine, call_id, call_sid):
        raise BadRequest("not a call of ours")
    row = await call_store.get_call(runtime.engine, call_id)
    if row is None or row.status in call_store.TERMINAL:
        return twiml.hangup()
    if row.status == CallStatus.RINGING:
        if not runtime.registry.try_reserve(call_sid):
            await call_store.transition(
                runtime.engine, call_id, CallStatus.FAILED, end_reason="no capacity when answered"
            )
            return twiml.hangup()
        runtime.events.emit(
            CallEvent(row.id, CallEventKind.OUTBOUND_ANSWERED, {"call_sid": call_sid})
        )
    token = runtime.tokens.issue(call_sid, row.id)
    return stream_twiml(runtime, row, token)


async def amd_result(runtime: Runtime, call_id: str, call_sid: str, answered_by: str) -> None:
    """Who answered: stored on the row (first result wins) and told to the call's holder."""
    if answered_by not in ANSWERED_BY:
        answered_by = "unknown"
    await bind_sid(runtime.engine, call_id, call_sid)
    async with runtime.engine.begin() as conn:
        outbound = (
            await conn.execute(
                sa.update(calls)
                .where(
                    calls.c.id == uuid.UUID(call_id),
                    calls.c.call_sid == call_sid,
                    calls.c.outbound["amd"].astext.is_(None),
                )
                .values(
                    outbound=calls.c.outbound.op("||")(
                        sa.func.jsonb_build_object("amd", sa.cast(answered_by, sa.Text))
                    )
                )
                .returning(calls.c.outbound)
            )
        ).scalar()
        if outbound is None:
            return  # not ours, or told already (Twilio retries)
        await note_on_placing(
            conn, outbound, f"answered by {answered_by}", {"answered_by": answered_by}
        )
    await publish_amd(runtime.engine, call_sid, answered_by)


async def unanswered(runtime: Runtime, row: CallRow, call_status: str) -> None:
    """A final status for an outbound call: the timeline (never answered: why) and the placing
    operation hear of it. The row itself is ended by the status callback."""
    if row.direction != "outbound":
        return
    outbound = await _outbound_of(runtime, row.id)
    if call_status in UNANSWERED and row.answered_at is None:
        runtime.events.emit(
            CallEvent(row.id, CallEventKind.OUTBOUND_UNANSWERED, {"status": call_status})
        )
    async with runtime.engine.begin() as conn:
        await note_on_placing(
            conn, outbound, f"the call ended: {call_status}", {"call_status": call_status}
        )
        if outbound.get("delivery_id"):
            # A callback's delivery hears of its call's end now, not at its next check.
            await deliveries.enqueue(conn, uuid.UUID(str(outbound["delivery_id"])))


async def _outbound_of(runtime: Runtime, call_id: str) -> dict[str, Any]:
    async with runtime.engine.connect() as conn:
        value = await conn.scalar(
            sa.select(calls.c.outbound).where(calls.c.id == uuid.UUID(call_id))
        )
    return dict(value or {})


async def answered_by_here(runtime: Runtime, call_sid: str, answered_by: str) -> None:
    """`call_control` `amd`: the outbound call `call_sid`, if this process holds it, acts."""
    entry = runtime.registry.get(call_sid)
    line = entry.outbound if entry is not None else None
    if isinstance(line, OutboundLine):
        await line.answered_by(answered_by)


def quoted(text: str) -> str:
    """Text safe inside the `Say exactly: "…"` of an instruction."""
    return " ".join(text.replace('"', "'").split())


class OutboundLine:
    """What the agent of one outbound call does once it is known who answered (the rule is
    in the module docstring). Lives on the call's registry entry, on its holder."""

    def __init__(self, runtime: Runtime, session: CallSession, bridge: Bridge) -> None:
        self.runtime = runtime
        self.session = session
        self.bridge = bridge
        self._acted = False

    async def pick_up_stored(self) -> None:
        """A result that came before this stream did (stored on the row)."""
        outbound = await _outbound_of(self.runtime, self.session.call_id)
        answered_by = outbound.get("amd")
        if isinstance(answered_by, str):
            await self.answered_by(answered_by)

    async def answered_by(
        self, answered_by: str, *, detected: bool = True, detail: dict[str, Any] | None = None
    ) -> None:
        """Act on who answered; `detected`: a detector said so (Twilio's, or ours on a SIP
        leg, whose `detail` says when and why); not detected (SIP_AMD off): whoever answered
        is taken for a person, without an `amd_result` on the timeline."""
        if self._acted:
            return
        self._acted = True
        call_id = self.session.call_id
        outbound = await _outbound_of(self.runtime, call_id)
        purpose = quoted(str(outbound.get("purpose") or "a message for you"))
        if detected:
            self._emit(CallEventKind.AMD_RESULT, {"answered_by": answered_by, **(detail or {})})
        delivery_id = outbound.get("delivery_id")
        if answered_by == "human" and delivery_id and self.runtime.delivery is not None:
            # A callback: the result goes as an announcement, so "told" means heard.
            line = f"Hello, this is an automated call about {purpose}."
            await self.bridge.open_line(
                f'The person you called has answered. Say exactly: "{line}" Then tell them '
                "the update you are given next, and answer their questions about it briefly.",
                listen=True,
            )
            told = await self.runtime.delivery.tell_on_callback(
                self.bridge, call_id, uuid.UUID(str(delivery_id))
            )
            if not told:
                log.info("call %s: the callback's result was not handed to the call", call_id)
            return
        if answered_by == "human":
            facts = await self._facts(outbound.get("about_operation_id"))
            line = f"Hello, this is an automated call about {purpose}. {facts}".strip()
            await self.bridge.open_line(
                f'The person you called has answered. Say exactly: "{line}" Then answer '
                "their questions about it briefly.",
                listen=True,
            )
            return
        if answered_by == "fax":
            await self._hang_up("a fax machine answered")
            return
        # A machine (or nobody could tell): only what a voicemail may hear.
        message = (
            f"Hello, this is an automated message about {purpose}. "
            "Please call us back when you can. Goodbye."
        )
        said = await self.bridge.open_line(
            f'You are leaving a voicemail message. Say exactly: "{message}" Say nothing else.',
            listen=False,
            wait_s=MESSAGE_WAIT_S,
        )
        if said:
            self._emit(CallEventKind.VOICEMAIL_LEFT, {"answered_by": answered_by})
            async with self.runtime.engine.begin() as conn:
                await note_on_placing(
                    conn, outbound, "a voicemail message was left", {"answered_by": answered_by}
                )
                if delivery_id:
                    await voicemail_left(conn, uuid.UUID(str(delivery_id)), call_id, answered_by)
        await self._hang_up("voicemail left" if said else f"answered by {answered_by}")

    async def _facts(self, operation_id: Any) -> str:
        """Where the operation this call is about stands, in one speakable sentence."""
        if not operation_id or self.runtime.tools is None:
            return ""
        async with self.runtime.engine.connect() as conn:
            op = await ledger.get_operation(conn, uuid.UUID(str(operation_id)))
        if op is None:
            return ""
        try:
            spec = self.runtime.tools.registry.get(op.tool)
        except UnknownTool:
            return ""
        return quoted(status_message(spec, op))

    def _emit(self, kind: CallEventKind, data: dict[str, Any]) -> None:
        self.session.sink.emit(CallEvent(self.session.call_id, kind, data))

    async def _hang_up(self, reason: str) -> None:
        twilio = self.runtime.twilio
        self.session.ended_by(reason)
        if self.session.leg is not LegKind.TWILIO:
            await self.bridge.end(reason)  # our own SIP leg: its BYE
            return
        try:
            async with asyncio.timeout(HANGUP_TIMEOUT_S):
                await end_call(twilio, self.session.call_sid)
        except Exception as exc:
            log.warning("call %s: hang-up through Twilio failed: %r", self.session.call_id, exc)
            await self.bridge.end(reason)
