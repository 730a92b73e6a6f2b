"""An echo Realtime fake for the full-duplex harness: every append comes straight back as audio.

Each `input_audio_buffer.append` is answered at once with a `response.output_audio.delta`
carrying the same base64 audio (the worst case: agent audio as dense as caller audio, all
the time). `session.update` gets `session.updated`, `response.create` gets `response.created`;
everything else is ignored. Accepts permessage-deflate when the client offers it, as a plain
`websockets` server does.

With `--barge-after S`, each session also plays a caller cutting in: S seconds (plus a
stagger per session) after its first append it sends `input_audio_buffer.speech_started`,
then answers with a new response and item, as the model does after an interruption; it
records when, which call it was (from the frame's sequence header), and the
`conversation.item.truncate` it receives; `--log FILE` gets that record on exit.

Usage: python bench/_echo_realtime.py PORT_FILE [--barge-after S --log FILE]. Writes its
base URL (`http://…/v1`) to PORT_FILE once listening; exits on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import time
from pathlib import Path

import orjson
from _wsio import Endpoint, server_endpoint

try:
    import uvloop
except ImportError:  # the default loop works too, only slower
    uvloop = None


class EchoSession:
    """One Realtime connection."""

    def __init__(self, endpoint: Endpoint, number: int, barge_after: float | None) -> None:
        self.ep = endpoint
        self.number = number
        self.seq = 0
        self.response_id = f"resp_echo_{number}"
        self.item_id = f"item_echo_{number}"
        self.barge_after = barge_after
        self.barge_at: float | None = None
        self.call: int | None = None  # the caller's index, from its first frame
        self.speech_started_at: float | None = None
        self.truncates: list[dict] = []
        self.cancelled = ""  # the response the interruption cut off
        endpoint.on_text = self.on_text
        endpoint.on_open = self.on_open

    def _send(self, event: dict) -> None:
        self.seq += 1
        event["event_id"] = f"ev_{self.seq}"
        self.ep.send_text(json.dumps(event))

    def on_open(self) -> None:
        self._send({"type": "session.created", "session": {"type": "realtime"}})

    def on_text(self, raw: str) -> None:
        event = orjson.loads(raw)
        kind = event.get("type")
        if kind == "input_audio_buffer.append":
            if self.barge_after is not None:
                self._maybe_barge_in(event["audio"])
            self.seq += 1
            self.ep.send_text(
                f'{{"type":"response.output_audio.delta","event_id":"ev_{self.seq}",'
                f'"response_id":"{self.response_id}","item_id":"{self.item_id}",'
                f'"output_index":0,"content_index":0,"delta":"{event["audio"]}"}}'
            )
        elif kind == "conversation.item.truncate":
            self.truncates.append(
                {
                    "t": time.monotonic(),
                    "item_id": event.get("item_id"),
                    "audio_end_ms": event.get("audio_end_ms"),
                }
            )
        elif kind == "response.cancel":
            self._send(
                {
                    "type": "response.done",
                    "response": {"id": self.cancelled, "status": "cancelled", "output": []},
                }
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

    def _maybe_barge_in(self, audio: str) -> None:
        now = time.monotonic()
        if self.barge_at is None:
            header = base64.b64decode(audio[:8])
            self.call = int.from_bytes(header[4:6], "big")
            # Staggered, so the calls do not all cut in at once.
            assert self.barge_after is not None
            self.barge_at = now + self.barge_after + (self.number % 10) * 0.5
        elif self.speech_started_at is None and now >= self.barge_at:
            self.speech_started_at = now
            self._send(
                {
                    "type": "input_audio_buffer.speech_started",
                    "item_id": f"caller_item_{self.number}",
                    "audio_start_ms": 0,
                }
            )
            # What follows is the model's answer to the interruption: a new response.
            self.cancelled = self.response_id
            self.response_id += "_after"
            self.item_id += "_after"
            self._send(
                {
                    "type": "response.created",
                    "response": {"id": self.response_id, "status": "in_progress", "output": []},
                }
            )

    def record(self) -> dict:
        return {
            "call": self.call,
            "speech_started_at": self.speech_started_at,
            "truncates": self.truncates,
        }


async def main(port_file: Path, barge_after: float | None, log: Path | None) -> None:
    loop = asyncio.get_running_loop()
    count = 0
    sessions: list[EchoSession] = []

    def factory() -> Endpoint:
        nonlocal count
        count += 1
        endpoint = server_endpoint(deflate=True)
        sessions.append(EchoSession(endpoint, count, barge_after))
        return endpoint

    server = await loop.create_server(factory, "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await asyncio.to_thread(port_file.write_text, f"http://127.0.0.1:{port}/v1")
    await stop.wait()
    server.close()
    if log is not None:
        records = [s.record() for s in sessions if s.call is not None]
        await asyncio.to_thread(log.write_text, json.dumps(records))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("port_file", type=Path)
    parser.add_argument("--barge-after", type=float)
    parser.add_argument("--log", type=Path)
    args = parser.parse_args()
    run = uvloop.run if uvloop is not None else asyncio.run
    run(main(args.port_file, args.barge_after, args.log))
