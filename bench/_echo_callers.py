"""The load side of the echo harness: N fake Twilio callers, full duplex, in one process.

Each caller sends 20 ms mu-law `media` frames in real time; the first bytes of each frame
carry the call and a sequence number, so when the echo Realtime fake sends the audio back
through the server under test, each frame's round trip is timed. Marks are echoed when
emulated playout (8000 bytes/s from arrival) reaches them, as Twilio does. Server CPU comes
from /proc over a measuring window that opens once every call is streaming.

Usage: python bench/_echo_callers.py --server URL --mode service|relay --calls N
  --seconds S --server-pid PID [--echo-pid PID] --out FILE [--deflate]
Writes a JSON summary to FILE.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import heapq
import json
import os
import random
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import orjson
from _wsio import Endpoint, connect

try:
    import uvloop
except ImportError:
    uvloop = None

FRAME_BYTES = 160
FRAME_S = 0.020
SLOTS = 20  # callers are spread over the 20 ms period, one slot per millisecond
TAIL = base64.b64encode(b"\xff" * (FRAME_BYTES - 6)).decode()  # mu-law silence


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


class Window:
    """The measuring window: frames sent inside it count; CPU is read at its edges."""

    def __init__(self) -> None:
        self.start = float("inf")
        self.end = float("inf")

    def inside(self, t: float) -> bool:
        return self.start <= t < self.end


class Caller:
    def __init__(self, index: int, run: Run) -> None:
        self.index = index
        self.run = run
        self.ep: Endpoint | None = None
        self.stream_sid = f"MZ{index:032x}"
        self.call_sid = f"CA{os.getpid():08x}{index:024x}"
        self.seq = 0
        self.sent: list[float] = []  # send time per sequence number
        self.got: dict[int, float] = {}  # sequence number -> round trip (s), window frames
        self.received_frames = 0
        self.media_msgs = 0
        self.mark_msgs = 0
        self.other_msgs = 0
        self.playout_end = 0.0
        self.queued_bytes = 0  # agent audio received since the stream began or the last clear
        self.clears: list[tuple[float, float]] = []  # (when, ms of the item heard by then)
        self.t0 = 0.0
        self.ended = float("inf")  # when the caller hung up (--churn-s), else never
        self.twilio_seq = 2

    def header(self, seq: int) -> bytes:
        return seq.to_bytes(4, "big") + self.index.to_bytes(2, "big")

    async def open(self, url: str, token: str | None, deflate: bool) -> None:
        self.ep = await connect(url, {"User-Agent": "Twilio.TmeWs/1.0"}, deflate=deflate)
        self.ep.on_text = self.on_text
        self.ep.send_text(json.dumps({"event": "connected", "protocol": "Call", "version": "1"}))
        self.ep.send_text(
            json.dumps(
                {
                    "event": "start",
                    "sequenceNumber": "1",
                    "start": {
                        "accountSid": "AC" + "0" * 32,
                        "streamSid": self.stream_sid,
                        "callSid": self.call_sid,
                        "tracks": ["inbound"],
                        "customParameters": {"token": token} if token else {},
                        "mediaFormat": {
                            "encoding": "audio/x-mulaw",
                            "sampleRate": 8000,
                            "channels": 1,
                        },
                    },
                    "streamSid": self.stream_sid,
                }
            )
        )

    def send_due(self, now: float) -> None:
        """Send every frame whose time has come (catching up if the loop was late)."""
        assert self.ep is not None
        while self.t0 + self.seq * FRAME_S <= now:
            seq = self.seq
            self.seq += 1
            self.twilio_seq += 1
            payload = base64.b64encode(self.header(seq)).decode() + TAIL
            self.sent.append(time.monotonic())
            self.ep.send_text(
                f'{{"event":"media","sequenceNumber":"{self.twilio_seq}","media":{{"track":'
                f'"inbound","chunk":"{seq + 1}","timestamp":"{seq * 20}","payload":"{payload}"}},'
                f'"streamSid":"{self.stream_sid}"}}'
            )

    def on_text(self, raw: str) -> None:
        now = time.monotonic()
        msg = orjson.loads(raw)
        event = msg.get("event")
        counted = self.run.window.inside(now)
        if event == "media":
            self.media_msgs += counted
            audio = base64.b64decode(msg["media"]["payload"])
            window = self.run.window
            for offset in range(0, len(audio) - 5, FRAME_BYTES):
                seq = int.from_bytes(audio[offset : offset + 4], "big")
                if int.from_bytes(audio[offset + 4 : offset + 6], "big") != self.index:
                    continue
                self.received_frames += 1
                if seq < len(self.sent) and window.inside(self.sent[seq]):
                    self.got.setdefault(seq, now - self.sent[seq])
            self.playout_end = max(self.playout_end, now) + len(audio) / 8000
            self.queued_bytes += len(audio)
        elif event == "mark":
            self.mark_msgs += counted
            name = msg["mark"]["name"]
            if self.playout_end <= now:
                self.echo_mark(name)
            else:
                self.run.schedule_mark(self.playout_end, self, name)
        elif event == "clear":
            self.other_msgs += 1
            # Twilio drops what it had not played yet: the item was heard up to here.
            unplayed = max(0.0, self.playout_end - now) * 8000
            self.clears.append((now, (self.queued_bytes - unplayed) / 8))
            self.queued_bytes = 0
            self.playout_end = now
            self.run.flush_marks(self)
        else:
            self.other_msgs += 1

    def echo_mark(self, name: str) -> None:
        assert self.ep is not None
        self.twilio_seq += 1
        self.ep.send_text(
            json.dumps(
                {
                    "event": "mark",
                    "sequenceNumber": str(self.twilio_seq),
                    "streamSid": self.stream_sid,
                    "mark": {"name": name},
                }
            )
        )

    def stop(self) -> None:
        if self.ep is None:
            return
        self.twilio_seq += 1
        self.ep.send_text(
            json.dumps(
                {
                    "event": "stop",
                    "sequenceNumber": str(self.twilio_seq),
                    "streamSid": self.stream_sid,
                    "stop": {"accountSid": "AC" + "0" * 32, "callSid": self.call_sid},
                }
            )
        )
        self.ep.close()


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.window = Window()
        self.callers: list[Caller] = []
        self.slots: list[list[Caller]] = [[] for _ in range(SLOTS)]
        self._marks: list[tuple[float, int, Caller, str]] = []
        self._mark_seq = 0
        self.late_ticks = 0
        self.max_tick_lag = 0.0
        self.running = True
        self.live: dict[Caller, float] = {}  # caller -> when it hangs up (--churn-s)
        self.next_index = args.calls
        self.churn_failed: list[str] = []
        self._lifetimes = random.Random(29)

    def schedule_mark(self, due: float, caller: Caller, name: str) -> None:
        self._mark_seq += 1
        heapq.heappush(self._marks, (due, self._mark_seq, caller, name))

    def flush_marks(self, caller: Caller) -> None:
        # A clear releases every pending mark at once.
        keep = []
        for entry in self._marks:
            if entry[2] is caller:
                caller.echo_mark(entry[3])
            else:
                keep.append(entry)
        heapq.heapify(keep)
        self._marks = keep

    async def ticker(self) -> None:
        """Once a millisecond: send the frames of that slot's callers, release due marks."""
        slot = 0
        next_tick = time.monotonic()
        while self.running:
            next_tick += FRAME_S / SLOTS
            delay = next_tick - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic()
            lag = now - next_tick
            if lag > 0.005:
                self.late_ticks += 1
            if self.window.inside(now):
                self.max_tick_lag = max(self.max_tick_lag, lag)
            for caller in self.slots[slot]:
                caller.send_due(now)
            slot = (slot + 1) % SLOTS
            marks = self._marks
            while marks and marks[0][0] <= now:
                _, _, caller, name = heapq.heappop(marks)
                caller.echo_mark(name)

    async def dial(self, caller: Caller) -> None:
        args = self.args
        ws_base = args.server.replace("http://", "ws://", 1)
        if args.mode == "relay":
            await caller.open(ws_base + "/twilio/media", None, args.deflate)
            return
        from telephony.sim.fake_caller import FakeTwilioCaller

        fake = FakeTwilioCaller(args.server, idle_audio=False, timeout=30, call_sid=caller.call_sid)
        outcome = await fake.dial(open_stream=False)
        if outcome.kind != "stream" or outcome.stream_url is None:
            raise RuntimeError(f"call {caller.index}: TwiML {outcome.kind}: {outcome.body[:200]}")
        url = fake.connect_url_for(outcome.stream_url)
        await caller.open(url, outcome.parameters.get("token"), args.deflate)

    async def start_call(self, index: int) -> None:
        caller = Caller(index, self)
        await self.dial(caller)
        caller.t0 = time.monotonic()
        self.callers.append(caller)
        self.slots[index % SLOTS].append(caller)
        if self.args.churn_s:
            lifetime = self.args.churn_s * self._lifetimes.uniform(0.5, 1.5)
            self.live[caller] = caller.t0 + lifetime

    async def churner(self) -> None:
        """--churn-s: each call hangs up when its lifetime is over and another is dialled in
        its place, so as many stay live while calls end and arrive all the time."""
        dialling: set[asyncio.Task[None]] = set()
        while self.running:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for caller, ends in list(self.live.items()):
                if ends > now or not self.running:
                    continue
                del self.live[caller]
                self.slots[caller.index % SLOTS].remove(caller)
                caller.ended = now
                caller.stop()
                index, self.next_index = self.next_index, self.next_index + 1
                task = asyncio.create_task(self.start_call(index % 65536))
                dialling.add(task)
                task.add_done_callback(self._dialled(dialling))
        for task in dialling:
            task.cancel()

    def _dialled(self, dialling: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            dialling.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self.churn_failed.append(repr(task.exception()))

        return done


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--mode", choices=["service", "relay"], required=True)
    parser.add_argument("--calls", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--ramp-per-s", type=float, default=40.0)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--echo-pid", type=int)
    parser.add_argument("--deflate", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--window-file", help="created when the measuring window opens")
    parser.add_argument(
        "--churn-s",
        type=float,
        default=0.0,
        help="each call lasts this long on average (0.5-1.5x), then hangs up and another is "
        "dialled in its place",
    )
    parser.add_argument(
        "--count-arrivals",
        action="store_true",
        help="open the measuring window before the first call: its arrivals (webhook, socket, "
        "set-up) are measured with the streaming",
    )
    return parser.parse_args()


def scrape(server: str) -> dict[str, float]:
    """The service's own loop watch (app/loop_watch.py) from its /metrics: every sample of
    the event loop's lateness and GC pause histograms, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (
            "voice_agent_event_loop_lag_seconds",
            "voice_agent_gc_pause_seconds",
            "voice_agent_gc_pause_cpu_seconds",
            "voice_agent_gc_sweeps",  # the collector's steward (app/gc_steward.py)
            "voice_agent_gc_frozen_objects",
        ):
            for sample in family.samples:
                key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}|{key}"] = sample.value
    return out


def watched(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """In the window: GC pauses (all, over 10 ms, the longest's bucket bound, and how many
    took over 10 ms of CPU) and the loop's
    lateness (samples, over 20 and 40 ms, the p99's and the worst's bucket bounds)."""

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    gc_all = sum(grew(f"voice_agent_gc_pause_seconds_count|generation={g}") for g in range(3))
    gc_10 = sum(
        grew(f"voice_agent_gc_pause_seconds_bucket|generation={g},le=0.01") for g in range(3)
    )
    lag = "voice_agent_event_loop_lag_seconds_bucket|le="
    bounds = sorted(
        (float(k.rpartition("=")[2]), k) for k in after if k.startswith(lag) and "+Inf" not in k
    )
    gc_bounds = sorted(
        {float(k.rpartition("=")[2]) for k in after if "gc_pause_seconds_bucket" in k}
        - {float("inf")}
    )
    lag_n = grew("voice_agent_event_loop_lag_seconds_count|")

    def lag_bound(share: float) -> float:
        for bound, key in bounds:
            if grew(key) >= share * lag_n:
                return bound
        return float("inf")

    def gc_longest() -> float:
        for bound in gc_bounds:
            under = sum(
                grew(f"voice_agent_gc_pause_seconds_bucket|generation={g},le={bound}")
                for g in range(3)
            )
            if under >= gc_all:
                return bound
        return float("inf")

    over_by_generation = [
        grew(f"voice_agent_gc_pause_seconds_count|generation={g}")
        - grew(f"voice_agent_gc_pause_seconds_bucket|generation={g},le=0.01")
        for g in range(3)
    ]
    # The same collections by the CPU they took (app/loop_watch.py): a pause over 10 ms whose
    # CPU was under it waited for the core (saturated or shared), not for the collector.
    cpu = "voice_agent_gc_pause_cpu_seconds"
    cpu_over_10 = sum(
        grew(f"{cpu}_count|generation={g}") - grew(f"{cpu}_bucket|generation={g},le=0.01")
        for g in range(3)
    )
    return {
        "gc_pauses": gc_all,
        "gc_over_10ms": gc_all - gc_10,
        "gc_cpu_over_10ms": cpu_over_10,
        "gc_over_10ms_by_generation": over_by_generation,
        "gc_longest_le_s": gc_longest() if gc_all else 0.0,
        "lag_samples": lag_n,
        "lag_over_20ms": lag_n - grew(lag + "0.02"),
        "lag_over_40ms": lag_n - grew(lag + "0.04"),
        "lag_p99_le_s": lag_bound(0.99) if lag_n else 0.0,
        "lag_max_le_s": lag_bound(1.0) if lag_n else 0.0,
        "gc_sweeps": sum(grew(k) for k in after if k.startswith("voice_agent_gc_sweeps_total|")),
        "gc_frozen": after.get("voice_agent_gc_frozen_objects|", 0.0),
    }


async def main(args: argparse.Namespace) -> dict:
    run = Run(args)
    ticker = asyncio.create_task(run.ticker())
    churner = asyncio.create_task(run.churner())
    scraped: list[dict[str, float]] = []

    async def open_window() -> tuple[float, float, float, float]:
        if args.mode == "service":
            scraped.append(await asyncio.to_thread(scrape, args.server))
        user, system = cpu_times(args.server_pid)
        echo = cpu_seconds(args.echo_pid) if args.echo_pid else 0.0
        mine = time.process_time()
        run.window.start = time.monotonic()
        if args.window_file:
            await asyncio.to_thread(Path(args.window_file).touch)
        return user, system, echo, mine

    if args.count_arrivals:
        user0, sys0, echo0, self0 = await open_window()
    t_ramp = time.monotonic()
    starts = []
    for index in range(args.calls):
        starts.append(asyncio.create_task(run.start_call(index)))
        await asyncio.sleep(1 / args.ramp_per_s)
    results = await asyncio.gather(*starts, return_exceptions=True)
    failed = [repr(r) for r in results if isinstance(r, BaseException)]
    ramp_s = time.monotonic() - t_ramp
    if not args.count_arrivals:
        await asyncio.sleep(args.settle)
        user0, sys0, echo0, self0 = await open_window()
    await asyncio.sleep(args.seconds)
    run.window.end = time.monotonic()
    user1, sys1 = cpu_times(args.server_pid)
    echo1 = cpu_seconds(args.echo_pid) if args.echo_pid else 0.0
    self1 = time.process_time()
    window_s = run.window.end - run.window.start
    if args.mode == "service":
        scraped.append(await asyncio.to_thread(scrape, args.server))
    await asyncio.sleep(2.0)  # stragglers still count as received, only later
    run.running = False
    await ticker
    await churner
    for caller in run.live if args.churn_s else run.callers:
        caller.stop()
    await asyncio.sleep(0.2)
    rtts: list[float] = []
    sent = lost = cut = 0
    media_msgs = mark_msgs = 0
    for caller in run.callers:
        # A frame sent in the last second before its caller hung up may not have come back.
        until = caller.ended - 1.0
        in_window = [seq for seq, t in enumerate(caller.sent) if run.window.inside(t) and t < until]
        sent += len(in_window)
        for seq in in_window:
            if seq in caller.got:
                continue
            t = caller.sent[seq]
            # Audio still queued in the server when the caller cut in is dropped, as it must be.
            if any(t_clear - 0.5 <= t <= t_clear for t_clear, _ in caller.clears):
                cut += 1
            else:
                lost += 1
        rtts.extend(v * 1000 for v in caller.got.values())
        media_msgs += caller.media_msgs
        mark_msgs += caller.mark_msgs
    live = max(1, len(run.live) if args.churn_s else len(run.callers))
    # Call-seconds inside the window (with --count-arrivals, each call from its answer on).
    call_s = sum(
        max(0.0, min(run.window.end, caller.ended) - max(run.window.start, caller.t0))
        for caller in run.callers
    )
    summary = {
        "call_s": call_s,
        "arrivals_counted": bool(args.count_arrivals),
        "mode": args.mode,
        "calls": args.calls,
        "streaming": len(run.live) if args.churn_s else len(run.callers),
        "failed": (failed + run.churn_failed)[:5],
        "ended_in_window": sum(run.window.inside(c.ended) for c in run.callers),
        "watch": watched(*scraped) if len(scraped) == 2 else None,
        "ramp_s": ramp_s,
        "window_s": window_s,
        "sent": sent,
        "lost": lost,
        "cut_by_barge_in": cut,
        "clears": {str(c.index): c.clears for c in run.callers if c.clears},
        "rtt_ms": sorted(rtts),
        "server_cpu_s": user1 - user0 + sys1 - sys0,
        "server_sys_s": sys1 - sys0,
        "echo_cpu_s": echo1 - echo0,
        "loadgen_cpu_s": self1 - self0,
        "late_ticks": run.late_ticks,
        "max_tick_lag_ms": run.max_tick_lag * 1000,
        "media_per_call_s": media_msgs / live / window_s,
        "marks_per_call_s": mark_msgs / live / window_s,
    }
    return summary


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    arguments = parse_args()
    result = uvloop.run(main(arguments)) if uvloop is not None else asyncio.run(main(arguments))
    Path(arguments.out).write_text(json.dumps(result))
