"""Late-result delivery benchmark: commit -> announcement audio sent, commit -> SMS request.

Prints tables (no assertions), each with a baseline measured in the same run:

- announcement: from the commit of an operation (its terminal transition durable) to the first
  audio frame of the announcement reaching the caller's Twilio stream, for 1 and 50 live calls
  at once. Baseline: the same calls, the bridge handed the same late result directly
  (`deliver_result`, no ledger, NOTIFY, relevance gate or durable offer).
- SMS: from the commit of an operation whose call has ended to the create request arriving at
  the (fake) Twilio Messages API, for 1 and 50 at once, through the in-process worker's
  delivery job (decide, persist the SMS, send). Baseline: the twilio library's
  `messages.create` called directly, as many at once.
- work per delivery in those windows (from the first commit until the last delivery arrived):
  this process's CPU, and the SQL statements, pool checkouts (each one pinged: pool_pre_ping)
  and transactions on the service's engine, divided by the deliveries. Everything in the
  window counts: the commits themselves, the offers, the announcement reports, the delivery
  jobs, the SMS status callbacks, and the calls' media. Procrastinate's own statements (job
  fetch, finish, defer) do not go through the engine and are not counted. These figures move
  little from run to run where the latencies above, on a shared machine, move a lot.

Everything runs in this process over real sockets: the service (uvicorn), the Realtime
simulator (first audio at once: realtime_factor 0), fake Twilio callers and the fake Twilio
REST API, on a scratch database in TEST_DATABASE_URL / DATABASE_URL (or embedded).

`--worker process` runs the SMS path in the deployed shape instead: the delivery worker is
`voice-agent worker` in a process of its own (as beside `serve --no-worker` replicas), on the
same scratch database, and the fake Twilio REST API is another process (bench/_fake_twilio.py;
Twilio is not on the service's CPU). This process then runs the service without a worker and
the benchmark; the worker process's CPU gets a column of its own, the fake API's is counted
nowhere. Announcements (when run) stay in one process.

    .venv/bin/python bench/delivery.py [--quick] [--only sms|announcement]
        [--worker inprocess|process]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _stats import pct  # bench/ is on sys.path when run as a script

from app.db import create_database, drop_database, make_engine, resolve_database_url, upgrade
from app.main import create_app
from app.ops.twilio_rest import close_twilio_client, make_twilio_client
from app.server import ServiceServer, uvicorn_config
from app.settings import Settings
from telephony.sim.fake_caller import DEFAULT_ACCOUNT_SID, DEFAULT_AUTH_TOKEN, FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import RealtimeSimulator
from telephony.tool_gateway import LateResult
from tools import ledger
from tools.autocommit import autocommit
from tools.states import OperationStatus

S = OperationStatus
BENCH = Path(__file__).resolve().parent
MODES = {
    "inprocess": "one process: service, delivery worker, fake Twilio API and the benchmark",
    "process": "SMS path as deployed: `voice-agent worker` in its own process, the fake Twilio"
    " API in another; this process runs the service (no worker: `serve --no-worker`) and the"
    " benchmark (announcements, when run, stay in one process)",
}
ARGS = {"date": "2027-01-05", "time": "20:00", "party_size": 2, "name": "Guest"}
SCENARIO = Scenario.model_validate(
    {
        "name": "bench-delivery",
        "greeting": {"text": "Hello.", "audio_ms": 300},
        "steps": [],
        "fallback": {"text": "{note}", "audio_ms": 300},
    }
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def service(
    engine: AsyncEngine, *, with_worker: bool = True, **values: Any
) -> AsyncIterator[Any]:
    port = _free_port()
    settings = Settings(
        host="127.0.0.1",
        port=port,
        public_base_url=f"http://127.0.0.1:{port}",
        twilio_auth_token=DEFAULT_AUTH_TOKEN,
        stream_token_secret="bench",
        console_password="bench-console-password",
        max_live_calls=200,
        # This loop also runs the callers, the simulator and the fake Twilio API: its lateness
        # is not the service's alone, so it refuses no call for it.
        busy_loop_lag_ms=0,
        log_level="WARNING",
        **values,
    )
    app = create_app(settings, engine=engine, with_worker=with_worker)
    server = ServiceServer(uvicorn_config(app, settings, log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield app, settings
    finally:
        server.should_exit = True
        await task


async def _wait(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(0.005)


def _first_media_after(caller: FakeTwilioCaller, t0: float) -> float | None:
    for message in caller.received:
        if message.t >= t0 and message.event == "media":
            return message.t
    return None


async def _quiet(callers: list[FakeTwilioCaller]) -> None:
    """Until every caller has heard everything sent to it (nothing in flight)."""
    await _wait(lambda: all(c.buffered_ms == 0 and c.heard_ms > 0 for c in callers))
    await asyncio.sleep(0.2)  # no audio still on its way from the model


async def _running_ops(engine: AsyncEngine, calls: list[tuple[str, str]]) -> list[uuid.UUID]:
    """One running booking per (call id, caller number)."""

    async def nobody(conn: Any, operation_id: uuid.UUID) -> None:
        return None  # no job: the benchmark plays the worker up to the commit

    ids = []
    for call_id, number in calls:
        async with engine.begin() as conn:
            adm = await ledger.admit_operation(
                conn,
                tenant_id="default",
                tool="book_table",
                args=ARGS,
                idempotency_key=f"bench-{uuid.uuid4().hex}",
                call_id=call_id,
                caller=number,
                enqueue=nobody,
            )
            op_id = adm.operation.operation_id
            await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="bench", reason="go")
        ids.append(op_id)
    return ids


async def _commit(engine: AsyncEngine, op_id: uuid.UUID) -> float:
    """Commit one operation as the executor records a provider's confirmation (one statement,
    no transaction around it); the monotonic time its commit became durable."""
    async with autocommit(engine) as conn:
        done = await ledger.transition(
            conn,
            op_id,
            S.RUNNING,
            S.COMMITTED,
            actor="bench",
            reason="ok",
            provider_ref="BKBENCH234",
            alone=True,
        )
    assert done is not None, "the commit changed nothing"
    observed = time.monotonic()
    assert done.committed_at is not None
    # The database's clock at the commit (its transaction's start), on this process's
    # monotonic clock: the commit as it happened, not when this busy loop got back to it.
    _COMMITTED_AT[op_id] = done.committed_at.timestamp() - (time.time() - observed)
    return observed


_COMMITTED_AT: dict[uuid.UUID, float] = {}


class Work:
    """CPU and database work of this process over a window (see the module docstring)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.counts = {"statements": 0, "checkouts": 0, "transactions": 0}
        self.rows: list[tuple[str, ...]] = []
        self._window: tuple[float, dict[str, int], float] | None = None
        self.worker_pid: int | None = None  # --worker process: its CPU counts too
        sync = engine.sync_engine
        sa.event.listen(sync, "before_cursor_execute", self._on("statements"))
        sa.event.listen(sync.pool, "checkout", self._on("checkouts"))
        sa.event.listen(sync, "begin", self._on("transactions"))

    def _on(self, key: str) -> Any:
        def count(*_args: Any, **_kw: Any) -> None:
            self.counts[key] += 1

        return count

    def start(self) -> None:
        self._window = (time.process_time(), dict(self.counts), self._worker_cpu())

    def _worker_cpu(self) -> float:
        """The worker process's CPU seconds so far (0 when the worker is in this process)."""
        if self.worker_pid is None:
            return 0.0
        fields = Path(f"/proc/{self.worker_pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, name: str, n: int) -> None:
        assert self._window is not None
        cpu0, before, worker0 = self._window
        self._window = None
        cpu_ms = (time.process_time() - cpu0) * 1000 / n
        worker_ms = (self._worker_cpu() - worker0) * 1000 / n if self.worker_pid else None
        per = {k: (v - before[k]) / n for k, v in self.counts.items()}
        self.rows.append(
            (
                name,
                str(n),
                f"{cpu_ms:.1f}",
                "-" if worker_ms is None else f"{worker_ms:.1f}",
                f"{per['statements']:.1f}",
                f"{per['checkouts']:.1f}",
                f"{per['transactions']:.1f}",
            )
        )


async def announcement_rows(engine: AsyncEngine, quick: bool, work: Work) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    async with (
        RealtimeSimulator(SCENARIO, realtime_factor=0.0, record=False) as sim,
        FakeTwilioApi() as api,
        service(engine, openai_base_url=sim.base_url, twilio_api_base_url=api.base_url) as (
            app,
            _settings,
        ),
    ):
        runtime = app.state.runtime
        for n, rounds in ((1, 5 if quick else 20), (50, 1 if quick else 3)):
            callers = [
                FakeTwilioCaller(runtime.settings.public_base_url, from_number=f"+1555{i:07d}")
                for i in range(n)
            ]
            for c in callers:
                api.attach(c)
            await asyncio.gather(*(c.dial() for c in callers))
            await _quiet(callers)
            sids = [c.call_sid for c in callers]
            bare: list[float] = []
            ours: list[float] = []
            for _ in range(rounds):
                # Baseline: the late result handed straight to each bridge.
                t0 = time.monotonic()
                await asyncio.gather(
                    *(
                        runtime.registry.get(sid).live.deliver_result(
                            LateResult("bench", "A baseline update.")
                        )
                        for sid in sids
                    )
                )
                await _wait(lambda t=t0, cs=callers: all(_first_media_after(c, t) for c in cs))
                bare += [_first_media_after(c, t0) - t0 for c in callers]  # type: ignore[operator]
                await _quiet(callers)
                # Ours: commit -> delivery row + NOTIFY -> gate -> durable offer -> bridge.
                calls = [
                    (runtime.registry.get(sid).call_id, c.from_number)
                    for sid, c in zip(sids, callers, strict=True)
                ]
                ops = await _running_ops(engine, calls)
                work.start()
                committed = await asyncio.gather(*(_commit(engine, op) for op in ops))
                start = min(committed)
                await _wait(lambda t=start, cs=callers: all(_first_media_after(c, t) for c in cs))
                work.stop(f"announcement, {n} call{'s' if n > 1 else ''}", n)
                ours += [
                    _first_media_after(c, t) - t  # type: ignore[operator]
                    for c, t in zip(callers, committed, strict=True)
                ]
                await _quiet(callers)
            await asyncio.gather(*(c.hangup() for c in callers))
            await _wait(lambda: runtime.registry.live_count() == 0)
            rows.append(_row(f"announcement, {n} call{'s' if n > 1 else ''}", ours, bare))
    return rows


async def sms_rows(
    engine: AsyncEngine, quick: bool, work: Work, url: str, worker: str
) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    alone = worker == "process"
    async with (
        _TwilioProcess() if alone else FakeTwilioApi(sms_step_delay_s=0.01) as api,
        service(
            engine,
            with_worker=not alone,
            twilio_api_base_url=api.base_url,
            sweep_interval_s=1.0,
        ) as (_app, settings),
        _worker_process(url, settings, api.base_url, work) if alone else _nothing(),
    ):
        client = make_twilio_client(DEFAULT_ACCOUNT_SID, DEFAULT_AUTH_TOKEN, api.base_url)
        arrivals: Any = api if alone else _Arrivals(api)
        try:
            for n, rounds in ((1, 5 if quick else 20), (50, 1 if quick else 3)):
                bare: list[float] = []
                ours: list[float] = []
                db: list[float] = []
                for r in range(rounds):
                    numbers = [f"+1666{n:03d}{r:02d}{i:02d}" for i in range(n)]

                    async def direct(to: str) -> float:
                        t0 = time.monotonic()
                        await client.messages.create_async(
                            to=to, from_="+15550000000", body="baseline"
                        )
                        return t0

                    starts = await asyncio.gather(*(direct("+1777" + t[4:]) for t in numbers))
                    # (--worker process: the arrivals come from the fake API's process)
                    await _wait(
                        lambda nums=numbers: all(arrivals.at("+1777" + x[4:]) for x in nums)
                    )
                    for to, t0 in zip(numbers, starts, strict=True):
                        arrived = arrivals.at("+1777" + to[4:])
                        bare.append(arrived - t0)
                    calls = [(await _ended_call(engine, num), num) for num in numbers]
                    ops = await _running_ops(engine, calls)
                    work.start()
                    committed = await asyncio.gather(*(_commit(engine, op) for op in ops))
                    await _wait(lambda nums=numbers: all(arrivals.at(x) for x in nums))
                    work.stop(f"SMS, {n} at once", n)
                    ours += [
                        arrivals.at(num) - t for num, t in zip(numbers, committed, strict=True)
                    ]
                    db += [
                        arrivals.at(num) - _COMMITTED_AT[op]
                        for num, op in zip(numbers, ops, strict=True)
                    ]
                rows.append(_row(f"SMS, {n} at once", ours, bare))
                rows.append(_row(f"SMS, {n} at once (db clock)", db, bare))
        finally:
            await close_twilio_client(client)
    return rows


@asynccontextmanager
async def _nothing() -> AsyncIterator[None]:
    yield


class _TwilioProcess:
    """The fake Twilio REST API in a process of its own (bench/_fake_twilio.py): its base URL,
    and when the first create request to each number reached it (`at`, as `_Arrivals`)."""

    def __init__(self) -> None:
        self.base_url = ""
        self.first: dict[str, float] = {}

    async def __aenter__(self) -> _TwilioProcess:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(BENCH / "_fake_twilio.py"),
            "--sms-step-delay-s",
            "0.01",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        ready = (await asyncio.wait_for(self._proc.stdout.readline(), 60)).decode().split()
        if ready[:1] != ["READY"]:
            raise RuntimeError(f"the fake Twilio API did not start: {ready}")
        self.base_url = ready[1]
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self._proc.stdout is not None
        async for line in self._proc.stdout:
            _, to, t = line.decode().split()
            self.first.setdefault(to, float(t))

    def at(self, to: str) -> float:
        return self.first.get(to, 0.0)

    async def __aexit__(self, *exc: object) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            await asyncio.wait_for(self._proc.wait(), 10)
        except TimeoutError:
            self._proc.kill()
            await self._proc.wait()
        self._reader.cancel()


@asynccontextmanager
async def _worker_process(
    url: str, settings: Settings, twilio_url: str, work: Work
) -> AsyncIterator[None]:
    """`voice-agent worker` (what production runs beside `serve --no-worker` replicas) on
    the scratch database, sending through the fake Twilio API; its CPU counts in `work`."""
    env = dict(
        os.environ,
        DATABASE_URL=url,
        TWILIO_API_BASE_URL=twilio_url,
        TWILIO_ACCOUNT_SID=DEFAULT_ACCOUNT_SID,
        TWILIO_AUTH_TOKEN=DEFAULT_AUTH_TOKEN,
        PUBLIC_BASE_URL=settings.public_base_url,
        STREAM_TOKEN_SECRET="bench",
        SWEEP_INTERVAL_S="1.0",
        LOG_LEVEL="WARNING",
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "app.cli",
        "worker",
        cwd=str(BENCH.parent),
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            while b"running" not in (line := await proc.stdout.readline()):
                if not line:
                    raise RuntimeError("voice-agent worker stopped before it ran")
        drain = asyncio.create_task(proc.stdout.read())
        work.worker_pid = proc.pid
        async with _profiled(proc.pid):
            yield
    finally:
        work.worker_pid = None
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if "drain" in locals():
            await drain


@asynccontextmanager
async def _profiled(pid: int) -> AsyncIterator[None]:
    """With BENCH_PROFILE_WORKER=FILE: py-spy samples the worker (`--format raw`, for
    bench/_profile.py) from the moment it runs (its start-up left out) until the benchmark
    is done with it."""
    out = os.environ.get("BENCH_PROFILE_WORKER")
    if not out:
        yield
        return
    py_spy = Path(sys.executable).with_name("py-spy")
    if not py_spy.exists():
        raise SystemExit(f"BENCH_PROFILE_WORKER needs py-spy ({py_spy}): pip install py-spy")
    spy = await asyncio.create_subprocess_exec(
        str(py_spy),
        *("record", "--pid", str(pid), "--format", "raw", "--rate", "500", "-o", out),
        stdout=asyncio.subprocess.DEVNULL,
    )
    await asyncio.sleep(1)  # attached
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        await asyncio.wait_for(spy.wait(), 30)


class _Arrivals:
    """When the first create request to each number reached the API. Reads only the requests
    new since the last look: the wait loop asks every 5 ms inside the measured window, and a
    rescan of every request each time cost the service's loop milliseconds per look."""

    def __init__(self, api: FakeTwilioApi) -> None:
        self.api = api
        self.seen = 0
        self.first: dict[str, float] = {}

    def at(self, to: str) -> float:
        requests = self.api.requests
        for request in requests[self.seen :]:
            if request.method == "POST":
                self.first.setdefault(request.form.get("To", ""), request.t)
        self.seen = len(requests)
        return self.first.get(to, 0.0)


async def _ended_call(engine: AsyncEngine, number: str) -> str:
    call_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO calls (id, call_sid, status, from_number, ended_at) "
                "VALUES (:id, :sid, 'completed', :n, now())"
            ),
            {"id": call_id, "sid": "CA" + call_id.hex, "n": number},
        )
    return str(call_id)


