"""The least a service can do with OpenAI SIP calls: the baseline of bench/openai_sip_held.py.

Usage: python bench/_sideband_bare.py SIM_BASE_URL BODY_FILE. On each stdin line
`take RATE ID...` it accepts each call (a bare httpx POST of the service's own accept body),
opens its sideband with plain `websockets` (compression off), asks for the greeting with one
`response.create`, and from then on reads and parses every event until the socket closes;
answers `{"opened": N}`. No webhook, no database, no conversation control: what is left is
holding the socket and reading the same events the service reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import websockets
from websockets.exceptions import ConnectionClosed

HEADERS = {"Authorization": "Bearer bench"}


async def hold(ws: Any, counts: dict[str, int]) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for message in ws:
            event = json.loads(message)
            kind = event.get("type", "")
            counts[kind] = counts.get(kind, 0) + 1


async def main(base: str, body: dict[str, Any]) -> None:
    ws_base = base.replace("http://", "ws://", 1)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    counts: dict[str, int] = {}
    holders: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(base_url=base, headers=HEADERS, timeout=10) as http:

        async def take(call_id: str) -> bool:
            response = await http.post(f"/realtime/calls/{call_id}/accept", json=body)
            if response.status_code != 200:
                return False
            ws = await websockets.connect(
                f"{ws_base}/realtime?call_id={call_id}", additional_headers=HEADERS,
                compression=None, max_size=None,
            )  # fmt: skip
            await ws.send(json.dumps({"type": "response.create"}))
            task = asyncio.create_task(hold(ws, counts))
            holders.add(task)
            task.add_done_callback(holders.discard)
            return True

        while line := (await reader.readline()).decode().split():
            if line[0] != "take":
                sys.stdout.write(json.dumps({"error": line[0]}) + "\n")
                sys.stdout.flush()
                continue
            rate, ids = float(line[1]), line[2:]
            began = loop.time()
            tasks = []
            for i, call_id in enumerate(ids):
                await asyncio.sleep(max(0.0, began + i / rate - loop.time()))
                tasks.append(asyncio.create_task(take(call_id)))
            opened = await asyncio.gather(*tasks, return_exceptions=True)
            sys.stdout.write(json.dumps({"opened": sum(o is True for o in opened)}) + "\n")
            sys.stdout.flush()
    for task in list(holders):
        task.cancel()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(Path(sys.argv[2]).read_text())))
