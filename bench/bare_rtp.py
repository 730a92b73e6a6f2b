"""Baseline for bench/sip_rtp.py: a bare asyncio RTP sender, no SIP, no bridge.

Usage: python bench/bare_rtp.py SECONDS PORT [PORT ...]. Sends one 20 ms G.711 silence packet
per stream per period to 127.0.0.1:PORT, each stream its own socket and task sleeping to
absolute deadlines (the plainest correct pacer), for SECONDS, then exits. It prints its
sockets' ports first, and reads and drops what arrives on them (the caller's audio).
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import sys

PERIOD_S = 0.02
SILENCE = b"\xff" * 160


class Sink(asyncio.DatagramProtocol):
    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        pass  # the caller's audio: an endpoint reads it, this one has nothing to do with it


async def stream(sock: socket.socket, port: int, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(Sink, sock=sock)
    seq, ts, ssrc = random.randrange(65536), random.randrange(2**32), random.randrange(2**32)
    start = loop.time()
    n = 0
    while loop.time() - start < seconds:
        n += 1
        header = struct.pack("!BBHII", 0x80, 0, seq, ts, ssrc)
        transport.sendto(header + SILENCE, ("127.0.0.1", port))
        seq = (seq + 1) & 0xFFFF
        ts = (ts + 160) & 0xFFFFFFFF
        await asyncio.sleep(max(0.0, start + n * PERIOD_S - loop.time()))
    transport.close()


async def main() -> None:
    seconds = float(sys.argv[1])
    ports = [int(p) for p in sys.argv[2:]]
    socks = []
    for _ in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
    print(" ".join(str(s.getsockname()[1]) for s in socks), flush=True)
    await asyncio.gather(*(stream(s, p, seconds) for s, p in zip(socks, ports, strict=True)))


if __name__ == "__main__":
    asyncio.run(main())
