"""Outbound calls: asking for one (`POST /api/calls`, `voice-agent dial`) and placing it.

`request_call` writes the call's row (direction outbound, ringing, a placeholder CallSid until
Twilio names the call, the purpose in `calls.outbound`) and admits the `place_call` operation
in one transaction, so the request is durable and shows in the console as an operation. A
worker runs it through `TwilioCalls`: `Calls.create` with answering-machine detection
(`MachineDetection=DetectMessageEnd`, `AsyncAmd`) and our signed webhooks (answer, AMD result,
status; app/legs/twilio/outbound.py). Placing a call is not idempotent at Twilio: a create
whose answer is lost (a timeout, a 5xx after sending) is `unknown`, and the reconciler asks
Twilio (`lookup`: the calls to that number since the operation began), never creates again.

Over our own SIP leg (`OUTBOUND_VIA=sip`, or a `sip:` URI in `to`) the worker's `SipCalls`
hands the call to the process's SIP listener (app/legs/sip_outbound.py): the row is named by
the INVITE's Call-ID, and the operation is committed once the far side answered the INVITE at
all (a 1xx or a final). With no answer by the deadline it is `unknown`: a SIP call cannot be
listed like Twilio's, so the reconciler reads what the listener recorded on the row: any
response to the INVITE (`outbound.sip_status`) means it was placed; none means it was not.

`place_call` is not a tool of the catalog: the model is never offered it; only the worker,
the console and deliveries know its spec (`with_place_call`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol
from urllib.parse import urlencode

import aiohttp
import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from twilio.base.exceptions import TwilioRestException

from app.calls.store import CallStatus, calls
from app.ops.twilio_rest import make_twilio_client
from app.settings import Settings
from telephony.call_events import CallEventKind
from tools import ledger
from tools.errors import ToolError
from tools.ledger import Enqueue, OperationRecord
from tools.provider import ActionResult, Finding, Outcome, Provider
from tools.registry import Registry, RetryPolicy, ToolKind, ToolSpec
from tools.sweeper import QueueWait
from tools.transfers import E164, CallbackScheduler, ScheduledCallback

MAX_SIP_URI = 256

log = logging.getLogger(__name__)

PLACE_CALL = "place_call"
PROVIDER = "twilio_calls"
# The CallSid of an outbound call's row until Twilio names the call.
PENDING_SID = "outbound-pending:"
MAX_PURPOSE = 300
# Twilio's clock and ours differ a little: calls this much older than the attempt still count.
LIST_SKEW_S = 120.0
# Twilio's AnsweredBy values, as the answer webhook and AMD callback send them.
MACHINE = frozenset({"machine_end_beep", "machine_end_silence", "machine_end_other"})
ANSWERED_BY = frozenset({"human", "fax", "unknown", *MACHINE, "machine_start"})


class OutboundRefused(ValueError):
    """A call that cannot be placed as asked (a bad number, no purpose): 400."""


class PlaceCallArgs(BaseModel):
    """The `place_call` operation's arguments."""

    model_config = ConfigDict(extra="forbid")

    to: str
    call_id: str
    purpose: str
    about_operation_id: str | None = None
    # The leg that places it, decided when it was asked for: a SIP placing goes on the queue
    # only processes with a SIP listener take (tools/executor.py SIP_QUEUE). None: a row from
    # before `via` (a `sip:` target, or OUTBOUND_VIA, says).
    via: Literal["twilio", "sip"] | None = None


def _masked(number: str) -> str:
    return number[:2] + "*" * max(0, len(number) - 6) + number[-4:]


