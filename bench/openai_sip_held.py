"""OpenAI SIP interconnect, calls held: the server's CPU per call, beside a bare sideband client.

On this leg OpenAI carries the audio; we hold one sideband WebSocket a call for tools and
control. N calls are announced (signed `realtime.call.incoming` webhooks) at `--rate` per
second; each is accepted, attached (`realtime.connect(call_id=...)`) and greeted, then held
while the interconnect stand-in (bench/_interconnect_proc.py) plays a conversation on every
sideband: the caller speaks a scripted turn 0.4 s after the agent stops, speech_started /
stopped, the committed item and its transcription, a response with ~3 s of audio (its
transcript deltas, output_audio_buffer.started / stopped around what the caller hears) — a
response every 4-5 s a call, for longer than the window.

Measured from /proc, all threads of the process under test:
- idle: its CPU per second over 5 s with no call (timers, pools), just before the ramp;
- set-up: its CPU from the first webhook until every call is greeted, per call (webhook
  verification, rows, accept, sideband attach, the greeting's response.create; the ramp's
  traffic is in it too);
- steady: its CPU over `--window` seconds while all N calls are held, per call-second (and
  the same less the idle process's share, "over idle");
- tear-down: its CPU over 3 s after every caller hangs up, per call (the ends persisted).

Baseline in the same run (`bare`, bench/_sideband_bare.py): accepts the same calls with the
service's own accept body (a bare httpx POST), opens each sideband with plain `websockets`,
sends the greeting's response.create, and reads and parses every event — the least a service
holding these sockets can spend (no webhook, no database, no conversation control).

Processes: the stand-in and this driver on CPU 1, the process under test on CPU 0 (`--pin`).
Uses DATABASE_URL / TEST_DATABASE_URL (a scratch database), else the embedded PostgreSQL.

    .venv/bin/python bench/openai_sip_held.py [--levels 50,100] [--window 20] [--rate 10]
        [--pin] [--repeat 1] [--targets service,bare]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _echo import (  # bench/ is on sys.path when run as a script
    LOAD_CPU,
    PY,
    ROOT,
    SERVER_CPU,
    _busy_share,
    _free_port,
    _loadavg,
    _pin,
    _start_server,
    _stop,
)
from _echo_callers import cpu_seconds

SECRET = "whsec_" + base64.b64encode(b"bench-openai-sip-secret-32-bytes").decode()
SETTLE_S = 2.0  # after the ramp: the last greetings play out before the window opens
TEARDOWN_S = 3.0
IDLE_S = 5.0
CORE_SHARE = 0.7  # calls per core are counted at 70% of a core, leaving room for bursts


class Line:
    """A child process spoken to in JSON lines (one command, one answer)."""

    def __init__(self, cmd: list[str], cpu: str, pinned: bool) -> None:
        self.proc = subprocess.Popen(
            _pin(cmd, cpu, pinned), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args} exited ({self.proc.poll()})")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            _stop(self.proc, signal.SIGTERM)


@dataclass
class Held:
    target: str
    calls: int
    ready: int
    setup_ms: float
    idle_ms: float  # CPU per second with no call (timers, pools), before the ramp
    steady_ms: float  # CPU per call-second, everything the process spent in the window
    teardown_ms: float
    events_per_call_s: float
    responses_per_call_min: float
    load: str

    @property
    def marginal_ms(self) -> float:
        """CPU per call-second over the idle process's own."""
        return self.steady_ms - self.idle_ms / self.calls

    @property
    def per_core(self) -> float:
        return CORE_SHARE * 1000 / self.steady_ms if self.steady_ms else float("inf")


def measure(
    target: str, calls: int, pid: int, sim: Line, ramp: Any, window: float
) -> Held:  # fmt: skip
    load = f"{_loadavg()}, others {_busy_share(1.0) * 100:.0f}% busy"
    idle0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(IDLE_S)
    cpu0 = cpu_seconds(pid)
    idle_ms = (cpu0 - idle0) * 1000 / (time.monotonic() - t0)
    ready = ramp()
    cpu1 = cpu_seconds(pid)
    time.sleep(SETTLE_S)
    c2, cpu2, t2 = sim.ask("count"), cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    c3, cpu3, t3 = sim.ask("count"), cpu_seconds(pid), time.monotonic()
    sim.ask("hangup")
    time.sleep(TEARDOWN_S)
    cpu4 = cpu_seconds(pid)
    call_s = calls * (t3 - t2)
    return Held(
        target, calls, ready,
        idle_ms=idle_ms,
        setup_ms=(cpu1 - cpu0) * 1000 / calls,
        steady_ms=(cpu3 - cpu2) * 1000 / call_s,
        teardown_ms=(cpu4 - cpu3) * 1000 / calls,
        events_per_call_s=(c3["sent"] - c2["sent"]) / call_s,
        responses_per_call_min=(c3["responses"] - c2["responses"]) * 60 / call_s,
        load=load,
    )  # fmt: skip


