"""The SIP user agent server core, sans-I/O (RFC 3261 sections 8, 12, 13, 17; RFC 6026,
RFC 3581, RFC 4028): datagrams and a clock in, datagrams, call events and deadlines out.

    core.receive(data, flow, now)       # a datagram, or one message framed off a TCP stream
    core.poll(now)                      # fire the timers that are due
    core.next_deadline()                # when to call poll() next
    core.take_transmits(), core.take_events()

and for the application: `ring`, `answer`, `reject`, `hangup`; `invite` places an outgoing
call on the same socket (telephony/legs/sip/uac.py). It never touches a socket or
sleeps, so retransmissions, timeouts and races are tested with a fake clock.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from aiosipua import SipDigestAuth, SipMessage, SipRequest, SipResponse
from aiosipua.headers import parse_address, parse_auth, parse_via, stringify_uri
from aiosipua.session_timer import parse_session_expires, peer_allows_update, watchdog_delay

from telephony.legs.sip import sdp as sdp_mod
from telephony.legs.sip.access import AllowList, RateLimiter, original_source
from telephony.legs.sip.dialog import Call, CallKey, CallState, SessionTimer
from telephony.legs.sip.digest import AuthResult, DigestAuth
from telephony.legs.sip.errors import SdpError, SipParseError
from telephony.legs.sip.message import (
    Flow,
    Request,
    Response,
    build_response,
    contact_uri,
    header_list,
    new_branch,
    new_tag,
    parse,
    reply_destination,
    via_hops,
)
from telephony.legs.sip.refer import (
    Refer,
    ReferState,
    event_id,
    refer_to_uri,
    replaces_uri,
    sipfrag_status,
    subscription_terminated,
)
from telephony.legs.sip.sdp import PCMU, PTIME_MS, Codec, Direction, LocalMedia, RemoteMedia
from telephony.legs.sip.timers import TimerConfig, TimerHeap, TimerOwner
from telephony.legs.sip.transaction import (
    ClientTransaction,
    InviteClientTransaction,
    ServerTransaction,
    TxKey,
    TxState,
    server_key,
)
from telephony.legs.sip.uac import (
    Outgoing,
    OutgoingAnswered,
    OutgoingFailed,
    OutgoingProgress,
    ack_for_final,
    authorization,
    cancel_for,
    contact_of,
    new_call_id,
    next_hop,
    route_set_of,
)

log = logging.getLogger(__name__)

ALLOW = "INVITE, ACK, CANCEL, BYE, OPTIONS, UPDATE, INFO, REFER, NOTIFY"
SUPPORTED = "timer"
KNOWN_EXTENSIONS = frozenset({"timer"})
URI_SCHEMES = frozenset({"sip", "sips", "tel"})
NOT_ALLOWED = frozenset({"REGISTER", "SUBSCRIBE", "PUBLISH", "MESSAGE"})
# NOTIFY only for the subscription our REFER made; a REFER only inside a call (and refused).
DIALOG_ONLY = frozenset({"BYE", "UPDATE", "INFO", "PRACK", "NOTIFY", "REFER"})
DTMF_KEYS = frozenset("0123456789*#ABCD")
MIN_SE = 90  # RFC 4028 section 4
ERROR_LOG_INTERVAL_S = 60.0
HOUSEKEEPING_S = 5.0
DRAIN_RETRY_AFTER_S = 5


@dataclass(frozen=True, slots=True)
class Transmit:
    """Bytes for the transport: over `flow` (a TCP connection when it has a conn_id)."""

    flow: Flow
    data: bytes


@dataclass(frozen=True, slots=True)
class IncomingCall:
    """A new INVITE passed every check: ring it, then answer or reject it."""

    key: CallKey
    from_user: str | None
    to_user: str | None
    source: Flow
    remote: RemoteMedia | None  # None: the INVITE had no offer (we offer in the 2xx)
    codec: Codec  # the codec of this call (the offer's preference, PCMU without an offer)


@dataclass(frozen=True, slots=True)
class CallCancelled:
    """The call ended before it was answered (CANCEL, BYE on the early dialog, no answer)."""

    key: CallKey
    reason: str


@dataclass(frozen=True, slots=True)
class CallConfirmed:
    """The ACK for our 2xx arrived."""

    key: CallKey


@dataclass(frozen=True, slots=True)
class MediaUpdated:
    """A re-INVITE, UPDATE or ACK changed the peer's media (hold, resume, new address)."""

    key: CallKey
    remote: RemoteMedia
    direction: Direction  # ours, as answered


@dataclass(frozen=True, slots=True)
class DtmfReceived:
    """A digit sent as SIP INFO (application/dtmf-relay) instead of RTP."""

    key: CallKey
    digit: str


@dataclass(frozen=True, slots=True)
class CallEnded:
    """An answered call is over (their BYE, our BYE, no ACK, session expired)."""

    key: CallKey
    reason: str


@dataclass(frozen=True, slots=True)
class ReferAnswered:
    """The final response to our REFER: 2xx (202) the transferee took it; anything else, or
    0 when nothing came within 64*T1, it did not (the call stays as it was)."""

    key: CallKey
    status: int


@dataclass(frozen=True, slots=True)
class ReferNotified:
    """A NOTIFY of our REFER's subscription: the status line of the transferee's call to the
    target (`message/sipfrag`); `final` once it is >= 200 or the subscription terminated."""

    key: CallKey
    status: int
    reason: str
    final: bool


SipEvent = (
    IncomingCall
    | CallCancelled
    | CallConfirmed
    | MediaUpdated
    | DtmfReceived
    | CallEnded
    | ReferAnswered
    | ReferNotified
    | OutgoingProgress
    | OutgoingAnswered
    | OutgoingFailed
)


@dataclass(frozen=True, slots=True)
class UasConfig:
    """What the core needs to know about itself and its limits."""

    host: str  # for Via and Contact: SIP_ADVERTISED_ADDRESS or the bound address
    port: int
    timers: TimerConfig = field(default_factory=TimerConfig)
    allow: AllowList = field(default_factory=lambda: AllowList.from_spec("127.0.0.0/8,::1/128"))
    rate_per_source: float = 10.0
    # SIP proxies (SIP_TRUSTED_PROXIES) whose requests count against the source below their
    # Via: the INVITE rate and the digest back-off (the transport: TCP connections).
    trusted_proxies: AllowList = field(default_factory=lambda: AllowList(()))
    max_calls: int = 50
    min_se: int = MIN_SE
    answer_timeout_s: float = 60.0  # a call never answered nor rejected gets 480
    max_transactions: int = 20_000
    user_agent: str = "voice-agent"


@dataclass(slots=True)
class SipStats:
    """Counters for metrics and tests."""

    messages: int = 0
    denied: int = 0
    malformed: int = 0
    rate_limited: int = 0
    overloaded: int = 0
    offered: int = 0
    rejected: int = 0
    internal_errors: int = 0
    auth_failed: int = 0  # digest responses that were wrong (each burns its nonce)
    auth_blocked: int = 0  # digest attempts refused unchecked during a back-off


class _Housekeeping(TimerOwner):
    pass


def _never_busy() -> bool:
    return False


