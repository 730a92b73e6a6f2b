"""Staff console benchmark: a call page with 500 timeline events, and the calls list API with
10,000 calls in the database.

Prints tables (no assertions). The service runs in its own process (`voice-agent serve
--no-worker`) on a scratch database made on TEST_DATABASE_URL / DATABASE_URL (or an embedded
PostgreSQL) and dropped afterwards; this process is only the client. `/healthz` in the same
run is the baseline: the cost of a request that does nothing. With Debian's Chromium
installed, the call page is also loaded and rendered in a real browser.

    .venv/bin/python bench/console.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import random
import socket
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _stats import pct  # bench/ is on sys.path when run as a script

from app.access import api_tokens, staff
from app.access.sessions import create_session
from app.access.staff import Role
from app.calls.store import call_events, calls
from app.db import create_database, drop_database, make_engine, resolve_database_url, upgrade
from tools.ledger_models import operation_events_table as op_events_t
from tools.ledger_models import operations_table as ops_t
from tools.ledger_models import tool_calls_table as tool_calls_t

CHROMIUM = "/usr/bin/chromium"
HAVE_CHROMIUM = os.path.exists(CHROMIUM)
STATUSES = ["completed"] * 8 + ["in_progress", "failed", "busy", "no_answer"]


def table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def ms(v: float) -> str:
    return f"{v * 1000:.1f}"


# --- data --------------------------------------------------------------------------------


async def seed_calls(engine: AsyncEngine, n: int, rng: random.Random) -> list[str]:
    """`n` calls over 30 days; one in ten has operations, some of them not settled."""
    now = datetime.now(UTC)
    rows, op_rows = [], []
    for i in range(n):
        call_id = uuid.uuid4()
        rows.append(
            {
                "id": call_id,
                "call_sid": f"CA{uuid.uuid4().hex}",
                "tenant_id": "default",
                "leg": "sip" if i % 7 == 0 else "twilio",
                "direction": "inbound",
                "from_number": f"+1555{rng.randrange(10**7):07d}",
                "to_number": "+15550000000",
                "status": rng.choice(STATUSES),
                "created_at": now - timedelta(seconds=rng.uniform(0, 30 * 86400)),
            }
        )
        if i % 10 == 0:
            for k in range(rng.randint(1, 3)):
                status = rng.choice(["committed"] * 6 + ["unknown", "running", "failed_final"])
                op_rows.append(_operation(str(call_id), status, f"seed:{i}:{k}"))
    async with engine.begin() as conn:
        for start in range(0, len(rows), 2000):
            await conn.execute(calls.insert(), rows[start : start + 2000])
        await conn.execute(ops_t.insert(), op_rows)
    return [str(r["id"]) for r in rows]


def _operation(call_id: str, status: str, key: str) -> dict[str, Any]:
    return {
        "operation_id": uuid.uuid4(),
        "tenant_id": "default",
        "idempotency_key": key,
        "call_id": call_id,
        "caller": "+15551230000",
        "tool": "book_table",
        "args": {"date": "2030-01-01", "time": "20:00", "party_size": 2, "name": "Ada"},
        "args_hash": hashlib.sha256(key.encode()).hexdigest(),
        "status": status,
        "provider_ref": "BK00000000" if status == "committed" else None,
    }


async def seed_big_call(engine: AsyncEngine, events: int) -> str:
    """One call with `events` timeline entries: 70 % call events, 10 % tool calls, 20 %
    operation events (4 operations x 5 transitions per 100 entries)."""
    call_id = uuid.uuid4()
    t0 = datetime.now(UTC) - timedelta(hours=1)
    n_ops = events // 25
    n_tool_calls = events // 10
    n_call = events - n_tool_calls - 5 * n_ops
    kinds = [
        ("speech_started", {"audio_start_ms": 100, "turn_id": 1}),
        ("speech_stopped", {"audio_end_ms": 900, "turn_id": 1}),
        ("caller_transcript", {"text": "I would like a table for four at eight", "turn_id": 1}),
        ("response_created", {"reason": "turn", "response_id": "r"}),
        ("agent_transcript", {"text": "Sure, one moment.", "cut": False, "heard_ms": 900,
                              "audio_ms": 900, "item_id": "i"}),
        ("barge_in", {"item_id": "i", "played_ms": 700, "truncated": True, "cancelled": False}),
        ("response_done", {"status": "completed", "response_id": "r"}),
    ]  # fmt: skip
    async with engine.begin() as conn:
        await conn.execute(
            calls.insert().values(
                id=call_id, call_sid=f"CA{call_id.hex}", tenant_id="default", leg="twilio",
                from_number="+15551230000", to_number="+15550000000", status="completed",
                created_at=t0,
            )
        )  # fmt: skip
        rows = []
        for seq in range(1, n_call + 1):
            kind, data = kinds[seq % len(kinds)]
            rows.append(
                {
                    "call_id": call_id,
                    "seq": seq,
                    "kind": kind if seq > 1 else "call_started",
                    "data": data,
                    "mono_ns": seq * 250_000_000,
                    "at": t0 + timedelta(milliseconds=250 * seq),
                }
            )
        await conn.execute(call_events.insert(), rows)
        op_ids = []
        for k in range(n_ops):
            row = _operation(str(call_id), "committed", f"big:{call_id}:{k}")
            op_ids.append(row["operation_id"])
            await conn.execute(ops_t.insert().values(**row))
            for j, (src, dst) in enumerate(
                [
                    (None, "awaiting_confirmation"),
                    ("awaiting_confirmation", "admitted"),
                    ("admitted", "running"),
                    ("running", "committed"),
                    (None, None),
                ]
            ):
                await conn.execute(
                    op_events_t.insert().values(
                        operation_id=row["operation_id"],
                        at=t0 + timedelta(seconds=5 * k + j),
                        from_status=src,
                        to_status=dst,
                        kind="transition" if dst else "decision",
                        actor="worker:bench" if dst else "delivery",
                        reason="bench" if dst else "announced in call",
                        data={},
                    )
                )
        for k in range(n_tool_calls):
            await conn.execute(
                tool_calls_t.insert().values(
                    call_id=str(call_id), provider_call_id=f"fc_{k}", tenant_id="default",
                    turn_id=k, tool="book_table", raw_arguments="{}", arguments={},
                    decision="needs_confirmation", operation_id=op_ids[k % len(op_ids)],
                    created_at=t0 + timedelta(seconds=3 * k),
                )
            )  # fmt: skip
    return str(call_id)


# --- the service in its own process --------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def service(db: str) -> Any:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TWILIO_"))},
        "DATABASE_URL": db,
        "PORT": str(port),
        "PUBLIC_BASE_URL": base,
        "CONSOLE_PASSWORD": "bench-console-password",
        "LOG_LEVEL": "WARNING",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", "serve", "--no-worker",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=base) as http:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/readyz")).status_code == 200:
                        break
                if time.monotonic() > deadline or proc.returncode is not None:
                    raise RuntimeError("the service did not start")
                await asyncio.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        await proc.wait()


async def timed(
    http: httpx.AsyncClient, path: str, n: int, concurrency: int = 1
) -> tuple[list[float], int]:
    """Latencies of `n` GETs of `path` (after 5 warm-ups), and the body size."""
    for _ in range(5):
        (await http.get(path)).raise_for_status()
    latencies: list[float] = []
    size = 0
    remaining = iter(range(n))

    async def worker() -> None:
        nonlocal size
        for _ in remaining:
            t0 = time.perf_counter()
            response = await http.get(path)
            latencies.append(time.perf_counter() - t0)
            response.raise_for_status()
            size = len(response.content)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, size


def row(what: str, lat: list[float], size: int | None = None, extra: str = "") -> tuple[str, ...]:
    out = (what, str(len(lat)), ms(pct(lat, 50)), ms(pct(lat, 99)), ms(max(lat)))
    if size is not None:
        out = (*out, f"{size / 1024:.0f}")
    return (*out, extra) if extra else out


async def browser_rows(base: str, cookie: str, call_ids: dict[int, str], n: int) -> list[Any]:
    from playwright.async_api import async_playwright

    rows = []
    async with async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"],
        )  # fmt: skip
        ctx = await browser.new_context(viewport={"width": 1400, "height": 1000})
        await ctx.add_cookies([{"name": "va_session", "value": cookie, "url": base}])
        page = await ctx.new_page()
        for events, call_id in call_ids.items():
            timings: dict[str, list[float]] = {"dcl": [], "load": [], "fcp": []}
            for i in range(n + 2):
                await page.goto(f"{base}/console/calls/{call_id}", wait_until="load")
                t = await page.evaluate(
                    """() => {
                      const nav = performance.getEntriesByType('navigation')[0];
                      const fcp = performance.getEntriesByName('first-contentful-paint')[0];
                      return {dcl: nav.domContentLoadedEventEnd, load: nav.loadEventEnd,
                              fcp: fcp ? fcp.startTime : null};
                    }"""
                )
                if i >= 2:  # the first loads warm the cache and the connection
                    for k in timings:
                        if t[k] is not None and t[k] == t[k]:  # a paint entry may be absent
                            timings[k].append(t[k] / 1000)
            items = await page.locator(".item").count()
            rows.append(
                (
                    f"call page, {events} events ({items} items drawn)",
                    str(n),
                    ms(pct(timings["fcp"], 50)),
                    ms(pct(timings["dcl"], 50)),
                    ms(pct(timings["load"], 50)),
                    ms(pct(timings["load"], 99)),
                )
            )
        await browser.close()
    return rows


class _Leg:
    """A leg that yields `frames` caller frames and swallows agent audio."""

    audio_format = "audio/pcmu"

    def __init__(self, frames: int) -> None:
        from telephony.playback import PlaybackTracker

        self.frames = frames
        self.playback = PlaybackTracker()

    async def events(self) -> Any:
        from telephony.legs.leg import AudioIn

        payload = b"\x7f" * 160
        for n in range(self.frames):
            yield AudioIn(payload, n * 20)

    async def play(self, item_id: str, audio: bytes) -> None:
        return None

    async def clear(self) -> None:
        return None

    async def close(self, reason: str) -> None:
        return None


async def recording_rows(frames: int) -> list[tuple[str, ...]]:
    """What the recording tap costs per frame, beside the bare leg; and rendering a call."""
    from app.calls.recording import CallRecorder, RecordingLeg

    rows = []
    for label, wrap in (("bare leg (baseline)", False), ("leg + recording tap", True)):
        best_in, best_out = float("inf"), float("inf")
        for _ in range(5):
            leg: Any = _Leg(frames)
            if wrap:
                leg = RecordingLeg(leg, CallRecorder("audio/pcmu", max_ms=10**9))
            t0 = time.perf_counter()
            async for _event in leg.events():
                pass
            best_in = min(best_in, (time.perf_counter() - t0) / frames)
            chunk = b"\x7f" * 480
            t0 = time.perf_counter()
            for _ in range(frames // 3):
                await leg.play("item", chunk)
            best_out = min(best_out, (time.perf_counter() - t0) / (frames // 3))
        rows.append((label, f"{best_in * 1e6:.2f}", f"{best_out * 1e6:.2f}"))
    # A 10-minute call: 30,000 caller frames, 5 minutes of agent audio, 50 barge-ins.
    clock_now = [0.0]
    rec = CallRecorder("audio/pcmu", max_ms=10**9, clock=lambda: clock_now[0])
    for n in range(30_000):
        clock_now[0] = n * 0.02
        rec.caller_audio(b"\x7f" * 160, n * 20)
        if n % 2 == 0:
            rec.agent_audio(b"\x7f" * 160)
        if n % 600 == 0:
            rec.cleared()
    t0 = time.perf_counter()
    rendered = await asyncio.to_thread(rec.render)
    took = time.perf_counter() - t0
    extra = (f"render a 10-min call: {took * 1000:.0f} ms in a thread, "
             f"{len(rendered.wav) / 1e6:.1f} MB WAV")  # fmt: skip
    return [*rows, (extra, "", "")]


def _server_url() -> str:
    url = os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    return resolve_database_url(url, Path(tempfile.gettempdir()) / "voice-agent-bench-pg")


async def main(quick: bool) -> None:
    server = _server_url()
    name = f"va_bench_console_{os.getpid()}"
    db = create_database(server, name)
    n_calls = 10_000
    samples = 100 if quick else 300
    rng = random.Random(7)
    try:
        await asyncio.to_thread(upgrade, db)
        engine = make_engine(db)
        t0 = time.perf_counter()
        call_ids = await seed_calls(engine, n_calls, rng)
        small = await seed_big_call(engine, 50)
        big = await seed_big_call(engine, 500)
        async with engine.connect() as conn:
            await conn.exec_driver_sql("ANALYZE")
            total = await conn.scalar(sa.select(sa.func.count()).select_from(calls))
            some_number = await conn.scalar(
                sa.select(calls.c.from_number).where(calls.c.id == uuid.UUID(call_ids[1234]))
            )
            ops_total = await conn.scalar(sa.select(sa.func.count()).select_from(ops_t))
        seeded = time.perf_counter() - t0
        _, secret = await api_tokens.create_token(engine, "bench", Role.VIEWER, created_by="bench")
        account = await staff.create_staff(
            engine, "bench-viewer", "bench viewer password", Role.VIEWER
        )
        cookie, _ = await create_session(engine, account.id, max_s=3600)
        await engine.dispose()

        async with service(db) as base:
            headers = {"Authorization": f"Bearer {secret}"}
            async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as http:
                first = (await http.get("/api/calls?limit=50")).json()
                cursor = first["next_cursor"]
                for _ in range(49):  # the 50th page
                    cursor = (await http.get(f"/api/calls?limit=50&cursor={cursor}")).json()[
                        "next_cursor"
                    ]
                since = (datetime.now(UTC) - timedelta(days=3)).isoformat().replace("+00:00", "Z")
                suffix = str(some_number)[-4:]
                list_paths = [
                    ("/healthz (baseline)", "/healthz"),
                    ("newest 50", "/api/calls?limit=50"),
                    ("page 50 by cursor", f"/api/calls?limit=50&cursor={cursor}"),
                    (f"phone ends {suffix}", f"/api/calls?phone={suffix}"),
                    ("status=failed&leg=sip", "/api/calls?status=failed&leg=sip"),
                    ("last 3 days", f"/api/calls?since={since}"),
                    ("unsettled operations", "/api/calls?unsettled=true"),
                    ("all filters", f"/api/calls?since={since}&status=completed&unsettled=true"
                                    "&leg=twilio&phone=5"),
                ]  # fmt: skip
                list_rows = []
                for concurrency in (1, 8):
                    for label, path in list_paths:
                        lat, size = await timed(http, path, samples, concurrency)
                        list_rows.append(row(label, lat, size, f"{concurrency}"))
            page_rows = []
            async with httpx.AsyncClient(
                base_url=base, cookies={"va_session": cookie}, timeout=30
            ) as http:
                for label, path in [
                    ("/healthz (baseline)", "/healthz"),
                    ("timeline JSON, 50 events", f"/api/calls/{small}/timeline"),
                    ("timeline JSON, 500 events", f"/api/calls/{big}/timeline"),
                    ("call page HTML, 50 events", f"/console/calls/{small}"),
                    ("call page HTML, 500 events", f"/console/calls/{big}"),
                    ("live fragment, 500 events", f"/console/calls/{big}?fragment=1"),
                ]:
                    lat, size = await timed(http, path, samples // 3)
                    page_rows.append(row(label, lat, size))
            browser = []
            if HAVE_CHROMIUM:
                browser = await browser_rows(
                    base, cookie, {50: small, 500: big}, 10 if quick else 20
                )

        print(
            f"console benchmark ({'quick' if quick else 'full'}; {os.cpu_count()} CPUs; "
            f"{total} calls, {ops_total} operations seeded in {seeded:.1f} s; "
            f"load average {os.getloadavg()[0]:.2f})"
        )
        table(
            f"Calls list API with {total} calls (ms; sequential and 8 concurrent clients)",
            ("request", "n", "p50", "p99", "max", "KB", "clients"),
            list_rows,
        )
        table(
            "A call with N timeline events: server load + render (ms, sequential)",
            ("request", "n", "p50", "p99", "max", "KB"),
            page_rows,
        )
        if browser:
            table(
                "The call page in Chromium (ms from navigation start; p50 unless noted)",
                ("page", "n", "first paint", "DOM ready", "load", "load p99"),
                browser,
            )
        else:
            print("\n(no /usr/bin/chromium: browser rendering not measured)")
        table(
            "Recording tap per frame (microseconds; best of 5 runs of 50,000 frames)",
            ("leg", "caller frame in", "agent chunk out"),
            await recording_rows(50_000),
        )
    finally:
        drop_database(server, name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    asyncio.run(main(parser.parse_args().quick))
