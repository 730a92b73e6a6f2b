"""What both offline demos share (the Twilio leg's `demo` and the interconnect's
`demo_openai_sip`): the demo system of record, a free local socket, the wait bound and the
narrator's type. Each demo imports this; neither imports the other's internals.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable

from app.settings import Settings
from tools.restaurant.sor import Faults, SystemOfRecord

# The restaurant's system takes a moment, so the booking is visibly "requested, not yet
# confirmed" before the worker's commit is announced.
SOR_LATENCY_S = 1.0
# Repeated demo runs on one data directory must not fill tomorrow's 20:00 slot.
SOR_SEATS_PER_SLOT = 100_000
WAIT_S = 20.0

Say = Callable[[str], None]


async def start_demo_sor(settings: Settings, url: str) -> tuple[SystemOfRecord | None, str]:
    """The demo's system of record: SOR_BASE_URL's, or one started here (then returned, for
    the caller to stop), answering after SOR_LATENCY_S so the late announcement shows."""
    if settings.sor_base_url is not None:
        return None, settings.sor_base_url
    sor = SystemOfRecord(
        url,
        host="127.0.0.1",
        faults=Faults(latency_s=SOR_LATENCY_S),
        seats_per_slot=SOR_SEATS_PER_SLOT,
    )
    await sor.start()
    print(f"- system of record at {sor.url} (answers after {SOR_LATENCY_S:.1f} s)")
    return sor, sor.url


def demo_caller_number() -> str:
    """A new caller's number for each demo call (+1 555 01xx xxxx, never a real line).

    The data directory keeps earlier demos' bookings: one caller booking the same evening
    again is a conflict the engine rightly asks about, which is not the call the demo plays.
    """
    return f"+1555{secrets.randbelow(10**7):07d}"


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock
