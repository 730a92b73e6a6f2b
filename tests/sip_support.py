"""A scripted SIP caller for the core's tests: builds the requests a UAC sends, parses replies."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from aiosipua import SipMessage, SipResponse

SDP_PCMU = (
    "v=0\r\n"
    "o=caller 1 1 IN IP4 {ip}\r\n"
    "s=-\r\n"
    "c=IN IP4 {ip}\r\n"
    "t=0 0\r\n"
    "m=audio {port} RTP/AVP {formats}\r\n"
    "a=rtpmap:0 PCMU/8000\r\n"
    "a=rtpmap:8 PCMA/8000\r\n"
    "a=rtpmap:{dtmf} telephone-event/8000\r\n"
    "a=fmtp:{dtmf} 0-15\r\n"
    "a=ptime:20\r\n"
    "a={direction}\r\n"
)


def sdp_offer(
    ip: str = "127.0.0.1",
    port: int = 40000,
    formats: str = "0 8 101",
    dtmf: int = 101,
    direction: str = "sendrecv",
) -> bytes:
    return SDP_PCMU.format(
        ip=ip, port=port, formats=formats, dtmf=dtmf, direction=direction
    ).encode()


@dataclass
class Uac:
    """One caller's dialog state, enough to script a call against the core by hand."""

    ip: str = "127.0.0.1"
    port: int = 5070
    transport: str = "UDP"
    call_id: str = field(default_factory=lambda: secrets.token_hex(12) + "@caller")
    from_tag: str = field(default_factory=lambda: secrets.token_hex(4))
    to_tag: str | None = None
    cseq: int = 1
    invite_branch: str = ""
    invite_cseq: int = 1
    extra_headers: list[str] = field(default_factory=list)

    def _request(
        self,
        method: str,
        *,
        cseq: int | None = None,
        branch: str | None = None,
        body: bytes = b"",
        headers: list[str] | None = None,
        to_tag: str | None = None,
        content_type: str = "application/sdp",
    ) -> bytes:
        branch = branch or "z9hG4bK" + secrets.token_hex(8)
        tag = to_tag if to_tag is not None else self.to_tag
        to = "<sip:agent@127.0.0.1>" + (f";tag={tag}" if tag else "")
        lines = [
            f"{method} sip:agent@127.0.0.1:5060 SIP/2.0",
            f"Via: SIP/2.0/{self.transport} {self.ip}:{self.port};branch={branch};rport",
            "Max-Forwards: 70",
            f"From: <sip:+15551230000@{self.ip}>;tag={self.from_tag}",
            f"To: {to}",
            f"Call-ID: {self.call_id}",
            f"CSeq: {cseq if cseq is not None else self.cseq} {method}",
            f"Contact: <sip:caller@{self.ip}:{self.port}>",
            *self.extra_headers,
            *(headers or []),
        ]
        if body:
            lines.append(f"Content-Type: {content_type}")
        lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    def invite(self, body: bytes | None = None, headers: list[str] | None = None) -> bytes:
        self.invite_branch = "z9hG4bK" + secrets.token_hex(8)
        self.invite_cseq = self.cseq
        return self._request(
            "INVITE",
            branch=self.invite_branch,
            body=sdp_offer() if body is None else body,
            headers=headers,
            to_tag="",
        )

    def reinvite(self, body: bytes = b"", headers: list[str] | None = None) -> bytes:
        self.cseq += 1
        self.invite_branch = "z9hG4bK" + secrets.token_hex(8)
        self.invite_cseq = self.cseq
        return self._request("INVITE", branch=self.invite_branch, body=body, headers=headers)

    def retransmit_invite(self, body: bytes | None = None) -> bytes:
        return self._request(
            "INVITE",
            branch=self.invite_branch,
            cseq=self.invite_cseq,
            body=sdp_offer() if body is None else body,
            to_tag="",
        )

    def ack(self, body: bytes = b"", *, non_2xx: bool = False) -> bytes:
        # ACK for a non-2xx is part of the INVITE transaction: same branch.
        return self._request(
            "ACK",
            cseq=self.invite_cseq,
            branch=self.invite_branch if non_2xx else None,
            body=body,
        )

    def cancel(self) -> bytes:
        return self._request("CANCEL", cseq=self.invite_cseq, branch=self.invite_branch, to_tag="")

    def bye(self) -> bytes:
        self.cseq += 1
        return self._request("BYE")

    def update(self, body: bytes = b"", headers: list[str] | None = None) -> bytes:
        self.cseq += 1
        return self._request("UPDATE", body=body, headers=headers)

    def options(self, in_dialog: bool = False) -> bytes:
        self.cseq += 1
        return self._request("OPTIONS", to_tag=None if in_dialog else "")

    def info_dtmf(self, digit: str) -> bytes:
        self.cseq += 1
        body = f"Signal={digit}\r\nDuration=160\r\n".encode()
        return self._request("INFO", body=body, content_type="application/dtmf-relay")

    def notify(
        self,
        sipfrag: bytes,
        *,
        terminated: bool = False,
        event: str = "refer",
        content_type: str = "message/sipfrag;version=2.0",
    ) -> bytes:
        """A NOTIFY of the subscription a REFER of ours made (RFC 3515 2.4.4)."""
        self.cseq += 1
        state = "terminated;reason=noresource" if terminated else "active;expires=60"
        return self._request(
            "NOTIFY",
            body=sipfrag,
            headers=[f"Event: {event}", f"Subscription-State: {state}"],
            content_type=content_type,
        )

    def learn(self, response: SipResponse) -> None:
        """Take the To tag of a dialog-creating response."""
        to = response.to_addr
        if to is not None and to.tag and response.status_code < 300:
            self.to_tag = to.tag

    @staticmethod
    def reply_to(request_data: bytes, status: int) -> bytes:
        """A response to a request the core sent (BYE, UPDATE)."""
        req = SipMessage.parse(request_data)
        lines = [f"SIP/2.0 {status} OK"]
        for via in req.headers.get("via"):
            lines.append(f"Via: {via}")
        for name in ("From", "To", "Call-ID", "CSeq"):
            lines.append(f"{name}: {req.headers.get_first(name)}")
        lines.append("Content-Length: 0")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


