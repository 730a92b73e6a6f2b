"""Outbound calls over our own SIP leg: the `place_call` operation's INVITE, and the answered
call's agent (the same bridge as an inbound SIP call, with the outbound purpose).

`SipOutbound.place` (the worker's `SipCalls`, in the process of the SIP listener):

1. an RTP port and our offer; the INVITE (telephony/legs/sip/uac.py) to `to` (a `sip:` URI, or
   `sip:+E164@<SIP_OUTBOUND_PROXY host>`), through SIP_OUTBOUND_PROXY when set, with
   SIP_OUTBOUND_USER / SIP_OUTBOUND_PASSWORD for one digest challenge;
2. the row is named by the INVITE's Call-ID; every response to the INVITE is recorded on it
   (`outbound.sip_status`): what the reconciler reads if the placing's answer is lost;
3. the operation is committed once the far side answered the INVITE at all (unknown when
   nothing came by its deadline: the call goes on, and the reconciler decides);
4. the call runs in its own task: answered -> the bridge, silent until the line opens with the
   purpose and the operation's facts (app/legs/twilio/outbound.py's OutboundLine); busy (486,
   600, 603), no answer (480, 408, the ring timeout's 487) or failed -> the row, the timeline
   and the placing operation, as Twilio's status callback records them.

Who answered is judged from the callee's first audio (telephony/amd.py, SIP_AMD, on by
default): a person is greeted with the purpose as soon as their "Hello?" ends, a machine gets
the short voicemail message once its greeting ended (the beep, or its silence), as Twilio's
`AnsweredBy` values, so the same OutboundLine acts on both legs. SIP_AMD=false takes whoever
answers for a person.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import sqlalchemy as sa
from aiosipua import SipDigestAuth

from app.calls import store as call_store
from app.calls.store import CallStatus, calls
from app.legs.session import CallSession
from app.legs.twilio.outbound import OutboundLine, unanswered
from app.ops.outbound import bind_sid
from app.runtime import Runtime
from app.settings import host_port
from telephony import audio
from telephony.amd import LineListener, Verdict
from telephony.call_events import CallEvent, CallEventKind
from telephony.legs.sip.access import AllowList
from telephony.legs.sip.dialog import CallKey
from telephony.legs.sip.errors import RtpPortsExhausted
from telephony.legs.sip.leg import SipLeg
from telephony.legs.sip.ports import RtpPorts
from telephony.legs.sip.rtp import MediaPolicy, MediaStats, RtpClock
from telephony.legs.sip.sdp import PCMU, PTIME_MS, LocalMedia
from telephony.legs.sip.transport import SipTransport
from telephony.legs.sip.uac import (
    OutgoingAnswered,
    OutgoingFailed,
    OutgoingProgress,
    next_hop,
    outcome_of,
    target_uri,
)
from telephony.legs.sip.uas import (
    CallEnded,
    DtmfReceived,
    MediaUpdated,
    SipEvent,
    UserAgentServer,
)
from tools.provider import ActionResult, Outcome


class SipListener(Protocol):
    """What an outgoing call needs of the SIP listener (app/legs/sip.py's SipService)."""

    runtime: Runtime
    core: UserAgentServer
    transport: SipTransport
    clock: RtpClock
    ports: RtpPorts
    media_allow: AllowList | None
    media_stats: MediaStats
    advertised: str
    bind_host: str

    def hang_up(self, key: CallKey, reason: str) -> None: ...

    async def bind_rtcp(self, leg: SipLeg, rtp_port: int) -> asyncio.DatagramTransport | None: ...


log = logging.getLogger(__name__)

# A SIP final status as the row and the timeline name it (Twilio's words, for one vocabulary).
ROW_STATUS = {
    "busy": (CallStatus.BUSY, "busy"),
    "declined": (CallStatus.BUSY, "busy"),
    "no_answer": (CallStatus.NO_ANSWER, "no-answer"),
    "failed": (CallStatus.FAILED, "failed"),
}


@dataclass(eq=False)
class _Outgoing:
    """One outgoing call from its INVITE until it is over in this process."""

    call_id: str
    heard: asyncio.Event = field(default_factory=asyncio.Event)  # any response to the INVITE
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # answered or failed
    answered: OutgoingAnswered | None = None
    failed: OutgoingFailed | None = None
    first_status: int = 0
    leg: SipLeg | None = None
    recorded: set[int] = field(default_factory=set)


@dataclass(eq=False)
class BareLeg:
    """An outgoing SIP call that is no call of its own (no row, no registry entry, no slot):
    a warm transfer's person. Its dialog's life as the core reports it."""

    key: CallKey
    leg: SipLeg
    rtp_port: int
    rtcp: Any
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # answered, failed or over
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # failed or over (a BYE)
    answered: OutgoingAnswered | None = None
    failed: OutgoingFailed | None = None
    end_reason: str = ""
    hung_up: bool = False  # by us: CANCEL or BYE sent
    released: bool = False


class SipOutbound:
    """Places outbound calls on a SipService's listener (the `SipPlacer` of app/ops)."""

    def __init__(self, service: SipListener) -> None:
        self.service = service
        self.runtime = service.runtime
        self._calls: dict[CallKey, _Outgoing] = {}
        self._bare: dict[CallKey, BareLeg] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def handles(self, key: CallKey) -> bool:
        return key in self._calls or key in self._bare

    # ---- placing ------------------------------------------------------------------------

    async def place(self, call_id: str, to: str, timeout_s: float) -> ActionResult:
        """Send the INVITE and wait (at most `timeout_s`) for the far side to answer it."""
        service = self.service
        settings = self.runtime.settings
        proxy = host_port(settings.sip_outbound_proxy, "") if settings.sip_outbound_proxy else None
        try:
            uri = target_uri(to, proxy[0] if proxy else None)
        except ValueError as exc:
            await self._fail_row(call_id, f"cannot call {to[:40]!r}: {exc}"[:128])
            return ActionResult(Outcome.failed_final, error=str(exc)[:300])
        row = await call_store.get_call(self.runtime.engine, call_id)
        if row is None or row.status != CallStatus.RINGING:
            return ActionResult(Outcome.failed_final, error="the call ended before it was placed")
        out = _Outgoing(call_id)
        holder: list[CallKey] = []

        def hang_up(reason: str) -> None:
            if holder:
                service.hang_up(holder[0], reason)

        try:
            leg, rtp_port, rtcp = await self._media(call_id, proxy or next_hop(uri), hang_up)
        except RtpPortsExhausted:
            await self._fail_row(call_id, "no RTP port free")
            return ActionResult(Outcome.failed_retryable, error="no RTP port free")
        out.leg = leg
        key = self._invite(uri, rtp_port, proxy, float(settings.outbound_ring_timeout_s))
        holder.append(key)
        self._calls[key] = out
        task = asyncio.create_task(
            self._run(key, out, leg, rtp_port, rtcp), name=f"sip-outbound-{call_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # The row is named by the Call-ID before anything can be recorded under it.
        await bind_sid(self.runtime.engine, call_id, key.call_id)
        try:
            async with asyncio.timeout(timeout_s):
                await out.heard.wait()
        except TimeoutError:
            return ActionResult(Outcome.unknown, error="no response to the INVITE yet")
        return ActionResult(
            Outcome.committed,
            {"call_sid": key.call_id, "sip_status": out.first_status},
            reference=key.call_id,
        )

    # ---- the parts of an outgoing call ----------------------------------------------------

    async def _media(
        self, name: str, signalling: tuple[str, int], hang_up: Callable[[str], None]
    ) -> tuple[SipLeg, int, Any]:
        """The RTP leg of an outgoing call, on a port of ours (RtpPortsExhausted: none free)."""
        service = self.service
        settings = self.runtime.settings
        leg = SipLeg(
            name, PCMU, 101, service.clock, hang_up,
            policy=MediaPolicy(signalling_host=signalling[0], allow=service.media_allow,
                               learn_s=settings.sip_rtp_learn_s,
                               probation=settings.sip_rtp_probation),
            stats=service.media_stats, ptime_ms=PTIME_MS,
        )  # fmt: skip
        _, _, rtp_port, rtp_sock = await service.ports.bind(service.bind_host, lambda: leg.rtp)
        leg.rtp.use_socket(rtp_sock)
        rtcp = await service.bind_rtcp(leg, rtp_port)
        return leg, rtp_port, rtcp

    def _invite(
        self, uri: str, rtp_port: int, proxy: tuple[str, int] | None, ring_timeout_s: float
    ) -> CallKey:
        """Our INVITE to `uri` (through `proxy`, with the outbound digest credentials)."""
        service = self.service
        settings = self.runtime.settings
        local = LocalMedia(service.advertised, rtp_port, random.randint(1, 2**31))
        credentials = None
        if settings.sip_outbound_user and settings.sip_outbound_password is not None:
            credentials = SipDigestAuth(
                settings.sip_outbound_user, settings.sip_outbound_password.get_secret_value()
            )
        key: CallKey = service.transport.act(
            lambda now: service.core.invite(
                uri,
                local,
                now,
                proxy=proxy,
                from_user=settings.sip_outbound_user or "voice-agent",
                credentials=credentials,
                ring_timeout_s=ring_timeout_s,
            )
        )
        return key

    # ---- a leg that is not a call of its own (a warm transfer's person) ------------------

    async def dial_leg(self, name: str, to: str, ring_timeout_s: float) -> BareLeg:
        """INVITE `to` as `place` does (proxy, digest, our RTP port) for a leg with no row of
        its own; its answer, failure and end come on the returned BareLeg. ValueError: `to`
        cannot be called; RtpPortsExhausted: no RTP port free."""
        service = self.service
        settings = self.runtime.settings
        proxy = host_port(settings.sip_outbound_proxy, "") if settings.sip_outbound_proxy else None
        uri = target_uri(to, proxy[0] if proxy else None)
        holder: list[BareLeg] = []

        def hang_up(reason: str) -> None:
            if holder and not holder[0].hung_up:
                holder[0].hung_up = True
                service.hang_up(holder[0].key, reason)

        leg, rtp_port, rtcp = await self._media(name, proxy or next_hop(uri), hang_up)
        key = self._invite(uri, rtp_port, proxy, ring_timeout_s)
        bare = BareLeg(key, leg, rtp_port, rtcp)
        holder.append(bare)
        self._bare[key] = bare
        return bare

    def release_leg(self, bare: BareLeg, reason: str) -> None:
        """Hang up the leg (CANCEL while it rings, BYE once up: nothing if over already) and
        give its ports back."""
        if not bare.ended.is_set() and not bare.hung_up:
            bare.hung_up = True
            self.service.hang_up(bare.key, reason)
        self._bare.pop(bare.key, None)
        bare.leg.rtp.close()
        if bare.rtcp is not None:
            bare.rtcp.close()
        if not bare.released:
            bare.released = True
            self.service.ports.release(bare.rtp_port)

    def _on_bare(self, bare: BareLeg, event: SipEvent) -> None:
        match event:
            case OutgoingAnswered():
                bare.answered = event
                bare.settled.set()
            case OutgoingFailed():
                bare.failed = event
                bare.settled.set()
                bare.ended.set()
            case CallEnded():
                bare.end_reason = event.reason
                bare.ended.set()
                bare.settled.set()
                bare.leg.remote_ended(event.reason)
            case MediaUpdated():
                bare.leg.media_updated(event.remote, event.direction)
            case _:
                pass

    # ---- events from the core -----------------------------------------------------------

    def on_event(self, event: SipEvent) -> None:
        bare = self._bare.get(event.key)
        if bare is not None:
            self._on_bare(bare, event)
            return
        out = self._calls.get(event.key)
        if out is None:
            return
        match event:
            case OutgoingProgress():
                self._heard(out, event.status)
            case OutgoingAnswered():
                out.answered = event
                self._heard(out, 200)
                out.settled.set()
            case OutgoingFailed():
                out.failed = event
                self._heard(out, event.status)
                out.settled.set()
            case CallEnded() if out.leg is not None:
                out.leg.remote_ended(event.reason)
            case MediaUpdated() if out.leg is not None:
                out.leg.media_updated(event.remote, event.direction)
            case DtmfReceived() if out.leg is not None:
                out.leg.digit(event.digit)
            case _:
                pass

    def _heard(self, out: _Outgoing, status: int) -> None:
        if not out.first_status:
            out.first_status = status
        out.heard.set()
        if status not in out.recorded:
            out.recorded.add(status)
            self._spawn(self._record_status(out.call_id, status))

    async def _record_status(self, call_id: str, status: int) -> None:
        """What the far side said, on the row: the reconciler's evidence that it was placed."""
        try:
            async with self.runtime.engine.begin() as conn:
                await conn.execute(
                    sa.update(calls)
                    .where(calls.c.id == uuid.UUID(call_id))
                    .values(
                        outbound=calls.c.outbound.op("||")(
                            sa.func.jsonb_build_object("sip_status", status)
                        )
                    )
                )
        except Exception:
            log.exception("call %s: could not record SIP status %d", call_id, status)

    # ---- one call -----------------------------------------------------------------------

    async def _run(
        self, key: CallKey, out: _Outgoing, leg: SipLeg, rtp_port: int, rtcp: Any
    ) -> None:
        service = self.service
        try:
            await out.settled.wait()
            if out.answered is not None:
                await self._answered(key, out, out.answered, leg, rtp_port)
            elif out.failed is not None:
                await self._unanswered(out.call_id, out.failed)
        except Exception:
            log.exception("SIP outbound call %s failed", out.call_id)
            with contextlib.suppress(Exception):
                service.hang_up(key, "internal error")
        finally:
            self._calls.pop(key, None)
            leg.rtp.close()
            if rtcp is not None:
                rtcp.close()
            service.ports.release(rtp_port)

    async def _unanswered(self, call_id: str, failed: OutgoingFailed) -> None:
        runtime = self.runtime
        status, said = ROW_STATUS[
            "no_answer" if outcome_of(failed.status) == "answered" else outcome_of(failed.status)
        ]
        reason = f"sip {failed.status}: {failed.reason}"[:128]
        ended = await call_store.transition(runtime.engine, call_id, status, end_reason=reason)
        if ended is None:
            return
        await unanswered(runtime, ended, said)
        runtime.events.emit(
            CallEvent(
                call_id,
                CallEventKind.CALL_ENDED,
                call_store.call_ended_data(reason, call_store.EndSource.CALL),
            )
        )

    async def _answered(
        self, key: CallKey, out: _Outgoing, answered: OutgoingAnswered, leg: SipLeg, rtp_port: int
    ) -> None:
        runtime = self.runtime
        call_id = out.call_id
        row = await call_store.get_call(runtime.engine, call_id)
        if row is None or row.status != CallStatus.RINGING:
            self.service.hang_up(key, "the call ended before it was answered")
            return
        if not runtime.registry.try_reserve(key.call_id):
            self.service.hang_up(key, "no capacity when answered")
            await call_store.transition(
                runtime.engine, call_id, CallStatus.FAILED, end_reason="no capacity when answered"
            )
            return
        runtime.events.emit(
            CallEvent(call_id, CallEventKind.OUTBOUND_ANSWERED, {"call_sid": key.call_id})
        )
        session = CallSession.of_row(runtime, row)
        # Silent and deaf until the line opens with the purpose (as on Twilio).
        config = dataclasses.replace(runtime.bridge_config, greeting=False, listen_at_start=False)
        bridge = session.build_bridge(leg, config=config)
        leg.answered(answered.remote, answered.direction)
        started = time.monotonic()
        run = asyncio.create_task(bridge.run(), name=f"sip-outbound-bridge-{call_id}")
        status = CallStatus.FAILED
        try:
            stream = {
                "codec": PCMU.name,
                "encoding": PCMU.audio_format,
                "sample_rate": 8000,
                "rtp_port": rtp_port,
                "remote": ":".join(map(str, answered.remote.address or ("", 0))),
                "direction": "outbound",
            }
            if await session.go_live(stream):
                status = CallStatus.COMPLETED
                line = OutboundLine(runtime, session, bridge)
                if session.entry is not None:
                    session.entry.outbound = line
                if runtime.settings.sip_amd:
                    verdict = await who_answered(leg, run)
                    if verdict is not None:
                        await line.answered_by(
                            verdict.answered_by,
                            detail={"at_ms": verdict.at_ms, "reason": verdict.reason},
                        )
                else:
                    await line.answered_by("human", detected=False)
            else:
                await bridge.end("ended elsewhere")
            await run
            log.debug("SIP outbound call %s ran %.1f s", call_id, time.monotonic() - started)
        finally:
            if not run.done():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
            await session.end(status)

    async def _fail_row(self, call_id: str, reason: str) -> None:
        await call_store.transition(
            self.runtime.engine, call_id, CallStatus.FAILED, end_reason=reason
        )

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Hang up what is still ringing or up, and wait for the calls' tasks."""
        for key in list(self._calls) + list(self._bare):
            self.service.hang_up(key, "server shutdown")
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10.0)
        for task in list(self._tasks):
            task.cancel()


async def who_answered(
    leg: SipLeg, ended: asyncio.Future[Any], *, message_end: bool = True
) -> Verdict | None:
    """The answering-machine detector's verdict on the audio of an answered leg (a callee, a
    warm transfer's person); None if `ended` (the call's end) came first. `message_end`: a
    machine's verdict once its greeting ended, else as soon as it is known."""
    listener = LineListener(message_end=message_end)
    codec: audio.Codec = "pcma" if leg.codec.name == "PCMA" else "pcmu"
    leg.listener = lambda data: listener.hear(audio.decode(data, codec))
    waiting = asyncio.create_task(listener.verdict(), name=f"amd-{leg.call_id}")
    try:
        await asyncio.wait({waiting, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leg.listener = None
        if not waiting.done():
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
    return waiting.result() if not waiting.cancelled() else None
