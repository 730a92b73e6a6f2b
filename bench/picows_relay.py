"""A second floor for the echo harness: the bare relay of bench/ws_relay.py on `picows`.

picows is a WebSocket library written in Cython for this kind of traffic (frames parsed and
built in C, a callback per frame, no task per connection), so this is the cheapest relay a
Python programmer would write with a library built for the job: per media stream one
Realtime WebSocket (a session.update and a response.create), caller `media` forwarded as
`input_audio_buffer.append`, `response.output_audio.delta` as Twilio `media`, `clear` on
speech_started; json.loads / json.dumps, no compression, uvloop; nothing else (no marks,
barge-in handling, storage or webhook).

Usage: python bench/picows_relay.py PORT (OPENAI_BASE_URL: the Realtime fake's http://…/v1).
Needs `pip install picows` (not a dependency of the service: the harness skips the target
when it is missing).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any, cast

import uvloop
import ws_relay  # bench/ is on sys.path when run as a script
from picows import (
    WSFrame,
    WSListener,
    WSMsgType,
    WSTransport,
    WSUpgradeRequest,
    ws_connect,
    ws_create_server,
)

SESSION = json.dumps(ws_relay.SESSION).encode()  # the same session as the websockets relay
CREATE = json.dumps({"type": "response.create"}).encode()
realtime_url = ws_relay.realtime_url


def text_event(transport: WSTransport, frame: WSFrame) -> dict[str, Any] | None:
    """A text frame's JSON; None for anything else (a close ends the connection)."""
    if frame.msg_type is WSMsgType.TEXT:
        return cast(dict[str, Any], json.loads(frame.get_payload_as_bytes()))
    if frame.msg_type is WSMsgType.CLOSE:
        transport.disconnect()
    return None


class RealtimeSide(WSListener):  # type: ignore[misc]
    """The model's socket of one call: deltas back to the caller."""

    def __init__(self, caller: CallerSide) -> None:
        self.caller = caller

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        event = text_event(transport, frame)
        if event is None:
            return
        kind = event["type"]
        out = self.caller.transport
        if out is None:
            return
        if kind == "response.output_audio.delta":
            message = {
                "event": "media",
                "streamSid": self.caller.stream_sid,
                "media": {"payload": event["delta"]},
            }
            out.send(WSMsgType.TEXT, json.dumps(message).encode())
        elif kind == "input_audio_buffer.speech_started":
            message = {"event": "clear", "streamSid": self.caller.stream_sid}
            out.send(WSMsgType.TEXT, json.dumps(message).encode())

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        if self.caller.transport is not None:
            self.caller.transport.disconnect()


class CallerSide(WSListener):  # type: ignore[misc]
    """The Twilio media socket of one call."""

    def __init__(self) -> None:
        self.transport: WSTransport | None = None
        self.stream_sid = ""
        self.realtime: WSTransport | None = None
        self.pending: list[bytes] = []  # appends before the model's socket is open

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        msg = text_event(transport, frame)
        if msg is None:
            return
        event = msg["event"]
        if event == "media":
            append = json.dumps(
                {"type": "input_audio_buffer.append", "audio": msg["media"]["payload"]}
            ).encode()
            if self.realtime is not None:
                self.realtime.send(WSMsgType.TEXT, append)
            else:
                self.pending.append(append)
        elif event == "start":
            self.stream_sid = msg["start"]["streamSid"]
            asyncio.get_running_loop().create_task(self.open_realtime())
        elif event == "stop":
            transport.disconnect()

    async def open_realtime(self) -> None:
        headers = {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'sk-bench')}"}
        try:
            rt, _ = await ws_connect(
                lambda: RealtimeSide(self), realtime_url(), extra_headers=headers
            )
        except Exception as exc:  # the harness counts the call as failed
            print(f"picows relay: Realtime connect failed: {exc!r}", file=sys.stderr)
            if self.transport is not None:
                self.transport.disconnect()
            return
        if self.transport is None or self.transport.is_disconnected:
            rt.disconnect()
            return
        rt.send(WSMsgType.TEXT, SESSION)
        rt.send(WSMsgType.TEXT, CREATE)
        for append in self.pending:
            rt.send(WSMsgType.TEXT, append)
        self.pending.clear()
        self.realtime = rt

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self.transport = None
        if self.realtime is not None:
            self.realtime.disconnect()


def listener(request: WSUpgradeRequest) -> Any:
    return CallerSide() if request.path.startswith(b"/twilio/media") else None


async def main(port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    server = await ws_create_server(listener, "127.0.0.1", port, backlog=1024)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
