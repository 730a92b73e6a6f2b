"""RTP ports from SIP_RTP_PORTS (`20000-20999`, or `0` for whatever the OS gives)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from telephony.sip.errors import RtpPortsExhausted


def parse_range(spec: str) -> tuple[int, int] | None:
    """`20000-20999` -> (20000, 20999); `0` -> None (ephemeral ports)."""
    spec = spec.strip()
    if spec in ("", "0"):
        return None
    low, sep, high = spec.partition("-")
    try:
        first, last = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"SIP_RTP_PORTS: {spec!r} is not a range like 20000-20999") from None
    if not 1024 <= first <= last <= 65535:
        raise ValueError(f"SIP_RTP_PORTS: {spec!r} must lie within 1024-65535")
    return first, last


class RtpPorts:
    """Hands out even RTP ports round-robin (RTCP would take the odd one above)."""

    def __init__(self, spec: str) -> None:
        bounds = parse_range(spec)
        if bounds is None:
            self._ports: list[int] = []
        else:
            first = bounds[0] + bounds[0] % 2
            self._ports = list(range(first, bounds[1] + 1, 2))
        self._in_use: set[int] = set()
        self._next = 0

    async def bind(
        self,
        host: str,
        factory: Callable[[], asyncio.DatagramProtocol],
    ) -> tuple[asyncio.DatagramTransport, asyncio.DatagramProtocol, int]:
        """A UDP endpoint on a free port of the range; RtpPortsExhausted when none is left."""
        loop = asyncio.get_running_loop()
        if not self._ports:
            transport, protocol = await loop.create_datagram_endpoint(factory, local_addr=(host, 0))
            port = int(transport.get_extra_info("sockname")[1])
            self._in_use.add(port)
            return transport, protocol, port
        for _ in range(len(self._ports)):
            port = self._ports[self._next]
            self._next = (self._next + 1) % len(self._ports)
            if port in self._in_use:
                continue
            try:
                transport, protocol = await loop.create_datagram_endpoint(
                    factory, local_addr=(host, port)
                )
            except OSError:
                continue  # taken by another process
            self._in_use.add(port)
            return transport, protocol, port
        raise RtpPortsExhausted(f"all {len(self._ports)} RTP ports are in use")

    def release(self, port: int) -> None:
        self._in_use.discard(port)

    @property
    def in_use(self) -> int:
        return len(self._in_use)