def start_sim(webhook_port: int, pinned: bool) -> tuple[Line, str]:
    sim = Line(
        [PY, str(ROOT / "bench" / "_interconnect_proc.py"),
         f"http://127.0.0.1:{webhook_port}/openai/webhook", SECRET],
        LOAD_CPU, pinned,
    )  # fmt: skip
    return sim, sim.read()["url"]


def run_service(
    calls: int, rate: float, window: float, pinned: bool, db_url: str | None, workdir: Path,
    body_file: Path,
) -> Held:  # fmt: skip
    port = _free_port()
    sim, url = start_sim(port, pinned)
    server = None
    try:
        os.environ["OPENAI_WEBHOOK_SECRET"] = SECRET
        server = _start_server("service", port, url, db_url, workdir, pinned)
        sim.ask("place 3 5")  # warm-up: imports, pools, first connections
        body_file.write_text(json.dumps(sim.ask("accept_body")["body"]))
        sim.ask("hangup")
        time.sleep(1.0)
        return measure(
            "service", calls, server.pid, sim,
            lambda: sim.ask(f"place {calls} {rate}")["greeted"], window,
        )  # fmt: skip
    finally:
        if server is not None:
            _stop(server)
        sim.close()


def run_bare(calls: int, rate: float, window: float, pinned: bool, body_file: Path) -> Held:
    sim, url = start_sim(_free_port(), pinned)
    bare = Line([PY, str(ROOT / "bench" / "_sideband_bare.py"), url, str(body_file)],
                SERVER_CPU, pinned)  # fmt: skip
    try:
        warm = sim.ask("new 3")["ids"]
        bare.ask(f"take 5 {' '.join(warm)}")
        sim.ask("greeted")
        sim.ask("hangup")
        time.sleep(1.0)

        def ramp() -> int:
            ids = sim.ask(f"new {calls}")["ids"]
            bare.ask(f"take {rate} {' '.join(ids)}")
            return int(sim.ask("greeted")["greeted"]) - len(warm)

        return measure("bare", calls, bare.proc.pid, sim, ramp, window)
    finally:
        bare.close()
        sim.close()


def table(results: list[Held], pinned: bool, window: float) -> str:
    lines = [
        f"OpenAI SIP calls held (sideband only), window {window:g} s, "
        f"{'process under test on CPU 0' if pinned else 'unpinned'}; "
        f"calls per core = {CORE_SHARE:.0%} of a core / steady CPU per call",
        f"{'target':8} {'calls':>5} {'ready':>5} {'idle ms/s':>9} {'set-up ms/call':>14} "
        f"{'steady ms/call-s':>16} {'over idle':>9} {'% core/call':>11} {'calls/core':>10} "
        f"{'tear-down ms':>12} {'events/call-s':>13} {'resp/call-min':>13}  load",
    ]
    for r in results:
        lines.append(
            f"{r.target:8} {r.calls:>5} {r.ready:>5} {r.idle_ms:>9.1f} {r.setup_ms:>14.1f} "
            f"{r.steady_ms:>16.3f} {r.marginal_ms:>9.3f} "
            f"{r.steady_ms / 10:>11.3f} {r.per_core:>10.0f} {r.teardown_ms:>12.1f} "
            f"{r.events_per_call_s:>13.2f} {r.responses_per_call_min:>13.1f}  {r.load}"
        )
    return "\n".join(lines)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="50,100")
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--targets", default="service,bare")
    args = parser.parse_args()
    targets = args.targets.split(",")
    if "bare" in targets and targets[0] != "service":
        parser.error("the service runs first: the bare client accepts with its accept body")
    server_url = os.environ.get("DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    dbname = f"bench_sip_held_{uuid.uuid4().hex[:8]}"
    db_url = None
    results: list[Held] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        body_file = workdir / "accept.json"
        if server_url:
            from app.db import create_database

            db_url = create_database(server_url, dbname)
        try:
            for calls in [int(x) for x in args.levels.split(",")]:
                for _ in range(args.repeat):
                    for target in targets:
                        if target == "service":
                            r = run_service(calls, args.rate, args.window, args.pin, db_url,
                                            workdir, body_file)  # fmt: skip
                        elif target == "bare":
                            r = run_bare(calls, args.rate, args.window, args.pin, body_file)
                        else:
                            parser.error(f"unknown target {target}")
                        print(f"{target} x{calls}: {r}", file=sys.stderr)
                        results.append(r)
        finally:
            if server_url and db_url:
                from app.db import drop_database

                drop_database(server_url, dbname)
    print(table(results, args.pin, args.window))


if __name__ == "__main__":
    main()