def place_call_spec(deadline_s: float = 10.0) -> ToolSpec:
    """The spec of the placing operation (never offered to a model)."""
    return ToolSpec(
        name=PLACE_CALL,
        description="Place an outbound call (asked through the API; never offered to a model).",
        args_model=PlaceCallArgs,
        kind=ToolKind.MUTATION,
        provider_action=f"{PROVIDER}.create",
        provider_idempotent=False,  # a second create is a second call: reconcile, never retry
        needs_confirmation=False,
        deadline_s=deadline_s,
        retry=RetryPolicy(max_attempts=1),
        reconcile=f"{PROVIDER}.list_to",
        describe=lambda a: f"a call to {_masked(a.to)} about {a.purpose}",
        provider_label="the phone network",
    )


def with_place_call(registry: Registry, deadline_s: float = 10.0) -> Registry:
    """`registry` and the placing operation's spec (a new registry; the model's is untouched)."""
    if PLACE_CALL in registry:
        return registry
    return Registry([*registry, place_call_spec(deadline_s)])


def url_key(settings: Settings, call_id: str) -> str:
    """What an outbound call's webhook URLs carry beside its call id: only we make them."""
    mac = hmac.new(settings.stream_secret(), f"outbound:{call_id}".encode(), hashlib.sha256)
    return mac.hexdigest()[:32]


def webhook_url(settings: Settings, path: str, call_id: str) -> str:
    """Our webhook `path` for the outbound call `call_id` (its id and key in the query)."""
    query = urlencode({"call_id": call_id, "k": url_key(settings, call_id)})
    return f"{settings.public_base_url.rstrip('/')}{path}?{query}"


def check_request(to: str, purpose: str, about: str | None) -> tuple[str, str, str | None]:
    """The request's number, purpose and operation, cleaned; OutboundRefused saying what is
    wrong otherwise."""
    to = (to or "").strip().removeprefix("tel:")
    if to.lower().startswith("sip:"):
        if len(to) > MAX_SIP_URI or any(c in to for c in ' \t\r\n<>"') or "@" not in to:
            raise OutboundRefused("'to' must be a SIP URI such as sip:alice@pbx.example")
    elif not E164.match(to):
        raise OutboundRefused(f"'to' must be an E.164 number such as +15551234567, not {to!r:.40}")
    purpose = " ".join((purpose or "").split())
    if not purpose:
        raise OutboundRefused("'purpose' is required: say in a few words what the call is for")
    if len(purpose) > MAX_PURPOSE:
        raise OutboundRefused(f"'purpose' is too long (at most {MAX_PURPOSE} characters)")
    if about is not None:
        try:
            about = str(uuid.UUID(str(about)))
        except ValueError:
            raise OutboundRefused("'operation_id' must be an operation's id (a UUID)") from None
    return to, purpose, about


@dataclass(frozen=True, slots=True)
class OutboundRequest:
    """A requested outbound call: its row and the operation that places it."""

    call_id: str
    operation_id: str
    created: bool
    leg: str = "twilio"  # which leg places it (`outbound_leg`)


async def request_call(
    engine: AsyncEngine,
    settings: Settings,
    enqueue: Enqueue,
    *,
    to: str,
    purpose: str,
    about_operation_id: str | None,
    by: str,
    idempotency_key: str | None = None,
) -> OutboundRequest:
    """The call's row and its `place_call` operation, in one transaction (see the module
    docstring). The same `idempotency_key` again answers the same call, placing nothing."""
    async with engine.begin() as conn:
        return await request_call_in(
            conn,
            settings,
            enqueue,
            to=to,
            purpose=purpose,
            about_operation_id=about_operation_id,
            by=by,
            idempotency_key=idempotency_key,
        )


