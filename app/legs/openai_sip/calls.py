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
from openai.types.webhooks.realtime_call_incoming_webhook_event import (
    RealtimeCallIncomingWebhookEvent,
)
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError

from app.calls import store as call_store
from app.calls.liveness import go_live
from app.calls.store import CallStatus
from app.legs.openai_sip import webhooks as openai_webhooks
from app.legs.twilio.media_session import CallSink
from app.runtime import Runtime
from telephony.bridge import Bridge
from telephony.call_events import CallEvent, CallEventKind
from telephony.session_config import BridgeConfig, session_update
from telephony.sideband_leg import SidebandLeg
from telephony.tool_gateway import CallContext

log = logging.getLogger(__name__)

LEG = "openai_sip"
FLUSH_TIMEOUT_S = 5.0
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

    openai_call_id: str
    row_id: str
    from_number: str | None
    caller_id: str | None
    to_number: str | None
    received_at: float  # monotonic, the webhook's arrival
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
        if event_type != "realtime.call.incoming":
            return "ignored"
        try:
            event = RealtimeCallIncomingWebhookEvent.model_validate(data)
        except ValidationError:
            return "malformed"
        call_id = event.data.call_id
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

    async def _incoming(self, event: RealtimeCallIncomingWebhookEvent, received_at: float) -> str:
        runtime = self.runtime
        settings = self._settings
        call_id = event.data.call_id
        headers = event.data.sip_headers
        from_number = sip_user(header(headers, "From"))
        to_number = sip_user(header(headers, "To"))
        caller_id = {
            "from": from_number,
            "asserted": sip_user(header(headers, "P-Asserted-Identity")),
            "none": None,
        }[settings.openai_sip_caller_id]
        fields: dict[str, Any] = {
            "call_sid": call_id,
            "tenant_id": settings.tenant_id,
            "from_number": from_number,
            "to_number": to_number,
            "leg": LEG,
        }
        ours = settings.openai_sip_number_set()
        if ours is not None and to_number not in ours:
            await self._refuse(fields, 403, "not our number", CallStatus.REJECTED)
            return "rejected 403"
        if not runtime.registry.try_reserve(call_id):
            if runtime.registry.draining:  # this process is stopping: the trunk may retry
                await self._refuse(fields, 503, "draining", CallStatus.BUSY)
                return "rejected 503"
            await self._refuse(fields, 486, "capacity", CallStatus.BUSY)
            return "rejected 486"
        try:
            row, created = await call_store.create_call(runtime.engine, **fields)
        except DBAPIError:
            runtime.registry.release_reservation(call_id)
            raise
        if not created:
            return "duplicate call"  # another delivery (new webhook-id) of a call we have
        runtime.events.emit(
            CallEvent(
                row.id,
                CallEventKind.CALL_STARTED,
                {
                    "call_sid": call_id,
                    "from": from_number,
                    "to": to_number,
                    "direction": "inbound",
                    "leg": LEG,
                    "caller_id": caller_id,
                    "caller_id_source": settings.openai_sip_caller_id,
                    "sip_media_security": event.data.sip_media_security,
                },
            )
        )
        call = _Call(call_id, row.id, from_number, caller_id, to_number, received_at)
        self._calls[call_id] = call
        self._spawn(self._run_call(call), f"openai-sip-{row.id}")
        return "accepting"

    async def _refuse(
        self, fields: dict[str, Any], status: int, reason: str, row_status: CallStatus
    ) -> None:
        runtime = self.runtime
        self.rejected[status] = self.rejected.get(status, 0) + 1
        log.warning("OpenAI SIP call %s refused with %d (%s)", fields["call_sid"], status, reason)
        self._spawn(self._send_reject(str(fields["call_sid"]), status), "openai-sip-reject")
        with contextlib.suppress(DBAPIError):
            row, created = await call_store.create_call(runtime.engine, status=row_status, **fields)
            if created:
                data: dict[str, Any] = {"reason": reason, "status_code": status}
                if status == 486:
                    data["max_live_calls"] = self._settings.max_live_calls
                runtime.events.emit(CallEvent(row.id, CallEventKind.CALL_REJECTED, data))

    async def _send_reject(self, call_id: str, status: int) -> None:
        try:
            await self.runtime.openai.realtime.calls.reject(
                call_id, status_code=status, timeout=self._settings.openai_sip_api_timeout_s
            )
        except Exception as exc:
            log.warning("reject of OpenAI SIP call %s failed: %r", call_id, exc)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- one call -----------------------------------------------------------------------

    def session(self) -> dict[str, Any]:
        """The accept body: the session every leg gets, in the interconnect's codec."""
        config: BridgeConfig = self.runtime.bridge_config
        body: dict[str, Any] = dict(
            session_update(config, "audio/pcmu", self.runtime.gateway.definitions())
        )
        body["model"] = config.model
        return body

    async def _run_call(self, call: _Call) -> None:
        runtime = self.runtime
        try:
            await self._accept_and_bridge(call)
        except Exception:
            log.exception("OpenAI SIP call %s failed", call.openai_call_id)
            with contextlib.suppress(Exception):
                await self._finish(call.row_id, CallStatus.FAILED, "internal error")
        finally:
            self._calls.pop(call.openai_call_id, None)
            runtime.registry.release_reservation(call.openai_call_id)

    async def _accept_and_bridge(self, call: _Call) -> None:
        runtime = self.runtime
        settings = self._settings
        body = self.session()
        self.accept_latencies.append(time.monotonic() - call.received_at)  # accept sent now
        try:
            await runtime.openai.realtime.calls.accept(
                call.openai_call_id, **body, timeout=settings.openai_sip_api_timeout_s
            )
        except Exception as exc:
            log.warning("accept of OpenAI SIP call %s failed: %r", call.openai_call_id, exc)
            error = {"where": "accept", "error": repr(exc)[:200]}
            runtime.events.emit(CallEvent(call.row_id, CallEventKind.ERROR, error))
            await self._finish(call.row_id, CallStatus.FAILED, "accept failed")
            return
        accept_s = time.monotonic() - call.received_at
        self.accepted += 1
        call.accepted.set()
        sink = CallSink(runtime.events)
        ctx = CallContext(
            call_id=call.row_id,
            call_sid=call.openai_call_id,
            tenant_id=settings.tenant_id,
            from_number=call.caller_id,
            to_number=call.to_number,
        )
        leg = SidebandLeg(
            call.openai_call_id,
            "audio/pcmu",
            on_close=lambda reason: self._on_leg_close(call, reason),
        )
        config = _sideband_config(runtime.bridge_config, settings.openai_sip_reattach_budget_s)

        async def on_fatal(reason: str) -> None:
            await self._hangup(call, f"sideband lost: {reason}")

        bridge = Bridge(
            leg,
            ctx,
            runtime.gateway,
            sink,
            config,
            runtime.openai,
            on_fatal=on_fatal,
            announcements=runtime.delivery,
        )
        call.bridge = bridge
        call.leg = leg
        entry = runtime.registry.attach(call.openai_call_id, call.row_id, bridge, call.from_number)
        try:
            row = await go_live(runtime.engine, runtime.registry, entry, holder=runtime.holder)
            if row is None:
                # Ended elsewhere (staff, a sweep) while it was being accepted.
                entry.end_reason = entry.end_reason or "the call was ended by another process"
                await self._hangup(call, entry.end_reason)
                return
            sink.emit(
                CallEvent(
                    call.row_id,
                    CallEventKind.STREAM_STARTED,
                    {"leg": LEG, "openai_call_id": call.openai_call_id,
                     "encoding": "audio/pcmu", "accept_ms": round(accept_s * 1000, 3)},
                )
            )  # fmt: skip
            await bridge.run()
        finally:
            try:
                if runtime.delivery is not None:
                    await runtime.delivery.flush(call.row_id)
                reason = entry.end_reason or sink.end_reason or "ended"
                if bridge.ended_remotely and not call.hung_up and call.transferred_to is None:
                    reason = "caller hung up (the call ended on OpenAI's side)"
                await self._finish(
                    call.row_id, CallStatus.COMPLETED, reason, emit_end=sink.end_reason is None
                )
            finally:
                runtime.registry.detach(entry)

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
            await self.runtime.openai.realtime.calls.hangup(
                call.openai_call_id, timeout=self._settings.openai_sip_api_timeout_s
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
        self.runtime.events.emit(CallEvent(call.row_id, CallEventKind.CALL_HANGUP, data))
        return ok

    async def _finish(
        self, call_id: str, status: CallStatus, reason: str, *, emit_end: bool = True
    ) -> None:
        runtime = self.runtime
        try:
            await call_store.transition(runtime.engine, call_id, status, end_reason=reason[:128])
        except DBAPIError:
            log.exception("could not persist the end of OpenAI SIP call %s", call_id)
        if emit_end:
            runtime.events.emit(CallEvent(call_id, CallEventKind.CALL_ENDED, {"reason": reason}))
        await runtime.events.flush(FLUSH_TIMEOUT_S)

    # ---- call control from the application ----------------------------------------------

    def _find(self, call: str) -> _Call:
        found = self._calls.get(call) or next(
            (c for c in self._calls.values() if c.row_id == call), None
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
            await self.runtime.openai.realtime.calls.refer(
                live.openai_call_id, target_uri=uri, timeout=self._settings.openai_sip_api_timeout_s
            )
        except Exception as exc:
            error = repr(exc)[:200]
        data: dict[str, Any] = {"target_uri": uri, "ok": error is None}
        if by:
            data["by"] = by[:128]
        if error is not None:
            data["error"] = error
        self.runtime.events.emit(CallEvent(live.row_id, CallEventKind.CALL_TRANSFERRED, data))
        if error is not None:
            raise RuntimeError(f"transfer failed: {error}")
        live.transferred_to = uri
        assert live.bridge is not None
        await live.bridge.end(f"transferred to {uri}")

    async def hangup(self, call: str, reason: str = "ended by the application") -> None:
        """End a live call from our side: `hangup` (through the bridge's end)."""
        live = self._find(call)
        entry = self.runtime.registry.get(live.openai_call_id)
        if entry is not None and entry.end_reason is None:
            entry.end_reason = reason[:128]
        assert live.bridge is not None
        await live.bridge.end(reason)

    def live_calls(self) -> int:
        return len(self._calls)

    async def stop(self) -> None:
        """End what is still here (hangup) and wait for the calls' tasks."""
        for call in list(self._calls.values()):
            if call.bridge is not None:
                with contextlib.suppress(Exception):
                    await call.bridge.end("server shutdown")
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10.0)
        for task in list(self._tasks):
            task.cancel()


def _sideband_config(config: BridgeConfig, budget_s: float) -> BridgeConfig:
    """The bridge's config for a sideband: the re-attach budget is the interconnect's own."""
    return replace(
        config,
        reconnect_budget_s=budget_s,
        connect_timeout_s=min(config.connect_timeout_s, budget_s),
    )
