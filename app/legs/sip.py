"""SIP calls in this process: the listener on SIP_BIND, and each call's row, bridge and RTP leg.

An INVITE that passed the core's checks rings at once; the call gets its `calls` row (leg
`sip`, the whole Call-ID), an RTP port and a bridge, and is answered with 200 as soon as the
Realtime session is up, or refused with 503 when it cannot open within SIP_ANSWER_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy.exc import DataError, DBAPIError

from app.calls.store import CallStatus
from app.legs.session import Admission, Caller, CallSession, EndReason, sip_refusal
from app.legs.sip_outbound import SipOutbound
from app.legs.sip_transfer import ReferPort, SipTransfer, put_through
from app.legs.sip_warm import warm_through
from app.models import LegKind
from app.runtime import Runtime
from app.settings import Settings, host_port
from telephony.bridge import Bridge
from telephony.call_events import CallEvent, CallEventKind
from telephony.legs.sip import udp_send
from telephony.legs.sip.access import DEFAULT_ALLOW_FROM, AllowList, parse_networks
from telephony.legs.sip.dialog import CallKey
from telephony.legs.sip.digest import DigestAuth, parse_users
from telephony.legs.sip.errors import RtpPortsExhausted
from telephony.legs.sip.leg import SipLeg
from telephony.legs.sip.pacer import PacerClock
from telephony.legs.sip.ports import RtpPorts
from telephony.legs.sip.rtp import MediaPolicy, MediaStats, RtcpSocket, RtpClock
from telephony.legs.sip.sdp import ANSWER_DIRECTION, PTIME_MS, LocalMedia
from telephony.legs.sip.timers import TimerConfig
from telephony.legs.sip.transport import SipTransport
from telephony.legs.sip.uas import (
    CallCancelled,
    CallEnded,
    DtmfReceived,
    IncomingCall,
    MediaUpdated,
    ReferAnswered,
    ReferNotified,
    SipEvent,
    UasConfig,
    UserAgentServer,
)
from telephony.tool_gateway import TransferOutcome, TransferRequest

log = logging.getLogger(__name__)

RTP_SWITCH_INTERVAL_S = 0.001


def parse_bind(spec: str) -> tuple[str, int]:
    """`127.0.0.1:5060`, `[::1]:5060`, `0.0.0.0:0` -> (host, port)."""
    spec = spec.strip()
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = spec.rpartition(":")
    if not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError(f"SIP_BIND: {spec!r} is not host:port")
    return host, int(port_text)


def _outward_address() -> str:
    """The address this host uses to reach others (no packet is sent), for a wildcard bind."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the routing table is consulted
        return str(s.getsockname()[0])
    return "127.0.0.1"


@dataclass(eq=False)
class _Pending:
    """One call from its INVITE until it is over in this process."""

    incoming: IncomingCall
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    leg: SipLeg | None = None
    bridge: Bridge | None = None
    cancel_reason: str = ""
    transfer: SipTransfer | None = None  # a REFER whose outcome the agent waits for
    warm: bool = False  # a warm transfer is calling or briefing the person


