"""The baseline: a bare Twilio <-> Realtime relay with no logic, on the same stack.

It answers /twilio/voice with a stream TwiML, and per stream forwards caller media to
`input_audio_buffer.append` and audio deltas to Twilio `media`, sends `clear` on
`speech_started`, and nothing else: no tracking, no truncate, no events, no database.
Usage: python bench/bare_relay.py PORT (OPENAI_BASE_URL / OPENAI_API_KEY from env).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

import uvicorn
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from openai import AsyncOpenAI

app = FastAPI()
client = AsyncOpenAI()


@app.post("/twilio/voice")
async def voice(request: Request) -> Response:
    host = request.headers["host"]
    twiml = (
        '<?xml version="1.0" encoding="UTF-8"?><Response><Connect>'
        f'<Stream url="ws://{host}/twilio/media"><Parameter name="token" value="x"/></Stream>'
        "</Connect></Response>"
    )
    return Response(twiml, media_type="text/xml")


@app.websocket("/twilio/media")
async def media(ws: WebSocket) -> None:
    await ws.accept()
    stream_sid = ""
    while not stream_sid:
        msg = json.loads(await ws.receive_text())
        if msg["event"] == "start":
            stream_sid = msg["start"]["streamSid"]
    async with client.realtime.connect(model="gpt-realtime") as rt:
        await rt.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcmu"},
                            "turn_detection": {"type": "semantic_vad"},
                        },
                        "output": {"format": {"type": "audio/pcmu"}},
                    },
                },
            }
        )
        await rt.send({"type": "response.create"})

        async def down() -> None:
            async for event in rt:
                if event.type == "response.output_audio.delta":
                    await ws.send_text(
                        json.dumps(
                            {"event": "media", "streamSid": stream_sid,
                             "media": {"payload": event.delta}}
                        )
                    )  # fmt: skip
                elif event.type == "input_audio_buffer.speech_started":
                    await ws.send_text(json.dumps({"event": "clear", "streamSid": stream_sid}))

        task = asyncio.create_task(down())
        try:
            while True:
                msg = json.loads(await ws.receive_text())
                if msg["event"] == "media":
                    await rt.send(
                        {"type": "input_audio_buffer.append", "audio": msg["media"]["payload"]}
                    )
                elif msg["event"] == "stop":
                    break
        except WebSocketDisconnect:
            pass
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
