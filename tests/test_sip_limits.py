"""What one allowed host can still do to the SIP listener, tried from outside over real UDP
and TCP sockets: guess digest passwords, hold TCP connections, leave them idle."""

from __future__ import annotations

import asyncio
import contextlib

from aiosipua import SipDigestAuth, SipMessage, SipRequest, SipResponse
from aiosipua.auth import answer_challenge
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import wait_until
from tests.sip_support import Uac, UdpPeer, sdp_offer
from tests.sipp_support import sip_stack

URI = "sip:agent@127.0.0.1:5060"  # the Request-URI of tests.sip_support.Uac


def _final(msg: SipMessage) -> bool:
    return isinstance(msg, SipResponse) and msg.status_code >= 200


async def _attempt(
    peer: UdpPeer,
    server: tuple[str, int],
    user: str,
    password: str,
    challenge: SipResponse | None = None,
) -> tuple[SipResponse, SipResponse]:
    """One INVITE answering `challenge` (a fresh one is asked for when None): (the
    challenge used, the final response)."""
    if challenge is None:
        uac = Uac(port=peer.port)
        start = len(peer.got)
        peer.send(uac.invite(), server)
        got = await peer.message(_final, start=start)
        assert isinstance(got, SipResponse) and got.status_code == 401, got
        peer.send(uac.ack(non_2xx=True), server)
        challenge = got
    creds = answer_challenge(SipDigestAuth(user, password), challenge, 401, "INVITE", URI)
    assert creds is not None
    uac = Uac(port=peer.port)
    start = len(peer.got)
    peer.send(uac.invite(headers=[f"{creds[0]}: {creds[1]}"]), server)
    final = await peer.message(_final, start=start)
    assert isinstance(final, SipResponse)
    if final.status_code >= 300:
        peer.send(uac.ack(non_2xx=True), server)
    else:
        uac.learn(final)
        peer.send(uac.ack(), server)
        start = len(peer.got)
        peer.send(uac.bye(), server)
        await peer.response(200, start=start)
    return challenge, final


async def test_a_wrong_digest_response_burns_its_nonce(engine: AsyncEngine) -> None:
    async with sip_stack(engine, sip_digest_users="alice:s3cret") as stack:
        server = ("127.0.0.1", stack.service.runtime.sip.port)
        peer = await UdpPeer.open()
        try:
            challenge, wrong = await _attempt(peer, server, "alice", "guess-1")
            assert wrong.status_code == 403
            # The right password with the nonce of the failed guess: challenged afresh, as
            # stale (the nonce is gone), never admitted.
            _, again = await _attempt(peer, server, "alice", "s3cret", challenge)
            assert again.status_code == 401
            assert "stale=true" in (again.headers.get_first("www-authenticate") or "")
        finally:
            peer.close()
        assert stack.service.runtime.sip.core.stats.auth_failed == 1