def _mean_work(rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """One row per window kind: the mean over its rounds."""
    out: list[tuple[str, ...]] = []
    for name in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == name]
        cols = [
            "-"
            if "-" in (r[i] for r in mine)
            else f"{sum(float(r[i]) for r in mine) / len(mine):.1f}"
            for i in range(2, 7)
        ]
        out.append((name, mine[0][1], *cols))
    return out


def _row(name: str, ours: list[float], bare: list[float]) -> tuple[str, ...]:
    def ms(values: list[float], q: float) -> str:
        return f"{pct(values, q) * 1000:8.1f}"

    return (
        name,
        str(len(ours)),
        ms(ours, 50),
        ms(ours, 99),
        ms(bare, 50),
        ms(bare, 99),
        f"{(pct(ours, 50) - pct(bare, 50)) * 1000:8.1f}",
    )


def table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(r[i].strip()) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.strip().ljust(w) for c, w in zip(r, widths, strict=True)))


def _server_url() -> str:
    url = os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    return resolve_database_url(url, Path(tempfile.gettempdir()) / "voice-agent-bench-pg")


async def main(quick: bool, only: str | None = None, worker: str = "inprocess") -> None:
    server = _server_url()
    name = f"va_bench_delivery_{os.getpid()}"
    url = create_database(server, name)
    try:
        await asyncio.to_thread(upgrade, url)
        engine = make_engine(url, pool_size=40, max_overflow=20)
        try:
            work = Work(engine)
            t0 = time.perf_counter()
            announce = await announcement_rows(engine, quick, work) if only != "sms" else []
            sms = await sms_rows(engine, quick, work, url, worker) if only != "announcement" else []
            took = time.perf_counter() - t0
        finally:
            await engine.dispose()
        print(
            f"delivery benchmark ({'quick' if quick else 'full'}; {os.cpu_count()} CPUs; "
            f"took {took:.0f} s; worker concurrency {Settings().worker_concurrency})"
        )
        print(f"mode: {MODES[worker]}")
        header = ("path", "n", "p50", "p99", "base p50", "base p99", "p50 over base")
        if announce:
            table(
                "Commit -> first announcement audio at the caller's stream (ms); "
                "baseline: bridge.deliver_result direct",
                header,
                announce,
            )
        if sms:
            table(
                "Commit -> SMS create request at the Twilio API (ms); "
                "baseline: twilio messages.create direct",
                header,
                sms,
            )
        table(
            "Work per delivery in each window (this process, and the worker's when it runs"
            " alone; mean over the window's deliveries)",
            (
                "window",
                "n",
                "CPU ms",
                "worker process CPU ms",
                "SQL statements",
                "pool checkouts",
                "transactions",
            ),
            _mean_work(work.rows),
        )
    finally:
        drop_database(server, name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--only", choices=("announcement", "sms"), help="one path only")
    parser.add_argument(
        "--worker",
        choices=tuple(MODES),
        default="inprocess",
        help="where the SMS path's delivery worker and the fake Twilio API run (default:"
        " everything in this process)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.quick, args.only, args.worker))
