"""RTP ports from SIP_RTP_PORTS (`20000-20999`, or `0` for whatever the OS gives)."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Callable

from telephony.legs.sip.errors import RtpPortsExhausted


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


# Port choice must not be guessable: a host spraying the range would find a new call's port at
# once if calls took the lowest free one (or the next in turn).
_RANDOM = random.SystemRandom()


class RtpPorts:
    """Hands out even RTP ports (RTCP would take the odd one above), chosen at random among the
    free ones of the whole range."""

    def __init__(self, spec: str) -> None:
        bounds = parse_range(spec)
        if bounds is None:
            self._ports: list[int] = []
        else:
            first = bounds[0] + bounds[0] % 2
            self._ports = list(range(first, bounds[1] + 1, 2))
        self._in_use: set[int] = set()

    async def bind(
        self,
        host: str,
        factory: Callable[[], asyncio.DatagramProtocol],
    ) -> tuple[asyncio.DatagramTransport, asyncio.DatagramProtocol, int, socket.socket]:
        """A UDP endpoint on a free port of the range (and its raw socket, for senders off the
        loop); RtpPortsExhausted when none is left."""
        candidates = [0] if not self._ports else self._shuffled()
        for port in candidates:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue  # taken by another process
            sock.setblocking(False)
            bound = int(sock.getsockname()[1])
            loop = asyncio.get_running_loop()
            transport, protocol = await loop.create_datagram_endpoint(factory, sock=sock)
            self._in_use.add(bound)
            return transport, protocol, bound, sock
        raise RtpPortsExhausted(f"all {len(self._ports)} RTP ports are in use")

    def _shuffled(self) -> list[int]:
        """Every free port, in random order (once a call: cheap beside the call's set-up)."""
        ports = [port for port in self._ports if port not in self._in_use]
        _RANDOM.shuffle(ports)
        return ports

    def release(self, port: int) -> None:
        self._in_use.discard(port)

    @property
    def in_use(self) -> int:
        return len(self._in_use)