async def request_call_in(
    conn: AsyncConnection,
    settings: Settings,
    enqueue: Enqueue,
    *,
    to: str,
    purpose: str,
    about_operation_id: str | None,
    by: str,
    idempotency_key: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> OutboundRequest:
    """`request_call` inside the caller's transaction (a callback's delivery moves with it);
    `extra` is kept on the row's `outbound` (a callback's delivery and attempt)."""
    to, purpose, about = check_request(to, purpose, about_operation_id)
    call_id = str(uuid.uuid4())
    key = f"outbound:{idempotency_key or call_id}"[:200]
    if about is not None:
        op = await ledger.get_operation(conn, uuid.UUID(about))
        if op is None or op.tenant_id != settings.tenant_id:
            raise OutboundRefused(f"no operation {about}")
    outbound = {"purpose": purpose, "about_operation_id": about, "by": by[:128], **(extra or {})}
    existing = await ledger.find_by_idempotency_key(conn, settings.tenant_id, key)
    if existing is not None:
        return OutboundRequest(str(existing.args["call_id"]), str(existing.operation_id), False)
    leg = outbound_leg(settings, to)
    await conn.execute(
        pg_insert(calls).values(
            id=uuid.UUID(call_id),
            call_sid=PENDING_SID + call_id,
            tenant_id=settings.tenant_id,
            leg=leg,
            direction="outbound",
            from_number=(
                settings.twilio_from_number
                if leg == "twilio"
                else (settings.sip_outbound_user or "voice-agent")
            ),
            to_number=to,
            status=str(CallStatus.RINGING),
            outbound=outbound,
        )
    )
    args = PlaceCallArgs(
        to=to,
        call_id=call_id,
        purpose=purpose,
        about_operation_id=about,
        via="sip" if leg == "sip" else "twilio",
    )
    admission = await ledger.admit_operation(
        conn,
        tenant_id=settings.tenant_id,
        tool=PLACE_CALL,
        args=args.model_dump(),
        idempotency_key=key,
        key_source="client" if idempotency_key else "derived",
        caller=to,
        actor=by[:128],
        reason="outbound call requested",
        enqueue=enqueue,
    )
    operation_id = str(admission.operation.operation_id)
    await conn.execute(
        sa.update(calls)
        .where(calls.c.id == uuid.UUID(call_id))
        .values(outbound={**outbound, "placing_operation_id": operation_id})
    )
    return OutboundRequest(call_id, operation_id, True, leg)


def outbound_leg(settings: Settings, to: str) -> str:
    """Which leg places a call to `to`: `sip` for a SIP URI or with OUTBOUND_VIA=sip."""
    if to.lower().startswith("sip:") or settings.outbound_via == "sip":
        return "sip"
    return "twilio"


def requested_events(request: OutboundRequest, to: str, purpose: str, by: str) -> list[Any]:
    """The timeline's first events of a requested call: (kind, data) pairs."""
    started = {"direction": "outbound", "to": to, "leg": request.leg, "by": by[:128]}
    requested = {"purpose": purpose, "operation_id": request.operation_id, "by": by[:128]}
    return [(CallEventKind.CALL_STARTED, started), (CallEventKind.OUTBOUND_REQUESTED, requested)]


class TwilioCalls:
    """The `twilio_calls` provider: places outbound calls and finds them again."""

    def __init__(self, settings: Settings, engine: AsyncEngine, client: Any = None) -> None:
        self.settings = settings
        self.engine = engine
        self._own = client is None
        self.client = client or make_twilio_client(
            settings.twilio_account_sid,
            settings.twilio_auth_token.get_secret_value(),
            settings.twilio_api_base_url,
        )

    async def perform(
        self,
        op: OperationRecord,
        spec: ToolSpec,
        *,
        timeout_s: float,
        callback_url: str | None = None,
    ) -> ActionResult:
        args = PlaceCallArgs.model_validate(op.args)
        s = self.settings
        try:
            call = await self.client.calls.create_async(
                to=args.to,
                from_=s.twilio_from_number,
                url=webhook_url(s, "/twilio/outbound-answer", args.call_id),
                method="POST",
                machine_detection="DetectMessageEnd",
                async_amd="true",
                async_amd_status_callback=webhook_url(s, "/twilio/amd", args.call_id),
                async_amd_status_callback_method="POST",
                status_callback=webhook_url(s, "/twilio/status", args.call_id),
                status_callback_method="POST",
                status_callback_event=["initiated", "ringing", "answered", "completed"],
                timeout=int(s.outbound_ring_timeout_s),
            )
        except TwilioRestException as exc:
            if exc.status is not None and (exc.status >= 500 or exc.status == 429):
                # A 5xx may come after Twilio placed the call: only a lookup can tell.
                return ActionResult(Outcome.unknown, error=f"HTTP {exc.status}: {exc.msg}")
            await self._failed(args.call_id, f"refused by Twilio: {exc.msg}"[:128])
            return ActionResult(Outcome.failed_final, error=f"{exc.code}: {exc.msg}"[:300])
        except (aiohttp.ClientError, TimeoutError) as exc:
            return ActionResult(Outcome.unknown, error=f"no answer from Twilio: {exc!r}"[:300])
        if not call.sid:
            return ActionResult(Outcome.unknown, error="Twilio answered without a CallSid")
        await bind_sid(self.engine, args.call_id, call.sid)
        return ActionResult(Outcome.committed, {"call_sid": call.sid}, reference=call.sid)

    async def lookup(self, op: OperationRecord, spec: ToolSpec) -> Finding:
        """The call this operation placed, if Twilio has one: the one bound to our row (its
        answer webhook came), else the one call to that number from ours since the operation
        began that no other row holds. None: it was never placed."""
        args = PlaceCallArgs.model_validate(op.args)
        async with self.engine.connect() as conn:
            sid = await conn.scalar(
                sa.select(calls.c.call_sid).where(calls.c.id == uuid.UUID(args.call_id))
            )
        if sid is not None and not sid.startswith(PENDING_SID):
            return Finding("applied", {"call_sid": sid}, reference=sid)
        since = (op.created_at or datetime.now(UTC)) - timedelta(seconds=LIST_SKEW_S)
        try:
            listed = await self.client.calls.list_async(
                to=args.to, from_=self.settings.twilio_from_number, start_time_after=since
            )
        except (TwilioRestException, aiohttp.ClientError, TimeoutError) as exc:
            raise ToolError(f"cannot list Twilio's calls: {exc!r}"[:300]) from exc
        sids = [c.sid for c in listed if c.sid]
        async with self.engine.connect() as conn:
            taken = set(
                (await conn.scalars(sa.select(calls.c.call_sid).where(calls.c.call_sid.in_(sids))))
                if sids
                else []
            )
        free = [sid for sid in sids if sid not in taken]
        if not free:
            return Finding("not_found")
        found = free[-1]  # Twilio lists newest first: the oldest unclaimed one is ours
        await bind_sid(self.engine, args.call_id, found)
        return Finding("applied", {"call_sid": found, "found_by": "list"}, reference=found)

    async def _failed(self, call_id: str, reason: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                sa.update(calls)
                .where(calls.c.id == uuid.UUID(call_id), calls.c.status == CallStatus.RINGING)
                .values(status=str(CallStatus.FAILED), end_reason=reason, ended_at=sa.func.now())
            )

    async def aclose(self) -> None:
        if self._own:
            from app.ops.twilio_rest import close_twilio_client

            await close_twilio_client(self.client)


async def bind_sid(engine: AsyncEngine | AsyncConnection, call_id: str, call_sid: str) -> bool:
    """Name the outbound call `call_id` by Twilio's CallSid (once; the same sid again is
    fine). False when the row is named otherwise or is not there."""
    stmt = (
        sa.update(calls)
        .where(
            calls.c.id == uuid.UUID(call_id),
            calls.c.direction == "outbound",
            calls.c.call_sid.in_([PENDING_SID + call_id, call_sid]),
        )
        .values(call_sid=call_sid)
        .returning(calls.c.id)
    )
    if isinstance(engine, AsyncConnection):
        return (await engine.execute(stmt)).first() is not None
    async with engine.begin() as conn:
        return (await conn.execute(stmt)).first() is not None


class SipPlacer(Protocol):
    """What places a call over our SIP leg (app/legs/sip_outbound.py, on the SIP listener)."""

    async def place(self, call_id: str, to: str, timeout_s: float) -> ActionResult: ...


class SipCalls:
    """The `place_call` provider over our own SIP leg: the listener of this process places it;
    `lookup` reads what it recorded (see the module docstring)."""

    def __init__(
        self, engine: AsyncEngine, placer: Callable[[], SipPlacer | None] | None = None
    ) -> None:
        self.engine = engine
        self.placer = placer or (lambda: None)

    async def perform(
        self, op: OperationRecord, spec: ToolSpec, *, timeout_s: float
    ) -> ActionResult:
        args = PlaceCallArgs.model_validate(op.args)
        placer = self.placer()
        if placer is None:
            # Only a job on the wrong queue, or one taken while the listener stops, gets here.
            async with self.engine.begin() as conn:
                await fail_unplaced_row(
                    conn, args.call_id, "no SIP listener in this worker's process"
                )
            return ActionResult(
                Outcome.failed_final,
                error="SIP outbound calls are placed by `serve` with SIP_BIND (its in-process "
                "worker); this worker has no SIP listener",
            )
        return await placer.place(args.call_id, args.to, timeout_s)

    async def lookup(self, op: OperationRecord, spec: ToolSpec) -> Finding:
        """Placed if the far side ever answered the INVITE (any 1xx or final recorded on the
        row); not placed otherwise: nothing was heard, so nothing can have rung."""
        args = PlaceCallArgs.model_validate(op.args)
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    sa.select(calls.c.call_sid, calls.c.outbound).where(
                        calls.c.id == uuid.UUID(args.call_id)
                    )
                )
            ).first()
        if row is None:
            return Finding("not_found")
        sid, outbound = row
        status = (outbound or {}).get("sip_status")
        if status and sid and not str(sid).startswith(PENDING_SID):
            return Finding("applied", {"call_sid": sid, "sip_status": status}, reference=sid)
        return Finding("not_found")


