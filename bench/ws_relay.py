"""The floor of the echo harness: a bare Twilio <-> Realtime relay in plain `websockets`.

Per media stream it opens a Realtime WebSocket, sends one session.update and a
response.create, then forwards caller `media` to `input_audio_buffer.append` and
`response.output_audio.delta` to Twilio `media` (and `clear` on speech_started), with
json.loads / json.dumps and nothing else: no marks, no barge-in, no storage, no webhook.

Usage: python bench/ws_relay.py PORT [--no-deflate] [--uvloop]
(OPENAI_BASE_URL: the Realtime fake's http://…/v1 URL). By default both sockets take
websockets' defaults, which negotiate permessage-deflate when the peer offers it;
`--no-deflate` turns compression off on both, `--uvloop` runs it on uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed


def realtime_url() -> str:
    base = os.environ["OPENAI_BASE_URL"].rstrip("/")
    return base.replace("http://", "ws://", 1) + "/realtime?model=gpt-realtime"


SESSION = {
    "type": "session.update",
    "session": {
        "type": "realtime",
        "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": {"type": "semantic_vad"}},
            "output": {"format": {"type": "audio/pcmu"}},
        },
    },
}


async def relay(ws: ServerConnection, compression: str | None) -> None:
    stream_sid = ""
    async for raw in ws:
        msg = json.loads(raw)
        if msg["event"] == "start":
            stream_sid = msg["start"]["streamSid"]
            break
    if not stream_sid:
        return  # hung up before `start` (the harness's readiness probe does)
    headers = {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'sk-bench')}"}
    async with connect(realtime_url(), additional_headers=headers, compression=compression) as rt:
        await rt.send(json.dumps(SESSION))
        await rt.send(json.dumps({"type": "response.create"}))

        async def down() -> None:
            async for raw in rt:
                event = json.loads(raw)
                if event["type"] == "response.output_audio.delta":
                    await ws.send(
                        json.dumps(
                            {
                                "event": "media",
                                "streamSid": stream_sid,
                                "media": {"payload": event["delta"]},
                            }
                        )
                    )
                elif event["type"] == "input_audio_buffer.speech_started":
                    await ws.send(json.dumps({"event": "clear", "streamSid": stream_sid}))

        task = asyncio.create_task(down())
        try:
            async for raw in ws:
                msg = json.loads(raw)
                if msg["event"] == "media":
                    await rt.send(
                        json.dumps(
                            {"type": "input_audio_buffer.append", "audio": msg["media"]["payload"]}
                        )
                    )
                elif msg["event"] == "stop":
                    break
        except ConnectionClosed:
            pass
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def main(port: int, compression: str | None) -> None:
    async def handler(ws: ServerConnection) -> None:
        await relay(ws, compression)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with serve(handler, "127.0.0.1", port, compression=compression, backlog=1024):
        await stop.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--no-deflate", action="store_true")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    compression = None if args.no_deflate else "deflate"
    if args.uvloop:
        import uvloop

        uvloop.run(main(args.port, compression))
    else:
        asyncio.run(main(args.port, compression))
