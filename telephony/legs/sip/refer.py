"""A transfer we ask of the caller's side (REFER, RFC 3515): its target URI, the implicit
subscription it creates, and the `message/sipfrag` progress its NOTIFYs carry.

A warm transfer (our own dialog with the person, briefed first) refers the caller's side to the
person's Contact with `?Replaces=` naming that dialog (RFC 3891 section 5: `replaces_uri`), so
the caller's new INVITE takes our place in it.

The transferee (the caller's phone or trunk) places a new call to the Refer-To URI and reports
on it through NOTIFYs (`Event: refer`) whose bodies are the new call's status lines:
`SIP/2.0 100 Trying`, then a final one (`SIP/2.0 200 OK`, `SIP/2.0 486 Busy Here`) with
`Subscription-State: terminated`. The subscription is an explicit state machine (`ReferState`,
`move`), as calls and transactions are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import quote

from telephony.legs.sip.errors import SipError

E164 = re.compile(r"^\+[1-9][0-9]{6,14}$")
SIP_URI = re.compile(r"^sips?:[^\s<>\"]{1,250}@[^\s<>\"]{1,250}$")
HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253})(:[0-9]{1,5})?$")
SIPFRAG_STATUS = re.compile(r"^SIP/2\.0[ \t]+([1-6][0-9]{2})(?:[ \t]+(.*))?$")
MAX_SIPFRAG_BYTES = 4096


class IllegalReferTransition(SipError):
    """A change of a REFER's state its state machine does not allow."""


class ReferState(StrEnum):
    SENT = "sent"  # REFER out, no final response yet (a NOTIFY may already arrive: RFC 6665)
    ACCEPTED = "accepted"  # 2xx (202): the transferee is calling the target
    DONE = "done"  # refused, timed out, a final NOTIFY, or given up by the application


_REFER_TRANSITIONS: dict[ReferState, frozenset[ReferState]] = {
    ReferState.SENT: frozenset({ReferState.ACCEPTED, ReferState.DONE}),
    ReferState.ACCEPTED: frozenset({ReferState.DONE}),
    ReferState.DONE: frozenset(),
}


@dataclass(eq=False, slots=True)
class Refer:
    """One REFER of a call and its implicit subscription (`Event: refer;id=<cseq>`)."""

    refer_to: str
    cseq: int = 0
    state: ReferState = ReferState.SENT
    last_status: int = 0  # the last sipfrag status reported

    def move(self, new: ReferState) -> None:
        if new not in _REFER_TRANSITIONS[self.state]:
            raise IllegalReferTransition(f"refer {self.state} -> {new}")
        self.state = new

    @property
    def open(self) -> bool:
        """Whether NOTIFYs for it are still taken."""
        return self.state is not ReferState.DONE


def refer_to_uri(destination: str, domain: str) -> str:
    """The Refer-To URI for a transfer target: a `sip:`/`sips:` URI as it is; an E.164 number
    as `sip:+E164@<domain>;user=phone` (RFC 3261 19.1.6), which a trunk or PBX routes like a
    dialled number, where many phones and trunks cannot place a call to a bare `tel:` URI."""
    destination = destination.strip()
    if SIP_URI.match(destination):
        return destination
    if not E164.match(destination):
        raise ValueError(f"not an E.164 number or a sip: URI: {destination[:64]!r}")
    if not HOST.match(domain):
        raise ValueError(f"not a host to route a number through: {domain[:64]!r}")
    return f"sip:{destination}@{domain};user=phone"


def replaces_uri(contact: str, call_id: str, to_tag: str, from_tag: str) -> str:
    """The Refer-To URI that replaces a dialog: `contact` (the far UA's Contact in it) with the
    embedded header `Replaces: <call_id>;to-tag=<to_tag>;from-tag=<from_tag>`, escaped as an
    URI header (RFC 3891 section 5, RFC 3261 19.1.1). The tags are as the far UA, the one that
    gets the Replaces, sees them: `to_tag` its own, `from_tag` ours."""
    if not contact.lower().startswith(("sip:", "sips:")) or any(c in contact for c in ' <>"'):
        raise ValueError(f"not a SIP contact: {contact[:64]!r}")
    if not call_id or not to_tag or not from_tag:
        raise ValueError("a dialog to replace needs its Call-ID and both tags")
    value = f"{call_id};to-tag={to_tag};from-tag={from_tag}"
    separator = "&" if "?" in contact else "?"
    return f"{contact}{separator}Replaces={quote(value, safe='')}"


def sipfrag_status(body: bytes) -> tuple[int, str] | None:
    """The status line of a `message/sipfrag` body (RFC 3420) as (code, reason), or None when
    it holds none (a request line, garbage, an empty body)."""
    if not body or len(body) > MAX_SIPFRAG_BYTES:
        return None
    first = body.split(b"\n", 1)[0].rstrip(b"\r")
    try:
        line = first.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    match = SIPFRAG_STATUS.match(line)
    if match is None:
        return None
    reason = "".join(ch for ch in (match.group(2) or "") if ch.isprintable())
    return int(match.group(1)), reason.strip()[:80]


def event_id(value: str) -> tuple[str, str | None]:
    """`Event: refer;id=93` -> ("refer", "93")."""
    package, _, params = value.partition(";")
    ident: str | None = None
    for param in params.split(";"):
        name, _, val = param.partition("=")
        if name.strip().lower() == "id":
            ident = val.strip()
    return package.strip().lower(), ident


def subscription_terminated(value: str | None) -> bool:
    """Whether a Subscription-State header says `terminated` (RFC 6665 8.2.3)."""
    return (value or "").split(";", 1)[0].strip().lower() == "terminated"
