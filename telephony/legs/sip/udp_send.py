"""UDP sends for the RTP clock thread that keep the GIL (libc's `sendto` through ctypes.PyDLL).

`socket.sendto` releases the GIL around its system call, so a thread sending a packet for each
of 100 calls asks for the GIL back 100 times a tick. While the event loop is busy each of those
waits up to the switch interval, and one tick of 100 calls spread over tens of milliseconds
(measured: 64 ms at worst, 3.6-7.6 ms on average). A non-blocking send on a UDP socket returns
at once (queued, or EAGAIN), so holding the GIL through it costs the loop a few microseconds,
and the clock thread needs the GIL once per tick.

Linux only (MSG_DONTWAIT, the sockaddr layouts); elsewhere, for a host that is not a literal
address, or a link-local address with a scope, the send is the socket's own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


def _load_sendto() -> Any:
    if not sys.platform.startswith("linux") or not MSG_DONTWAIT:
        return None
    try:
        libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        sendto = libc.sendto
    except (OSError, AttributeError):
        return None
    sendto.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint32,
    ]
    sendto.restype = ctypes.c_ssize_t
    return sendto


_SENDTO = _load_sendto()
# Whether sends keep the GIL (said once at the SIP listener's start).
KEEPS_GIL = _SENDTO is not None


def sockaddr(family: int, host: str, port: int) -> bytes | None:
    """`struct sockaddr_in` / `sockaddr_in6` for a literal address (IPv4 mapped into an IPv6
    socket), or None where only the socket module knows how (a name, a scoped address)."""
    try:
        if family == socket.AF_INET:
            return (
                struct.pack("=H", socket.AF_INET)
                + struct.pack("!H", port)
                + socket.inet_pton(socket.AF_INET, host)
                + bytes(8)
            )
        if family == socket.AF_INET6 and "%" not in host:
            if ":" not in host:
                host = "::ffff:" + host
            return (
                struct.pack("=H", socket.AF_INET6)
                + struct.pack("!HI", port, 0)
                + socket.inet_pton(socket.AF_INET6, host)
                + struct.pack("=I", 0)
            )
    except (OSError, ValueError, struct.error):
        return None
    return None


class GilSender:
    """`sock.sendto` that keeps the GIL: a callable of the same shape, for one socket."""

    __slots__ = ("_addr", "_family", "_sock", "_sockaddr")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._family = sock.family
        self._addr: tuple[str, int] | None = None
        self._sockaddr: bytes | None = None

    def __call__(self, data: bytes, addr: tuple[str, int]) -> int:
        if addr != self._addr:
            self._sockaddr = sockaddr(self._family, addr[0], addr[1])
            self._addr = addr
        target = self._sockaddr
        # The descriptor is read under the GIL, which socket.close() needs to let it go, so it
        # cannot be closed (and reused by another socket) before the send below returns.
        fd = self._sock.fileno()
        if target is None or fd < 0 or _SENDTO is None:
            return self._sock.sendto(data, addr)
        sent: int = _SENDTO(fd, data, len(data), MSG_DONTWAIT, target, len(target))
        if sent < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return sent


def sender(sock: socket.socket) -> Callable[[bytes, tuple[str, int]], int]:
    """The way the clock thread sends on `sock`: keeping the GIL where it can (a socket of
    this platform), else the object's own `sendto`."""
    return GilSender(sock) if KEEPS_GIL and isinstance(sock, socket.socket) else sock.sendto