def parsed(data: bytes) -> SipMessage:
    return SipMessage.parse(data)


class UdpPeer:
    """A UDP socket of a test caller (SIP or RTP): keeps what arrives, with arrival times."""

    def __init__(self) -> None:
        import asyncio

        self.got: list[tuple[float, bytes]] = []
        self.arrived = asyncio.Event()
        self.transport: asyncio.DatagramTransport | None = None
        self.port = 0

    @classmethod
    async def open(cls, host: str = "127.0.0.1") -> UdpPeer:
        """A socket on `host` (any 127.x address is this machine: another source)."""
        import asyncio

        peer = cls()
        loop = asyncio.get_running_loop()

        class _Protocol(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                peer.got.append((loop.time(), data))
                peer.arrived.set()

        transport, _ = await loop.create_datagram_endpoint(_Protocol, local_addr=(host, 0))
        peer.transport = transport
        peer.port = int(transport.get_extra_info("sockname")[1])
        return peer

    def send(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(data, addr)

    async def message(
        self,
        match: Callable[[SipMessage], bool],
        start: int = 0,
        within: float = 10.0,
    ) -> SipMessage:
        """The first SIP message from index `start` on that `match` accepts."""
        import asyncio

        async with asyncio.timeout(within):
            while True:
                for _, data in self.got[start:]:
                    try:
                        msg = SipMessage.parse(data)
                    except ValueError:
                        continue
                    if match(msg):
                        return msg
                self.arrived.clear()
                await self.arrived.wait()

    async def response(self, status: int, start: int = 0, within: float = 10.0) -> SipResponse:
        msg = await self.message(
            lambda m: isinstance(m, SipResponse) and m.status_code == status, start, within
        )
        assert isinstance(msg, SipResponse)
        return msg

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def rtp_port_of(sdp_body: str) -> int:
    for line in sdp_body.splitlines():
        if line.startswith("m=audio "):
            return int(line.split()[1])
    raise AssertionError("no m=audio line")