class UserAgentServer:
    """Server transactions, dialogs and offer/answer for incoming calls; see the module doc."""

    def __init__(self, config: UasConfig, *, digest: DigestAuth | None = None) -> None:
        self.config = config
        self.t = config.timers
        self.digest = digest
        self.stats = SipStats()
        self._rate = RateLimiter(config.rate_per_source)
        self._timers = TimerHeap()
        self._server_txs: dict[TxKey, ServerTransaction] = {}
        self._client_txs: dict[str, ClientTransaction] = {}
        self._invite_txs: dict[str, InviteClientTransaction] = {}
        self._calls: dict[CallKey, Call] = {}
        self._out: list[Transmit] = []
        self._events: list[SipEvent] = []
        self._last_error_log = -ERROR_LOG_INTERVAL_S
        self._house = _Housekeeping()
        self.draining = False
        # The application cannot take more calls for now (an overloaded process): out-of-dialog
        # OPTIONS get 503 while it says so, as while draining, and 200 again once it does not.
        self.busy: Callable[[], bool] = _never_busy

    def stop_accepting(self) -> None:
        """The process is stopping: out-of-dialog OPTIONS get 503 from now on, so a dispatcher's
        health probe takes this server out and sends no more calls here. Requests inside live
        dialogs are served as before; a new INVITE still reaches the application, which records
        it and refuses it with 503 (reason `draining`)."""
        self.draining = True

    # ---- inputs -------------------------------------------------------------------------

    def receive(self, data: bytes, flow: Flow, now: float) -> None:
        """One datagram (or one framed TCP message) from `flow`."""
        # Checked before parsing: a source not on the list costs one lookup and no reply.
        if not self.config.allow.allows(flow.remote[0]):
            self.stats.denied += 1
            return
        if not data.strip(b"\r\n \t"):
            return  # a keepalive (RFC 5626 CRLF ping)
        self.stats.messages += 1
        try:
            message = parse(data)
        except SipParseError as exc:
            self.stats.malformed += 1
            log.debug("malformed SIP message from %s: %s", flow.remote[0], exc)
            self._bad_request(data, flow, str(exc))
            return
        try:
            if isinstance(message, Response):
                self._on_response(message, now)
            else:
                self._on_request(message, flow, now)
        except Exception:
            # A bug must not stop the listener; one traceback a minute is enough to find it.
            self.stats.internal_errors += 1
            if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
                self._last_error_log = now
                log.exception("SIP core failed on a message from %s", flow.remote[0])
        self._house_keep(now)

    def poll(self, now: float) -> None:
        """Fire every timer due at `now`."""
        for owner, kind in self._timers.pop_due(now):
            try:
                if isinstance(owner, ServerTransaction):
                    self._server_timer(owner, kind, now)
                elif isinstance(owner, ClientTransaction):
                    self._client_timer(owner, kind, now)
                elif isinstance(owner, InviteClientTransaction):
                    self._invite_timer(owner, kind, now)
                elif isinstance(owner, Call):
                    self._call_timer(owner, kind, now)
                else:
                    self._house_keep(now, force=True)
            except Exception:
                self.stats.internal_errors += 1
                if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
                    self._last_error_log = now
                    log.exception("SIP timer %s failed", kind)

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    def take_transmits(self) -> list[Transmit]:
        out, self._out = self._out, []
        return out

    def take_events(self) -> list[SipEvent]:
        events, self._events = self._events, []
        return events

    # ---- the application's side ---------------------------------------------------------

    def ring(self, key: CallKey, now: float) -> bool:
        """180 Ringing (while the Realtime session opens)."""
        call = self._calls.get(key)
        if call is None or call.state is not CallState.OFFERED:
            return False
        tx = self._tx_of(call)
        if tx is None or tx.final_sent:
            return False
        self._respond(tx, 180, now, to_tag=key.local_tag, headers=self._dialog_headers(call))
        return True

    def answer(self, key: CallKey, local: LocalMedia, now: float) -> bool:
        """200 OK with our SDP; False if the call is gone (cancelled, timed out)."""
        call = self._calls.get(key)
        if call is None or call.state is not CallState.OFFERED:
            return False
        tx = self._tx_of(call)
        if tx is None or tx.final_sent:
            return False
        call.local = local
        if call.remote is not None:
            call.direction = sdp_mod.ANSWER_DIRECTION[call.remote.direction]
            call.our_sdp = sdp_mod.answer(
                call.offer_body, call.remote, local, call.sdp_version, call.direction
            )
        else:
            call.our_sdp = sdp_mod.offer(PCMU, local, call.sdp_version)
            call.awaiting_answer = True
        self._timers.cancel(call, "answer_timeout")
        data = self._respond(
            tx,
            200,
            now,
            to_tag=key.local_tag,
            headers=self._dialog_headers(call) + self._ok_headers(call),
            body=call.our_sdp,
        )
        call.move(CallState.ANSWERED)
        self._await_ack(call, data, tx.reply_to or call.flow, call.remote_cseq, now)
        self._arm_session_timer(call, now)
        return True

    def reject(
        self, key: CallKey, status: int, now: float, *, retry_after: int | None = None
    ) -> bool:
        """A final non-2xx to an unanswered call (503 when the session cannot open)."""
        call = self._calls.get(key)
        if call is None or call.state is not CallState.OFFERED:
            return False
        tx = self._tx_of(call)
        headers = [("Retry-After", str(retry_after))] if retry_after is not None else []
        if tx is not None and not tx.final_sent:
            self._respond(tx, status, now, to_tag=key.local_tag, headers=headers)
        self.stats.rejected += 1
        self._end(call, f"rejected {status}")
        return True

    def hangup(self, key: CallKey, now: float, reason: str = "hung up") -> None:
        """End the call from our side: BYE (after the ACK, if it has not come yet)."""
        call = self._calls.get(key)
        if call is None:
            return
        if call.state is CallState.OFFERED:
            self.reject(key, 480, now)
        elif call.state is CallState.CALLING:
            self._cancel_invite(call, reason, now)
        elif call.state is CallState.ANSWERED and call.ok_data:
            # RFC 3261 15: no BYE before the ACK of our 2xx (or its timeout).
            call.hangup_requested = True
            call.end_reason = reason
        elif call.live:
            self._bye(call, now, reason, notify=False)

    def refer(
        self,
        key: CallKey,
        destination: str,
        now: float,
        *,
        domain: str | None = None,
        replacing: CallKey | None = None,
    ) -> bool:
        """Ask the caller's side to call `destination` (RFC 3515): an in-dialog REFER, sent and
        retransmitted like a BYE. An E.164 number becomes `sip:+E164@<domain>;user=phone`,
        `domain` by default the host of the caller's From. With `replacing` (our confirmed
        outgoing call to the person of a warm transfer) the Refer-To is instead that dialog's
        remote target with `?Replaces=` naming it (RFC 3891), and `destination` is not used.
        False, with nothing sent, when the call (or the replaced one) is not confirmed, is
        ending, or a REFER of it is still open."""
        call = self._calls.get(key)
        if call is None or call.state is not CallState.CONFIRMED:
            return False
        if call.refer is not None and call.refer.open:
            return False
        try:
            if replacing is not None:
                other = self._calls.get(replacing)
                if other is None or other.state is not CallState.CONFIRMED:
                    raise ValueError("the dialog to replace is not up")
                target = replaces_uri(
                    other.remote_target, other.key.call_id, other.remote_tag, other.key.local_tag
                )
            else:
                target = refer_to_uri(destination, domain or _host(call.remote_to))
        except ValueError as exc:
            log.warning("call %s: no REFER: %s", key.call_id[:64], exc)
            return False
        ctx = self._request(
            call,
            "REFER",
            now,
            [
                ("Refer-To", f"<{target}>"),
                ("Referred-By", f"<{_uri_text([call.local_from]) or self._contact(call)}>"),
                ("Allow", ALLOW),
            ],
        )
        call.refer = Refer(target, cseq=call.local_cseq)
        ctx.extra["cseq"] = str(call.local_cseq)
        return True

    def give_up_refer(self, key: CallKey) -> None:
        """The application stops waiting for the REFER's outcome (its ring timeout): later
        NOTIFYs of it get 481, which ends the subscription (RFC 6665 4.1.3), and the call may
        be referred again."""
        call = self._calls.get(key)
        if call is not None and call.refer is not None and call.refer.open:
            call.refer.move(ReferState.DONE)

    def call_state(self, key: CallKey) -> CallState | None:
        call = self._calls.get(key)
        return call.state if call else None

    def footprint(self) -> dict[str, int]:
        """What the core holds in memory (tests assert it empties once calls are over)."""
        return {
            "calls": len(self._calls),
            "server_transactions": len(self._server_txs),
            "client_transactions": len(self._client_txs) + len(self._invite_txs),
            "timers": len(self._timers),
            "rate_buckets": len(self._rate),
            "nonces": len(self.digest) if self.digest else 0,
        }

    def live_calls(self) -> int:
        return len(self._calls)

    def has_dialog_on(self, conn_id: int) -> bool:
        """Whether a call not yet over was set up over TCP connection `conn_id`."""
        return any(call.flow.conn_id == conn_id for call in self._calls.values())

    # ---- requests -----------------------------------------------------------------------

    def _on_request(self, req: Request, flow: Flow, now: float) -> None:
        tx = self._server_txs.get(server_key(req))
        if req.method == "ACK":
            if tx is not None and tx.invite and tx.state is TxState.COMPLETED:
                self._ack_non_2xx(tx, now)
            elif tx is None or tx.state is TxState.ACCEPTED:
                self._ack_2xx(req, now)
            return
        if tx is not None:
            self._retransmission(tx)
            return
        if req.method == "CANCEL":
            self._on_cancel(req, flow, now)
        elif req.to_tag is not None:
            self._in_dialog(req, flow, now)
        elif req.method == "INVITE":
            self._on_new_invite(req, flow, now)
        elif req.method == "OPTIONS":
            tx = self._new_tx(req, flow)
            if tx is not None and (self.draining or self.busy()):
                self._respond(tx, 503, now, headers=[("Retry-After", str(DRAIN_RETRY_AFTER_S))])
            elif tx is not None:
                self._respond(tx, 200, now, headers=self._capabilities())
        else:
            status = 405 if req.method in NOT_ALLOWED else 481 if req.method in DIALOG_ONLY else 501
            tx = self._new_tx(req, flow)
            if tx is not None:
                self._respond(tx, status, now, headers=[("Allow", ALLOW)])

    def _retransmission(self, tx: ServerTransaction) -> None:
        # RFC 6026: a retransmitted INVITE after the 2xx is absorbed; the 2xx is resent by its
        # own timer until the ACK. In every other state the last response is replayed.
        if tx.state in (TxState.ACCEPTED, TxState.CONFIRMED, TxState.TRYING):
            return
        if tx.last_response is not None and tx.reply_to is not None:
            self._out.append(Transmit(tx.reply_to, tx.last_response))

    def limit_source(self, req: Request, flow: Flow) -> str:
        """The source `req` counts against in the per-source limits: the packet's, or behind a
        trusted proxy the one its Via below the proxy's names."""
        source = flow.remote[0]
        trusted = self.config.trusted_proxies
        if not trusted.networks or not trusted.allows(source):
            return source
        return original_source(source, via_hops(req), trusted)

    def _on_new_invite(self, req: Request, flow: Flow, now: float) -> None:
        source = self.limit_source(req, flow)
        if not self._rate.allow(source, now):
            self.stats.rate_limited += 1
            self._stateless(req, flow, 503, [("Retry-After", "1")], "Rate Limited")
            return
        tx = self._new_tx(req, flow)
        if tx is None:
            return
        self._respond(tx, 100, now)
        status, headers = self._screen_invite(req, source, now)
        remote: RemoteMedia | None = None
        codec = PCMU
        if status == 0 and req.msg.body:
            try:
                remote = sdp_mod.read_offer(req.msg.body)
                codec = remote.codec
            except SdpError as exc:
                status = exc.status
                headers = [("Warning", f'399 {self.config.host} "{str(exc)[:80]}"')]
        if status:
            self.stats.rejected += 1
            self._respond(tx, status, now, headers=headers)
            return
        call = self._new_call(req, flow, tx, remote, now)
        self.stats.offered += 1
        self._events.append(
            IncomingCall(
                call.key,
                _user(req.msg.headers.get_first("from")),
                _user(req.msg.headers.get_first("to")),
                flow,
                remote,
                codec,
            )
        )

    def _screen_invite(
        self, req: Request, source: str, now: float
    ) -> tuple[int, list[tuple[str, str]]]:
        """The first reason to refuse a new INVITE (status, headers); (0, []) to accept it.
        `source` is what the digest back-off counts against (see `limit_source`)."""
        msg = req.msg
        scheme = msg.uri.split(":", 1)[0].lower() if ":" in msg.uri else ""
        if scheme not in URI_SCHEMES:
            return 416, []
        unknown = [e for e in header_list(msg, "require") if e not in KNOWN_EXTENSIONS]
        if unknown:
            return 420, [("Unsupported", ", ".join(unknown)[:200])]
        encoding = (msg.headers.get_first("content-encoding") or "identity").strip().lower()
        content_type = (msg.content_type or "").split(";")[0].strip().lower()
        if encoding != "identity" or (msg.body and content_type != "application/sdp"):
            return 415, [("Accept", "application/sdp"), ("Accept-Encoding", "identity")]
        if self.digest is not None:
            authorization = msg.headers.get_first("authorization")
            result = self.digest.verify(authorization, "INVITE", msg.uri, now, source)
            if result in (AuthResult.MISSING, AuthResult.STALE):
                challenge = self.digest.challenge(now, stale=result is AuthResult.STALE)
                return 401, [("WWW-Authenticate", challenge)]
            if result is AuthResult.BAD:
                self.stats.auth_failed += 1
                return 403, []
            if result is AuthResult.BLOCKED:
                # 403, not 503: a 503 tells the trunk's proxy that this server is down, so
                # one guesser behind it would send everyone's calls elsewhere; a 403 ends
                # only this attempt of this (user, source).
                self.stats.auth_blocked += 1
                wait = self.digest.retry_after(_auth_user(authorization), source, now)
                warning = f'399 {self.config.host} "too many failed attempts; retry in {wait} s"'
                return 403, [("Warning", warning)]
        status, headers, _ = self._negotiate_timer(req)
        if status:
            return status, headers
        if len(self._calls) >= self.config.max_calls:
            self.stats.overloaded += 1
            return 503, [("Retry-After", str(random.randint(5, 15)))]
        return 0, []

    def _new_call(
        self,
        req: Request,
        flow: Flow,
        tx: ServerTransaction,
        remote: RemoteMedia | None,
        now: float,
    ) -> Call:
        msg = req.msg
        key = CallKey(req.call_id, new_tag())
        contact = msg.contact[0].uri if msg.headers.get("contact") else None
        call = Call(
            key=key,
            remote_tag=req.from_tag or "",
            flow=flow,
            transport=flow.transport,
            route_set=list(msg.headers.get("record-route")),
            remote_target=_uri_text(msg.headers.get("contact")) or msg.uri,
            remote_cseq=req.cseq,
            local_cseq=random.randint(1, 10_000),
            local_from=f"{msg.headers.get_first('to')};tag={key.local_tag}",
            remote_to=msg.headers.get_first("from") or "",
            # Straight from the caller (one Via, rport): answer where it came from, for NAT.
            symmetric=len(msg.headers.get("via")) == 1
            and ("rport" in req.top_via.params or contact is None),
            invite_tx=tx,
            remote=remote,
            offer_body=msg.body,
            peer_allows_update=peer_allows_update(header_list(msg, "allow")),
        )
        _, _, call.timer = self._negotiate_timer(req, call)
        tx.call = call
        tx.to_tag = key.local_tag
        self._calls[key] = call
        self._after(call, "answer_timeout", self.config.answer_timeout_s, now)
        return call

    def _on_cancel(self, req: Request, flow: Flow, now: float) -> None:
        invite_tx = self._server_txs.get(server_key(req, "INVITE"))
        tx = self._new_tx(req, flow)
        if tx is None:
            return
        if invite_tx is None:
            self._respond(tx, 481, now)
            return
        self._respond(tx, 200, now)
        if invite_tx.final_sent:
            return  # the 2xx (or a rejection) crossed the CANCEL: the call is unaffected
        call = invite_tx.call if isinstance(invite_tx.call, Call) else None
        self._respond(invite_tx, 487, now, to_tag=call.key.local_tag if call else None)
        if call is not None:
            self._end(call, "cancelled")
            self._events.append(CallCancelled(call.key, "cancelled"))

    def _in_dialog(self, req: Request, flow: Flow, now: float) -> None:
        call = self._calls.get(CallKey(req.call_id, req.to_tag or ""))
        tx = self._new_tx(req, flow)
        if tx is None:
            return
        if call is None or (call.remote_tag and req.from_tag != call.remote_tag):
            self._respond(tx, 481, now)
            return
        if req.cseq <= call.remote_cseq:
            # RFC 3261 12.2.2: a request older than the last one (retransmissions never get here).
            self._respond(tx, 500, now, headers=[("Retry-After", "1")])
            return
        call.remote_cseq = req.cseq
        contact = _uri_text(req.msg.headers.get("contact"))
        if contact and req.method in ("INVITE", "UPDATE"):
            call.remote_target = contact  # RFC 3261 12.2.2: target refresh
        match req.method:
            case "BYE":
                self._on_bye(call, tx, now)
            case "INVITE" | "UPDATE":
                self._on_offer(call, req, tx, now)
            case "OPTIONS":
                self._respond(tx, 200, now, headers=self._capabilities())
            case "INFO":
                self._on_info(call, req, tx, now)
            case "NOTIFY":
                self._on_notify(call, req, tx, now)
            case "REFER":
                # We take no transfer orders from the caller's side.
                self._respond(tx, 403, now)
            case _:
                self._respond(tx, 405 if req.method in NOT_ALLOWED else 501, now,
                              headers=[("Allow", ALLOW)])  # fmt: skip

    def _on_bye(self, call: Call, tx: ServerTransaction, now: float) -> None:
        self._respond(tx, 200, now)
        if call.state is CallState.OFFERED:
            # A BYE on the early dialog (after our 180): the INVITE is over too.
            invite = self._tx_of(call)
            if invite is not None and not invite.final_sent:
                self._respond(invite, 487, now, to_tag=call.key.local_tag)
            self._end(call, "bye before answer")
            self._events.append(CallCancelled(call.key, "bye before answer"))
            return
        if call.state is CallState.TERMINATING:
            return  # BYEs crossed; ours completes the call
        self._end(call, "bye")
        self._events.append(CallEnded(call.key, "bye"))

    def _on_offer(self, call: Call, req: Request, tx: ServerTransaction, now: float) -> None:
        """re-INVITE or UPDATE: hold, resume, a new address, a session refresh."""
        invite = req.method == "INVITE"
        if call.state is CallState.TERMINATING:
            self._respond(tx, 481, now)
            return
        if call.state is CallState.OFFERED or (invite and call.ok_data) or call.awaiting_answer:
            # An offer while ours (or the first 2xx) is unacknowledged (RFC 3261 14.2, 3311).
            self._respond(tx, 500 if invite else 491, now,
                          headers=[("Retry-After", str(random.randint(1, 10)))])  # fmt: skip
            return
        status, headers, timer = self._negotiate_timer(req, call)
        if status:
            self._respond(tx, status, now, headers=headers)
            return
        msg = req.msg
        content_type = (msg.content_type or "").split(";")[0].strip().lower()
        if msg.body and content_type != "application/sdp":
            self._respond(tx, 415, now, headers=[("Accept", "application/sdp")])
            return
        assert call.local is not None  # a live call was answered with our media
        codec = call.remote.codec if call.remote else PCMU
        if msg.body:
            try:
                remote = sdp_mod.read_offer(msg.body, (codec,))
                # The stream keeps its packet time (a re-offer's ptime is only a wish).
                remote = replace(remote, ptime=call.remote.ptime if call.remote else PTIME_MS)
            except SdpError as exc:
                # The call goes on with what it had (RFC 3261 14.2).
                self._respond(tx, exc.status, now)
                return
            direction = sdp_mod.ANSWER_DIRECTION[remote.direction]
            if direction != call.direction:
                call.sdp_version += 1
            call.direction = direction
            call.remote = remote
            call.offer_body = msg.body
            call.our_sdp = sdp_mod.answer(msg.body, remote, call.local, call.sdp_version, direction)
            self._events.append(MediaUpdated(call.key, remote, direction))
            body = call.our_sdp
        elif invite:
            # No offer in the re-INVITE: we offer in the 2xx, the answer comes in the ACK.
            call.sdp_version += 1
            call.direction = "sendrecv"
            call.our_sdp = sdp_mod.offer(codec, call.local, call.sdp_version)
            call.awaiting_answer = True
            body = call.our_sdp
        else:
            body = b""  # an UPDATE without SDP: a session refresh
        call.timer = timer
        data = self._respond(
            tx, 200, now, headers=self._dialog_headers(call) + self._ok_headers(call), body=body
        )
        if invite:
            self._await_ack(call, data, tx.reply_to or call.flow, req.cseq, now)
        self._arm_session_timer(call, now)

    def _on_info(self, call: Call, req: Request, tx: ServerTransaction, now: float) -> None:
        content_type = (req.msg.content_type or "").split(";")[0].strip().lower()
        if content_type == "application/dtmf-relay":
            for line in req.msg.text.splitlines():
                name, _, value = line.partition("=")
                digit = value.strip().upper()
                if name.strip().lower() == "signal" and len(digit) == 1 and digit in DTMF_KEYS:
                    self._events.append(DtmfReceived(call.key, digit))
                    break
        elif req.msg.body:
            self._respond(tx, 415, now, headers=[("Accept", "application/dtmf-relay")])
            return
        self._respond(tx, 200, now)

    def _on_notify(self, call: Call, req: Request, tx: ServerTransaction, now: float) -> None:
        """A NOTIFY of our REFER's subscription (RFC 3515 2.4.4, RFC 6665): answered, and its
        sipfrag reported; anything that is not one gets a 4xx and changes nothing."""
        msg = req.msg
        package, ident = event_id(msg.headers.get_first("event") or msg.headers.get_first("o")
                                  or "")  # fmt: skip
        if package != "refer":
            self._respond(tx, 489, now, headers=[("Allow-Events", "refer")])
            return
        refer = call.refer
        if refer is None or not refer.open or (ident is not None and ident != str(refer.cseq)):
            self._respond(tx, 481, now)
            return
        content_type = (msg.content_type or "").split(";")[0].strip().lower()
        if content_type != "message/sipfrag":
            self._respond(tx, 415, now, headers=[("Accept", "message/sipfrag")])
            return
        status = sipfrag_status(msg.body)
        if status is None:
            warning = f'399 {self.config.host} "no SIP status line in the sipfrag"'
            self._respond(tx, 400, now, headers=[("Warning", warning)])
            return
        code, reason = status
        terminated = subscription_terminated(msg.headers.get_first("subscription-state"))
        final = code >= 200 or terminated
        self._respond(tx, 200, now)
        if refer.state is ReferState.SENT:
            refer.move(ReferState.ACCEPTED)  # the NOTIFY overtook the 202 (RFC 6665 4.1.2.4)
        refer.last_status = code
        if final:
            refer.move(ReferState.DONE)
        self._events.append(ReferNotified(call.key, code, reason, final))

    # ---- ACK ----------------------------------------------------------------------------

    def _ack_non_2xx(self, tx: ServerTransaction, now: float) -> None:
        tx.move(TxState.CONFIRMED)
        self._timers.cancel(tx, "G")
        self._timers.cancel(tx, "H")
        if tx.reply_to is not None and tx.reply_to.reliable:
            tx.move(TxState.TERMINATED)  # timer I is zero over a reliable transport
            self._drop_tx(tx)
        else:
            self._after(tx, "I", self.t.t4, now)

    def _ack_2xx(self, req: Request, now: float) -> None:
        call = self._calls.get(CallKey(req.call_id, req.to_tag or ""))
        if call is None or not call.ok_data or req.cseq != call.ok_cseq:
            return  # a stray or late ACK
        call.ok_data = b""
        self._timers.cancel(call, "ok")
        self._timers.cancel(call, "ack_timeout")
        if call.state is CallState.ANSWERED:
            call.move(CallState.CONFIRMED)
            self._events.append(CallConfirmed(call.key))
        if call.awaiting_answer:
            call.awaiting_answer = False
            try:
                if not req.msg.body:
                    raise SdpError("no answer in the ACK")
                remote = sdp_mod.read_answer(
                    req.msg.body, call.remote.codec if call.remote else PCMU
                )
            except SdpError as exc:
                self._bye(call, now, f"unusable answer: {exc}")
                return
            call.remote = remote
            call.direction = sdp_mod.ANSWER_DIRECTION[remote.direction]
            self._events.append(MediaUpdated(call.key, remote, call.direction))
        if call.hangup_requested:
            self._bye(call, now, call.end_reason or "hung up", notify=False)

    # ---- responses to our requests ------------------------------------------------------

    def _on_response(self, resp: Response, now: float) -> None:
        if resp.cseq_method == "INVITE":
            itx = self._invite_txs.get(resp.top_via.branch or "")
            if itx is not None and resp.cseq == itx.cseq:
                self._on_invite_response(itx, resp, now)
            return
        ctx = self._client_txs.get(resp.top_via.branch or "")
        if ctx is None or resp.cseq_method != ctx.method or ctx.state is TxState.COMPLETED:
            return
        if resp.status < 200:
            if ctx.state is TxState.TRYING:
                ctx.move(TxState.PROCEEDING)
            ctx.interval = self.t.t2
            return
        ctx.status = resp.status
        ctx.move(TxState.COMPLETED)
        self._timers.cancel(ctx, "E")
        self._timers.cancel(ctx, "F")
        if ctx.dest is not None and ctx.dest.reliable:
            self._timers.cancel_all(ctx)  # timer K is zero over a reliable transport
            self._client_txs.pop(ctx.branch, None)
        else:
            self._after(ctx, "K", self.t.t4, now)
        self._client_done(ctx, resp.msg, now)

    def _client_done(self, ctx: ClientTransaction, msg: SipResponse | None, now: float) -> None:
        call = ctx.call if isinstance(ctx.call, Call) else None
        if call is None:
            return
        if ctx.method == "BYE":
            self._forget(call)
            return
        if ctx.method == "REFER":
            refer = call.refer
            if refer is None or ctx.extra.get("cseq") != str(refer.cseq):
                return  # an older REFER's answer
            if 200 <= ctx.status < 300:
                if refer.state is ReferState.SENT:
                    refer.move(ReferState.ACCEPTED)
                    self._events.append(ReferAnswered(call.key, ctx.status))
                return
            if refer.state is ReferState.SENT:
                refer.move(ReferState.DONE)
                self._events.append(ReferAnswered(call.key, ctx.status))
            return
        if ctx.method == "UPDATE" and call.live:
            call.refresh_pending = False
            if ctx.status in (408, 481) or ctx.status == 0:
                self._bye(call, now, "session refresh failed")
            elif 200 <= ctx.status < 300 and call.timer is not None:
                raw = msg.headers.get_first("session-expires") if msg else None
                if raw:
                    interval, refresher = parse_session_expires(raw)
                    if interval >= self.config.min_se:
                        call.timer.interval = interval
                        call.timer.we_refresh = refresher != "uac"
                self._arm_session_timer(call, now)

    # ---- timers -------------------------------------------------------------------------

    def _server_timer(self, tx: ServerTransaction, kind: str, now: float) -> None:
        if kind == "G":
            if tx.state is TxState.COMPLETED and tx.last_response and tx.reply_to:
                self._out.append(Transmit(tx.reply_to, tx.last_response))
                tx.retransmit_interval = min(2 * tx.retransmit_interval, self.t.t2)
                self._after(tx, "G", tx.retransmit_interval, now)
            return
        # H (no ACK for a rejection), I, J, L: the transaction is over.
        if tx.state is not TxState.TERMINATED:
            tx.move(TxState.TERMINATED)
        self._drop_tx(tx)

    def _client_timer(self, ctx: ClientTransaction, kind: str, now: float) -> None:
        if kind == "E":
            if ctx.dest is not None and ctx.state in (TxState.TRYING, TxState.PROCEEDING):
                self._out.append(Transmit(ctx.dest, ctx.data))
                ctx.interval = min(2 * ctx.interval, self.t.t2)
                self._after(ctx, "E", ctx.interval, now)
            return
        if kind == "F":
            ctx.move(TxState.TERMINATED)
            self._timers.cancel_all(ctx)
            self._client_txs.pop(ctx.branch, None)
            self._client_done(ctx, None, now)  # status 0: no answer at all
            return
        self._client_txs.pop(ctx.branch, None)  # K

    def _call_timer(self, call: Call, kind: str, now: float) -> None:
        if kind == "ok":
            if call.ok_data and call.ok_dest is not None:
                self._out.append(Transmit(call.ok_dest, call.ok_data))
                call.ok_interval = min(2 * call.ok_interval, self.t.t2)
                self._after(call, "ok", call.ok_interval, now)
        elif kind == "ack_timeout":
            # RFC 3261 13.3.1.4: no ACK within 64*T1: confirm the dialog, then end it with BYE.
            call.ok_data = b""
            self._timers.cancel(call, "ok")
            if call.state is CallState.ANSWERED:
                call.move(CallState.CONFIRMED)
            self._bye(call, now, f"no ACK for our 200 within {self.t.b:g} s (64*T1)",
                      notify=not call.hangup_requested)  # fmt: skip
        elif kind == "ring_timeout":
            if call.state is CallState.CALLING:
                self._cancel_invite(call, "ring timeout", now)
        elif kind == "cancel_timeout":
            # RFC 3261 9.1: no final answer 64*T1 after our CANCEL: the call is over anyway.
            out = call.outgoing
            if call.state is CallState.CALLING and isinstance(out, Outgoing):
                self._outgoing_over(call, 487, out.cancel_reason or "cancelled", now)
        elif kind == "answer_timeout":
            if call.state is CallState.OFFERED:
                self.reject(call.key, 480, now)
                self._events.append(CallCancelled(call.key, "not answered"))
        elif kind == "session_expiry":
            if call.live:
                self._bye(call, now, "session expired")
        elif kind == "session_refresh":
            if call.live and not call.refresh_pending and call.timer is not None:
                call.refresh_pending = True
                self._request(
                    call,
                    "UPDATE",
                    now,
                    [
                        ("Session-Expires", f"{call.timer.interval};refresher=uas"),
                        ("Supported", SUPPORTED),
                        ("Min-SE", str(self.config.min_se)),
                    ],
                )

    # ---- outgoing calls (telephony/legs/sip/uac.py) ---------------------------------------

    def invite(
        self,
        uri: str,
        local: LocalMedia,
        now: float,
        *,
        proxy: tuple[str, int] | None = None,
        from_user: str = "voice-agent",
        credentials: SipDigestAuth | None = None,
        ring_timeout_s: float = 30.0,
    ) -> CallKey:
        """Place a call to `uri` (over UDP): an INVITE with our offer, to `proxy` (a loose
        Route to it) when given, else to the URI's host. Its life comes back as
        OutgoingProgress / OutgoingAnswered / OutgoingFailed, then CallEnded as any call."""
        host, port = self.config.host, self.config.port
        shown = f"[{host}]" if ":" in host else host
        key = CallKey(new_call_id(shown), new_tag())
        dest = proxy or next_hop(uri)
        route = None
        if proxy is not None:
            proxy_shown = f"[{proxy[0]}]" if ":" in proxy[0] else proxy[0]
            route = f"<sip:{proxy_shown}:{proxy[1]};lr>"
        out = Outgoing(request_uri=uri, dest=dest, route=route, credentials=credentials)
        call = Call(
            key=key,
            state=CallState.CALLING,
            flow=Flow("udp", dest),
            transport="udp",
            remote_target=uri,
            local_cseq=random.randint(1, 10_000),
            local_from=f"<sip:{from_user}@{shown}:{port}>;tag={key.local_tag}",
            remote_to=f"<{uri}>",
            local=local,
            our_sdp=sdp_mod.offer(PCMU, local, 1),
            outgoing=out,
        )
        self._calls[key] = call
        self._send_invite(call, out, now)
        self._after(call, "ring_timeout", ring_timeout_s, now)
        return key

    def _send_invite(
        self, call: Call, out: Outgoing, now: float, auth: tuple[str, str] | None = None
    ) -> None:
        host, port = self.config.host, self.config.port
        shown = f"[{host}]" if ":" in host else host
        branch = new_branch()
        request = SipRequest(method="INVITE", uri=out.request_uri)
        request.headers.append("Via", f"SIP/2.0/UDP {shown}:{port};branch={branch};rport")
        request.headers.set_single("Max-Forwards", "70")
        request.headers.set_single("From", call.local_from)
        request.headers.set_single("To", call.remote_to)
        request.headers.set_single("Call-ID", call.key.call_id)
        request.headers.set_single("CSeq", f"{call.local_cseq} INVITE")
        if out.route is not None:
            request.headers.append("Route", out.route)
        request.headers.set_single("Contact", self._contact(call))
        request.headers.set_single("Allow", ALLOW)
        request.headers.set_single("User-Agent", self.config.user_agent)
        if auth is not None:
            request.headers.set_single(*auth)
        request.headers.set_single("Content-Type", "application/sdp")
        request.body = call.our_sdp
        out.invite = request
        out.branch = branch
        data = bytes(request)
        dest = Flow("udp", out.dest)
        itx = InviteClientTransaction(
            branch=branch, data=data, dest=dest, interval=self.t.t1, call=call,
            cseq=call.local_cseq,
        )  # fmt: skip
        self._invite_txs[branch] = itx
        self._out.append(Transmit(dest, data))
        self._after(itx, "A", self.t.t1, now)
        self._after(itx, "B", self.t.b, now)

    def _on_invite_response(self, itx: InviteClientTransaction, resp: Response, now: float) -> None:
        call = itx.call if isinstance(itx.call, Call) else None
        out = call.outgoing if call is not None else None
        status = resp.status
        if status < 200:
            if itx.state in (TxState.CALLING, TxState.PROCEEDING):
                itx.move(TxState.PROCEEDING)
                self._timers.cancel(itx, "A")
                self._timers.cancel(itx, "B")  # timer B runs only while nothing was heard
            if call is None or not isinstance(out, Outgoing) or call.state is not CallState.CALLING:
                return
            if status > 100 and status != out.provisional:
                self._events.append(OutgoingProgress(call.key, status))
            out.provisional = max(out.provisional, status)
            if out.cancel_reason and not out.cancel_sent:
                self._send_cancel(call, out, now)
            return
        if status < 300:
            if itx.state in (TxState.CALLING, TxState.PROCEEDING):
                itx.move(TxState.ACCEPTED)
                self._timers.cancel_all(itx)
                self._after(itx, "M", self.t.b, now)  # RFC 6026: absorbs retransmitted 2xx
            if call is not None and isinstance(out, Outgoing):
                self._on_invite_2xx(call, out, itx, resp, now)
            return
        if itx.state is TxState.COMPLETED:
            self._out.append(Transmit(itx.dest or Flow("udp", ("", 0)), itx.ack))
            return
        if itx.state not in (TxState.CALLING, TxState.PROCEEDING) or not isinstance(out, Outgoing):
            return
        itx.ack = bytes(ack_for_final(out.invite, resp.msg))
        itx.move(TxState.COMPLETED)
        self._timers.cancel_all(itx)
        if itx.dest is not None:
            self._out.append(Transmit(itx.dest, itx.ack))
        self._after(itx, "D", 32.0, now)  # retransmitted finals get the ACK again
        assert call is not None
        if call.state is not CallState.CALLING:
            return
        if (
            status in (401, 407)
            and out.credentials is not None
            and not out.authenticated
            and not out.cancel_reason
        ):
            header = authorization(out.credentials, resp.msg, out.request_uri)
            if header is not None:
                # Once: a second challenge means the credentials are wrong.
                out.authenticated = True
                out.provisional = 0
                call.local_cseq += 1
                self._send_invite(call, out, now, header)
                return
        reason = f"{status} {resp.msg.reason_phrase}".strip()
        if out.cancel_reason:
            reason = f"{out.cancel_reason} ({reason})"
        self._outgoing_over(call, status, reason, now)

    def _on_invite_2xx(
        self,
        call: Call,
        out: Outgoing,
        itx: InviteClientTransaction,
        resp: Response,
        now: float,
    ) -> None:
        msg = resp.msg
        to_tag = _tag_of(msg.headers.get_first("to"))
        if call.state is not CallState.CALLING:
            if out.ack_2xx and out.ack_dest is not None and to_tag == call.remote_tag:
                # A retransmitted 2xx: our ACK was lost (RFC 3261 13.2.2.4).
                self._out.append(Transmit(Flow("udp", out.ack_dest), out.ack_2xx))
            return
        # The dialog (RFC 3261 12.1.2): their tag, the route set, the remote target.
        call.remote_tag = to_tag
        call.remote_to = msg.headers.get_first("to") or call.remote_to
        call.route_set = route_set_of(msg) or ([out.route] if out.route else [])
        call.remote_target = contact_of(msg) or out.request_uri
        request, _, host, port = call.next_request(
            "ACK", self.config.host, self.config.port, self._contact(call), cseq=itx.cseq
        )
        out.ack_2xx = bytes(request)
        out.ack_dest = (host, port)
        self._out.append(Transmit(Flow("udp", (host, port)), out.ack_2xx))
        out.outcome = resp.status
        self._timers.cancel(call, "ring_timeout")
        self._timers.cancel(call, "cancel_timeout")
        call.move(CallState.CONFIRMED)
        if out.cancel_reason:
            # The 2xx crossed our CANCEL: the call is up, and ended at once.
            self._bye(call, now, out.cancel_reason, notify=False)
            reason = f"{out.cancel_reason} (answered as it was cancelled)"
            self._events.append(OutgoingFailed(call.key, 487, reason))
            return
        try:
            if not msg.body:
                raise SdpError("no SDP answer in the 2xx")
            remote = sdp_mod.read_answer(msg.body, PCMU)
        except SdpError as exc:
            self._bye(call, now, f"unusable answer: {exc}", notify=False)
            self._events.append(OutgoingFailed(call.key, 488, f"unusable answer: {exc}"))
            return
        call.remote = remote
        call.direction = sdp_mod.ANSWER_DIRECTION[remote.direction]
        self._events.append(OutgoingAnswered(call.key, remote, call.direction))

    def _cancel_invite(self, call: Call, reason: str, now: float) -> None:
        """End an outgoing call not yet answered: CANCEL once a provisional came (RFC 3261
        9.1 forbids it before); the 487 (or timer B) then ends the call."""
        out = call.outgoing
        if not isinstance(out, Outgoing) or out.cancel_reason:
            return
        out.cancel_reason = reason
        self._timers.cancel(call, "ring_timeout")
        if out.provisional:
            self._send_cancel(call, out, now)

    def _send_cancel(self, call: Call, out: Outgoing, now: float) -> None:
        out.cancel_sent = True
        data = bytes(cancel_for(out.invite))
        dest = Flow("udp", out.dest)
        ctx = ClientTransaction(
            branch=out.branch, method="CANCEL", data=data, dest=dest, interval=self.t.t1
        )
        self._client_txs[out.branch] = ctx
        self._out.append(Transmit(dest, data))
        self._after(ctx, "E", self.t.t1, now)
        self._after(ctx, "F", self.t.b, now)
        self._after(call, "cancel_timeout", self.t.b, now)

    def _invite_timer(self, itx: InviteClientTransaction, kind: str, now: float) -> None:
        if kind == "A":
            if itx.state is TxState.CALLING and itx.dest is not None:
                self._out.append(Transmit(itx.dest, itx.data))
                itx.interval *= 2  # no T2 cap for INVITE (RFC 3261 17.1.1.2)
                self._after(itx, "A", itx.interval, now)
            return
        if kind == "B":
            call = itx.call if isinstance(itx.call, Call) else None
            if itx.state is TxState.CALLING:
                itx.move(TxState.TERMINATED)
            self._drop_invite_tx(itx)
            if call is not None and call.state is CallState.CALLING:
                out = call.outgoing
                why = out.cancel_reason if isinstance(out, Outgoing) else ""
                self._outgoing_over(call, 408, why or "no response to the INVITE", now)
            return
        # D, M: the transaction is over.
        if itx.state is not TxState.TERMINATED:
            itx.move(TxState.TERMINATED)
        self._drop_invite_tx(itx)

    def _drop_invite_tx(self, itx: InviteClientTransaction) -> None:
        self._timers.cancel_all(itx)
        if self._invite_txs.get(itx.branch) is itx:
            del self._invite_txs[itx.branch]
        itx.call = None

    def _outgoing_over(self, call: Call, status: int, reason: str, now: float) -> None:
        out = call.outgoing
        if isinstance(out, Outgoing):
            out.outcome = status
        self._events.append(OutgoingFailed(call.key, status, reason))
        self._end(call, reason)

    # ---- helpers ------------------------------------------------------------------------

    def _after(self, owner: TimerOwner, kind: str, delay: float, now: float) -> None:
        self._timers.set(owner, kind, now + delay)

    def _new_tx(self, req: Request, flow: Flow) -> ServerTransaction | None:
        if len(self._server_txs) >= self.config.max_transactions:
            self.stats.overloaded += 1
            self._stateless(req, flow, 503, [("Retry-After", "5")])
            return None
        invite = req.method == "INVITE"
        tx = ServerTransaction(
            key=server_key(req),
            request=req,
            reply_to=reply_destination(req, flow),
            invite=invite,
            state=TxState.PROCEEDING if invite else TxState.TRYING,
            retransmit_interval=self.t.t1,
        )
        self._server_txs[tx.key] = tx
        return tx

    def _drop_tx(self, tx: ServerTransaction) -> None:
        self._timers.cancel_all(tx)
        if self._server_txs.get(tx.key) is tx:
            del self._server_txs[tx.key]
        tx.call = None
        tx.request = None

    def _respond(
        self,
        tx: ServerTransaction,
        status: int,
        now: float,
        *,
        to_tag: str | None = None,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
    ) -> bytes:
        """Send a response in `tx` and move it on (timers G, H, J, L start here)."""
        req = tx.request
        if req is None or tx.reply_to is None:
            return b""
        if status > 100 and to_tag is None:
            to_tag = tx.to_tag or new_tag()
        if to_tag:
            tx.to_tag = to_tag
        dialog = req.method == "INVITE" and (status == 180 or 200 <= status < 300)
        all_headers = [*(headers or []), ("Server", self.config.user_agent)]
        response = build_response(
            req,
            tx.reply_to,
            status,
            to_tag=to_tag if status > 100 else None,
            headers=all_headers,
            body=body,
            record_route=dialog,
        )
        data = bytes(response)
        tx.last_response = data
        tx.last_status = status
        self._out.append(Transmit(tx.reply_to, data))
        reliable = tx.reply_to.reliable
        if tx.invite:
            if status < 200:
                tx.move(TxState.PROCEEDING)
            elif status < 300:
                tx.move(TxState.ACCEPTED)
                self._after(tx, "L", self.t.b, now)
            else:
                tx.move(TxState.COMPLETED)
                if not reliable:
                    self._after(tx, "G", tx.retransmit_interval, now)
                self._after(tx, "H", self.t.b, now)
        elif status < 200:
            tx.move(TxState.PROCEEDING)
        else:
            tx.move(TxState.COMPLETED)
            if reliable:
                tx.move(TxState.TERMINATED)
                self._drop_tx(tx)
            else:
                self._after(tx, "J", self.t.b, now)
        return data

    def _stateless(
        self,
        req: Request,
        flow: Flow,
        status: int,
        headers: list[tuple[str, str]],
        reason: str | None = None,
    ) -> None:
        if req.method == "ACK":
            return
        response = build_response(
            req,
            flow,
            status,
            reason=reason,
            to_tag=new_tag(),
            headers=[*headers, ("Server", self.config.user_agent)],
        )
        self._out.append(Transmit(reply_destination(req, flow), bytes(response)))

    def _bad_request(self, data: bytes, flow: Flow, why: str) -> None:
        """400 to a request we could not use, when it carries enough to address a reply."""
        try:
            msg = SipMessage.parse(data)
        except Exception:
            return
        if not hasattr(msg, "method") or getattr(msg, "method", "") in ("ACK", ""):
            return
        headers = msg.headers
        if not all(headers.get(h) for h in ("via", "from", "to", "call-id", "cseq")):
            return
        try:
            via = parse_via(headers.get("via")[0])
            if not via.host:
                return
            response = SipResponse(status_code=400, reason_phrase="Bad Request")
            for value in headers.get("via"):
                response.headers.append("Via", value)
            for name in ("from", "to", "call-id", "cseq"):
                response.headers.set_single(name.title(), headers.get_first(name) or "")
            response.headers.set_single("Warning", f'399 {self.config.host} "{why[:60]}"')
            data_out = bytes(response)
        except Exception:
            return
        port = via.port if via.port and 0 < via.port < 65536 else 5060
        dest = (
            flow if flow.reliable or "rport" in via.params else Flow("udp", (flow.remote[0], port))
        )
        self._out.append(Transmit(dest, data_out))

    def _tx_of(self, call: Call) -> ServerTransaction | None:
        tx = call.invite_tx
        return tx if isinstance(tx, ServerTransaction) and tx.request is not None else None

    def _contact(self, call: Call) -> str:
        return contact_uri(self.config.host, self.config.port, call.transport)

    def _dialog_headers(self, call: Call) -> list[tuple[str, str]]:
        return [("Contact", self._contact(call))]

    def _capabilities(self) -> list[tuple[str, str]]:
        return [("Allow", ALLOW), ("Accept", "application/sdp"), ("Supported", SUPPORTED)]

    def _ok_headers(self, call: Call) -> list[tuple[str, str]]:
        headers = [("Allow", ALLOW), ("Supported", SUPPORTED)]
        timer = call.timer
        if timer is not None:
            refresher = "uas" if timer.we_refresh else "uac"
            headers.append(("Session-Expires", f"{timer.interval};refresher={refresher}"))
            if timer.require_timer:
                headers.append(("Require", "timer"))
        return headers

    def _negotiate_timer(
        self, req: Request, call: Call | None = None
    ) -> tuple[int, list[tuple[str, str]], SessionTimer | None]:
        """RFC 4028 as UAS: (status, headers, timer); a session timer only when asked for."""
        msg = req.msg
        raw = msg.headers.get_first("session-expires") or msg.headers.get_first("x")
        if not raw:
            return 0, [], None
        interval, refresher = parse_session_expires(raw)
        if interval <= 0:
            return 400, [], None
        if interval < self.config.min_se:
            return 422, [("Min-SE", str(self.config.min_se))], None
        supported = "timer" in header_list(msg, "supported")
        allows_update = (
            call.peer_allows_update if call else peer_allows_update(header_list(msg, "allow"))
        )
        if refresher not in ("uac", "uas") or (refresher == "uac" and not supported):
            refresher = "uac" if supported else "uas"
        if refresher == "uas" and not allows_update:
            if not supported:
                return 0, [], None  # we could refresh only with re-INVITEs: no session timer
            refresher = "uac"
        return 0, [], SessionTimer(interval, refresher == "uas", supported)

    def _arm_session_timer(self, call: Call, now: float) -> None:
        self._timers.cancel(call, "session_expiry")
        self._timers.cancel(call, "session_refresh")
        timer = call.timer
        if timer is None:
            return
        if timer.we_refresh:
            self._after(call, "session_refresh", timer.interval / 2, now)
        else:
            self._after(call, "session_expiry", watchdog_delay(timer.interval), now)

    def _await_ack(self, call: Call, data: bytes, dest: Flow, cseq: int, now: float) -> None:
        """Retransmit this 2xx until its ACK (T1 doubling to T2), give up after 64*T1."""
        call.ok_data = data
        call.ok_cseq = cseq
        call.ok_dest = dest
        call.ok_interval = self.t.t1
        self._after(call, "ok", self.t.t1, now)
        self._after(call, "ack_timeout", self.t.b, now)

    def _request(
        self, call: Call, method: str, now: float, headers: list[tuple[str, str]] | None = None
    ) -> ClientTransaction:
        request, branch, host, port = call.next_request(
            method, self.config.host, self.config.port, self._contact(call)
        )
        request.headers.set_single("User-Agent", self.config.user_agent)
        for name, value in headers or ():
            request.headers.append(name, value)
        data = bytes(request)
        if call.transport == "tcp":
            dest = Flow("tcp", call.flow.remote if call.symmetric else (host, port),
                        call.flow.conn_id)  # fmt: skip
        else:
            dest = Flow("udp", (host, port))
        ctx = ClientTransaction(
            branch=branch, method=method, data=data, dest=dest, interval=self.t.t1, call=call
        )
        self._client_txs[branch] = ctx
        self._out.append(Transmit(dest, data))
        if not dest.reliable:
            self._after(ctx, "E", self.t.t1, now)
        self._after(ctx, "F", self.t.b, now)
        return ctx

    def _bye(self, call: Call, now: float, reason: str, *, notify: bool = True) -> None:
        if call.state in (CallState.TERMINATING, CallState.ENDED):
            return
        for kind in ("ok", "ack_timeout", "session_expiry", "session_refresh"):
            self._timers.cancel(call, kind)
        call.ok_data = b""
        call.move(CallState.TERMINATING)
        call.end_reason = reason
        self._request(call, "BYE", now)
        if notify:
            self._events.append(CallEnded(call.key, reason))

    def _end(self, call: Call, reason: str) -> None:
        call.end_reason = call.end_reason or reason
        if call.state is not CallState.ENDED:
            call.move(CallState.ENDED)
        self._forget(call)

    def _forget(self, call: Call) -> None:
        if call.state is not CallState.ENDED:
            call.move(CallState.ENDED)
        self._timers.cancel_all(call)
        if self._calls.get(call.key) is call:
            del self._calls[call.key]
        call.invite_tx = None
        call.ok_data = b""

    def _house_keep(self, now: float, force: bool = False) -> None:
        """Forget full rate buckets and expired nonces, on a timer while there are any."""
        if "house" in self._house.timers and not force:
            return
        self._rate.prune(now)
        if self.digest is not None:
            self.digest.expire(now)
        if len(self._rate) or (self.digest is not None and self.digest.held()):
            self._timers.set(self._house, "house", now + HOUSEKEEPING_S)


