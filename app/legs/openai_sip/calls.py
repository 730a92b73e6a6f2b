"""Calls through OpenAI's SIP interconnect: OpenAI carries the audio, we keep the rest.

OpenAI answers the SIP side and announces the call with a signed `realtime.call.incoming`
webhook. We verify it (the SDK's Standard Webhooks check), take each delivery once (by
`webhook-id`, durably), create the `calls` row (leg `openai_sip`, the `rtc_...` call id as its
CallSid), and answer the webhook at once; off the request, the call is accepted with the same
session the other legs get, or rejected (486 at capacity, 403 for a To number that is not ours).
The bridge then attaches over the sideband WebSocket and runs the conversation, tools and late
results as on any leg, with a `SidebandLeg` where the others have audio.

Call control: `transfer` (refer) and `hangup`, both on the timeline. A call that ends on
OpenAI's side shows as the sideband closing and a re-attach being refused; a network drop gets
OPENAI_SIP_REATTACH_BUDGET_S to come back; either way the call ends, never left unattended.

With MODEL_API=live the same call is GPT-Live's: OpenAI announces the pending call with
`live.transport.incoming` as well (its `live_...` session id), and the first accept that
succeeds, on either API, picks the runtime. So on Live we accept that one
(`client.live.sessions.accept` with the Live session every leg gets, no audio format: SIP
negotiates the media) and leave `realtime.call.incoming` unanswered (and on Realtime the other
way round); reject, refer and hangup go to `client.live.sessions` by the session id, and the
bridge attaches to the session's Live sideband.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from openai import APIStatusError, InvalidWebhookSignatureError
from openai.types.webhooks.live_transport_incoming_webhook_event import (
    LiveTransportIncomingWebhookEvent,
)
from openai.types.webhooks.realtime_call_incoming_webhook_event import (
    RealtimeCallIncomingWebhookEvent,
)
from pydantic import ValidationError

from app.calls.store import CallStatus
from app.legs.openai_sip import webhooks as openai_webhooks
from app.legs.session import Admission, Caller, CallSession, EndReason, sip_refusal
from app.models import LegKind
from app.runtime import Runtime
from telephony.bridge import Bridge
from telephony.bridge.live_link import session_start
from telephony.call_events import CallEvent, CallEventKind
from telephony.legs.sideband import LiveSidebandLeg, SidebandLeg
from telephony.session_config import BridgeConfig, session_update
from telephony.tool_gateway import TransferOutcome, TransferRequest

log = logging.getLogger(__name__)

LEG = "openai_sip"
REALTIME_INCOMING = "realtime.call.incoming"
LIVE_INCOMING = "live.transport.incoming"
IncomingEvent = RealtimeCallIncomingWebhookEvent | LiveTransportIncomingWebhookEvent
_SIP_USER = re.compile(r"<?\s*(?:sips?|tel):([^@;>\s]+)", re.IGNORECASE)
_TARGET = re.compile(r"^(tel:\+[1-9][0-9]{6,14}|sips?:[^\s@]+@[^\s]+)$")


class WebhookRejected(Exception):
    """A webhook that did not verify: nothing recorded. 401 when it carries no signature at all
    (an anonymous request), 400 when its signature is wrong, stale or malformed."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


SIGNATURE_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")


def sip_user(value: str | None) -> str | None:
    """The user part of a From/To/P-Asserted-Identity value (`+15551230000`), if any."""
    if not value:
        return None
    match = _SIP_USER.search(value)
    if match is None:
        return None
    user = match.group(1).strip()
    return user[:32] or None


def header(headers: list[Any], name: str) -> str | None:
    """The first SIP header called `name` (case-insensitive), as OpenAI relayed it."""
    wanted = name.lower()
    for item in headers:
        if str(item.name).lower() == wanted:
            return str(item.value)
    return None


