"""A standalone operation worker process for crash tests: `python -m tests.worker_main`.

The same `OperationWorker` as `voice-agent worker`, on one domain's catalog (as a deployment
builds it, with a test deadline) and a fast heartbeat, and no sweeper: recovery is someone
else's job. With `--deliveries` it also runs the delivery tasks (SMS through the Twilio API at
`--twilio-api`), as a worker process of a deployment does.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from app.db import make_engine
from app.ops.worker import OperationWorker, build_delivery
from app.settings import Settings
from tests.domains import BY_NAME


async def main(
    database_url: str,
    domain: str,
    url: str,
    deadline_s: float,
    deliveries: bool = False,
    twilio_api: str | None = None,
    public_url: str = "http://127.0.0.1:9",
) -> int:
    engine = make_engine(database_url, pool_size=2, max_overflow=2)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    catalog = BY_NAME[domain].catalog(url, deadline_s=deadline_s)
    try:
        delivery = None
        if deliveries:
            settings = Settings(
                database_url=database_url,
                twilio_api_base_url=twilio_api,
                public_base_url=public_url,
            )
            delivery = build_delivery(settings, engine, catalog.registry)
        worker = OperationWorker(
            database_url=database_url,
            engine=engine,
            registry=catalog.registry,
            provider=catalog.router,
            concurrency=1 if delivery is None else 2,
            heartbeat_s=0.2,
            poll_interval_s=0.2,
            sweep=False,
            delivery=delivery,
            callback_base_url=public_url if deliveries else None,
        )
        await worker.start()
        print(f"ready {worker.worker_id}", flush=True)
        await stop.wait()
        await worker.stop()
    finally:
        await catalog.aclose()
    await engine.dispose()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--domain", choices=sorted(BY_NAME), required=True)
    parser.add_argument("--url", required=True, help="the domain's system of record")
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--deliveries", action="store_true")
    parser.add_argument("--twilio-api", default=None)
    parser.add_argument("--public-url", default="http://127.0.0.1:9")
    args = parser.parse_args()
    raise SystemExit(
        asyncio.run(
            main(
                args.database_url,
                args.domain,
                args.url,
                args.deadline,
                args.deliveries,
                args.twilio_api,
                args.public_url,
            )
        )
    )
