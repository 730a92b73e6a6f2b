"""A standalone operation worker process for crash tests: `python -m tests.worker_main`.

The same `OperationWorker` as `voice-agent worker`, on one domain's catalog (as a deployment
builds it, with a test deadline) and a fast heartbeat, and no sweeper: recovery is someone
else's job.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from app.db import make_engine
from app.worker import OperationWorker
from tests.domains import BY_NAME


async def main(database_url: str, domain: str, url: str, deadline_s: float) -> int:
    engine = make_engine(database_url, pool_size=2, max_overflow=2)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    catalog = BY_NAME[domain].catalog(url, deadline_s=deadline_s)
    try:
        worker = OperationWorker(
            database_url=database_url,
            engine=engine,
            registry=catalog.registry,
            provider=catalog.router,
            concurrency=1,
            heartbeat_s=0.2,
            poll_interval_s=0.2,
            sweep=False,
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
    args = parser.parse_args()
    raise SystemExit(asyncio.run(main(args.database_url, args.domain, args.url, args.deadline)))
