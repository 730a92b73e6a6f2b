"""Call set-up and tear-down: the server's CPU per call, beside a bare relay in the same run.

Each call is as short as a call gets: Twilio's signed voice webhook, the media WebSocket and its
`start`, one second of caller audio (50 frames, the agent answering through the echo fake), then
`stop`. Calls arrive at `--rate` per second until `--calls` have run; the server's CPU (all its
threads, from /proc) over the whole run, divided by the calls, is what one call costs to set up,
carry for a second and tear down (the row, the Realtime session, the recorder and its render,
the timeline). The carry part is small: a call-second of audio costs the service 7-9 ms at 50
calls (README, Capacity). `--frames 1` sends one frame (20 ms) instead: the call is stopped
once the agent's first audio is back (its session up end to end), so what is left is the
set-up and tear-down alone.

The server's CPU with no call is read for 10 s before the calls (its timers, sweepers and
listeners, whatever the calls): "less idle" takes that rate over the calls' window off the
per-call figure, which is printed whole beside it.

Baseline: the plain `websockets` relay (bench/ws_relay.py, compression off) carrying the same
calls: its per-call CPU is accepting the caller's socket and opening one upstream socket, the
least any service doing this can spend (no webhook, no database, no session configuration).

Three processes as in the echo harness: the echo Realtime fake, the server (on CPU 0 with
--pin), and this driver (CPU 1). Uses DATABASE_URL / TEST_DATABASE_URL, else embedded.

    .venv/bin/python bench/setup.py [--calls 200] [--rate 10] [--pin] [--repeat 2]
        [--frames 1] [--profile DIR]  (py-spy, raw: the server during the run)
        [--wakeups DIR]  (strace: the server's event loop woken per call, by what; the CPU
                          figures of such a run include strace's cost)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _echo import (  # bench/ is on sys.path when run as a script
    LOAD_CPU,
    PY,
    _free_port,
    _loadavg,
    _pin,
    _start_echo,
    _start_server,
    _stop,
)
from _echo_callers import cpu_seconds
from _stats import pct
from _wakeups import KINDS, strace_command
from _wakeups import count as count_wakeups
from _wakeups import stop as stop_strace
from _wsio import connect

from telephony.sim.fake_caller import FakeTwilioCaller

IDLE_S = 10.0  # the server's CPU with no call, measured this long before the calls
FRAMES = 50  # caller audio frames a call by default (--frames): one second
SILENCE = base64.b64encode(b"\xff" * 160).decode()


RUN = [0]  # distinct CallSids per churn in this process


async def one_call(
    server: str, relay: bool, index: int, took: list[float], webhook: list[float], frames: int
) -> None:
    started = time.monotonic()
    call_sid = f"CA{os.getpid():08x}{RUN[0]:04x}{index:020x}"
    stream_sid = f"MZ{RUN[0]:012x}{index:020x}"
    ws_base = server.replace("http://", "ws://", 1)
    token = None
    if relay:
        url = ws_base + "/twilio/media"
    else:
        fake = FakeTwilioCaller(server, idle_audio=False, timeout=30, call_sid=call_sid)
        outcome = await fake.dial(open_stream=False)
        if outcome.kind != "stream" or outcome.stream_url is None:
            raise RuntimeError(f"call {index}: TwiML {outcome.kind}: {outcome.body[:200]}")
        url = fake.connect_url_for(outcome.stream_url)
        token = outcome.parameters.get("token")
    webhook.append(time.monotonic() - started)
    ep = await connect(url, {"User-Agent": "Twilio.TmeWs/1.0"}, deflate=False)
    answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_text(text: str) -> None:
        if '"media"' in text and not answered.done():
            answered.set_result(None)
            ep.on_text = lambda text: None

    ep.on_text = on_text
    ep.send_text(json.dumps({"event": "connected", "protocol": "Call", "version": "1"}))
    start = {
        "accountSid": "AC" + "0" * 32, "streamSid": stream_sid, "callSid": call_sid,
        "tracks": ["inbound"], "customParameters": {"token": token} if token else {},
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
    }  # fmt: skip
    ep.send_text(json.dumps({"event": "start", "sequenceNumber": "1", "start": start,
                             "streamSid": stream_sid}))  # fmt: skip
    for seq in range(frames):
        media = {"track": "inbound", "chunk": str(seq + 1), "timestamp": str(seq * 20),
                 "payload": SILENCE}  # fmt: skip
        ep.send_text(json.dumps({"event": "media", "sequenceNumber": str(seq + 2),
                                 "media": media, "streamSid": stream_sid}))  # fmt: skip
        await asyncio.sleep(0.02)
    # The agent's first audio back: the call's session was up end to end before it is stopped.
    await asyncio.wait_for(answered, 10.0)
    stop = {"accountSid": "AC" + "0" * 32, "callSid": call_sid}
    ep.send_text(json.dumps({"event": "stop", "sequenceNumber": str(frames + 2),
                             "streamSid": stream_sid, "stop": stop}))  # fmt: skip
    ep.close()
    took.append(time.monotonic() - started)


async def churn(
    server: str, relay: bool, calls: int, rate: float, pid: int, frames: int = FRAMES
) -> dict:
    RUN[0] += 1
    took: list[float] = []
    webhook: list[float] = []
    cpu0 = cpu_seconds(pid)
    t0 = time.monotonic()
    tasks = []
    for i in range(calls):
        due = t0 + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_call(server, relay, i, took, webhook, frames)))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    await asyncio.sleep(3.0)  # the ends are persisted, the recordings rendered
    cpu = cpu_seconds(pid) - cpu0
    window = time.monotonic() - t0
    return {
        "calls": calls, "failed": len(failed), "cpu_ms_per_call": cpu * 1000 / calls,
        "window_s": window,
        "took_p50": pct(took, 50), "took_p99": pct(took, 99),
        "webhook_p50": pct(webhook, 50), "webhook_p99": pct(webhook, 99),
        "first_error": repr(failed[0])[:200] if failed else "",
    }  # fmt: skip


def run_target(
    target: str, calls: int, rate: float, pin: bool, db_url: str | None, workdir: Path,
    profile: Path | None, frames: int, wakeups: Path | None = None,
) -> dict:  # fmt: skip
    echo, echo_url = _start_echo(workdir, pin, None, workdir / f"echo-{uuid.uuid4().hex}.json")
    port = _free_port()
    server = None
    spy = None
    tracer = None
    try:
        server = _start_server(target, port, echo_url, db_url, workdir, pin)
        load = _loadavg()
        # Warm-up (imports, pools, first connections), not counted.
        asyncio.run(churn(f"http://127.0.0.1:{port}", target.startswith("relay"), 5, 5, server.pid))
        # What the process spends with no call (its timers, sweepers, listeners), per second.
        cpu0, t0 = cpu_seconds(server.pid), time.monotonic()
        time.sleep(IDLE_S)
        idle = (cpu_seconds(server.pid) - cpu0) / (time.monotonic() - t0)
        if profile is not None:
            # After the idle read, so the profile holds the calls; `--gil`: only the thread
            # holding the GIL is sampled (without it, a thread pool's and the event loop's idle
            # waits count as work). Blocking (the process paused for each sample, so its CPU
            # figure is inflated): `--nonblocking` cuts coroutines' stacks short.
            profile.mkdir(parents=True, exist_ok=True)
            spy = subprocess.Popen(
                _pin([str(Path(PY).parent / "py-spy"), "record", "--pid", str(server.pid),
                      "--duration", str(int(calls / rate) + 2), "--rate", "250", "--gil",
                      "--format", "raw", "--output",
                      str(profile / f"{target}.txt")], LOAD_CPU, pin),
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
        if wakeups is not None:
            wakeups.mkdir(parents=True, exist_ok=True)
            trace = wakeups / f"{target}-{uuid.uuid4().hex[:6]}.strace"
            tracer = subprocess.Popen(strace_command(server.pid, trace), stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached before the first call
        result = asyncio.run(
            churn(
                f"http://127.0.0.1:{port}",
                target.startswith("relay"),
                calls,
                rate,
                server.pid,
                frames,
            )
        )
        result["idle_ms_per_s"] = idle * 1000
        result["less_idle_ms_per_call"] = (
            result["cpu_ms_per_call"] - idle * 1000 * result["window_s"] / calls
        )
        result["load"] = load
        if tracer is not None:
            stop_strace(tracer)
            tracer = None
            db_port = urlsplit(db_url).port or 5432 if db_url else 5432
            woken = count_wakeups(trace, port, urlsplit(echo_url).port or 0, db_port)
            result["wakeups"] = {kind: n / calls for kind, n in woken.items()}
        return result
    finally:
        if tracer is not None:
            stop_strace(tracer)
        if spy is not None:
            spy.wait(120)
        if server is not None:
            _stop(server)
        _stop(echo, signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--targets", default="relay-plain,service")
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--wakeups", type=Path, help="strace logs here; wake-ups per call")
    parser.add_argument(
        "--frames", type=int, default=50,
        help="caller audio frames a call (20 ms each; 1: the set-up and tear-down alone)",
    )  # fmt: skip
    args = parser.parse_args()
    frames = max(1, args.frames)
    server_url = os.environ.get("DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    dbname = f"bench_setup_{uuid.uuid4().hex[:8]}"
    db_url = None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if server_url:
            from app.db import create_database

            db_url = create_database(server_url, dbname)
        try:
            for _ in range(args.repeat):
                for target in args.targets.split(","):
                    r = run_target(target, args.calls, args.rate, args.pin, db_url, Path(tmp),
                                   args.profile, frames, args.wakeups)  # fmt: skip
                    print(f"{target}: {r}", file=sys.stderr)
                    rows.append((target, r))
        finally:
            if server_url and db_url:
                from app.db import drop_database

                drop_database(server_url, dbname)
    carried = f"{frames * 20} ms of audio" if frames != FRAMES else "1 s"
    print(f"\nCall set-up + {carried} + tear-down: {args.calls} calls at {args.rate}/s, "
          f"{'server pinned to CPU 0' if args.pin else 'unpinned'}")  # fmt: skip
    print(f"{'target':14} {'CPU ms/call':>11} {'idle ms/s':>9} {'less idle':>9} {'failed':>6} "
          f"{'call p50/p99 s':>15}  load")  # fmt: skip
    for target, r in rows:
        print(f"{target:14} {r['cpu_ms_per_call']:>11.1f} {r['idle_ms_per_s']:>9.1f} "
              f"{r['less_idle_ms_per_call']:>9.1f} {r['failed']:>6} "
              f"{r['took_p50']:>7.2f}/{r['took_p99']:<7.2f}  {r['load']}")  # fmt: skip
    if args.wakeups is not None:
        print("\nThe server's event loop woken per call, by what woke it (strace; a wake-up for"
              " several kinds counts for the first; idle timers included)")  # fmt: skip
        print(f"{'target':14} " + " ".join(f"{k:>8}" for k in KINDS) + f" {'all':>8}")
        for target, r in rows:
            w = r.get("wakeups") or {}
            print(f"{target:14} " + " ".join(f"{w.get(k, 0):>8.2f}" for k in KINDS)
                  + f" {sum(w.values()):>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
