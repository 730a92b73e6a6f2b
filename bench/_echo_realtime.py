"""An echo Realtime fake for the full-duplex harness: every append comes straight back as audio.

Each `input_audio_buffer.append` is answered at once with a `response.output_audio.delta`
carrying the same base64 audio (the worst case: agent audio as dense as caller audio, all
the time). `session.update` gets `session.updated`, `response.create` gets `response.created`;
everything else is ignored. Accepts permessage-deflate when the client offers it, as a plain
`websockets` server does.

Usage: python bench/_echo_realtime.py PORT_FILE. Writes its base URL (`http://…/v1`) to
PORT_FILE once listening; exits on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from _wsio import Endpoint, server_endpoint

try:
    import uvloop
except ImportError:  # the default loop works too, only slower
    uvloop = None


class EchoSession:
    """One Realtime connection."""

    def __init__(self, endpoint: Endpoint, number: int) -> None:
        self.ep = endpoint
        self.seq = 0
        self.response_id = f"resp_echo_{number}"
        self.item_id = f"item_echo_{number}"
        endpoint.on_text = self.on_text
        endpoint.on_open = self.on_open

    def _send(self, event: dict) -> None:
        self.seq += 1
        event["event_id"] = f"ev_{self.seq}"
        self.ep.send_text(json.dumps(event))

    def on_open(self) -> None:
        self._send({"type": "session.created", "session": {"type": "realtime"}})

    def on_text(self, raw: str) -> None:
        event = json.loads(raw)
        kind = event.get("type")
        if kind == "input_audio_buffer.append":
            self.seq += 1
            self.ep.send_text(
                f'{{"type":"response.output_audio.delta","event_id":"ev_{self.seq}",'
                f'"response_id":"{self.response_id}","item_id":"{self.item_id}",'
                f'"output_index":0,"content_index":0,"delta":"{event["audio"]}"}}'
            )
        elif kind == "session.update":
            self._send({"type": "session.updated", "session": event.get("session", {})})
        elif kind == "response.create":
            self._send(
                {
                    "type": "response.created",
                    "response": {
                        "id": self.response_id,
                        "object": "realtime.response",
                        "status": "in_progress",
                        "output": [],
                    },
                }
            )


async def main(port_file: Path) -> None:
    loop = asyncio.get_running_loop()
    count = 0

    def factory() -> Endpoint:
        nonlocal count
        count += 1
        endpoint = server_endpoint(deflate=True)
        EchoSession(endpoint, count)
        return endpoint

    server = await loop.create_server(factory, "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await asyncio.to_thread(port_file.write_text, f"http://127.0.0.1:{port}/v1")
    await stop.wait()
    server.close()


if __name__ == "__main__":
    if uvloop is not None:
        uvloop.run(main(Path(sys.argv[1])))
    else:
        asyncio.run(main(Path(sys.argv[1])))
