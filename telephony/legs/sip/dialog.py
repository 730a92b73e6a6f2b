"""A call as the UAS sees it: the dialog of RFC 3261 section 12 plus its offer/answer state.

The call is one explicit state machine (`CallState`, `move`). Its dialog half (tags, route set,
remote target, CSeqs) builds the requests we send inside it (BYE, UPDATE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from aiosipua import SipRequest
from aiosipua.headers import parse_address, parse_uri, stringify_uri

from telephony.legs.sip.errors import SipError
from telephony.legs.sip.message import Flow, Transport, new_branch
from telephony.legs.sip.refer import Refer
from telephony.legs.sip.sdp import Direction, LocalMedia, RemoteMedia
from telephony.legs.sip.timers import TimerOwner


class IllegalCallTransition(SipError):
    """A call state change the call's state machine does not allow."""


class CallState(StrEnum):
    CALLING = "calling"  # our INVITE sent (an outgoing call), no 2xx yet
    OFFERED = "offered"  # INVITE received, no final response yet
    ANSWERED = "answered"  # 2xx sent, ACK not yet received
    CONFIRMED = "confirmed"  # ACK received
    TERMINATING = "terminating"  # our BYE sent, not yet answered
    ENDED = "ended"


_CALL_TRANSITIONS: dict[CallState, frozenset[CallState]] = {
    CallState.CALLING: frozenset({CallState.CONFIRMED, CallState.ENDED}),
    CallState.OFFERED: frozenset({CallState.ANSWERED, CallState.ENDED}),
    CallState.ANSWERED: frozenset({CallState.CONFIRMED, CallState.TERMINATING, CallState.ENDED}),
    CallState.CONFIRMED: frozenset({CallState.TERMINATING, CallState.ENDED}),
    CallState.TERMINATING: frozenset({CallState.ENDED}),
    CallState.ENDED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class CallKey:
    """Names one call: its Call-ID and our (random, unique) tag."""

    call_id: str
    local_tag: str


@dataclass(slots=True)
class SessionTimer:
    """RFC 4028 as negotiated: the interval and who refreshes."""

    interval: int
    we_refresh: bool
    require_timer: bool  # the peer supports timers, so our 2xx says Require: timer


@dataclass(eq=False, slots=True)
class Call(TimerOwner):
    """One incoming call and its dialog."""

    key: CallKey = field(default_factory=lambda: CallKey("", ""))
    state: CallState = CallState.OFFERED
    remote_tag: str = ""
    flow: Flow = field(default_factory=lambda: Flow("udp", ("", 0)))
    transport: Transport = "udp"
    # Dialog state (RFC 3261 12.1.1): route set as in Record-Route, remote target from Contact.
    route_set: list[str] = field(default_factory=list)
    remote_target: str = ""
    remote_cseq: int = 0
    local_cseq: int = 1
    local_from: str = ""  # our From in requests we send: the INVITE's To with our tag
    remote_to: str = ""  # their address in requests we send: the INVITE's From
    symmetric: bool = False  # send in-dialog requests back to the source (NAT), not Contact
    # Offer/answer.
    invite_tx: object | None = None
    remote: RemoteMedia | None = None
    local: LocalMedia | None = None
    offer_body: bytes = b""  # the peer's latest offer (empty: INVITE without SDP)
    our_sdp: bytes = b""
    sdp_version: int = 1
    direction: Direction = "sendrecv"  # ours, as answered
    awaiting_answer: bool = False  # we offered in a 2xx; the answer comes in the ACK
    # The 2xx waiting for its ACK (initial INVITE or re-INVITE), retransmitted until it comes.
    ok_data: bytes = b""
    ok_cseq: int = 0
    ok_interval: float = 0.0
    ok_dest: Flow | None = None
    hangup_requested: bool = False  # end wanted before the ACK: BYE once it comes
    timer: SessionTimer | None = None
    peer_allows_update: bool = True
    refresh_pending: bool = False
    end_reason: str = ""
    refer: Refer | None = None  # our latest REFER (a transfer) and its subscription
    # An outgoing call (we sent the INVITE): see telephony/legs/sip/uac.py.
    outgoing: object | None = None

    def move(self, new: CallState) -> None:
        if new not in _CALL_TRANSITIONS[self.state]:
            raise IllegalCallTransition(f"call {self.state} -> {new}")
        self.state = new

    @property
    def live(self) -> bool:
        return self.state in (CallState.ANSWERED, CallState.CONFIRMED)

    def next_request(
        self,
        method: str,
        via_host: str,
        via_port: int,
        contact: str,
        *,
        cseq: int | None = None,
    ) -> tuple[SipRequest, str, str, int]:
        """An in-dialog request; returns (request, branch, destination host, port). `cseq`:
        the ACK of a 2xx takes its INVITE's number instead of the next one."""
        if cseq is None:
            self.local_cseq += 1
            cseq = self.local_cseq
        target = self.remote_target
        routes = list(self.route_set)
        uri = target
        if routes:
            first = parse_address(routes[0]).uri
            if "lr" not in first.params:
                # Strict router (RFC 3261 12.2.1.1): it goes in the Request-URI.
                first.headers = {}
                uri = stringify_uri(first)
                routes = [*routes[1:], f"<{target}>"]
            hop = first
        else:
            hop = parse_uri(target)
        branch = new_branch()
        transport = "TCP" if self.transport == "tcp" else "UDP"
        request = SipRequest(method=method, uri=uri)
        shown = f"[{via_host}]" if ":" in via_host else via_host
        request.headers.append(
            "Via", f"SIP/2.0/{transport} {shown}:{via_port};branch={branch};rport"
        )
        request.headers.set_single("Max-Forwards", "70")
        request.headers.set_single("From", self.local_from)
        request.headers.set_single("To", self.remote_to)
        request.headers.set_single("Call-ID", self.key.call_id)
        request.headers.set_single("CSeq", f"{cseq} {method}")
        for route in routes:
            request.headers.append("Route", route)
        request.headers.set_single("Contact", contact)
        host = hop.host.strip("[]")
        port = hop.port or 5060
        if self.symmetric and not self.route_set:
            host, port = self.flow.remote
        return request, branch, host, port
