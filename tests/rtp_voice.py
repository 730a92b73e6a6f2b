"""A far end's media in tests of our SIP calls: an RTP socket that records what our side sends
(with when) and speaks back (PCMU, paced at 20 ms, from the same socket) a voice made with
eSpeak NG, a tone, or silence: a person's "Hello?", an answering machine's greeting and beep."""

from __future__ import annotations

import asyncio
import math
import re
import shutil
import struct
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from telephony import audio
from tests.e2e_support import wait_until

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None, reason="espeak-ng is not installed"
)
SILENCE = 0xFF  # PCMU
GREETING = (
    "Hi, you have reached Alex. I cannot take your call right now. "
    "Please leave a message after the tone."
)


def speech(text: str) -> bytes:
    """`text` spoken by eSpeak NG, 16-bit 8 kHz."""
    wav = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True, check=True).stdout
    return audio.wav_to_pcm16(wav)


def beep(ms: int, hz: float = 1000.0) -> bytes:
    n = 8 * ms
    samples = (int(8000 * math.sin(2 * math.pi * hz * i / 8000)) for i in range(n))
    return struct.pack(f"<{n}h", *samples)


def quiet(ms: int) -> bytes:
    return b"\x00\x00" * 8 * ms


class Ear(asyncio.DatagramProtocol):
    """The far end's RTP socket: what our side sent, when (wall clock and loop time)."""

    def __init__(self) -> None:
        self.packets: list[tuple[float, bytes]] = []  # (time.time(), packet)
        self.timed: list[tuple[float, bytes]] = []  # (loop time, packet)
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.packets.append((time.time(), data))
        self.timed.append((asyncio.get_running_loop().time(), data))

    def speech(self) -> list[float]:
        """When each packet carrying sound (not PCMU silence) came (wall clock)."""
        return [
            at
            for at, p in self.packets
            if len(p) > 12 and p[1] & 0x7F == 0 and any(b != SILENCE for b in p[12:])
        ]

    def voiced_at(self) -> float | None:
        """When (loop time) the first packet of our side that was not near-silence came."""
        return next((t for t, data in self.timed if audio.rms(data[12:]) > 300), None)

    async def say(self, trace: Callable[[], str], pcm: bytes, *, first: bool = True) -> None:
        """Once our side's media flows, `pcm` (16-bit 8 kHz) toward the port of our offer,
        read from the far end's SIP trace (`trace()`: our INVITE's SDP)."""

        async def flowing() -> bool:
            return bool(self.packets)

        await wait_until(flowing, 20.0, "our RTP")
        sent_by_us = trace().split("SIP/2.0 100")[0]
        port = int(re.findall(r"m=audio (\d+) RTP/AVP", sent_by_us)[0])
        if first:
            await asyncio.sleep(0.5)  # the call is live: the detector listens
        mulaw = audio.pcm16_to_mulaw(pcm)
        assert self.transport is not None
        for seq, at in enumerate(range(0, len(mulaw), 160)):
            header = struct.pack("!BBHII", 0x80, 0, seq, seq * 160, 0x5EED)
            self.transport.sendto(header + mulaw[at : at + 160], ("127.0.0.1", port))
            await asyncio.sleep(0.02)


async def open_ear() -> tuple[asyncio.DatagramTransport, Ear, int]:
    """An Ear on a free local port: (transport, ear, port)."""
    loop = asyncio.get_running_loop()
    transport, ear = await loop.create_datagram_endpoint(Ear, local_addr=("127.0.0.1", 0))
    return transport, ear, transport.get_extra_info("sockname")[1]