def _auth_user(authorization: str | None) -> str:
    """The username of an Authorization header, "" when it has none."""
    try:
        return str(parse_auth(authorization or "", credentials=True).params.get("username", ""))
    except Exception:
        return ""


def _tag_of(raw: str | None) -> str:
    try:
        return parse_address(raw or "").tag or ""
    except Exception:
        return ""


def _user(raw: str | None) -> str | None:
    if not raw:
        return None
    try:
        user = parse_address(raw).uri.user
    except Exception:
        return None
    return user[:64] if user else None


def _host(address: str) -> str:
    """The host (and port) of a name-addr's URI: where the caller's side routes numbers."""
    try:
        uri = parse_address(address).uri
    except Exception:
        return ""
    if not uri.host:
        return ""
    return f"{uri.host}:{uri.port}" if uri.port else str(uri.host)


def _uri_text(values: list[str]) -> str:
    if not values:
        return ""
    try:
        uri = parse_address(values[0]).uri
    except Exception:
        return ""
    return stringify_uri(uri) if uri.host else ""


__all__ = [
    "CallCancelled",
    "CallConfirmed",
    "CallEnded",
    "CallKey",
    "DtmfReceived",
    "IncomingCall",
    "MediaUpdated",
    "OutgoingAnswered",
    "OutgoingFailed",
    "OutgoingProgress",
    "ReferAnswered",
    "ReferNotified",
    "SipEvent",
    "Transmit",
    "UasConfig",
    "UserAgentServer",
]
