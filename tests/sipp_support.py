"""Running the real sipp (Debian `sip-tester`) against the service, and a recording tool layer."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.scenario import Scenario
from telephony.tool_gateway import CallContext, FunctionCallRequest, ToolReply
from tests.e2e_support import Stack, call_stack
from tests.server_proc import free_port

SIPP = shutil.which("sipp")
SCENARIOS = Path(__file__).parent / "sipp"

# Skipped on a developer machine without sipp; under CI (.ci/run installs it) a missing sipp fails.
needs_sipp = pytest.mark.skipif(
    SIPP is None and not os.environ.get("CI"), reason="sipp (apt-get install sip-tester) missing"
)

# Where Debian's sip-tester puts the pcap files its uac_pcap scenario plays.
_PCAP_DIRS = ("/usr/share/sip-tester", "/usr/share/sipp", "/usr/share/doc/sip-tester/pcap")


def pcap_dir() -> Path:
    """The directory holding sipp's g711a.pcap and dtmf_2833_*.pcap."""
    for candidate in _PCAP_DIRS:
        if (Path(candidate) / "g711a.pcap").is_file():
            return Path(candidate)
    try:
        listing = subprocess.run(
            ["dpkg", "-L", "sip-tester"], capture_output=True, text=True, check=False, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    for line in listing.splitlines():
        if line.endswith("/g711a.pcap"):
            return Path(line).parent
    if os.environ.get("CI"):
        pytest.fail("sipp's pcap files (g711a.pcap) not found")
    pytest.skip("sipp's pcap files (g711a.pcap) not found")


def free_udp_port() -> int:
    """An even port free for UDP and TCP right now, for sipp's own sockets (sipp cannot take 0
    for -p or -mp), below the ephemeral range as the servers' ports are."""
    return free_port(udp=True, even=True)


@dataclass
class SippRun:
    returncode: int
    stdout: str
    stderr: str
    errors: str

    def explain(self) -> str:
        return (
            f"sipp exited {self.returncode}\n--- stdout (tail)\n{self.stdout[-3000:]}\n"
            f"--- stderr\n{self.stderr[-2000:]}\n--- errors\n{self.errors[-3000:]}"
        )


async def run_sipp(
    target_port: int,
    scenario: str,
    tmp: Path,
    *,
    calls: int = 1,
    limit: int = 1,
    rate: float = 10.0,
    transport: str = "u1",
    timeout_s: float = 60.0,
    extra: list[str] | None = None,
) -> SippRun:
    """Run sipp once to completion; `scenario` is a built-in name or a file in tests/sipp."""
    assert SIPP is not None, "sipp is not installed (apt-get install sip-tester)"
    local_port = free_udp_port()
    media_port = free_udp_port()
    errors = tmp / f"sipp-{local_port}-errors.log"
    if (SCENARIOS / scenario).is_file():
        which = ["-sf", str(SCENARIOS / scenario)]
    else:
        which = ["-sn", scenario]
    args = [
        SIPP,
        f"127.0.0.1:{target_port}",
        *which,
        "-i", "127.0.0.1",
        "-p", str(local_port),
        "-mp", str(media_port),
        "-t", transport,
        "-m", str(calls),
        "-l", str(limit),
        "-r", str(rate),
        "-nostdin",
        "-timeout", f"{int(timeout_s)}s",
        "-timeout_error",
        "-trace_err",
        "-error_file", str(errors),
        *(extra or []),
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *args,
        cwd=tmp,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout_s + 15):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
    text = errors.read_text(errors="replace") if errors.exists() else ""
    return SippRun(
        proc.returncode if proc.returncode is not None else -1,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        text,
    )


@dataclass
class RecordingGateway:
    """A tool layer that records what reaches it (digits, function calls, call ends)."""

    digits: list[tuple[str, str]] = field(default_factory=list)
    calls: list[FunctionCallRequest] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)

    def definitions(self) -> list[dict[str, Any]]:
        return []

    async def handle(self, ctx: CallContext, request: FunctionCallRequest) -> ToolReply:
        self.calls.append(request)
        return ToolReply({"ok": True})

    async def on_dtmf(self, ctx: CallContext, digit: str) -> None:
        self.digits.append((ctx.call_sid, digit))

    async def on_call_end(self, ctx: CallContext) -> None:
        self.ended.append(ctx.call_sid)


@asynccontextmanager
async def sip_stack(
    engine: AsyncEngine,
    scenario: Scenario | None = None,
    **overrides: Any,
) -> AsyncIterator[Stack]:
    """The service with a SIP listener on an ephemeral port and ephemeral RTP ports."""
    values: dict[str, Any] = {"sip_bind": "127.0.0.1:0", "sip_rtp_ports": "0", **overrides}
    async with call_stack(engine, scenario, **values) as stack:
        yield stack


def write_rtp_pcap(path: Path, payload: bytes, payload_type: int, frame_bytes: int = 160) -> None:
    """A pcap of RTP packets (20 ms apart) carrying `payload`, for sipp's play_pcap_audio."""
    import struct

    out = bytearray(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
    seq, ts, ssrc = 1000, 160_000, 0x5EED5EED
    for n, offset in enumerate(range(0, len(payload), frame_bytes)):
        chunk = payload[offset : offset + frame_bytes]
        rtp = struct.pack("!BBHII", 0x80, payload_type | (0x80 if n == 0 else 0), seq, ts, ssrc)
        rtp += chunk
        udp = struct.pack("!HHHH", 6000, 6002, 8 + len(rtp), 0) + rtp
        ip = struct.pack(
            "!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), n & 0xFFFF, 0, 64, 17, 0,
            bytes([127, 0, 0, 1]), bytes([127, 0, 0, 1]),
        ) + udp  # fmt: skip
        frame = b"\x00" * 12 + b"\x08\x00" + ip
        usec = n * 20_000
        out += struct.pack("<IIII", usec // 1_000_000, usec % 1_000_000, len(frame), len(frame))
        out += frame
        seq = (seq + 1) & 0xFFFF
        ts = (ts + frame_bytes) & 0xFFFFFFFF
    path.write_bytes(bytes(out))


def count_in_trace(tmp: Path, needle: str, *, anywhere: bool = False) -> int:
    """How many lines of sipp's -trace_msg logs under `tmp` start with (or hold) `needle`."""
    total = 0
    for log_file in tmp.glob("*_messages.log"):
        for line in log_file.read_text(errors="replace").splitlines():
            if line.startswith(needle) or (anywhere and needle in line):
                total += 1
    return total