class SipService:
    """The SIP listener and every SIP call of this process."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        settings = runtime.settings
        assert settings.sip_bind is not None
        self.bind_host, bind_port = parse_bind(settings.sip_bind)
        self.advertised = settings.sip_advertised_address or self.bind_host
        if ipaddress.ip_address(self.advertised).is_unspecified:
            self.advertised = _outward_address()
            log.warning(
                "SIP_BIND is a wildcard and SIP_ADVERTISED_ADDRESS is unset: advertising %s "
                "in SDP and Contact",
                self.advertised,
            )
        self.max_calls = (
            settings.sip_max_calls
            if settings.sip_max_calls is not None
            else settings.max_live_calls
        )
        self.core = UserAgentServer(self._config(settings, bind_port), digest=_digest(settings))
        # Draining: OPTIONS gets 503 (INVITEs get theirs from admission), so a dispatcher
        # stops sending calls here.
        runtime.registry.on_drain(self.core.stop_accepting)
        # Overloaded (BUSY_LOOP_LAG_MS): OPTIONS get 503 too while it lasts, so a dispatcher
        # sends new calls to another replica (INVITEs get 486 from admission meanwhile).
        registry = runtime.registry
        self.core.busy = lambda: registry.overloaded() is not None
        self.transport = SipTransport(
            self.core,
            self.bind_host,
            bind_port,
            self._on_event,
            max_per_source=settings.sip_tcp_max_per_source,
            idle_s=settings.sip_tcp_idle_s,
        )
        self.ports = RtpPorts(settings.sip_rtp_ports)
        self.clock = PacerClock() if settings.sip_pacer == "process" else RtpClock()
        self.media_stats = MediaStats()
        media_allow = settings.sip_media_allow_from
        self.media_allow = (
            AllowList(parse_networks(media_allow, "SIP_MEDIA_ALLOW_FROM")) if media_allow else None
        )
        self._calls: dict[CallKey, _Pending] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._switch_interval = sys.getswitchinterval()
        # Outbound calls over this listener (the worker's `place_call` over SIP).
        self.outbound = SipOutbound(self)

    def _config(self, settings: Settings, port: int) -> UasConfig:
        if settings.sip_allow_from is None:
            log.warning(
                "SIP_ALLOW_FROM is unset: only loopback may send SIP. List your trunk's "
                "signalling ranges (CIDRs) in SIP_ALLOW_FROM to take calls from it."
            )
        trusted = parse_networks(settings.sip_trusted_proxies or "", "SIP_TRUSTED_PROXIES")
        if trusted:
            log.info(
                "SIP_TRUSTED_PROXIES: requests from %s count against the source in the Via "
                "below the proxy's own",
                ", ".join(str(n) for n in trusted),
            )
        return UasConfig(
            host=self.advertised,
            port=port,
            timers=TimerConfig(t1=settings.sip_t1_s),
            allow=AllowList.from_spec(_allow_spec(settings)),
            rate_per_source=settings.sip_rate_per_source,
            trusted_proxies=AllowList(trusted),
            max_calls=self.max_calls,
        )

    async def start(self) -> tuple[str, int]:
        # The RTP clock thread needs the GIL for a few microseconds every 20 ms; by default a
        # busy event loop hands it over only every 5 ms. 1 ms keeps ticks on time.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, RTP_SWITCH_INTERVAL_S))
        log.info(
            "RTP sends %s the GIL (telephony/legs/sip/udp_send.py)",
            "keep" if udp_send.KEEPS_GIL else "give up (not Linux or no libc)",
        )
        if isinstance(self.clock, PacerClock):
            self.clock.start_process()
        host, port = await self.transport.start()
        if port != self.core.config.port:
            # SIP_BIND port 0 (tests): Via and Contact must name the port we got.
            self.core.config = replace(self.core.config, port=port)
        return host, port

    @property
    def port(self) -> int:
        return self.transport.port

    async def stop(self) -> None:
        """End what is still here (BYE) and close the listener."""
        for pending in list(self._calls.values()):
            if pending.bridge is not None:
                with contextlib.suppress(Exception):
                    await pending.bridge.end(EndReason.SHUTDOWN)
            else:
                pending.cancel_reason = EndReason.SHUTDOWN
                pending.cancelled.set()
        await self.outbound.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10.0)
        for task in self._tasks:
            task.cancel()
        await self.transport.stop()
        if isinstance(self.clock, PacerClock):
            await asyncio.to_thread(self.clock.close)
        sys.setswitchinterval(self._switch_interval)

    def live_calls(self) -> int:
        return len(self._calls)

    # ---- events from the core -----------------------------------------------------------

    def _on_event(self, event: SipEvent) -> None:
        if self.outbound.handles(event.key):
            self.outbound.on_event(event)
            return
        if isinstance(event, IncomingCall):
            self.transport.act(lambda now: self.core.ring(event.key, now))
            pending = _Pending(event)
            self._calls[event.key] = pending
            task = asyncio.create_task(self._run_call(pending), name="sip-call")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        known = self._calls.get(event.key)
        if known is None:
            return
        leg = known.leg
        transfer = known.transfer
        match event:
            case ReferAnswered() if transfer is not None:
                transfer.on_answered(event.status)
                return
            case ReferNotified() if transfer is not None:
                transfer.on_notified(event.status, event.reason, event.final)
                return
            case CallCancelled() | CallEnded() if transfer is not None:
                transfer.on_ended(event.reason)
        match event:
            case CallCancelled():
                known.cancel_reason = event.reason
                known.cancelled.set()
                if leg is not None:
                    leg.remote_ended(f"caller {event.reason}")
            case CallEnded() if leg is not None:
                leg.remote_ended(event.reason)
            case MediaUpdated() if leg is not None:
                leg.media_updated(event.remote, event.direction)
            case DtmfReceived() if leg is not None:
                leg.digit(event.digit)
            case _:
                pass  # CallConfirmed, or an event for a call whose leg is not up yet

    # ---- one call -----------------------------------------------------------------------

    def _reject(self, key: CallKey, status: int, retry_after: int | None = None) -> None:
        self.transport.act(lambda now: self.core.reject(key, status, now, retry_after=retry_after))

    async def _run_call(self, pending: _Pending) -> None:
        incoming = pending.incoming
        call_sid = incoming.key.call_id  # the whole SIP Call-ID
        session = CallSession(
            self.runtime, LegKind.SIP, Caller(call_sid, incoming.from_user, incoming.to_user)
        )
        try:
            await self._call(pending, session)
        except Exception:
            log.exception("SIP call %s failed", call_sid[:64])
            key = incoming.key
            self._reject(key, 500)
            with contextlib.suppress(Exception):
                self.transport.act(lambda now: self.core.hangup(key, now, "internal error"))
        finally:
            self._calls.pop(incoming.key, None)
            # Every way out ends an admitted call here (once: the usual ways ended it already).
            await session.end(CallStatus.FAILED, EndReason.INTERNAL_ERROR)

    async def _call(self, pending: _Pending, session: CallSession) -> None:
        incoming = pending.incoming
        key = incoming.key
        try:
            admission = await session.admit({"transport": incoming.source.transport})
        except DataError:
            self._reject(key, 400)
            return
        except DBAPIError:
            log.exception("could not record SIP call %s", key.call_id[:64])
            self._reject(key, 503, retry_after=5)
            return
        if admission in (Admission.BUSY, Admission.DRAINING):
            # Stopping: 503 with Retry-After sends the caller's proxy to another server;
            # full: 486 Busy Here, as a busy line.
            code = sip_refusal(admission)
            self._reject(key, code, retry_after=5 if code == 503 else None)
            log.warning("%s: SIP call %s gets %d", admission, key.call_id[:64], code)
            return
        if admission is not Admission.ADMITTED:
            # The same Call-ID again with another From tag: a forked or replayed INVITE.
            self._reject(key, 482)
            return
        call_id = session.call_id
        if pending.cancelled.is_set():
            await session.end(CallStatus.CANCELED, pending.cancel_reason or EndReason.CANCELLED)
            return
        dtmf_pt = incoming.remote.dtmf_pt if incoming.remote else 101
        leg = SipLeg(key.call_id, incoming.codec, dtmf_pt, self.clock,
                     lambda reason: self._hang_up(key, reason),
                     policy=self._media_policy(incoming), stats=self.media_stats,
                     on_foreign=lambda source: self._foreign_media(call_id, source),
                     ptime_ms=incoming.remote.ptime if incoming.remote else PTIME_MS)  # fmt: skip
        try:
            _, _, rtp_port, rtp_sock = await self.ports.bind(self.bind_host, lambda: leg.rtp)
            leg.rtp.use_socket(rtp_sock)
        except RtpPortsExhausted:
            log.warning("no RTP port free for SIP call %s", key.call_id[:64])
            self._reject(key, 503, retry_after=5)
            await session.end(CallStatus.FAILED, EndReason.NO_RTP_PORT)
            return
        rtcp = await self._bind_rtcp(leg, rtp_port)
        try:
            await self._bridge(pending, session, leg, rtp_port)
        finally:
            leg.rtp.close()
            if rtcp is not None:
                rtcp.close()
            self.ports.release(rtp_port)

    async def _bind_rtcp(self, leg: SipLeg, rtp_port: int) -> asyncio.DatagramTransport | None:
        """The RTCP socket on the port above RTP (RTP ports are even, the odd one above is
        RTCP's); None when it is taken (RTCP then goes only where the peer multiplexes it)."""
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((self.bind_host, rtp_port + 1))
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            transport, _ = await loop.create_datagram_endpoint(
                lambda: RtcpSocket(leg.rtp), sock=sock
            )
        except OSError as exc:
            sock.close()
            log.info("RTCP port %d not available: %s", rtp_port + 1, exc.strerror)
            return None
        leg.rtp.use_rtcp_socket(sock)
        return transport

    async def _bridge(
        self, pending: _Pending, session: CallSession, leg: SipLeg, rtp_port: int
    ) -> None:
        runtime = self.runtime
        incoming = pending.incoming
        key = incoming.key
        pending.leg = leg
        if pending.cancelled.is_set():
            leg.remote_ended(pending.cancel_reason)
        sink = session.sink

        async def transfer(request: TransferRequest) -> TransferOutcome:
            return await self._transfer(pending, session, request)

        # Warm transfers call the person from this listener (app/legs/sip_warm.py).
        bridge = session.build_bridge(leg, transfer=transfer, warm_transfer=True)
        pending.bridge = bridge
        started = time.monotonic()
        run = asyncio.create_task(bridge.run(), name=f"sip-bridge-{session.call_id}")
        status = CallStatus.FAILED
        try:
            outcome = await _first(
                {
                    "connected": sink.connected.wait(),
                    "failed": sink.failed.wait(),
                    "cancelled": pending.cancelled.wait(),
                },
                runtime.settings.sip_answer_timeout_s,
            )
            answered = False
            if outcome == "connected" and not pending.cancelled.is_set():
                local = LocalMedia(self.advertised, rtp_port, random.randint(1, 2**31))
                answered = bool(self.transport.act(lambda now: self.core.answer(key, local, now)))
            if answered:
                remote = incoming.remote
                direction = ANSWER_DIRECTION[remote.direction] if remote else "sendrecv"
                leg.answered(remote, direction)
                # Until here the call was in set-up for the heartbeat (its row ringing).
                stream = {
                    "codec": incoming.codec.name,
                    "encoding": incoming.codec.audio_format,
                    "sample_rate": 8000,
                    "rtp_port": rtp_port,
                    "dtmf_payload_type": remote.dtmf_pt if remote else None,
                    "answer_ms": round((time.monotonic() - started) * 1000),
                }
                if await session.go_live(stream):
                    status = CallStatus.COMPLETED
                else:
                    # Ended elsewhere (staff, a sweep) while it was being answered.
                    await bridge.end(EndReason.ENDED_ELSEWHERE)
            elif pending.cancelled.is_set() or outcome == "cancelled":
                status = CallStatus.CANCELED
                await bridge.end(f"caller {pending.cancel_reason or EndReason.CANCELLED}")
            else:
                why = (
                    EndReason.REALTIME_FAILED if outcome == "failed" else EndReason.REALTIME_TIMEOUT
                )
                self._reject(key, 503, retry_after=random.randint(5, 15))
                await bridge.end(why)
            await run
        finally:
            if not run.done():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
            await session.end(status)

    def _media_policy(self, incoming: IncomingCall) -> MediaPolicy:
        settings = self.runtime.settings
        return MediaPolicy(
            signalling_host=incoming.source.remote[0],
            allow=self.media_allow,
            learn_s=settings.sip_rtp_learn_s,
            probation=settings.sip_rtp_probation,
        )

    def _foreign_media(self, call_id: str, source: tuple[str, int]) -> None:
        """RTP from a source the signalling did not name reached a call (once a call)."""
        self.runtime.events.emit(
            CallEvent(
                call_id, CallEventKind.FOREIGN_MEDIA_DROPPED, {"source": f"{source[0]}:{source[1]}"}
            )
        )
        log.warning("call %s: RTP from %s:%s dropped (not the signalled media source)",
                    call_id, source[0], source[1])  # fmt: skip

    async def _transfer(
        self, pending: _Pending, session: CallSession, request: TransferRequest
    ) -> TransferOutcome:
        """`transfer_call` on this call: REFER, and its outcome (app/legs/sip_transfer.py);
        a warm one calls and briefs the person first (app/legs/sip_warm.py)."""
        if pending.transfer is not None or pending.warm:
            return TransferOutcome(False, "failed", "a transfer of this call is under way")
        if request.mode == "warm":

            async def refer(
                replacing: CallKey, joined: Callable[[], Awaitable[None]]
            ) -> TransferOutcome:
                return await self._refer(pending, session, request, replacing, joined)

            pending.warm = True
            try:
                return await warm_through(self.runtime, session, request, self.outbound, refer)
            finally:
                pending.warm = False
        return await self._refer(pending, session, request, None)

    async def _refer(
        self,
        pending: _Pending,
        session: CallSession,
        request: TransferRequest,
        replacing: CallKey | None,
        joined: Callable[[], Awaitable[None]] | None = None,
    ) -> TransferOutcome:
        """The REFER of this call to `request`'s target, or (`replacing`) to the person of a
        warm transfer in place of our dialog with them; its outcome."""
        key = pending.incoming.key
        domain = self.runtime.settings.sip_transfer_domain

        def send(destination: str) -> bool:
            return bool(
                self.transport.act(
                    lambda now: self.core.refer(
                        key, destination, now, domain=domain, replacing=replacing
                    )
                )
            )

        def end_call(reason: str) -> None:
            bridge = pending.bridge
            if bridge is None:
                self._hang_up(key, reason)
                return
            # Not from this task (the bridge's own): the bridge's end waits for its tasks.
            task = asyncio.create_task(bridge.end(reason), name="sip-transfer-end")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        port = ReferPort(
            send=send,
            give_up=lambda: self.transport.act(lambda now: self.core.give_up_refer(key)),
            end_call=end_call,
            answer_timeout_s=self.core.t.b,
            on_answered=joined,
        )
        pending.transfer = SipTransfer(request)
        try:
            return await put_through(self.runtime, session, pending.transfer, port)
        finally:
            pending.transfer = None

    def _hang_up(self, key: CallKey, reason: str) -> None:
        """Our side ends the call (tools, errors, drain): BYE, or 503/480 if not yet answered."""
        self.transport.act(lambda now: self.core.hangup(key, now, reason))

    # The port of outgoing calls (app/legs/sip_outbound.py's SipListener).
    hang_up = _hang_up

    async def bind_rtcp(self, leg: SipLeg, rtp_port: int) -> asyncio.DatagramTransport | None:
        return await self._bind_rtcp(leg, rtp_port)


async def _first(waits: dict[str, Coroutine[Any, Any, Any]], timeout_s: float) -> str:
    """Which of the named waits finishes first; "timeout" if none does in time."""
    tasks = {asyncio.ensure_future(w): name for name, w in waits.items()}
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not done:
        return "timeout"
    return tasks[next(iter(done))]


def _allow_spec(settings: Settings) -> str:
    """SIP_ALLOW_FROM, and the outbound proxy's address: its answers to our INVITEs (and its
    in-dialog requests) come from there."""
    spec = settings.sip_allow_from or DEFAULT_ALLOW_FROM
    if settings.sip_outbound_proxy:
        host = host_port(settings.sip_outbound_proxy, "")[0]
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(host)
            spec += f",{ip}/{ip.max_prefixlen}"
    return spec


def _digest(settings: Settings) -> DigestAuth | None:
    if settings.sip_digest_users is None:
        return None
    users = parse_users(settings.sip_digest_users.get_secret_value())
    if not users:
        return None
    return DigestAuth(
        users,
        realm="voice-agent",
        failures_allowed=settings.sip_digest_failures_allowed,
        backoff_max_s=settings.sip_digest_backoff_max_s,
    )
