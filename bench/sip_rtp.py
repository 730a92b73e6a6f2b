"""SIP/RTP benchmark: outbound RTP pacing and CPU per SIP call, beside a bare RTP sender.

Processes: the Realtime simulator (bench/_simproc.py), the server under test (`voice-agent
serve` with SIP_BIND, or bench/bare_rtp.py as the baseline), and this driver, which places N
SIP calls (a minimal UAC: INVITE with its own RTP port, ACK, BYE), talks on each (0.8 s of
speech every 3 s, so the agent is interrupted and answers all the time) and timestamps every
RTP packet the server sends. Inter-packet intervals are measured at the receiver over a
window after every call was answered; CPU is the server process's over that window.

Usage: python bench/sip_rtp.py [--levels 1,20,100] [--window 10]. The service gets a scratch
database on the DATABASE_URL / TEST_DATABASE_URL server (dropped at the end), else an embedded
PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import secrets
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from _stats import pct  # bench/ is on sys.path when run as a script
from aiosipua import SipMessage, SipResponse
from bridge import PY, ROOT, Simulator, cpu_seconds

from telephony import audio

SPEECH = audio.speech_like_mulaw(800)
SILENCE = b"\xff" * 160
CYCLE = 150  # frames: 0.8 s speech + 2.2 s silence


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SO_TIMESTAMPNS = 35  # Linux: the kernel stamps each datagram as it arrives


class Rx:
    """The caller's RTP socket: kernel arrival times and sequence numbers of what it receives.

    A receiver thread reads every call's socket with kernel timestamps, so the driver's own
    event loop (busy sending the callers' audio) never blurs the measured intervals.
    """

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.setblocking(False)
        self.port = int(self.sock.getsockname()[1])
        self.times: list[float] = []
        self.seqs: list[int] = []
        self.recording = False

    def read(self) -> None:
        while True:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(2048, socket.CMSG_SPACE(16))
            except BlockingIOError:
                return
            if not self.recording or len(data) < 12 or 200 <= data[1] <= 204:
                continue  # (RTCP: a report meant for a port next to this one)
            stamp = time.time()
            for level, kind, value in ancdata:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(value) >= 16:
                    sec, nsec = struct.unpack("qq", value[:16])
                    stamp = sec + nsec / 1e9
            self.times.append(stamp)
            self.seqs.append(struct.unpack_from("!H", data, 2)[0])

    def send(self, data: bytes, addr: tuple[str, int]) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendto(data, addr)


class Receiver(threading.Thread):
    """Reads every Rx socket as packets arrive, until stopped."""

    def __init__(self, sockets: list[Rx]) -> None:
        super().__init__(daemon=True)
        self.selector = selectors.DefaultSelector()
        for rx in sockets:
            self.selector.register(rx.sock, selectors.EVENT_READ, rx)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            for key, _ in self.selector.select(timeout=0.1):
                key.data.read()
        self.selector.close()


@dataclass
class Call:
    index: int
    rx: Rx
    call_id: str = field(default_factory=lambda: secrets.token_hex(10) + "@bench")
    tag: str = field(default_factory=lambda: secrets.token_hex(4))
    to_tag: str = ""
    server_rtp: tuple[str, int] | None = None
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    answered_at: float = 0.0
    bye_done: asyncio.Event = field(default_factory=asyncio.Event)


class Uac(asyncio.DatagramProtocol):
    """One SIP socket for every call of the driver."""

    def __init__(self, server: tuple[str, int]) -> None:
        self.server = server
        self.calls: dict[str, Call] = {}
        self.transport: asyncio.DatagramTransport | None = None
        self.port = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.port = transport.get_extra_info("sockname")[1]

    def request(self, call: Call, method: str, cseq: int, body: bytes = b"") -> None:
        to = "<sip:agent@127.0.0.1>" + (f";tag={call.to_tag}" if call.to_tag else "")
        lines = [
            f"{method} sip:agent@{self.server[0]}:{self.server[1]} SIP/2.0",
            f"Via: SIP/2.0/UDP 127.0.0.1:{self.port};branch=z9hG4bK{secrets.token_hex(8)};rport",
            "Max-Forwards: 70",
            f"From: <sip:+1555000{call.index:04d}@127.0.0.1>;tag={call.tag}",
            f"To: {to}",
            f"Call-ID: {call.call_id}",
            f"CSeq: {cseq} {method}",
            f"Contact: <sip:bench@127.0.0.1:{self.port}>",
        ]
        if body:
            lines.append("Content-Type: application/sdp")
        lines.append(f"Content-Length: {len(body)}")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
        assert self.transport is not None
        self.transport.sendto(data, self.server)

    def invite(self, call: Call) -> None:
        sdp = (
            "v=0\r\no=bench 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            f"m=audio {call.rx.port} RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\n"
            "a=rtpmap:101 telephone-event/8000\r\na=sendrecv\r\n"
        ).encode()
        self.calls[call.call_id] = call
        self.request(call, "INVITE", 1, sdp)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            msg = SipMessage.parse(data)
        except ValueError:
            return
        call = self.calls.get(msg.call_id or "")
        if call is None:
            return
        if not isinstance(msg, SipResponse):
            return  # the server's BYE would go here; the driver hangs up first
        cseq = msg.cseq
        if cseq and cseq.method == "INVITE" and msg.status_code == 200:
            to = msg.to_addr
            call.to_tag = (to.tag if to else "") or ""
            for line in msg.text.splitlines():
                if line.startswith("m=audio "):
                    call.server_rtp = ("127.0.0.1", int(line.split()[1]))
            self.request(call, "ACK", 1)
            if not call.answered.is_set():
                call.answered_at = time.monotonic()
            call.answered.set()
        elif cseq and cseq.method == "BYE" and msg.status_code >= 200:
            call.bye_done.set()


@dataclass
class Result:
    target: str
    calls: int
    answered: int = 0
    intervals_ms: list[float] = field(default_factory=list)
    gaps: int = 0
    cpu_per_call: float = float("nan")
    # CPU of a call's set-up and tear-down (INVITE to greeting under way, BYE to the call's
    # end written), the steady cost of the seconds carried meanwhile taken out.
    setup_ms: float = float("nan")


def analyse(result: Result, calls: list[Call]) -> None:
    for call in calls:
        times, seqs = call.rx.times, call.rx.seqs
        result.intervals_ms += [(b - a) * 1000 for a, b in itertools.pairwise(times)]
        result.gaps += sum(1 for a, b in itertools.pairwise(seqs) if (b - a) & 0xFFFF != 1)


def open_calls(n: int) -> tuple[list[Call], Receiver]:
    calls = [Call(index, Rx()) for index in range(n)]
    receiver = Receiver([c.rx for c in calls])
    receiver.start()
    return calls, receiver


def close_calls(calls: list[Call], receiver: Receiver) -> None:
    receiver.stopped.set()
    receiver.join(5)
    for call in calls:
        call.rx.sock.close()


async def talk(calls: list[Call], stop: asyncio.Event) -> None:
    """Every call's caller audio, paced by one 20 ms clock: speech 0.8 s out of every 3 s."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    n = 0
    while not stop.is_set():
        k = n % CYCLE
        payload = SPEECH[k * 160 : (k + 1) * 160] if k < 40 else SILENCE
        for call in calls:
            if call.server_rtp is not None:
                header = struct.pack("!BBHII", 0x80, 0, n & 0xFFFF, n * 160, 0x1000 + call.index)
                call.rx.send(header + payload, call.server_rtp)
        n += 1
        await asyncio.sleep(max(0.0, start + n * 0.02 - loop.time()))


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its children (the pacer process of SIP_PACER=process)."""
    total = cpu_seconds(pid)
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for child in children:
            with contextlib.suppress(OSError, ValueError):
                total += cpu_seconds(int(child))
    return total


async def run_sip(n: int, window: float, sip_port: int, pid: int, pacer: str) -> Result:
    loop = asyncio.get_running_loop()
    result = Result(f"voice-agent SIP (SIP_PACER={pacer})", n)
    uac_transport, uac = await loop.create_datagram_endpoint(
        lambda: Uac(("127.0.0.1", sip_port)), local_addr=("127.0.0.1", 0)
    )
    calls, receiver = open_calls(n)
    stop = asyncio.Event()
    talker = asyncio.create_task(talk(calls, stop))
    cpu_start = tree_cpu_seconds(pid)
    try:
        for call in calls:
            uac.invite(call)
            await asyncio.sleep(0.02)  # 50 INVITEs a second
        await asyncio.wait([asyncio.create_task(c.answered.wait()) for c in calls], timeout=60)
        result.answered = sum(c.answered.is_set() for c in calls)
        await asyncio.sleep(1.0)  # greetings under way, first barge-ins
        cpu0, t0 = tree_cpu_seconds(pid), time.monotonic()
        setup_cpu = cpu0 - cpu_start
        carried_s = sum(t0 - c.answered_at for c in calls if c.answered.is_set())
        for call in calls:
            call.rx.recording = True
        await asyncio.sleep(window)
        for call in calls:
            call.rx.recording = False
        cpu1, t1 = tree_cpu_seconds(pid), time.monotonic()
        result.cpu_per_call = (cpu1 - cpu0) / (t1 - t0) / n * 100
        analyse(result, calls)
    finally:
        stop.set()
        await talker
        cpu_end0 = tree_cpu_seconds(pid)
        for call in calls:
            if call.answered.is_set():
                uac.request(call, "BYE", 2)
        await asyncio.wait(
            [asyncio.create_task(c.bye_done.wait()) for c in calls if c.answered.is_set()]
            or [asyncio.sleep(0)],
            timeout=20,
        )
        await asyncio.sleep(2.0)  # the calls' ends written, recordings rendered
        teardown_cpu = tree_cpu_seconds(pid) - cpu_end0
    if result.answered and not math.isnan(result.cpu_per_call):
        steady_s = result.cpu_per_call / 100  # CPU seconds per call-second
        result.setup_ms = (setup_cpu - steady_s * carried_s + teardown_cpu) / result.answered * 1000
        close_calls(calls, receiver)
        uac_transport.close()
    return result


async def run_bare(n: int, window: float) -> Result:
    """The same driver (and caller audio) against bench/bare_rtp.py."""
    result = Result("bare asyncio RTP sender", n, answered=n)
    calls, receiver = open_calls(n)
    proc = subprocess.Popen(  # noqa: ASYNC220 - once per level, not on a hot path
        [
            PY,
            str(ROOT / "bench" / "bare_rtp.py"),
            str(window + 2.0),
            *(str(c.rx.port) for c in calls),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ports = [int(p) for p in (await asyncio.to_thread(proc.stdout.readline)).split()]
    for call, port in zip(calls, ports, strict=True):
        call.server_rtp = ("127.0.0.1", port)
    stop = asyncio.Event()
    talker = asyncio.create_task(talk(calls, stop))
    try:
        await asyncio.sleep(1.0)
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        for call in calls:
            call.rx.recording = True
        await asyncio.sleep(window)
        for call in calls:
            call.rx.recording = False
        cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
        result.cpu_per_call = (cpu1 - cpu0) / (t1 - t0) / n * 100
        analyse(result, calls)
    finally:
        stop.set()
        await talker
        await asyncio.to_thread(proc.wait, 30)
        close_calls(calls, receiver)
    return result


def start_server(
    sip_port: int, http_port: int, sim_url: str, workdir: Path, pacer: str
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SIP_PACER": pacer,
        "OPENAI_API_KEY": "sk-bench",
        "OPENAI_BASE_URL": sim_url,
        "SIP_BIND": f"127.0.0.1:{sip_port}",
        "SIP_RTP_PORTS": "0",
        "SIP_RATE_PER_SOURCE": "1000",
        "SIP_MAX_CALLS": "1000",
        "MAX_LIVE_CALLS": "1000",
        "LOG_LEVEL": "WARNING",
        "DATA_DIR": str(workdir / "data"),
    }
    if SCRATCH_DB:
        env["DATABASE_URL"] = SCRATCH_DB[0]
    cmd = [str(Path(PY).parent / "voice-agent"), "serve", "--no-worker", "--port", str(http_port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"voice-agent serve exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", http_port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("voice-agent serve did not start")


# A throwaway database on the DATABASE_URL / TEST_DATABASE_URL server, for this run only, as
# bench/bridge.py does: the test suite resets the shared one under a running benchmark.
SCRATCH_DB: list[str] = []


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def table(results: list[Result]) -> str:
    lines = [
        "| sender | calls | answered | interval mean ms | stdev ms | p99 ms | max ms | seq gaps "
        "| CPU per call (% of a core) | set-up + tear-down CPU ms per call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        iv = r.intervals_ms
        mean = statistics.fmean(iv) if iv else float("nan")
        stdev = statistics.pstdev(iv) if len(iv) > 1 else float("nan")
        lines.append(
            f"| {r.target} | {r.calls} | {r.answered} | {_fmt(mean)} | {_fmt(stdev)} | "
            f"{_fmt(pct(iv, 99))} | {_fmt(max(iv) if iv else float('nan'))} | {r.gaps} | "
            f"{_fmt(r.cpu_per_call)} | {_fmt(r.setup_ms, 1)} |"
        )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,20,100")
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument(
        "--pacers", default="process,thread",
        help="SIP_PACER values to measure, each with a server of its own",
    )  # fmt: skip
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    pacers = [p for p in args.pacers.split(",") if p]
    results: list[Result] = []
    server_url = os.environ.get("DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    dbname = f"bench_sip_rtp_{os.getpid()}"
    if server_url:
        from app.db import create_database

        SCRATCH_DB.append(await asyncio.to_thread(create_database, server_url, dbname))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        sim = Simulator(workdir)
        servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        try:
            for pacer in pacers:
                sip_port, http_port = free_port(), free_port(socket.SOCK_STREAM)
                (workdir / pacer).mkdir()
                proc = start_server(sip_port, http_port, sim.base_url, workdir / pacer, pacer)
                servers[pacer] = (proc, sip_port)
            for n in levels:
                results.append(await run_bare(n, args.window))
                for pacer, (proc, sip_port) in servers.items():
                    results.append(await run_sip(n, args.window, sip_port, proc.pid, pacer))
                    await asyncio.sleep(2.0)  # calls wind down between runs
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            sim.stop()
            if server_url:
                from app.db import drop_database

                await asyncio.to_thread(drop_database, server_url, dbname)
    print(f"\nOutbound RTP pacing and CPU, window {args.window:g} s per level "
          f"(load: {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs)\n")  # fmt: skip
    print(table(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    asyncio.run(main())
