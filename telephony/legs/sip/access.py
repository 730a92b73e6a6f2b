"""Who may talk to the SIP listener: source CIDRs (checked before parsing), INVITE rates, and
which source the per-source limits count a request against (behind trusted SIP proxies)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Loopback only: every accepted INVITE opens a paid Realtime session, so deny by default.
DEFAULT_ALLOW_FROM = "127.0.0.0/8,::1/128"

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(spec: str, setting: str = "SIP_ALLOW_FROM") -> tuple[IpNetwork, ...]:
    """`10.0.0.0/8, 192.0.2.7` -> networks; ValueError names the entry that is not a CIDR."""
    networks: list[IpNetwork] = []
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{setting}: {entry!r} is not an address or CIDR") from None
    return tuple(networks)


class AllowList:
    """Source addresses allowed to reach the SIP core at all."""

    def __init__(self, networks: Iterable[IpNetwork]) -> None:
        self.networks = tuple(networks)
        self._cache: dict[str, bool] = {}

    @classmethod
    def from_spec(cls, spec: str) -> AllowList:
        return cls(parse_networks(spec))

    def allows(self, ip: str) -> bool:
        known = self._cache.get(ip)
        if known is not None:
            return known
        try:
            address = ipaddress.ip_address(ip.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        allowed = any(address in net for net in self.networks)
        if len(self._cache) >= 4096:
            self._cache.clear()  # a scan over many addresses must not grow this forever
        self._cache[ip] = allowed
        return allowed


# A Via host is a hostname at worst (RFC 3261 caps nothing): keys stay bounded all the same.
MAX_SOURCE_KEY = 255


def original_source(packet_source: str, hops: Sequence[str], trusted: AllowList) -> str:
    """The source the per-source limits count a request against.

    `hops` are the request's Vias from the top, each as its `received` (else its host). A
    request from a trusted proxy counts against the hop below the proxy's own Via, and so on
    down while that hop is itself a trusted proxy (a chain: edge, then dispatcher). Anything
    below an untrusted hop is the caller's own word: a caller who writes Vias still counts as
    the address its packets come from.
    """
    source = packet_source
    for hop in hops[1:]:
        if not trusted.allows(source):
            break
        hop = hop.strip().strip("[]").lower()[:MAX_SOURCE_KEY]
        if not hop:
            break
        source = hop
    return source


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """Token bucket per source: `rate` new INVITEs a second, bursts up to `rate` (at least 1).

    Buckets that are full again are forgotten, so a scan from many sources keeps no memory.
    """

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = max(1.0, rate)
        self._buckets: dict[str, _Bucket] = {}
        self._last_prune = 0.0

    def allow(self, source: str, now: float) -> bool:
        if self.rate <= 0:
            return True
        self._prune(now)
        bucket = self._buckets.get(source)
        if bucket is None:
            bucket = self._buckets[source] = _Bucket(self.burst, now)
        else:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def _prune(self, now: float) -> None:
        if now - self._last_prune >= 1.0:
            self.prune(now)

    def prune(self, now: float) -> None:
        """Forget the buckets that are full again."""
        self._last_prune = now
        if self.rate <= 0:
            return
        refill_s = self.burst / self.rate
        for source in [s for s, b in self._buckets.items() if now - b.at >= refill_s]:
            del self._buckets[source]

    def __len__(self) -> int:
        return len(self._buckets)
