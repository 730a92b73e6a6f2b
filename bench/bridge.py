"""Bridge benchmark: added latency per frame, barge-in, CPU per call, against a bare relay.

Three processes per target: the Realtime simulator (bench/_simproc.py), the server under
test (`voice-agent serve`, or bench/bare_relay.py as the baseline), and this driver running
N fake Twilio callers. All share the machine's monotonic clock, so a frame's latency is the
receiver's timestamp minus the sender's.

Each call: the agent greets (3 s of audio); after 1.5 s the caller talks over it for 0.8 s
(barge-in), stays quiet 1.5 s while the agent answers, then listens 1 s and hangs up. Every
caller frame carries a unique 8-byte marker (quiet mu-law codes), so an append received by
the simulator is matched to the exact frame the caller sent.

Usage: python bench/bridge.py barge-in [--levels 1,50,200] [--targets ...]: this scripted
harness; python bench/bridge.py echo [--calls 1,50,100] [--pin] ...: the full-duplex echo
harness (bench/_echo.py), with `--arrivals 10` the calls arriving at 10 a second inside
the measured window (set-up counted); with no harness named, both. Uses DATABASE_URL /
TEST_DATABASE_URL for the service, else an embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _stats import pct  # bench/ is on sys.path when run as a script

from telephony import audio
from telephony.sim.fake_caller import FakeTwilioCaller

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
FRAME = 160
SILENCE_1 = 75  # 1.5 s of listening to the greeting
SPEECH = 40  # 0.8 s talking over it
SILENCE_2 = 75  # 1.5 s while the agent answers
TAIL = 50  # 1 s
WARMUP_FRAMES = 25  # frames sent while the Realtime session opens are not "per-frame" latency
CALL_S = (SILENCE_1 + SPEECH + SILENCE_2 + TAIL) * 0.02
QUIET = [0xF8 + d for d in range(8)]  # mu-law codes within a few LSB of zero


# A throwaway database on the DATABASE_URL / TEST_DATABASE_URL server, for this run only.
SCRATCH_DB: list[str] = []


def marker(call: int, frame: int) -> bytes:
    value = call * 65536 + frame
    digits = []
    for _ in range(8):
        digits.append(QUIET[value & 7])
        value >>= 3
    return bytes(digits)


def call_audio(call: int) -> bytes:
    silence = audio.silence(20, "pcmu")
    speech = audio.speech_like_mulaw(SPEECH * 20)
    frames: list[bytes] = []
    for n in range(SILENCE_1 + SPEECH + SILENCE_2 + TAIL):
        if SILENCE_1 <= n < SILENCE_1 + SPEECH:
            k = n - SILENCE_1
            base = speech[k * FRAME : (k + 1) * FRAME]
        else:
            base = silence
        frames.append(marker(call, n) + base[8:])
    return b"".join(frames)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


@dataclass
class LevelResult:
    target: str
    calls: int
    ok: int = 0
    up_ms: list[float] = field(default_factory=list)
    down_ms: list[float] = field(default_factory=list)
    clear_ms: list[float] = field(default_factory=list)
    heard_after_ms: list[float] = field(default_factory=list)
    cpu_per_call: float = float("nan")
    # conversation.item.truncate's audio_end_ms minus the greeting audio the caller had heard
    # when the clear reached it (what the model is told was heard vs what was).
    truncate_error_ms: list[float] = field(default_factory=list)
    # The bridge's own measure (BARGE_IN events): from handling speech_started to `clear`
    # written to the socket; excludes time the event waited behind earlier ones.
    server_clear_ms: list[float] = field(default_factory=list)


class Simulator:
    def __init__(self, workdir: Path) -> None:
        self.port_file = workdir / "sim.url"
        self.dump_file = workdir / "sim.json"
        self.port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [PY, str(ROOT / "bench" / "_simproc.py"), str(self.port_file), str(self.dump_file)],
            cwd=ROOT,
        )
        deadline = time.monotonic() + 30
        while not self.port_file.exists() or not self.port_file.read_text():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("simulator did not start")
            time.sleep(0.05)
        self.base_url = self.port_file.read_text().strip()

    async def dump(self) -> list[dict]:
        self.dump_file.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        for _ in range(600):
            if self.dump_file.exists():
                try:
                    data: list[dict] = json.loads(self.dump_file.read_text())
                    self.proc.send_signal(signal.SIGUSR2)  # forget these sessions
                    return data
                except ValueError:
                    pass  # still being written
            await asyncio.sleep(0.05)
        raise RuntimeError("simulator did not dump its timings")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def start_target(target: str, port: int, sim_url: str, workdir: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OPENAI_API_KEY": "sk-bench",
        "OPENAI_BASE_URL": sim_url,
        "PUBLIC_BASE_URL": f"http://127.0.0.1:{port}",
        "TWILIO_AUTH_TOKEN": "dev-auth-token",
        "MAX_LIVE_CALLS": "1000",
        "LOG_LEVEL": "WARNING",
        "DATA_DIR": str(workdir / "data"),
    }
    if SCRATCH_DB:
        env["DATABASE_URL"] = SCRATCH_DB[0]
    cwd = ROOT
    if target == "bridge-before":
        # The service from another source tree (BENCH_BEFORE_TREE), with its own defaults.
        cwd = Path(os.environ["BENCH_BEFORE_TREE"])
        env["PYTHONPATH"] = str(cwd)
        cmd = [PY, "-m", "app.cli", "serve", "--no-worker", "--port", str(port)]
    elif target.startswith("bridge"):
        # "bridge" runs the default settings; "bridge-20ms" sends agent audio in 20 ms chunks
        # (a mark each), "bridge-100ms" in 100 ms chunks.
        chunk = target.removeprefix("bridge").strip("-").removesuffix("ms")
        if chunk:
            env["TWILIO_MEDIA_CHUNK_MS"] = chunk
        cmd = [str(Path(PY).parent / "voice-agent"), "serve", "--no-worker", "--port", str(port)]
    else:
        cmd = [PY, str(ROOT / "bench" / "bare_relay.py"), str(port)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{target} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{target} did not start")


async def one_call(url: str, index: int, stagger: float) -> FakeTwilioCaller | None:
    await asyncio.sleep(stagger)
    caller = FakeTwilioCaller(url, idle_audio=False, timeout=30)
    try:
        outcome = await caller.dial()
        if outcome.kind != "stream" or caller.closed:
            return None
        await caller.play_mulaw(call_audio(index))
        await caller.hangup()
    except Exception as exc:
        print(f"call {index} failed: {exc!r}", file=sys.stderr)
        await caller.aclose()
        return None
    return caller


def analyse(
    result: LevelResult, callers: dict[int, FakeTwilioCaller], sessions: list[dict]
) -> None:
    sent_at: dict[str, tuple[int, int, float]] = {}
    for index, caller in callers.items():
        n = 0
        for msg in caller.sent:
            if msg.event == "media":
                payload = base64.b64decode(json.loads(msg.raw)["media"]["payload"])
                sent_at[payload[:8].hex()] = (index, n, msg.t)
                n += 1
    for session in sessions:
        index = None
        for t, mark in session["appends"]:
            found = sent_at.get(mark)
            if found is None:
                continue
            index, frame, t_sent = found
            if frame >= WARMUP_FRAMES:
                result.up_ms.append((t - t_sent) * 1000)
        if index is None or index not in callers:
            continue
        caller = callers[index]
        # Downstream: the first response's deltas, matched by byte offset to media received
        # before the first clear (after a clear the two streams legitimately diverge).
        media: list[tuple[float, int]] = []
        offset = 0
        clear_t = None
        for msg in caller.received:
            if msg.event == "clear":
                clear_t = msg.t
                break
            if msg.event == "media" and msg.data is not None:
                offset += len(base64.b64decode(msg.data["media"]["payload"]))
                media.append((msg.t, offset))
        deltas = session["deltas"]
        if deltas:
            first_response = deltas[0][1]
            start = 0
            pos = 0
            for t_sent, response_id, size in deltas:
                if response_id != first_response:
                    break
                while pos < len(media) and media[pos][1] <= start:
                    pos += 1
                if pos == len(media):
                    break
                result.down_ms.append((media[pos][0] - t_sent) * 1000)
                start += size
        if session["speech_started"] and clear_t is not None:
            result.clear_ms.append((clear_t - session["speech_started"][0]) * 1000)
            onset = [m.t for m in caller.sent if m.event == "media"][SILENCE_1]
            # Agent audio heard between the caller starting to talk and the clear arriving.
            result.heard_after_ms.append(
                caller.heard_ms_after(onset) - caller.heard_ms_after(clear_t)
            )
            if session.get("truncates"):
                heard = caller.heard_ms - caller.heard_ms_after(clear_t)
                result.truncate_error_ms.append(session["truncates"][0][2] - heard)


async def run_level(target: str, url: str, calls: int, sim: Simulator, pid: int) -> LevelResult:
    result = LevelResult(target, calls)
    async with httpx.AsyncClient() as client:  # warm the server up (imports, pools)
        await client.get(url + "/healthz")
    cpu0 = cpu_seconds(pid)
    wall0 = time.monotonic()
    spread = min(2.0, calls * 0.01)
    outcomes = await asyncio.gather(
        *(one_call(url, i, spread * i / max(1, calls)) for i in range(calls))
    )
    wall = time.monotonic() - wall0
    cpu = cpu_seconds(pid) - cpu0
    callers = {i: c for i, c in enumerate(outcomes) if c is not None}
    result.ok = len(callers)
    # CPU share of one core per live call, averaged over the call duration.
    live_s = max(1e-9, result.ok * CALL_S)
    result.cpu_per_call = cpu / live_s * 100 if wall > 0 else float("nan")
    sessions = await sim.dump()
    if os.environ.get("BENCH_DEBUG"):
        print(target, [(len(s["appends"]), len(s["deltas"])) for s in sessions], file=sys.stderr)
        for c in callers.values():
            print(len(c.sent), len(c.received), file=sys.stderr)
    analyse(result, callers, sessions)
    if target.startswith("bridge"):
        result.server_clear_ms = await server_clear_latencies(
            [c.call_sid for c in callers.values()]
        )
    return result


async def server_clear_latencies(call_sids: list[str]) -> list[float]:
    """clear_latency_ms of the service's persisted barge-ins for these calls."""
    import psycopg

    from app.db import plain_url

    url = SCRATCH_DB[0] if SCRATCH_DB else None
    if not url or not call_sids:
        return []
    await asyncio.sleep(1.0)  # the event writer flushes at call end; give it a moment
    async with await psycopg.AsyncConnection.connect(plain_url(url)) as conn:
        cur = await conn.execute(
            "SELECT (e.data->>'clear_latency_ms')::float FROM call_events e "
            "JOIN calls c ON c.id = e.call_id WHERE e.kind = 'barge_in' AND c.call_sid = ANY(%s)",
            (call_sids,),
        )
        return [row[0] for row in await cur.fetchall() if row[0] is not None]