async def test_digest_guesses_back_off_per_user_and_source_then_the_right_password_works(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(
        engine,
        sip_digest_users="alice:s3cret,bob:hunter2",
        sip_digest_failures_allowed=2,
        sip_digest_backoff_max_s=60.0,
        sip_rate_per_source=0,  # the INVITE rate limit is another test's; this one polls
    ) as stack:
        sip = stack.service.runtime.sip
        server = ("127.0.0.1", sip.port)
        peer = await UdpPeer.open()
        try:
            for n in range(3):  # two allowed, the third starts a 1 s back-off
                _, final = await _attempt(peer, server, "alice", f"guess-{n}")
                assert final.status_code == 403
                assert "too many" not in (final.headers.get_first("warning") or "")
            # Now even the right password is refused, unchecked, with the wait named.
            _, blocked = await _attempt(peer, server, "alice", "s3cret")
            assert blocked.status_code == 403
            assert "too many failed attempts" in (blocked.headers.get_first("warning") or "")
            assert sip.core.stats.auth_blocked == 1
            # Another user from the same source is not held back by alice's failures.
            _, other = await _attempt(peer, server, "bob", "nope")
            assert other.status_code == 403
            assert "too many" not in (other.headers.get_first("warning") or "")

            # Refused attempts do not count: the back-off ends on schedule and the right
            # password is admitted (answered 200, hung up).
            async def admitted() -> bool:
                _, final = await _attempt(peer, server, "alice", "s3cret")
                return final.status_code == 200

            await wait_until(admitted, 10, "alice admitted after her back-off")
            # The success cleared her count: one more wrong guess is a plain 403 again.
            _, final = await _attempt(peer, server, "alice", "guess-after")
            assert final.status_code == 403
            assert "too many" not in (final.headers.get_first("warning") or "")
        finally:
            peer.close()
        await wait_until(lambda: sip.live_calls() == 0, 15, "calls over")


# ---- SIP over TCP -----------------------------------------------------------------------


class TcpPeer:
    """One raw TCP connection to the listener, framing what comes back into messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.port = int(writer.get_extra_info("sockname")[1])
        self.pongs = 0

    @classmethod
    async def open(cls, port: int) -> TcpPeer:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def message(self, within: float = 5.0) -> SipMessage:
        async with asyncio.timeout(within):
            while True:
                first = await self.reader.readexactly(1)
                if first in b"\r\n":
                    self.pongs += first == b"\n"
                    continue
                head = first + await self.reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() in (b"content-length", b"l"):
                        length = int(value.strip())
                body = await self.reader.readexactly(length) if length else b""
                return SipMessage.parse(head + body)

    async def closed_by_server(self, within: float) -> bool:
        """True once the server closed the connection (EOF) within `within` seconds."""
        try:
            async with asyncio.timeout(within):
                while True:
                    data = await self.reader.read(4096)
                    if not data:
                        return True
        except (TimeoutError, ConnectionError):
            return False

    def close(self) -> None:
        self.writer.close()


async def _options_answered(peer: TcpPeer, uac: Uac | None = None) -> bool:
    uac = uac or Uac(port=peer.port, transport="TCP")
    peer.send(uac.options(in_dialog=uac.to_tag is not None))
    try:
        reply = await peer.message(within=3)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        return False
    return isinstance(reply, SipResponse) and reply.status_code == 200


async def test_one_source_gets_at_most_its_share_of_tcp_connections(engine: AsyncEngine) -> None:
    async with sip_stack(engine, sip_tcp_max_per_source=3) as stack:
        port = stack.service.runtime.sip.port
        transport = stack.service.runtime.sip.transport
        peers = [await TcpPeer.open(port) for _ in range(3)]
        try:
            for peer in peers:
                assert await _options_answered(peer)
            extra = await TcpPeer.open(port)
            try:
                assert await extra.closed_by_server(5), "a 4th connection was kept"
            finally:
                extra.close()
            assert transport.refused_per_source >= 1
            # A slot freed is a slot for the same source again.
            peers.pop().close()

            async def reconnected() -> bool:
                peer = await TcpPeer.open(port)
                if await _options_answered(peer):
                    peers.append(peer)
                    return True
                peer.close()
                return False

            await wait_until(reconnected, 10, "a new connection once one closed")
        finally:
            for peer in peers:
                peer.close()


async def test_an_idle_tcp_connection_is_closed_but_keepalives_and_a_live_dialog_keep_theirs(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, sip_tcp_idle_s=0.5) as stack:
        sip = stack.service.runtime.sip
        idle = await TcpPeer.open(sip.port)
        pinging = await TcpPeer.open(sip.port)
        calling = await TcpPeer.open(sip.port)
        rtp = await UdpPeer.open()
        ping_task: asyncio.Task[None] | None = None
        try:
            assert await _options_answered(idle)
            assert await _options_answered(pinging)
            # A call over TCP, answered and acknowledged on its connection.
            uac = Uac(port=calling.port, transport="TCP")
            calling.send(uac.invite(sdp_offer(port=rtp.port, formats="0 101")))
            while True:
                ok = await calling.message(within=10)
                if isinstance(ok, SipResponse) and ok.status_code >= 200:
                    break
            assert isinstance(ok, SipResponse) and ok.status_code == 200
            uac.learn(ok)
            calling.send(uac.ack())

            async def ping() -> None:
                while True:
                    pinging.send(b"\r\n\r\n")
                    await asyncio.sleep(0.2)

            ping_task = asyncio.create_task(ping())
            # The silent connection goes after its idle time; the others stay.
            assert await idle.closed_by_server(10), "an idle connection was kept"
            await wait_until(lambda: sip.transport.idle_closed >= 1, 5, "idle close counted")
            await asyncio.sleep(0)  # let the pings' pongs in
            assert await _options_answered(pinging) and pinging.pongs >= 1
            # The dialog's connection outlived the idle time: its in-dialog request is
            # answered on it, and the caller's BYE ends the call.
            assert await _options_answered(calling, uac)
            calling.send(uac.bye())
            while True:
                reply = await calling.message(within=10)
                if isinstance(reply, SipResponse) and reply.status_code == 200:
                    break
                if isinstance(reply, SipRequest):
                    continue
            await wait_until(lambda: sip.live_calls() == 0, 15, "call over")
            # With its dialog over, that connection is idle like any other.
            assert await calling.closed_by_server(10)
        finally:
            if ping_task is not None:
                ping_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ping_task
            for peer in (idle, pinging, calling):
                peer.close()
            rtp.close()
