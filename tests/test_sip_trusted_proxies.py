"""SIP_TRUSTED_PROXIES, tried from outside over real UDP and TCP sockets: behind a trusted SIP
proxy (a Kamailio dispatcher with record_route) the per-source limits count each request
against the caller in the Via below the proxy's own, not against the proxy; a request from
anyone else counts against its packet's source, whatever Vias it carries."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from typing import Any

from aiosipua import SipMessage, SipResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.legs.sip.access import AllowList, original_source
from telephony.legs.sip.digest import DigestAuth
from tests.sip_support import Uac, UdpPeer
from tests.sipp_support import sip_stack
from tests.test_sip_core import make
from tests.test_sip_limits import TcpPeer, _options_answered

PROXY = "127.0.0.1"  # the Kamailio of these tests (SIP_TRUSTED_PROXIES)
STRANGER = "127.0.0.2"  # allowed to send SIP (loopback), not a trusted proxy
LIMITS: dict[str, Any] = {
    "sip_trusted_proxies": f"{PROXY}/32",
    "sip_rate_per_source": 10,  # a burst of 10, then 10 a second
    # Every INVITE that passes the rate limit is challenged (401) and no call is set up:
    # what the burst measures is the rate limit alone.
    "sip_digest_users": "alice:s3cret",
}


def _caller_via(original: str) -> str:
    """The caller's Via as a proxy forwards it: its sent-by a private address, the proxy's
    `received` naming where the packet really came from."""
    branch = "z9hG4bK" + secrets.token_hex(8)
    return f"Via: SIP/2.0/UDP 192.168.1.20:5060;received={original};rport=5060;branch={branch}"


async def _burst(server: tuple[str, int], host: str, originals: list[str]) -> Counter[str]:
    """One INVITE from `host` per entry of `originals` (its second Via names it), sent back to
    back; the final responses, counted by `status reason`."""
    peer = await UdpPeer.open(host)
    try:
        uacs = {}
        for original in originals:
            uac = Uac(ip=host, port=peer.port, extra_headers=[_caller_via(original)])
            uacs[uac.call_id] = uac
            peer.send(uac.invite(), server)
        finals: dict[str, SipResponse] = {}
        async with asyncio.timeout(15):
            while len(finals) < len(uacs):
                for _, data in peer.got:
                    msg = SipMessage.parse(data)
                    call_id = msg.headers.get_first("call-id") or ""
                    if isinstance(msg, SipResponse) and msg.status_code >= 200:
                        if call_id in uacs and call_id not in finals:
                            finals[call_id] = msg
                            peer.send(uacs[call_id].ack(non_2xx=True), server)
                peer.arrived.clear()
                if len(finals) < len(uacs):
                    await peer.arrived.wait()
        return Counter(f"{m.status_code} {m.reason_phrase}" for m in finals.values())
    finally:
        peer.close()


async def test_forty_invites_through_a_trusted_proxy_from_forty_callers_are_none_refused(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, **LIMITS) as stack:
        sip = stack.service.runtime.sip
        server = ("127.0.0.1", sip.port)
        callers = [f"198.51.100.{n}" for n in range(1, 41)]
        through_proxy = await _burst(server, PROXY, callers)
        # The proxy is not exempt: one caller behind it still gets its own rate.
        one_caller = await _burst(server, PROXY, ["203.0.113.7"] * 40)
    print(f"40 callers through the proxy: {dict(through_proxy)}; one caller: {dict(one_caller)}")
    assert through_proxy == Counter({"401 Unauthorized": 40})
    assert one_caller["503 Rate Limited"] >= 20, one_caller
    assert one_caller["401 Unauthorized"] >= 10, one_caller
    assert sip.core.stats.rate_limited == one_caller["503 Rate Limited"]


async def test_an_untrusted_source_counts_as_itself_whatever_vias_it_writes(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, **LIMITS) as stack:
        sip = stack.service.runtime.sip
        server = ("127.0.0.1", sip.port)
        callers = [f"198.51.100.{n}" for n in range(1, 41)]
        spoofed = await _burst(server, STRANGER, callers)
        # Nothing was counted against the callers the stranger named: through the proxy,
        # each of them still has its whole burst.
        named = await _burst(server, PROXY, callers[:10])
    print(f"40 INVITEs from an untrusted source naming 40 callers: {dict(spoofed)}")
    assert spoofed["503 Rate Limited"] >= 20, spoofed
    assert spoofed["401 Unauthorized"] >= 10, spoofed
    assert named == Counter({"401 Unauthorized": 10})


async def test_a_trusted_proxy_holds_more_tcp_connections_than_one_sources_share(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(
        engine, sip_tcp_max_per_source=2, sip_trusted_proxies=f"{PROXY}/32"
    ) as stack:
        port = stack.service.runtime.sip.port
        peers = [await TcpPeer.open(port) for _ in range(5)]
        try:
            answered = [await _options_answered(peer) for peer in peers]
        finally:
            for peer in peers:
                peer.close()
        assert answered == [True] * 5
        assert stack.service.runtime.sip.transport.refused_per_source == 0


# ---- the sans-I/O core and the rule itself ------------------------------------------------

TRUSTED = AllowList.from_spec("10.0.0.0/24")


def test_the_source_is_the_hop_below_each_trusted_proxy_and_never_below_an_untrusted_one() -> None:
    hops = ["10.0.0.5", "10.0.0.6", "198.51.100.7", "10.0.0.9"]
    # A chain of trusted proxies: the first hop that is not one.
    assert original_source("10.0.0.5", hops, TRUSTED) == "198.51.100.7"
    # Below an untrusted hop nothing is believed, even a trusted-looking address.
    assert original_source("203.0.113.1", hops, TRUSTED) == "203.0.113.1"
    assert original_source("10.0.0.5", ["10.0.0.5"], TRUSTED) == "10.0.0.5"  # its own request
    assert original_source("10.0.0.5", ["10.0.0.5", "[2001:DB8::1]"], TRUSTED) == "2001:db8::1"


def test_digest_back_off_behind_a_trusted_proxy_is_per_caller() -> None:
    """One caller's wrong passwords behind the proxy hold back that caller, not the proxy."""
    from aiosipua import SipDigestAuth
    from aiosipua.auth import answer_challenge

    from telephony.legs.sip.message import Flow

    h = make(
        digest=DigestAuth({"alice": "s3cret"}, failures_allowed=0, backoff_max_s=60),
        trusted_proxies=AllowList.from_spec(f"{PROXY}/32"),
        rate_per_source=0.0,
    )
    proxy = Flow("udp", (PROXY, 5070))

    def attempt(original: str, password: str) -> SipResponse:
        uac = Uac(extra_headers=[_caller_via(original)])
        challenge = h.feed(uac.invite(), proxy)[-1]
        assert isinstance(challenge, SipResponse) and challenge.status_code == 401
        h.feed(uac.ack(non_2xx=True), proxy)
        uri = "sip:agent@127.0.0.1:5060"
        creds = answer_challenge(SipDigestAuth("alice", password), challenge, 401, "INVITE", uri)
        assert creds is not None
        uac.cseq += 1
        final = h.feed(uac.invite(headers=[f"{creds[0]}: {creds[1]}"]), proxy)[-1]
        assert isinstance(final, SipResponse)
        return final

    assert attempt("198.51.100.1", "guess-1").status_code == 403
    blocked = attempt("198.51.100.1", "s3cret")
    assert blocked.status_code == 403
    assert "too many failed attempts" in (blocked.headers.get_first("warning") or "")
    # Another caller through the same proxy is not held back by the first one's guesses.
    other = attempt("198.51.100.2", "s3cret")
    assert other.status_code == 100 and h.incoming()