def _pair(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{pct(values, 50):.2f} / {pct(values, 99):.2f}"


def _truncate_error(values: list[float]) -> str:
    if not values:
        return "-"
    absolute = [abs(v) for v in values]
    worst = max(values, key=abs)
    return f"{pct(absolute, 50):.1f} / {pct(absolute, 99):.1f} / {worst:+.1f}"


def table(results: list[LevelResult]) -> str:
    head = (
        "| target | calls | ok | up p50 ms | up p99 ms | down p50 ms | down p99 ms | "
        "speech_started->clear p50 ms | p99 ms | heard after barge-in p50 ms | p99 ms | "
        "CPU per call (% of a core) | in-bridge speech_started->clear sent p50/p99 ms "
        "| truncate - heard p50 / p99 of abs / max ms |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in results:
        lines.append(
            f"| {r.target} | {r.calls} | {r.ok} | {pct(r.up_ms, 50):.1f} | {pct(r.up_ms, 99):.1f} "
            f"| {pct(r.down_ms, 50):.1f} | {pct(r.down_ms, 99):.1f} | {pct(r.clear_ms, 50):.1f} "
            f"| {pct(r.clear_ms, 99):.1f} | {pct(r.heard_after_ms, 50):.0f} "
            f"| {pct(r.heard_after_ms, 99):.0f} | {r.cpu_per_call:.2f} "
            f"| {_pair(r.server_clear_ms)} | {_truncate_error(r.truncate_error_ms)} |"
        )
    by = {(r.target, r.calls): r for r in results}
    lines.append("")
    lines.append(
        "| target | calls | added up p50 ms (vs relay) | added down p50 ms | "
        "added speech_started->clear p50 ms | CPU ratio |"
    )
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        if not r.target.startswith("bridge") or ("relay", r.calls) not in by:
            continue
        b = by[("relay", r.calls)]
        lines.append(
            f"| {r.target} | {r.calls} | {pct(r.up_ms, 50) - pct(b.up_ms, 50):.1f} "
            f"| {pct(r.down_ms, 50) - pct(b.down_ms, 50):.1f} "
            f"| {pct(r.clear_ms, 50) - pct(b.clear_ms, 50):.1f} "
            f"| {r.cpu_per_call / b.cpu_per_call if b.cpu_per_call else float('nan'):.2f}x |"
        )
    return "\n".join(lines)


async def barge_in(levels: list[int], targets: list[str]) -> list[LevelResult]:
    """The scripted-call harness: latency each way, barge-in and CPU per call."""
    results: list[LevelResult] = []
    server_url = os.environ.get("DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    dbname = f"bench_bridge_{os.getpid()}"
    if server_url:
        from app.db import create_database

        SCRATCH_DB.append(await asyncio.to_thread(create_database, server_url, dbname))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            for target in targets:
                sim = Simulator(workdir)
                port = free_port()
                proc = start_target(target, port, sim.base_url, workdir)
                try:
                    for calls in levels:
                        url = f"http://127.0.0.1:{port}"
                        r = await run_level(target, url, calls, sim, proc.pid)
                        print(f"{target} x{calls}: {r.ok}/{calls} calls ok", file=sys.stderr)
                        results.append(r)
                finally:
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                    sim.stop()
    finally:
        if server_url:
            from app.db import drop_database

            await asyncio.to_thread(drop_database, server_url, dbname)
    return results


def main() -> None:
    # A stopped run still drops its scratch database and stops its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="harness")
    b = sub.add_parser("barge-in", help="scripted calls against the Realtime simulator")
    b.add_argument("--levels", default="1,50,200")
    b.add_argument("--targets", default="relay,bridge,bridge-20ms")
    e = sub.add_parser("echo", help="full duplex against an echo Realtime fake (bench/_echo.py)")
    e.add_argument("--calls", default="1,50,100")
    e.add_argument("--targets", default="relay,relay-plain,service")
    e.add_argument("--seconds", type=float, default=10.0)
    e.add_argument("--repeat", type=int, default=1)
    e.add_argument("--pin", action="store_true", help="server on CPU 0, load on CPU 1")
    e.add_argument(
        "--no-deflate-offer",
        action="store_true",
        help="callers do not offer permessage-deflate (by default they do, as websockets does)",
    )
    e.add_argument(
        "--profile", type=Path, help="py-spy record each server into this directory (raw format)"
    )
    e.add_argument(
        "--barge-in",
        action="store_true",
        help="each call's caller cuts in once inside the window (clear latency, truncate error)",
    )
    e.add_argument(
        "--quiet",
        type=float,
        metavar="SHARE",
        help="before each run wait (up to --patience s) until the machine is under SHARE busy",
    )
    e.add_argument("--patience", type=float, default=180.0)
    e.add_argument(
        "--arrivals",
        type=float,
        metavar="PER_S",
        help="calls arrive at this rate inside the measuring window (their set-up counted: "
        "webhook, media socket, session); the window then runs --seconds past the last",
    )
    e.add_argument(
        "--churn",
        type=float,
        default=0.0,
        metavar="S",
        help="each call lasts S seconds on average (0.5-1.5x), then hangs up and another "
        "arrives in its place (set-up and tear-down inside the window)",
    )
    args = parser.parse_args()
    # With no harness named, both run with their defaults.
    echo_args = args if args.harness == "echo" else e.parse_args([])
    barge_args = args if args.harness == "barge-in" else b.parse_args([])
    if args.harness in (None, "echo"):
        import _echo

        echo_results = _echo.run(
            echo_args.targets.split(","),
            [int(x) for x in echo_args.calls.split(",")],
            echo_args.seconds,
            echo_args.pin,
            echo_args.repeat,
            not echo_args.no_deflate_offer,
            echo_args.profile,
            echo_args.barge_in,
            (echo_args.quiet, echo_args.patience) if echo_args.quiet else None,
            echo_args.arrivals,
            echo_args.churn,
        )
        print(_echo.table(echo_results))
    if args.harness in (None, "barge-in"):
        results = asyncio.run(
            barge_in([int(x) for x in barge_args.levels.split(",")], barge_args.targets.split(","))
        )
        print(table(results))


if __name__ == "__main__":
    main()