async def fail_unplaced_row(conn: AsyncConnection, call_id: str, reason: str) -> None:
    """The row of an outbound call that was never placed: failed, with `reason`."""
    await conn.execute(
        sa.update(calls)
        .where(calls.c.id == uuid.UUID(call_id), calls.c.status == CallStatus.RINGING)
        .values(status=str(CallStatus.FAILED), end_reason=reason[:128], ended_at=sa.func.now())
    )


def sip_queue_wait(wait_s: float) -> QueueWait:
    """How long a SIP placing may wait for a process with a SIP listener to take it: after
    `wait_s` past due nobody did, so nothing was sent: the operation fails (the sweeper,
    conditionally, so a worker that takes it in the same instant wins or loses whole) and the
    call's row says why."""
    reason = f"no replica with a SIP listener took it within {wait_s:g} s"

    async def failed(conn: AsyncConnection, op: OperationRecord) -> None:
        call_id = op.args.get("call_id")
        if op.tool == PLACE_CALL and call_id:
            await fail_unplaced_row(conn, str(call_id), reason)

    return QueueWait(wait_s=wait_s, reason=reason, on_failed=failed)


class OutboundRouter:
    """The worker's provider: `place_call` to Twilio (or over SIP), every other tool to the
    catalog's."""

    def __init__(
        self,
        inner: Provider,
        calls_provider: TwilioCalls,
        sip_calls: SipCalls | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.inner = inner
        self.calls = calls_provider
        self.sip_calls = sip_calls
        self.settings = settings or calls_provider.settings

    def _over_sip(self, op: OperationRecord) -> SipCalls | None:
        to = str(op.args.get("to", ""))
        via = op.args.get("via") or outbound_leg(self.settings, to)
        if to.lower().startswith("sip:"):
            via = "sip"
        if self.sip_calls is not None and via == "sip":
            return self.sip_calls
        return None

    async def perform(
        self,
        op: OperationRecord,
        spec: ToolSpec,
        *,
        timeout_s: float,
        callback_url: str | None = None,
    ) -> ActionResult:
        if spec.name == PLACE_CALL:
            if (sip := self._over_sip(op)) is not None:
                return await sip.perform(op, spec, timeout_s=timeout_s)
            return await self.calls.perform(op, spec, timeout_s=timeout_s)
        return await self.inner.perform(op, spec, timeout_s=timeout_s, callback_url=callback_url)

    async def lookup(self, op: OperationRecord, spec: ToolSpec) -> Finding:
        if spec.name == PLACE_CALL:
            if (sip := self._over_sip(op)) is not None:
                return await sip.lookup(op, spec)
            return await self.calls.lookup(op, spec)
        return await self.inner.lookup(op, spec)

    async def cancel(
        self, op: OperationRecord, spec: ToolSpec, *, timeout_s: float
    ) -> ActionResult:
        cancel = getattr(self.inner, "cancel", None)
        if spec.name == PLACE_CALL or cancel is None:
            return ActionResult(Outcome.failed_final, error="the provider cannot cancel requests")
        result: ActionResult = await cancel(op, spec, timeout_s=timeout_s)
        return result

    async def aclose(self) -> None:
        await self.calls.aclose()


def outbound_worker(
    settings: Settings,
    engine: AsyncEngine,
    registry: Registry,
    provider: Provider,
    sip: Callable[[], SipPlacer | None] | None = None,
) -> tuple[Registry, OutboundRouter]:
    """A worker's registry and provider with outbound calls beside the catalog's tools;
    `sip`: this process's SIP placer, when it has a SIP listener (read when a call is placed:
    the listener starts after the worker)."""
    deadline = settings.outbound_create_timeout_s
    return with_place_call(registry, deadline), OutboundRouter(
        provider, TwilioCalls(settings, engine), SipCalls(engine, sip), settings
    )


async def note_on_placing(
    conn: AsyncConnection, outbound: Mapping[str, Any] | None, reason: str, data: dict[str, Any]
) -> None:
    """Record what became of the call on its placing operation (no status change)."""
    op_id = (outbound or {}).get("placing_operation_id")
    if not op_id:
        return
    await ledger.record_event(
        conn, uuid.UUID(str(op_id)), kind="note", actor="twilio", reason=reason, data=data
    )


def callback_scheduler(settings: Settings, jobs: Any) -> CallbackScheduler:
    """`schedule_callback`'s way to arrange a call back: an outbound call to the caller's number
    (`request_call_in`, in the tool call's transaction) whose `place_call` job waits until
    `at` (moved out of QUIET_HOURS), keyed by the tool call so a retry arranges one call."""
    from tools.executor import enqueue_operation
    from tools.quiet_hours import QuietHours

    quiet = (
        QuietHours.parse(settings.quiet_hours, settings.quiet_hours_tz)
        if settings.quiet_hours
        else None
    )

    async def schedule(
        conn: AsyncConnection, ctx: Any, purpose: str, at: datetime, key: str
    ) -> ScheduledCallback:
        due = (quiet.end_if_quiet(at) if quiet is not None else None) or at

        async def enqueue_then(conn: AsyncConnection, operation_id: uuid.UUID) -> None:
            await enqueue_operation(jobs, conn, operation_id, schedule_at=due)

        placed = await request_call_in(
            conn,
            settings,
            enqueue_then,
            to=str(ctx.from_number),
            purpose=purpose,
            about_operation_id=None,
            by="agent (call back asked for in the call)",
            idempotency_key=f"callback-asked:{key}",
            extra={"asked_in_call": ctx.call_id, "due_at": due.isoformat()},
        )
        return ScheduledCallback(placed.call_id, placed.operation_id, due)

    return schedule
