"""SIP messages at the edge: aiosipua parses and serializes, we validate and build replies.

Everything that arrives is checked here before the transaction layer sees it: size, start
line, the mandatory headers (RFC 3261 section 8.1.1), a CSeq that parses and names the
method, a top Via with a sent-by, a Call-ID the `calls` table can hold, and a body as long as
its Content-Length. What fails is a `SipParseError`; the core answers 400 when it can.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from typing import Literal

from aiosipua import Address, SipMessage, SipRequest, SipResponse, Via
from aiosipua.headers import parse_address, parse_via, stringify_via

from telephony.legs.sip.errors import SipParseError

# aiosipua logs a warning per message whose body and Content-Length disagree; we reject those
# ourselves and count them, and one log line per hostile datagram would flood the log.
logging.getLogger("aiosipua.message").setLevel(logging.ERROR)

# A UDP datagram cannot be larger; over TCP a message this size is not a phone call.
MAX_MESSAGE_BYTES = 64 * 1024
# Call-IDs have no length limit in RFC 3261; real ones are under 100 characters. This bound
# keeps every Call-ID we accept storable (and indexable) whole in `calls.call_sid`.
MAX_CALL_ID = 1024
MAX_CSEQ = 2**31 - 1
SIP_VERSION = "SIP/2.0"
MAGIC_COOKIE = "z9hG4bK"

_TOKEN = re.compile(r"^[A-Za-z0-9.!%*_+`'~-]+$")
# RFC 3261 `callid = word [ "@" word ]`: printable ASCII without spaces.
_CALL_ID = re.compile(r"^[\x21-\x7e]+$")

REASONS: dict[int, str] = {
    100: "Trying",
    180: "Ringing",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    415: "Unsupported Media Type",
    416: "Unsupported URI Scheme",
    420: "Bad Extension",
    422: "Session Interval Too Small",
    480: "Temporarily Unavailable",
    481: "Call/Transaction Does Not Exist",
    482: "Loop Detected",
    483: "Too Many Hops",
    486: "Busy Here",
    487: "Request Terminated",
    488: "Not Acceptable Here",
    491: "Request Pending",
    500: "Server Internal Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "Version Not Supported",
}

Transport = Literal["udp", "tcp"]


@dataclass(frozen=True, slots=True)
class Flow:
    """Where a message came from, and so where its replies go.

    `conn_id` names the TCP connection it arrived on (replies go back on it); None for UDP.
    """

    transport: Transport
    remote: tuple[str, int]
    conn_id: int | None = None

    @property
    def reliable(self) -> bool:
        return self.transport == "tcp"


@dataclass(frozen=True, slots=True)
class Request:
    """A validated request: the aiosipua message plus the fields every layer needs."""

    msg: SipRequest
    method: str
    call_id: str
    cseq: int
    cseq_method: str
    top_via: Via
    from_tag: str | None
    to_tag: str | None

    @property
    def branch(self) -> str | None:
        return self.top_via.branch


@dataclass(frozen=True, slots=True)
class Response:
    """A validated response to one of our requests (BYE, UPDATE)."""

    msg: SipResponse
    status: int
    call_id: str
    cseq: int
    cseq_method: str
    top_via: Via


def _header_section_ok(data: bytes) -> bool:
    head, _, _ = data.partition(b"\r\n\r\n")
    # NUL never belongs in a header; no column or log line should carry one.
    return b"\x00" not in head


def _check_length(msg: SipMessage, data: bytes) -> None:
    raw = msg.headers.get_first("content-length")
    if raw is None:
        return
    text = raw.strip()
    if not text.isdigit():
        raise SipParseError(f"bad Content-Length {raw[:20]!r}")
    declared = int(text)
    _, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        _, sep, body = data.partition(b"\n\n")
    if declared > len(body):
        # RFC 3261 18.3: a datagram shorter than its Content-Length is an error.
        raise SipParseError("body shorter than Content-Length")


def _common(msg: SipMessage) -> tuple[str, int, str, Via]:
    for name in ("via", "from", "to", "call-id", "cseq"):
        if not msg.headers.get(name):
            raise SipParseError(f"missing {name}")
    call_id = (msg.call_id or "").strip()
    if not call_id or len(call_id) > MAX_CALL_ID or not _CALL_ID.match(call_id):
        raise SipParseError("bad Call-ID")
    if len(msg.headers.get("call-id")) != 1 or len(msg.headers.get("cseq")) != 1:
        raise SipParseError("repeated Call-ID or CSeq")
    parts = (msg.headers.get_first("cseq") or "").split()
    if len(parts) != 2 or not parts[0].isdigit() or not _TOKEN.match(parts[1]):
        raise SipParseError("bad CSeq")
    seq = int(parts[0])
    if seq > MAX_CSEQ:
        raise SipParseError("CSeq out of range")
    via = parse_via(msg.headers.get("via")[0])
    if via.protocol.upper() != SIP_VERSION or not via.host or via.transport not in ("UDP", "TCP"):
        raise SipParseError("bad Via")
    if via.port is not None and not 0 < via.port < 65536:
        raise SipParseError("bad Via port")
    return call_id, seq, parts[1], via


def _tag(raw: str | None) -> str | None:
    if raw is None:
        return None
    tag = parse_address(raw).tag
    return tag or None


def parse(data: bytes) -> Request | Response:
    """Validate one SIP message; raises SipParseError for anything we cannot use."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise SipParseError("message too large")
    if not _header_section_ok(data):
        raise SipParseError("NUL in headers")
    try:
        msg = SipMessage.parse(data)
        _check_length(msg, data)
        call_id, seq, cseq_method, via = _common(msg)
        if isinstance(msg, SipResponse):
            first_line = data.split(b"\n", 1)[0].decode("ascii", errors="replace")
            if not first_line.startswith(SIP_VERSION + " ") or not 100 <= msg.status_code <= 699:
                raise SipParseError("bad status line")
            return Response(msg, msg.status_code, call_id, seq, cseq_method, via)
        if not _TOKEN.match(msg.method):
            raise SipParseError("bad method")
        first_line = data.split(b"\n", 1)[0].decode("utf-8", errors="replace").strip()
        if not first_line.endswith(" " + SIP_VERSION):
            raise SipParseError("bad SIP version")
        return Request(
            msg,
            msg.method,
            call_id,
            seq,
            cseq_method,
            via,
            _tag(msg.headers.get_first("from")),
            _tag(msg.headers.get_first("to")),
        )
    except SipParseError:
        raise
    except Exception as exc:  # aiosipua raises ValueError, IndexError... on hostile input
        raise SipParseError(f"unparsable: {type(exc).__name__}") from None