def transfer_target(target: str) -> str:
    """A REFER target: `tel:+E164` or a `sip:` URI; a bare E.164 number becomes `tel:`."""
    target = target.strip()
    if re.fullmatch(r"\+[1-9][0-9]{6,14}", target):
        target = "tel:" + target
    if not _TARGET.match(target):
        raise ValueError(f"not a tel:+E.164 number or a sip: URI: {target[:64]!r}")
    return target


@dataclass(eq=False)
class _Call:
    """One interconnect call in this process."""

    session: CallSession
    caller_id: str | None
    received_at: float  # monotonic, the webhook's arrival
    live: bool = False  # GPT-Live (the `live_...` session id) rather than Realtime
    bridge: Bridge | None = None
    leg: SidebandLeg | None = None
    transferred_to: str | None = None
    hung_up: bool = False
    accepted: asyncio.Event = field(default_factory=asyncio.Event)


class OpenAISipService:
    """Incoming interconnect calls of this process, from webhook to the end of the call."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._calls: dict[str, _Call] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Counters (tests, /metrics): nothing else is recorded for a bad signature.
        self.bad_signatures = 0
        self.duplicates = 0
        self.accepted = 0
        self.rejected: dict[int, int] = {}
        # Latency samples (seconds) for the benchmark: webhook in -> accept sent (not answered).
        self.accept_latencies: list[float] = []

    @property
    def _settings(self) -> Any:
        return self.runtime.settings

    @property
    def _live(self) -> bool:
        return bool(self._settings.model_api == "live")

    def _control(self, live: bool) -> Any:
        """The call-control API of the runtime that took the call: Realtime's calls or
        GPT-Live's sessions (the same reject, refer and hangup, by that runtime's id)."""
        openai = self.runtime.openai
        return openai.live.sessions if live else openai.realtime.calls

    def _secret(self) -> str | None:
        secret = self._settings.openai_webhook_secret
        return secret.get_secret_value() if secret is not None else None

    # ---- the webhook --------------------------------------------------------------------

    async def on_webhook(self, body: bytes, headers: Mapping[str, str]) -> str:
        """Take one webhook delivery; returns what became of it. Raises WebhookRejected."""
        received_at = time.monotonic()
        if not any(headers.get(name) for name in SIGNATURE_HEADERS):
            self.bad_signatures += 1
            raise WebhookRejected("no webhook signature", status=401)
        secret = self._secret()
        if secret is None:
            self.bad_signatures += 1
            raise WebhookRejected("OPENAI_WEBHOOK_SECRET is not set")
        try:
            self.runtime.openai.webhooks.verify_signature(body, dict(headers), secret=secret)
            data = json.loads(body)
        except (InvalidWebhookSignatureError, ValueError) as exc:
            self.bad_signatures += 1
            raise WebhookRejected(str(exc)[:200]) from None
        webhook_id = str(headers.get("webhook-id") or "")
        event_type = str(data.get("type") or "") if isinstance(data, dict) else ""
        # OpenAI may announce one pending call on both APIs; we answer the one we run on
        # (the first accept picks the runtime, so answering both could take it twice).
        if event_type != (LIVE_INCOMING if self._live else REALTIME_INCOMING):
            return "ignored"
        event: IncomingEvent
        try:
            if self._live:
                event = LiveTransportIncomingWebhookEvent.model_validate(data)
            else:
                event = RealtimeCallIncomingWebhookEvent.model_validate(data)
        except ValidationError:
            return "malformed"
        call_id = _carrier_id(event)
        engine = self.runtime.engine
        if not await openai_webhooks.record_delivery(engine, webhook_id, event_type, call_id):
            self.duplicates += 1
            return "duplicate"
        try:
            return await self._incoming(event, received_at)
        except Exception:
            # Nothing was done: OpenAI's retry of this delivery must be able to do it.
            with contextlib.suppress(Exception):
                await openai_webhooks.forget_delivery(engine, webhook_id)
            raise

    async def _incoming(self, event: IncomingEvent, received_at: float) -> str:
        settings = self._settings
        live = isinstance(event, LiveTransportIncomingWebhookEvent)
        # OpenAI's id of the call (`rtc_...`, or the Live session's `live_...`): the carrier's.
        call_sid = _carrier_id(event)
        headers = event.data.sip_headers
        from_number = sip_user(header(headers, "From"))
        to_number = sip_user(header(headers, "To"))
        caller_id = {
            "from": from_number,
            "asserted": sip_user(header(headers, "P-Asserted-Identity")),
            "none": None,
        }[settings.openai_sip_caller_id]
        session = CallSession(
            self.runtime, LegKind.OPENAI_SIP, Caller(call_sid, from_number, to_number)
        )
        ours = settings.openai_sip_number_set()
        if ours is not None and to_number not in ours:
            self._refused(call_sid, 403, "not our number", live)
            await session.refuse(
                CallStatus.REJECTED, {"reason": "not our number", "status_code": 403}
            )
            return "rejected 403"
        admission = await session.admit(
            {
                "caller_id": caller_id,
                "caller_id_source": settings.openai_sip_caller_id,
                "sip_media_security": event.data.sip_media_security,
            },
            rejected={"status_code": 503 if self.runtime.registry.draining else 486},
        )
        if admission in (Admission.BUSY, Admission.DRAINING):
            # Stopping: 503, the trunk may retry elsewhere; full: 486.
            code = sip_refusal(admission)
            self._refused(call_sid, code, str(admission), live)
            return f"rejected {code}"
        if admission is not Admission.ADMITTED:
            return "duplicate call"  # another delivery (new webhook-id) of a call we have
        if live and event.data.sip_media_security not in (None, "srtp"):
            # GPT-Live requires SRTP on the trunk: a trunk sending plain RTP is misconfigured.
            log.warning(
                "OpenAI SIP call %s on GPT-Live reports media security %r (SRTP expected)",
                call_sid,
                str(event.data.sip_media_security)[:16],
            )
        call = _Call(session, caller_id, received_at, live=live)
        self._calls[call_sid] = call
        self._spawn(self._run_call(call), f"openai-sip-{session.call_id}")
        return "accepting"

    def _refused(self, call_sid: str, status: int, reason: str, live: bool) -> None:
        """Tell OpenAI the call is refused (off the request) and count it."""
        self.rejected[status] = self.rejected.get(status, 0) + 1
        log.warning("OpenAI SIP call %s refused with %d (%s)", call_sid, status, reason)
        self._spawn(self._send_reject(call_sid, status, live), "openai-sip-reject")

    async def _send_reject(self, call_sid: str, status: int, live: bool) -> None:
        try:
            await self._control(live).reject(
                call_sid, status_code=status, timeout=self._settings.openai_sip_api_timeout_s
            )
        except Exception as exc:
            log.warning("reject of OpenAI SIP call %s failed: %r", call_sid, exc)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- one call -----------------------------------------------------------------------

    def session(self) -> dict[str, Any]:
        """The accept body: the session every leg gets, in the interconnect's codec."""
        config: BridgeConfig = self.runtime.bridge_config
        gateway = self.runtime.gateway
        # Agents declared: the call is accepted with the first agent's instructions and tools.
        starting = getattr(gateway, "starting_session", None)
        agent = starting() if starting is not None else None
        tools = agent.tools if agent is not None else gateway.definitions()
        persona = agent.instructions if agent is not None else None
        voice = agent.voice if agent is not None else None
        body: dict[str, Any] = dict(session_update(config, "audio/pcmu", tools, (), persona, voice))
        body["model"] = config.model
        return body

    def live_session(self) -> dict[str, Any]:
        """The Live accept's `session`: what `session.start` gives the other legs on GPT-Live
        (model, instructions, voice, the Responses delegation with the catalog's tools), with
        no audio format: SIP negotiates the media."""
        config: BridgeConfig = self.runtime.bridge_config
        gateway = self.runtime.gateway
        starting = getattr(gateway, "starting_session", None)
        agent = starting() if starting is not None else None
        tools = agent.tools if agent is not None else gateway.definitions()
        persona = agent.instructions if agent is not None else None
        voice = (agent.voice if agent is not None else None) or config.voice
        return {"type": "live", **session_start(config, None, tools, persona, voice)}

    async def _run_call(self, call: _Call) -> None:
        session = call.session
        try:
            await self._accept_and_bridge(call)
        except Exception:
            log.exception("OpenAI SIP call %s failed", session.call_sid)
        finally:
            self._calls.pop(session.call_sid, None)
            # Every way out ends the call here (once: the usual ways ended it already).
            await session.end(CallStatus.FAILED, EndReason.INTERNAL_ERROR)

    async def _accept_and_bridge(self, call: _Call) -> None:
        session = call.session
        runtime = self.runtime
        settings = self._settings
        self.accept_latencies.append(time.monotonic() - call.received_at)  # accept sent now
        try:
            if call.live:
                await runtime.openai.live.sessions.accept(
                    session.call_sid,
                    session=self.live_session(),  # type: ignore[arg-type]
                    timeout=settings.openai_sip_api_timeout_s,
                )
            else:
                await runtime.openai.realtime.calls.accept(
                    session.call_sid, **self.session(), timeout=settings.openai_sip_api_timeout_s
                )
        except Exception as exc:
            log.warning("accept of OpenAI SIP call %s failed: %r", session.call_sid, exc)
            error = {"where": "accept", "error": repr(exc)[:200]}
            runtime.events.emit(CallEvent(session.call_id, CallEventKind.ERROR, error))
            await session.end(CallStatus.FAILED, EndReason.ACCEPT_FAILED)
            return
        accept_s = time.monotonic() - call.received_at
        self.accepted += 1
        call.accepted.set()
        leg = (LiveSidebandLeg if call.live else SidebandLeg)(
            session.call_sid,
            "audio/pcmu",
            on_close=lambda reason: self._on_leg_close(call, reason),
        )

        async def on_fatal(reason: str) -> None:
            await self._hangup(call, f"sideband lost: {reason}")

        async def put_through(request: TransferRequest) -> TransferOutcome:
            return await self._tool_transfer(call, request)

        bridge = session.build_bridge(
            leg,
            carries_audio=False,  # OpenAI carries the audio: nothing here to record
            caller_id=call.caller_id,
            config=_sideband_config(runtime.bridge_config, settings.openai_sip_reattach_budget_s),
            on_fatal=on_fatal,
            transfer=put_through,
        )
        call.bridge = bridge
        call.leg = leg
        try:
            if not await session.go_live(
                {"encoding": "audio/pcmu", "accept_ms": round(accept_s * 1000, 3)}
            ):
                # Ended elsewhere (staff, a sweep) while it was being accepted.
                session.ended_by(EndReason.ENDED_ELSEWHERE)
                await self._hangup(call, EndReason.ENDED_ELSEWHERE)
                return
            await bridge.run()
        finally:
            override = None
            if bridge.ended_remotely and not call.hung_up and call.transferred_to is None:
                override = EndReason.REMOTE_HANGUP
            await session.end(CallStatus.COMPLETED, override=override)

    async def _on_leg_close(self, call: _Call, reason: str) -> None:
        """The bridge is done with the call: unless OpenAI's side ended it, hang up."""
        bridge = call.bridge
        if bridge is not None and bridge.ended_remotely:
            return
        if call.transferred_to is not None:
            return
        await self._hangup(call, reason)

    async def _hangup(self, call: _Call, reason: str) -> bool:
        if call.hung_up:
            return True
        call.hung_up = True
        ok = True
        error: str | None = None
        try:
            await self._control(call.live).hangup(
                call.session.call_sid, timeout=self._settings.openai_sip_api_timeout_s
            )
        except APIStatusError as exc:
            ok = exc.status_code == 404  # already over on OpenAI's side
            error = f"HTTP {exc.status_code}"
        except Exception as exc:
            ok = False
            error = repr(exc)[:200]
        data: dict[str, Any] = {"reason": reason[:200], "sent": True, "ok": ok}
        if error is not None:
            data["error"] = error
        self.runtime.events.emit(CallEvent(call.session.call_id, CallEventKind.CALL_HANGUP, data))
        return ok

    # ---- call control from the application ----------------------------------------------

    def _find(self, call: str) -> _Call:
        """A live call by its `call_sid` (OpenAI's id) or its `call_id` (ours)."""
        found = self._calls.get(call) or next(
            (c for c in self._calls.values() if c.session.call_id == call), None
        )
        if found is None or found.bridge is None:
            raise LookupError(f"no live OpenAI SIP call {call!r} in this process")
        return found

    async def transfer(self, call: str, target: str, by: str | None = None) -> None:
        """Transfer a live call (our id or OpenAI's) to a number or SIP URI: `refer` (`by`:
        who asked, recorded with it)."""
        live = self._find(call)
        uri = transfer_target(target)
        error: str | None = None
        try:
            await self._control(live.live).refer(
                live.session.call_sid,
                target_uri=uri,
                timeout=self._settings.openai_sip_api_timeout_s,
            )
        except Exception as exc:
            error = repr(exc)[:200]
        data: dict[str, Any] = {"target_uri": uri, "ok": error is None}
        if by:
            data["by"] = by[:128]
        if error is not None:
            data["error"] = error
        self.runtime.events.emit(
            CallEvent(live.session.call_id, CallEventKind.CALL_TRANSFERRED, data)
        )
        if error is not None:
            raise RuntimeError(f"transfer failed: {error}")
        live.transferred_to = uri
        assert live.bridge is not None
        await live.bridge.end(f"transferred to {uri}")

    async def _tool_transfer(self, live: _Call, request: TransferRequest) -> TransferOutcome:
        """`transfer_call` on an interconnect call: OpenAI's `refer` (it sends the REFER to
        the carrier, who puts the caller through and tells us no more); once it took it, the
        call is over here, "transferred to <target>"."""
        try:
            uri = transfer_target(request.destination)
            await self._control(live.live).refer(
                live.session.call_sid,
                target_uri=uri,
                timeout=self._settings.openai_sip_api_timeout_s,
            )
        except Exception as exc:
            log.warning("OpenAI SIP call %s: refer refused: %r", live.session.call_id, exc)
            return TransferOutcome(False, "refused", "the phone system did not take the transfer")
        self.runtime.events.emit(
            CallEvent(
                live.session.call_id,
                CallEventKind.TRANSFER_STARTED,
                {"target": request.target, "target_uri": uri, "by": "transfer_call"},
            )
        )
        live.transferred_to = uri
        bridge = live.bridge
        if bridge is not None:
            # Not from this task (the bridge's own): the bridge's end waits for its tasks.
            self._spawn(bridge.end(f"transferred to {request.target}"), "transfer-end")
        return TransferOutcome(True, "referred", f"referred to {request.target}")

    async def hangup(self, call: str, reason: str = "ended by the application") -> None:
        """End a live call from our side: `hangup` (through the bridge's end)."""
        live = self._find(call)
        live.session.ended_by(reason)
        assert live.bridge is not None
        await live.bridge.end(reason)

    def live_calls(self) -> int:
        return len(self._calls)

    async def stop(self) -> None:
        """End what is still here (hangup) and wait for the calls' tasks."""
        for call in list(self._calls.values()):
            if call.bridge is not None:
                with contextlib.suppress(Exception):
                    await call.bridge.end(EndReason.SHUTDOWN)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10.0)
        for task in list(self._tasks):
            task.cancel()


def _carrier_id(event: IncomingEvent) -> str:
    """OpenAI's id of an incoming call: Realtime's `call_id`, or the Live `session_id`."""
    if isinstance(event, LiveTransportIncomingWebhookEvent):
        return event.data.session_id
    return event.data.call_id


def _sideband_config(config: BridgeConfig, budget_s: float) -> BridgeConfig:
    """The bridge's config for a sideband: the re-attach budget is the interconnect's own."""
    return replace(
        config,
        reconnect_budget_s=budget_s,
        connect_timeout_s=min(config.connect_timeout_s, budget_s),
    )
