"""CPU of Twilio's voice webhook with the route lane (app/http/route_lane.py) and without.

The service (create_app, uvicorn, its own database pool) runs in this process on a real
socket; a client in the same process posts signed voice webhooks, each a new call (its row
inserted, its stream token and TwiML written), over a new connection as Twilio does. The
lane is turned on and off between rounds (the app's middleware stack rebuilt with and
without it), alternated so the machine's load falls on both; `time.process_time` of the
whole process over `--calls` webhooks, per webhook. The client's share is the same both
ways, so the difference is the server's. No assertions.

    .venv/bin/python bench/route_lane.py [--calls 400] [--rounds 3]

Uses DATABASE_URL / TEST_DATABASE_URL's server (a scratch database), else an embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from twilio.request_validator import RequestValidator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _scratch import scratch_database  # bench/ is on sys.path when run as a script

from app.db import make_engine
from app.main import create_app
from app.server import ServiceServer, uvicorn_config
from app.settings import Settings

TOKEN = "bench-auth-token"


def _settings(port: int, database_url: str) -> Settings:
    return Settings(
        database_url=database_url,
        openai_api_key=None,
        openai_base_url=None,
        twilio_auth_token=TOKEN,
        twilio_api_base_url="http://127.0.0.1:9",
        public_base_url=f"http://127.0.0.1:{port}",
        host="127.0.0.1",
        port=port,
        stream_token_secret="bench-stream-secret",
        max_live_calls=100_000,
        busy_loop_lag_ms=0,
        log_level="WARNING",
    )


def _lane(app: Any, on: bool, with_lane: Any) -> None:
    """Rebuild `app`'s middleware stack on its next request, with or without the lane."""
    if on:
        app.build_middleware_stack = with_lane
    else:
        app.__dict__.pop("build_middleware_stack", None)  # the class's own: no lane
    app.middleware_stack = None


async def _webhooks(port: int, public: str, calls: int, gap: float = 0.0) -> float:
    """`calls` signed voice webhooks, each on a connection of its own (written by hand: an
    HTTP client library would cost this process more than the server's part)."""
    validator = RequestValidator(TOKEN)
    started = time.process_time()
    for _ in range(calls):
        params = {
            "CallSid": "CA" + uuid.uuid4().hex,
            "AccountSid": "AC" + "0" * 32,
            "From": "+15551230000",
            "To": "+15550000000",
            "CallStatus": "ringing",
            "Direction": "inbound",
            "ApiVersion": "2010-04-01",
        }
        signature = validator.compute_signature(public + "/twilio/voice", params)
        body = urlencode(params).encode()
        head = (
            f"POST /twilio/voice HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"X-Twilio-Signature: {signature}\r\nConnection: close\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head.encode() + body)
        response = await reader.read()
        writer.close()
        if not response.startswith(b"HTTP/1.1 200") or b"<Stream" not in response:
            raise RuntimeError(f"webhook answered {response[:300]!r}")
        if gap:
            await asyncio.sleep(gap)
    return (time.process_time() - started) / calls


async def run(calls: int, rounds: int, database_url: str, gap: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = _settings(port, database_url)
    engine = make_engine(database_url)
    app = create_app(settings, engine=engine)
    with_lane = app.__dict__.get("build_middleware_stack")
    if with_lane is None:
        raise SystemExit(f"this app has no route lane: {app.state.route_lane}")
    server = ServiceServer(uvicorn_config(app, settings, log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 (uvicorn sets a flag, no event)
        await asyncio.sleep(0.01)
    spent: dict[str, list[float]] = {"router": [], "lane": []}
    try:
        for on in (False, True):  # warm both (imports, pools, prepared statements)
            _lane(app, on, with_lane)
            await _webhooks(port, settings.public_base_url, 20)
        idle0 = time.process_time()
        await asyncio.sleep(5)
        print(f"idle: {(time.process_time() - idle0) / 5 * 1e3:.1f} ms of CPU a second")
        for _ in range(rounds):
            for on in (False, True):
                _lane(app, on, with_lane)
                spent["lane" if on else "router"].append(
                    await _webhooks(port, settings.public_base_url, calls, gap)
                )
    finally:
        server.should_exit = True
        await task
        sock.close()
        await engine.dispose()
    print(f"\nVoice webhook, {calls} a round, {rounds} rounds alternated: CPU of this process")
    print("| way | CPU per webhook (server and client), each round | mean |")
    print("|---|---|---|")
    for way, values in spent.items():
        each = " / ".join(f"{v * 1e3:.3f}" for v in values)
        print(f"| {way} | {each} ms | {sum(values) / len(values) * 1e3:.3f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--gap", type=float, default=0.0, help="seconds between webhooks (0: back to back)"
    )
    args = parser.parse_args()
    with scratch_database("bench_lane") as url:
        try:
            import uvloop

            uvloop.run(run(args.calls, args.rounds, url, args.gap))
        except ImportError:
            asyncio.run(run(args.calls, args.rounds, url, args.gap))


if __name__ == "__main__":
    main()
