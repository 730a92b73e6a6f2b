"""Transactions of RFC 3261 section 17 (as amended by RFC 6026): server INVITE, server
non-INVITE, client INVITE and client non-INVITE, as explicit state machines. They hold no
sockets and no clocks; the core feeds them and runs their timers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from telephony.legs.sip.errors import SipError
from telephony.legs.sip.message import MAGIC_COOKIE, Flow, Request
from telephony.legs.sip.timers import TimerOwner


class IllegalTransition(SipError):
    """A transaction state change its state machine does not allow."""


class TxState(StrEnum):
    CALLING = "calling"  # INVITE client: sent, nothing heard yet (timers A, B)
    TRYING = "trying"
    PROCEEDING = "proceeding"
    COMPLETED = "completed"
    CONFIRMED = "confirmed"  # INVITE server: ACK for a non-2xx final received
    ACCEPTED = "accepted"  # INVITE server, RFC 6026: 2xx sent, retransmitted INVITEs absorbed
    TERMINATED = "terminated"


_INVITE_SERVER: dict[TxState, frozenset[TxState]] = {
    TxState.PROCEEDING: frozenset({TxState.PROCEEDING, TxState.ACCEPTED, TxState.COMPLETED}),
    TxState.ACCEPTED: frozenset({TxState.TERMINATED}),
    TxState.COMPLETED: frozenset({TxState.CONFIRMED, TxState.TERMINATED}),
    TxState.CONFIRMED: frozenset({TxState.TERMINATED}),
    TxState.TERMINATED: frozenset(),
}
# RFC 6026 17.1.1: a 2xx moves the client to ACCEPTED (timer M), where retransmitted 2xx
# (and those of other forks) are still passed up for their ACK.
_INVITE_CLIENT: dict[TxState, frozenset[TxState]] = {
    TxState.CALLING: frozenset(
        {TxState.PROCEEDING, TxState.ACCEPTED, TxState.COMPLETED, TxState.TERMINATED}
    ),
    TxState.PROCEEDING: frozenset({TxState.PROCEEDING, TxState.ACCEPTED, TxState.COMPLETED}),
    TxState.ACCEPTED: frozenset({TxState.TERMINATED}),
    TxState.COMPLETED: frozenset({TxState.TERMINATED}),
    TxState.TERMINATED: frozenset(),
}
_NON_INVITE: dict[TxState, frozenset[TxState]] = {
    TxState.TRYING: frozenset({TxState.PROCEEDING, TxState.COMPLETED, TxState.TERMINATED}),
    TxState.PROCEEDING: frozenset({TxState.PROCEEDING, TxState.COMPLETED, TxState.TERMINATED}),
    TxState.COMPLETED: frozenset({TxState.TERMINATED}),
    TxState.TERMINATED: frozenset(),
}

TxKey = tuple[str, ...]


def server_key(request: Request, method: str | None = None) -> TxKey:
    """RFC 3261 17.2.3: branch + sent-by + method (ACK and CANCEL look up their INVITE)."""
    method = method or request.method
    if method == "ACK":
        method = "INVITE"
    via = request.top_via
    sent_by = f"{via.host.lower()}:{via.port or 5060}"
    branch = request.branch or ""
    if branch.startswith(MAGIC_COOKIE):
        return ("3261", branch, sent_by, method)
    # RFC 2543 peers: no unique branch, so match on the request's identity instead.
    return (
        "2543",
        request.call_id,
        request.from_tag or "",
        str(request.cseq),
        sent_by,
        branch,
        method,
    )


@dataclass(eq=False, slots=True)
class ServerTransaction(TimerOwner):
    """One server transaction: the request, where replies go, and the last response sent."""

    key: TxKey = ()
    request: Request | None = None
    reply_to: Flow | None = None
    invite: bool = False
    state: TxState = TxState.TRYING
    last_response: bytes | None = None
    last_status: int = 0
    retransmit_interval: float = 0.0  # timer G's current value
    to_tag: str = ""  # our To tag in this transaction's responses (stable across retransmits)
    call: object | None = None  # the call this INVITE created, if any

    def move(self, new: TxState) -> None:
        table = _INVITE_SERVER if self.invite else _NON_INVITE
        if new not in table[self.state]:
            raise IllegalTransition(f"server transaction {self.state} -> {new}")
        self.state = new

    @property
    def final_sent(self) -> bool:
        return self.last_status >= 200


@dataclass(eq=False, slots=True)
class ClientTransaction(TimerOwner):
    """A non-INVITE request we sent (BYE, UPDATE), retransmitted until answered (timers E, F)."""

    branch: str = ""
    method: str = ""
    data: bytes = b""
    dest: Flow | None = None
    state: TxState = TxState.TRYING
    interval: float = 0.0  # timer E's current value
    call: object | None = None
    status: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def move(self, new: TxState) -> None:
        if new not in _NON_INVITE[self.state]:
            raise IllegalTransition(f"client transaction {self.state} -> {new}")
        self.state = new


@dataclass(eq=False, slots=True)
class InviteClientTransaction(TimerOwner):
    """An INVITE we sent (RFC 3261 17.1.1, RFC 6026): retransmitted until a response (timer
    A, doubling without a cap), given up after 64*T1 with none (timer B); a non-2xx final is
    ACKed inside it (and again for each retransmission, until timer D); a 2xx is passed to
    the call, whose ACK is its own transaction."""

    branch: str = ""
    data: bytes = b""
    dest: Flow | None = None
    state: TxState = TxState.CALLING
    interval: float = 0.0  # timer A's current value
    call: object | None = None
    cseq: int = 0
    ack: bytes = b""  # the ACK of a non-2xx final, resent for each retransmission of it

    def move(self, new: TxState) -> None:
        if new not in _INVITE_CLIENT[self.state]:
            raise IllegalTransition(f"INVITE client transaction {self.state} -> {new}")
        self.state = new
