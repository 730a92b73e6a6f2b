"""OpenAI SIP interconnect: how fast a call is taken and greeted.

Measures, over N calls through the interconnect stand-in (telephony/sim/interconnect.py):

- webhook -> accept: from the stand-in sending the signed `realtime.call.incoming` to its
  accept endpoint receiving our accept (verification, dedupe row, call row, session build, the
  accept request), and inside the service from the webhook's arrival to the accept being sent;
- accept -> first `response.create` on the sideband: the bridge attaching with the SDK
  (`realtime.connect(call_id=...)`) and greeting.

Baselines in the same run: a bare httpx POST of the same accept body to the same endpoint, and
a bare `websockets` connect to the sideband plus one `response.create`.

The CPU a held call costs (calls per core on this leg) is bench/openai_sip_held.py.

Everything runs in this process over real sockets, on a scratch database in
TEST_DATABASE_URL / DATABASE_URL (or embedded PostgreSQL).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import websockets
from _stats import pct  # bench/ is on sys.path when run as a script

from app.db import create_database, drop_database, make_engine, resolve_database_url, upgrade
from app.main import create_app
from app.server import ServiceServer, uvicorn_config
from app.settings import Settings
from telephony.sim.interconnect import SimCall, SipInterconnect
from telephony.sim.scenario import Scenario

SECRET = "whsec_" + base64.b64encode(b"bench-openai-sip-secret-32-bytes").decode()
SCENARIO = Scenario.model_validate(
    {"name": "bench-openai-sip", "greeting": {"text": "Hello.", "audio_ms": 600}, "steps": []}
)


def table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def row(name: str, ours: list[float], bare: list[float] | None) -> tuple[str, ...]:
    def ms(values: list[float], q: float) -> str:
        return f"{pct(values, q) * 1000:.2f}" if values else "-"

    over = f"{(pct(ours, 50) - pct(bare, 50)) * 1000:.2f}" if bare else "-"
    return (name, str(len(ours)), ms(ours, 50), ms(ours, 99),
            ms(bare or [], 50), ms(bare or [], 99), over)  # fmt: skip


async def first_create_at(sim: SipInterconnect, call: SimCall) -> float:
    session = await sim.wait_for_session(call.call_id)
    await session.wait_for_received("response.create", within=10)
    return next(t for t, e in session.received if e.get("type") == "response.create")


async def ours(sim: SipInterconnect, app: Any, n: int) -> tuple[list[float], ...]:
    to_accept: list[float] = []
    to_create: list[float] = []
    service = app.state.runtime.openai_sip
    for _ in range(n):
        call = await sim.place_call()
        created = await first_create_at(sim, call)
        accepted = sim.requests_for(call.call_id, "accept")
        assert len(accepted) == 1 and call.accepted_at is not None
        assert call.webhook_sent_at is not None
        arrived = next(t for t, _, p, _ in sim.requests if p.endswith(f"{call.call_id}/accept"))
        to_accept.append(arrived - call.webhook_sent_at)
        to_create.append(created - call.accepted_at)
        await sim.remote_hangup(call.call_id)
        entry = app.state.runtime.registry.get(call.call_id)
        if entry is not None:
            await asyncio.wait_for(entry.done.wait(), 10)
    return to_accept, list(service.accept_latencies[-n:]), to_create


async def bare(sim: SipInterconnect, body: dict[str, Any], n: int) -> tuple[list[float], ...]:
    posts: list[float] = []
    creates: list[float] = []
    headers = {"Authorization": "Bearer bench"}
    async with httpx.AsyncClient(base_url=sim.base_url, headers=headers) as http:
        for _ in range(n):
            call = sim.new_call()
            t0 = time.monotonic()
            response = await http.post(f"/realtime/calls/{call.call_id}/accept", json=body)
            assert response.status_code == 200, response.text
            arrived = next(t for t, _, p, _ in sim.requests if p.endswith(f"{call.call_id}/accept"))
            posts.append(arrived - t0)
            assert call.accepted_at is not None
            url = f"ws://{sim.host}:{sim.port}/v1/realtime?call_id={call.call_id}"
            async with websockets.connect(url, additional_headers=headers, compression=None) as ws:
                await ws.send(json.dumps({"type": "response.create"}))
                created = await first_create_at(sim, call)
            creates.append(created - call.accepted_at)
            await sim.remote_hangup(call.call_id)
    return posts, creates


def _db_server() -> str:
    url = os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    return resolve_database_url(url, Path(tempfile.gettempdir()) / "voice-agent-bench-pg")


async def main(quick: bool) -> None:
    n = 10 if quick else 50
    server_url = _db_server()
    name = f"va_bench_openai_sip_{os.getpid()}"
    url = create_database(server_url, name)
    try:
        await asyncio.to_thread(upgrade, url)
        engine = make_engine(url, pool_size=10, max_overflow=10)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        began = time.perf_counter()
        async with SipInterconnect(SCENARIO, auto_caller=False, webhook_secret=SECRET) as sim:
            settings = Settings(
                database_url=url,
                openai_base_url=sim.base_url,
                openai_webhook_secret=SECRET,
                public_base_url=f"http://127.0.0.1:{port}",
                host="127.0.0.1",
                port=port,
                max_live_calls=n + 10,
            )
            sim.webhook_url = f"http://127.0.0.1:{port}/openai/webhook"
            app = create_app(settings, engine=engine)
            server = ServiceServer(
                uvicorn_config(app, settings, log_level="warning", access_log=False)
            )
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            try:
                # uvicorn has no started event to await; its flag is polled.
                while not server.started:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                await ours(sim, app, 3)  # warm-up: imports, pools, first connections
                await bare(sim, app.state.runtime.openai_sip.session(), 3)
                to_accept, inside, to_create = await ours(sim, app, n)
                posts, creates = await bare(sim, app.state.runtime.openai_sip.session(), n)
            finally:
                server.should_exit = True
                await serving
                sock.close()
        await engine.dispose()
        took = time.perf_counter() - began
        print(f"OpenAI SIP interconnect benchmark ({'quick' if quick else 'full'}; "
              f"{os.cpu_count()} CPUs; {n} calls; took {took:.0f} s)")  # fmt: skip
        header = ("path", "n", "p50 ms", "p99 ms", "base p50", "base p99", "p50 over base")
        table(
            "Webhook -> accept (ms); baseline: a bare httpx POST of the accept body",
            header,
            [
                row("webhook sent -> accept at OpenAI", to_accept, posts),
                row("webhook in -> accept sent (service)", inside, None),
            ],
        )
        table(
            "Accept -> first response.create on the sideband (ms); "
            "baseline: bare websockets connect + send",
            header,
            [row("accept -> first response.create", to_create, creates)],
        )
    finally:
        drop_database(server_url, name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer calls")
    asyncio.run(main(parser.parse_args().quick))