def new_tag() -> str:
    return secrets.token_hex(8)


def new_branch() -> str:
    return MAGIC_COOKIE + secrets.token_hex(10)


def via_hops(request: Request) -> list[str]:
    """Each Via of `request`, top first, as the address it was received from: its `received`
    parameter (set by the next hop when the sent-by is not the packet's source), else its host.
    A Via that does not parse ends the list (nothing below it can be placed)."""
    hops: list[str] = []
    for value in request.msg.headers.get("via"):
        try:
            via = parse_via(value)
        except ValueError:
            break
        hop = via.params.get("received") or via.host
        if not hop:
            break
        hops.append(str(hop))
    return hops


def response_via(request: Request, flow: Flow) -> list[str]:
    """The request's Via values for a response, the top one with received/rport set."""
    values = list(request.msg.headers.get("via"))
    top = parse_via(values[0])
    source_ip, source_port = flow.remote
    if top.host.strip("[]") != source_ip:
        top.received = source_ip
    if "rport" in top.params:
        # RFC 3581: the client asked to learn its port; replies go to where it came from.
        top.rport = str(source_port)
        top.received = source_ip
    values[0] = stringify_via(top)
    return values


def reply_destination(request: Request, flow: Flow) -> Flow:
    """Where a response goes (RFC 3261 18.2.2, RFC 3581): the arriving connection over TCP,
    the source address over UDP (its port when the Via asked for rport)."""
    if flow.reliable:
        return flow
    if "rport" in request.top_via.params:
        return flow
    port = request.top_via.port or 5060
    return Flow("udp", (flow.remote[0], port))


def build_response(
    request: Request,
    flow: Flow,
    status: int,
    *,
    reason: str | None = None,
    to_tag: str | None = None,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    content_type: str | None = None,
    record_route: bool = False,
) -> SipResponse:
    """A response to `request`: Via (received/rport), From, To (+ our tag), Call-ID, CSeq."""
    response = SipResponse(status_code=status, reason_phrase=reason or REASONS.get(status, ""))
    for via in response_via(request, flow):
        response.headers.append("Via", via)
    src = request.msg.headers
    if record_route:
        # RFC 3261 12.1.1: a dialog-creating response copies every Record-Route, in order.
        for value in src.get("record-route"):
            response.headers.append("Record-Route", value)
    response.headers.set_single("From", src.get_first("from") or "")
    to_value = src.get_first("to") or ""
    if to_tag is not None and request.to_tag is None:
        to_value = f"{to_value};tag={to_tag}"
    response.headers.set_single("To", to_value)
    response.headers.set_single("Call-ID", request.call_id)
    response.headers.set_single("CSeq", f"{request.cseq} {request.cseq_method}")
    for name, value in headers or ():
        response.headers.append(name, value)
    if body:
        response.headers.set_single("Content-Type", content_type or "application/sdp")
    response.body = body
    return response


def contact_uri(host: str, port: int, transport: Transport, user: str = "voice-agent") -> str:
    """Our Contact URI; `transport=tcp` when the dialog runs over TCP."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    uri = f"sip:{user}@{shown}:{port}"
    if transport == "tcp":
        uri += ";transport=tcp"
    return f"<{uri}>"


def address_user(raw: str | None) -> str | None:
    """The user part of a From/To value (`sip:+15551230000@host` -> `+15551230000`)."""
    if not raw:
        return None
    try:
        addr: Address = parse_address(raw)
    except Exception:
        return None
    return addr.uri.user or None


def header_list(msg: SipMessage, name: str) -> list[str]:
    """Comma lists and repeated headers as one list of lowercase tokens (Supported, Require)."""
    tokens: list[str] = []
    for value in msg.headers.get(name):
        tokens.extend(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens
