"""The full-duplex echo harness of bench/bridge.py (`python bench/bridge.py echo`).

Per run, three processes: the echo Realtime fake (bench/_echo_realtime.py), the server under
test (`voice-agent serve`, or the plain-`websockets` relay bench/ws_relay.py), and the load
generator (bench/_echo_callers.py). Targets alternate within each call count, so the relay
and the service see the same moment of the machine. With `--pin`, the server runs on CPU 0
and the echo fake and the load generator on CPU 1 (`taskset`), so the server's CPU use and
latency are its own: "calls per core".

Targets:
  relay          plain websockets relay, websockets' defaults (permessage-deflate negotiated)
  relay-plain    the same relay with compression off on both sockets
  relay-uvloop   relay-plain on uvloop
  relay-picows   the same relay on picows (Cython WebSocket frames) and uvloop
                 (bench/picows_relay.py; needs `pip install picows`)
  service        `voice-agent serve` with its defaults
  service-<N>ms  the service sending agent audio in N ms chunks (TWILIO_MEDIA_CHUNK_MS)
  service-asyncio  the service on the standard asyncio loop (EVENT_LOOP=asyncio)
  service-deflate  the service accepting permessage-deflate from callers (WS_DEFLATE=true)
  service-nofreeze the service with its heap frozen once at start only (GC_FREEZE_EVERY_S=0)
  service-before   the service from another source tree, e.g. an earlier commit unpacked with
                   `git archive REV | tar -x -C DIR`, named by BENCH_BEFORE_TREE=DIR
                   (its own defaults; same venv)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from _stats import pct

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SERVER_CPU = "0"
LOAD_CPU = "1"


@dataclass
class EchoResult:
    target: str
    calls: int
    pinned: bool
    data: dict
    load: str
    # Per barge-in (with --barge-in): speech_started sent -> clear at the caller, and the
    # truncate's audio_end_ms minus the item audio the caller had heard at the clear.
    clear_ms: list[float] = field(default_factory=list)
    truncate_error_ms: list[float] = field(default_factory=list)

    @property
    def streaming(self) -> int:
        return int(self.data["streaming"])

    @property
    def cpu_ms_per_call_s(self) -> float:
        """Server CPU over the call-seconds carried in the window (with arrivals counted, their
        set-up is in the CPU and each call's seconds start at its answer)."""
        live_s = self.data.get("call_s") or self.streaming * self.data["window_s"]
        return self.data["server_cpu_s"] * 1000 / max(1e-9, live_s)

    @property
    def sys_share(self) -> float:
        total = self.data["server_cpu_s"]
        return self.data.get("server_sys_s", 0.0) / total if total else 0.0

    def rtt(self, q: float) -> float:
        return pct(self.data["rtt_ms"], q)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(cmd: list[str], cpu: str, pinned: bool) -> list[str]:
    return ["taskset", "-c", cpu, *cmd] if pinned else cmd


def _wait_ready(proc: subprocess.Popen[bytes], port: int, what: str, within: float = 60) -> None:
    """Until the server completes a WebSocket handshake on /twilio/media (then hang up)."""
    from websockets.exceptions import InvalidHandshake
    from websockets.sync.client import connect

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with connect(f"ws://127.0.0.1:{port}/twilio/media", open_timeout=1, close_timeout=1):
                return
        except (OSError, TimeoutError, InvalidHandshake):
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start")


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _start_echo(
    workdir: Path, pinned: bool, barge_after: float | None, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port_file = workdir / f"echo-{uuid.uuid4().hex}.url"
    cmd = [PY, str(ROOT / "bench" / "_echo_realtime.py"), str(port_file), "--log", str(log)]
    if barge_after is not None:
        cmd += ["--barge-after", str(barge_after)]
    proc = subprocess.Popen(_pin(cmd, LOAD_CPU, pinned), cwd=ROOT)
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("echo Realtime fake did not start")
        time.sleep(0.05)
    return proc, port_file.read_text().strip()


def _start_server(
    target: str, port: int, echo_url: str, db_url: str | None, workdir: Path, pinned: bool
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OPENAI_API_KEY": "sk-bench",
        "OPENAI_BASE_URL": echo_url,
        "PUBLIC_BASE_URL": f"http://127.0.0.1:{port}",
        "TWILIO_AUTH_TOKEN": "dev-auth-token",
        "MAX_LIVE_CALLS": "1000",
        "LOG_LEVEL": "WARNING",
        "DATA_DIR": str(workdir / "data"),
    }
    if target == "relay-picows":
        cmd = [PY, str(ROOT / "bench" / "picows_relay.py"), str(port)]
    elif target.startswith("relay"):
        cmd = [PY, str(ROOT / "bench" / "ws_relay.py"), str(port)]
        if target in ("relay-plain", "relay-uvloop"):
            cmd.append("--no-deflate")
        if target == "relay-uvloop":
            cmd.append("--uvloop")
    elif target == "service-before":
        tree = os.environ.get("BENCH_BEFORE_TREE")
        if not tree:
            raise ValueError("service-before needs BENCH_BEFORE_TREE (a source tree)")
        if db_url:
            env["DATABASE_URL"] = db_url
        env["PYTHONPATH"] = tree
        cmd = [PY, "-m", "app.cli", "serve", "--no-worker", "--port", str(port)]
        proc = subprocess.Popen(_pin(cmd, SERVER_CPU, pinned), cwd=tree, env=env)
        _wait_ready(proc, port, target)
        return proc
    elif target.startswith("service"):
        if db_url:
            env["DATABASE_URL"] = db_url
        variant = target.removeprefix("service").strip("-")
        if variant.endswith("ms"):
            env["TWILIO_MEDIA_CHUNK_MS"] = variant.removesuffix("ms")
        elif variant == "asyncio":
            env["EVENT_LOOP"] = "asyncio"
        elif variant == "deflate":
            env["WS_DEFLATE"] = "true"
        elif variant == "nofreeze":
            env["GC_FREEZE_EVERY_S"] = "0"
        elif variant:
            raise ValueError(f"unknown target {target}")
        cmd = [str(Path(PY).parent / "voice-agent"), "serve", "--no-worker", "--port", str(port)]
    else:
        raise ValueError(f"unknown target {target}")
    proc = subprocess.Popen(_pin(cmd, SERVER_CPU, pinned), cwd=ROOT, env=env)
    _wait_ready(proc, port, target)
    return proc


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _busy_share(seconds: float = 2.0) -> float:
    """The machine's CPU use (0..1, all cores) over the next `seconds`, from /proc/stat."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_quiet(limit: float, patience_s: float) -> float:
    """Wait (up to `patience_s`) until others use under `limit` of the machine; returns the
    share measured last. The machine is shared: numbers taken under load mean little."""
    deadline = time.monotonic() + patience_s
    while True:
        busy = _busy_share()
        if busy < limit or time.monotonic() > deadline:
            return busy
        time.sleep(3.0)


def run_one(
    target: str,
    calls: int,
    seconds: float,
    pinned: bool,
    deflate_offer: bool,
    db_url: str | None,
    workdir: Path,
    profile_dir: Path | None = None,
    barge_in: bool = False,
    quiet: tuple[float, float] | None = None,
    arrivals_per_s: float | None = None,
    churn_s: float = 0.0,
) -> EchoResult:
    """One target at one call count: fresh echo fake, fresh server, one load run."""
    busy = wait_for_quiet(*quiet) if quiet else _busy_share(1.0)
    echo_log = workdir / f"echo-{uuid.uuid4().hex}.json"
    # Cut in a second into the measuring window (after the ramp at 40 calls/s and the settle).
    barge_after = calls / 40 + 3.0 if barge_in else None
    echo, echo_url = _start_echo(workdir, pinned, barge_after, echo_log)
    port = _free_port()
    server: subprocess.Popen[bytes] | None = None
    try:
        server = _start_server(target, port, echo_url, db_url, workdir, pinned)
        out = workdir / f"result-{uuid.uuid4().hex}.json"
        load = f"{_loadavg()}, others {busy * 100:.0f}% busy"
        cmd = [
            PY,
            str(ROOT / "bench" / "_echo_callers.py"),
            "--server",
            f"http://127.0.0.1:{port}",
            "--mode",
            "relay" if target.startswith("relay") else "service",
            "--calls",
            str(calls),
            "--seconds",
            str(seconds),
            "--server-pid",
            str(server.pid),
            "--echo-pid",
            str(echo.pid),
            "--out",
            str(out),
        ]
        if deflate_offer:
            cmd.append("--deflate")
        if arrivals_per_s:
            cmd += ["--ramp-per-s", str(arrivals_per_s), "--count-arrivals"]
        if churn_s:
            cmd += ["--churn-s", str(churn_s)]
        window_file = workdir / f"window-{uuid.uuid4().hex}"
        cmd += ["--window-file", str(window_file)]
        spy: subprocess.Popen[bytes] | None = None
        load_proc = subprocess.Popen(_pin(cmd, LOAD_CPU, pinned), cwd=ROOT)
        if profile_dir is not None:
            while not window_file.exists():  # profile the measuring window only
                if load_proc.poll() is not None:
                    break
                time.sleep(0.05)
            profile_dir.mkdir(parents=True, exist_ok=True)
            spy = subprocess.Popen(
                _pin(
                    [
                        str(Path(PY).parent / "py-spy"),
                        "record",
                        "--pid",
                        str(server.pid),
                        "--duration",
                        str(int(min(8, max(1, seconds - 2)))),
                        "--rate",
                        "200",
                        "--nonblocking",
                        "--nolineno",
                        "--format",
                        "raw",
                        "--output",
                        str(profile_dir / f"{target}-x{calls}.txt"),
                    ],
                    LOAD_CPU,
                    pinned,
                ),
                stdout=subprocess.DEVNULL,
            )
        if load_proc.wait(600) != 0:
            raise RuntimeError(f"load generator failed ({load_proc.returncode})")
        if spy is not None:
            spy.wait(60)
        result = EchoResult(target, calls, pinned, json.loads(out.read_text()), load)
    finally:
        if server is not None:
            _stop(server)
        _stop(echo, signal.SIGTERM)
    if barge_in and echo_log.exists():
        _barge_ins(result, json.loads(echo_log.read_text()))
    return result


def _barge_ins(result: EchoResult, sessions: list[dict]) -> None:
    clears = result.data.get("clears", {})
    for session in sessions:
        started = session["speech_started_at"]
        heard = [c for c in clears.get(str(session["call"]), []) if started and c[0] >= started]
        if started is None or not heard:
            continue
        t_clear, heard_ms = heard[0]
        result.clear_ms.append((t_clear - started) * 1000)
        if session["truncates"]:
            result.truncate_error_ms.append(session["truncates"][0]["audio_end_ms"] - heard_ms)


def _cut(d: dict) -> str:
    cut = d.get("cut_by_barge_in", 0)
    return f" (+{cut} cut by barge-in)" if cut else ""


def _pair(values: list[float]) -> str:
    return f"{pct(values, 50):.1f} / {pct(values, 99):.1f}" if values else "-"


def _abs3(values: list[float]) -> str:
    if not values:
        return "-"
    absolute = [abs(v) for v in values]
    worst = max(values, key=abs)
    return f"{pct(absolute, 50):.1f} / {pct(absolute, 99):.1f} / {worst:+.1f}"


def _watch(w: dict | None) -> str:
    """The service's own loop watch over the window (its /metrics, app/loop_watch.py)."""
    if not w:
        return "- | -"

    def ms(bound: float) -> str:
        return f"{bound * 1000:g}" if bound != float("inf") else "inf"

    by_gen = w.get("gc_over_10ms_by_generation") or []
    which = ", ".join(f"gen{g}: {n:.0f}" for g, n in enumerate(by_gen) if n)
    if w.get("gc_sweeps"):
        which += f"{', ' if which else ''}{w['gc_sweeps']:.0f} sweeps"
    return (
        f"{w['gc_over_10ms']:.0f}{f' ({which})' if which else ''} / {w['gc_pauses']:.0f} "
        f"({ms(w['gc_longest_le_s'])}; over 10 ms of CPU: {w.get('gc_cpu_over_10ms', 0):.0f}) "
        f"| {ms(w['lag_p99_le_s'])} / {ms(w['lag_max_le_s'])} ({w['lag_over_40ms']:.0f} "
        f"of {w['lag_samples']:.0f})"
    )


def table(results: list[EchoResult]) -> str:
    lines = [
        "| target | calls | pinned | streaming | frames sent | lost | RTT p50 ms | p99 ms | max ms "
        "| server CPU ms per call-s (kernel part) | vs relay | vs relay-plain "
        "| media msgs/s per call "
        "| marks/s per call | barge-ins | speech_started->clear at caller p50 / p99 ms "
        "| truncate - heard abs p50 / p99 / worst ms | calls ended in window "
        "| GC pauses > 10 ms / all (longest <= ms; > 10 ms of CPU) "
        "| loop late p99 / max <= ms (> 40 ms) "
        "| load gen CPU % | echo CPU % "
        "| load at start (1/5/15 min; machine busy just before) |",
        "|" + "---|" * 23,
    ]
    base: dict[tuple[str, int, bool], list[EchoResult]] = {}
    for r in results:
        base.setdefault((r.target, r.calls, r.pinned), []).append(r)

    def ratio(r: EchoResult, other: str) -> str:
        peers = base.get((other, r.calls, r.pinned))
        if not peers or r.target == other:
            return "-"
        mean = sum(p.cpu_ms_per_call_s for p in peers) / len(peers)
        return f"{r.cpu_ms_per_call_s / mean:.2f}x" if mean else "-"

    for r in results:
        d = r.data
        window = d["window_s"]
        lines.append(
            f"| {r.target} | {r.calls} | {'yes' if r.pinned else 'no'} | {r.streaming} "
            f"| {d['sent']} | {d['lost']}{_cut(d)} "
            f"| {r.rtt(50):.1f} | {r.rtt(99):.1f} | {r.rtt(100):.1f} "
            f"| {r.cpu_ms_per_call_s:.2f} ({r.sys_share * 100:.0f}% kernel) "
            f"| {ratio(r, 'relay')} | {ratio(r, 'relay-plain')} "
            f"| {d['media_per_call_s']:.1f} | {d['marks_per_call_s']:.1f} "
            f"| {len(r.clear_ms) or '-'} | {_pair(r.clear_ms)} | {_abs3(r.truncate_error_ms)} "
            f"| {d.get('ended_in_window', 0)} | {_watch(d.get('watch'))} "
            f"| {d['loadgen_cpu_s'] / window * 100:.0f} | {d['echo_cpu_s'] / window * 100:.0f} "
            f"| {r.load} |"
        )
        if d["failed"]:
            lines.append(f"|  failures: {'; '.join(d['failed'])[:300]} |")
    return "\n".join(lines)


def run(
    targets: list[str],
    levels: list[int],
    seconds: float,
    pinned: bool,
    repeat: int,
    deflate_offer: bool,
    profile_dir: Path | None = None,
    barge_in: bool = False,
    quiet: tuple[float, float] | None = None,
    arrivals_per_s: float | None = None,
    churn_s: float = 0.0,
) -> list[EchoResult]:
    """Every target at every call count, `repeat` times, alternating targets per count."""
    server_url = os.environ.get("DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    db_url: str | None = None
    dbname = f"bench_echo_{uuid.uuid4().hex[:8]}"
    results: list[EchoResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if server_url:
            from app.db import create_database

            db_url = create_database(server_url, dbname)
        try:
            for calls in levels:
                for _ in range(repeat):
                    for target in targets:
                        r = run_one(
                            target,
                            calls,
                            seconds,
                            pinned,
                            deflate_offer,
                            db_url,
                            workdir,
                            profile_dir,
                            barge_in,
                            quiet,
                            arrivals_per_s,
                            churn_s,
                        )
                        print(
                            f"{target} x{calls}: {r.streaming} streaming, lost {r.data['lost']}"
                            f"/{r.data['sent']}, p99 {r.rtt(99):.1f} ms, "
                            f"{r.cpu_ms_per_call_s:.2f} ms CPU per call-s",
                            file=sys.stderr,
                        )
                        results.append(r)
        finally:
            if server_url and db_url:
                from app.db import drop_database

                drop_database(server_url, dbname)
    return results
