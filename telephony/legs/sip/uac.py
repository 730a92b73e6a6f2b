"""Our side as the caller (a UAC, RFC 3261 sections 8.1, 13.2, 17.1): what one outgoing call
needs beside the dialog it shares with incoming calls, and the events the core gives about it.

The core (`UserAgentServer.invite`) sends the INVITE with our offer on the listener's own
socket, so responses come back to it; this module builds the requests and names the outcome:

    1xx      -> OutgoingProgress (180/183: it rings; 100 only stops timer A)
    401/407  -> the INVITE once more with digest credentials (aiosipua's `answer_challenge`)
    2xx      -> ACK (its own transaction, to the Contact through the route set), OutgoingAnswered
    3xx-6xx  -> ACK (inside the INVITE transaction), OutgoingFailed with the status
    ring timeout -> CANCEL once a provisional came (RFC 3261 9.1), then the 487
    no response in 64*T1 (timer B) -> OutgoingFailed 408
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from aiosipua import SipDigestAuth, SipRequest, SipResponse
from aiosipua.auth import answer_challenge
from aiosipua.headers import parse_address, parse_uri, stringify_uri

from telephony.legs.sip.dialog import CallKey
from telephony.legs.sip.sdp import Direction, RemoteMedia

# What an outgoing call's final status means to whoever placed it.
BUSY = frozenset({486, 600})
NO_ANSWER = frozenset({408, 480, 487})
DECLINED = frozenset({603})


def outcome_of(status: int) -> str:
    """`answered`, `busy`, `no_answer`, `declined` or `failed` for a final status."""
    if 200 <= status < 300:
        return "answered"
    if status in BUSY:
        return "busy"
    if status in NO_ANSWER:
        return "no_answer"
    if status in DECLINED:
        return "declined"
    return "failed"


@dataclass(frozen=True, slots=True)
class OutgoingProgress:
    """A provisional response to our INVITE (180 Ringing, 183 Session Progress)."""

    key: CallKey
    status: int


@dataclass(frozen=True, slots=True)
class OutgoingAnswered:
    """A 2xx to our INVITE: ACKed; media goes to `remote`."""

    key: CallKey
    remote: RemoteMedia
    direction: Direction  # ours, as the answer leaves it


@dataclass(frozen=True, slots=True)
class OutgoingFailed:
    """Our INVITE ended without a call: the final status (408 when nothing answered at all,
    487 after our CANCEL) and why."""

    key: CallKey
    status: int
    reason: str


@dataclass(eq=False, slots=True)
class Outgoing:
    """What an outgoing call keeps beside its dialog: the INVITE as sent (for the CANCEL and
    the retry with credentials), where it goes, and how it is going."""

    request_uri: str
    dest: tuple[str, int]
    route: str | None  # the outbound proxy's Route (loose routing), None: straight there
    invite: SipRequest = field(default_factory=lambda: SipRequest(method="INVITE", uri=""))
    branch: str = ""
    credentials: SipDigestAuth | None = None
    authenticated: bool = False  # one challenge answered already: a second one is final
    provisional: int = 0  # the last provisional status (a CANCEL waits for one)
    cancel_reason: str = ""  # a CANCEL is wanted (ring timeout, hung up)
    cancel_sent: bool = False
    ack_2xx: bytes = b""  # the ACK of the 2xx, resent for each retransmission of it
    ack_dest: tuple[str, int] | None = None
    outcome: int = 0  # the final status, once known


def new_call_id(host: str) -> str:
    return f"{secrets.token_hex(16)}@{host}"


def target_uri(destination: str, proxy_host: str | None) -> str:
    """A `sip:` URI as is; an E.164 number as `sip:+E164@<proxy host>;user=phone`."""
    destination = destination.strip()
    if destination.lower().startswith(("sip:", "sips:")):
        uri = parse_uri(destination)
        if not uri.host:
            raise ValueError("the SIP URI has no host")
        return stringify_uri(uri)
    if not proxy_host:
        raise ValueError("a number needs SIP_OUTBOUND_PROXY (its host names the number's domain)")
    return f"sip:{destination}@{proxy_host};user=phone"


def next_hop(uri: str) -> tuple[str, int]:
    """Where a request to `uri` goes without a proxy: its host and port (5060)."""
    parsed = parse_uri(uri)
    return parsed.host.strip("[]"), parsed.port or 5060


def ack_for_final(invite: SipRequest, response: SipResponse) -> SipRequest:
    """The ACK of a non-2xx final (RFC 3261 17.1.1.3): the INVITE's Request-URI, top Via,
    From, Call-ID, Route and CSeq number; the response's To (with its tag)."""
    ack = SipRequest(method="ACK", uri=invite.uri)
    ack.headers.append("Via", invite.headers.get("via")[0])
    ack.headers.set_single("Max-Forwards", "70")
    ack.headers.set_single("From", invite.headers.get_first("from") or "")
    ack.headers.set_single("To", response.headers.get_first("to") or "")
    ack.headers.set_single("Call-ID", invite.headers.get_first("call-id") or "")
    number = (invite.headers.get_first("cseq") or "1").split()[0]
    ack.headers.set_single("CSeq", f"{number} ACK")
    for route in invite.headers.get("route"):
        ack.headers.append("Route", route)
    return ack


def cancel_for(invite: SipRequest) -> SipRequest:
    """The CANCEL of a pending INVITE (RFC 3261 9.1): the same Request-URI, top Via (so the
    same branch), From, To, Call-ID, Route and CSeq number."""
    cancel = SipRequest(method="CANCEL", uri=invite.uri)
    cancel.headers.append("Via", invite.headers.get("via")[0])
    cancel.headers.set_single("Max-Forwards", "70")
    for name in ("From", "To", "Call-ID"):
        cancel.headers.set_single(name, invite.headers.get_first(name.lower()) or "")
    number = (invite.headers.get_first("cseq") or "1").split()[0]
    cancel.headers.set_single("CSeq", f"{number} CANCEL")
    for route in invite.headers.get("route"):
        cancel.headers.append("Route", route)
    return cancel


def authorization(
    credentials: SipDigestAuth, response: SipResponse, uri: str
) -> tuple[str, str] | None:
    """The Authorization (401) or Proxy-Authorization (407) header answering `response`'s
    challenge for an INVITE to `uri`; None when it cannot be answered (no challenge, an
    algorithm or qop we do not speak)."""
    try:
        return answer_challenge(credentials, response, response.status_code, "INVITE", uri)
    except (ValueError, KeyError):
        return None


def route_set_of(response: SipResponse) -> list[str]:
    """A UAC's route set: the 2xx's Record-Route in reverse (RFC 3261 12.1.2)."""
    values: list[str] = []
    for header in response.headers.get("record-route"):
        values.extend(v.strip() for v in _split_commas(header) if v.strip())
    return list(reversed(values))


def contact_of(response: SipResponse) -> str:
    values = response.headers.get("contact")
    if not values:
        return ""
    try:
        uri = parse_address(values[0]).uri
    except Exception:
        return ""
    return stringify_uri(uri) if uri.host else ""


def _split_commas(value: str) -> list[str]:
    """`<a>, <b;lr>` -> ["<a>", "<b;lr>"] (commas inside <> or quotes stay)."""
    parts: list[str] = []
    depth = 0
    quoted = False
    start = 0
    for i, ch in enumerate(value):
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch == "<":
            depth += 1
        elif not quoted and ch == ">":
            depth -= 1
        elif ch == "," and depth == 0 and not quoted:
            parts.append(value[start:i])
            start = i + 1
    parts.append(value[start:])
    return parts
