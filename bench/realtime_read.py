"""The model read loops' CPU per server event, on a conversation's real mix of events.

A scripted server (a process of its own, plain `websockets`) answers the session's set-up and
then sends, as fast as the socket takes them, `--cycles` conversation cycles, each one turn of
the caller and one of the agent:

- Realtime, as the Realtime API sends them: the caller's speech started, stopped and
  committed, its item added and done, three transcription deltas and the completed
  transcription; the agent's response created, its item and content part added, 3 s of audio
  in 20 ms deltas with a transcript delta every 300 ms, the audio and transcript done, the
  part, item and response done, and the rate limits. 180 frames a cycle: 150 audio deltas and
  30 other events, 9 of which the bridge acts on.
- GPT-Live, on its primary socket: three caller transcript deltas, 3 s of audio in 20 ms
  deltas with an agent transcript delta every 300 ms, and the session's usage. 164 frames:
  150 audio deltas, 13 transcript deltas the bridge acts on, one event it does not.

This process reads them the way a call does (the link's `connect`, then its `read` with
handlers that do nothing), its CPU (`resource.getrusage`, this process only) over the read
divided by the frames, for:

- `handled`: `read` with the bridge's handled set (`REALTIME_EVENTS_HANDLED`,
  `LIVE_EVENTS_READ`): each frame parsed once, audio deltas without the SDK's models, the
  events no handler acts on dropped unparsed, the others made into the SDK's models
  (validated against their own model: `realtime_wire.sdk_event`);
- `all` (Realtime): `read` with no handled set: every event that is not an audio delta made
  into the SDK's model;
- `sdk` (baseline): the SDK's own read, `async for event in connection` (every frame parsed
  into its model): on GPT-Live, what `LiveLink.read` did before (`recv_bytes` and
  `parse_event`, audio deltas included).

Modes alternate round by round so the machine's load falls on all of them. An earlier tree's
figures: run its own copy of this file (`PYTHONPATH=TREE python TREE/bench/realtime_read.py`).
No assertions.

    .venv/bin/python bench/realtime_read.py [--cycles 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import resource
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

IDS = {"response_id": "resp_1", "item_id": "item_a", "output_index": 0, "content_index": 0}
AUDIO = base64.b64encode(bytes([0x7F]) * 160).decode()  # 20 ms of G.711


def _response(status: str) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "realtime.response",
        "status": status,
        "status_details": None,
        "output": []
        if status == "in_progress"
        else [
            {
                "id": "item_a",
                "object": "realtime.item",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_audio", "transcript": "Your table is booked."}],
            }
        ],
        "conversation_id": "conv_1",
        "output_modalities": ["audio"],
        "max_output_tokens": "inf",
        "audio": {"output": {"format": {"type": "audio/pcmu"}, "voice": "marin"}},
        "usage": None
        if status == "in_progress"
        else {
            "total_tokens": 420,
            "input_tokens": 300,
            "output_tokens": 120,
            "input_token_details": {"text_tokens": 200, "audio_tokens": 100, "cached_tokens": 0},
            "output_token_details": {"text_tokens": 20, "audio_tokens": 100},
        },
        "metadata": None,
    }


def _user_item() -> dict[str, Any]:
    return {
        "id": "item_u",
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [{"type": "input_audio", "transcript": None}],
    }


def cycle() -> list[str]:
    """One caller turn and one agent turn, as the Realtime API sends them."""
    events: list[dict[str, Any]] = [
        {"type": "input_audio_buffer.speech_started", "audio_start_ms": 1000, "item_id": "item_u"},
        {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": 2400, "item_id": "item_u"},
        {"type": "input_audio_buffer.committed", "previous_item_id": None, "item_id": "item_u"},
        {"type": "conversation.item.added", "previous_item_id": None, "item": _user_item()},
        {"type": "conversation.item.done", "previous_item_id": None, "item": _user_item()},
    ]  # fmt: skip
    for word in ("A table ", "for two ", "tonight"):
        events.append(
            {
                "type": "conversation.item.input_audio_transcription.delta",
                "item_id": "item_u",
                "content_index": 0,
                "delta": word,
            }
        )
    events += [
        {"type": "conversation.item.input_audio_transcription.completed", "item_id": "item_u",
         "content_index": 0, "transcript": "A table for two tonight",
         "usage": {"type": "duration", "seconds": 1.4}},
        {"type": "response.created", "response": _response("in_progress")},
        {"type": "conversation.item.added", "previous_item_id": "item_u",
         "item": {"id": "item_a", "object": "realtime.item", "type": "message",
                  "status": "in_progress", "role": "assistant", "content": []}},
        {"type": "response.output_item.added", "response_id": "resp_1", "output_index": 0,
         "item": {"id": "item_a", "object": "realtime.item", "type": "message",
                  "status": "in_progress", "role": "assistant", "content": []}},
        {"type": "response.content_part.added", **IDS,
         "part": {"type": "audio", "transcript": ""}},
    ]  # fmt: skip
    for n in range(150):
        events.append({"type": "response.output_audio.delta", **IDS, "delta": AUDIO})
        if n % 15 == 14:
            events.append({"type": "response.output_audio_transcript.delta", **IDS,
                           "delta": "booked "})  # fmt: skip
    events += [
        {"type": "response.output_audio.done", **IDS},
        {"type": "response.output_audio_transcript.done", **IDS,
         "transcript": "Your table is booked."},
        {"type": "response.content_part.done", **IDS,
         "part": {"type": "audio", "transcript": "Your table is booked."}},
        {"type": "response.output_item.done", "response_id": "resp_1", "output_index": 0,
         "item": _response("completed")["output"][0]},
        {"type": "conversation.item.done", "previous_item_id": "item_u",
         "item": _response("completed")["output"][0]},
        {"type": "response.done", "response": _response("completed")},
        {"type": "rate_limits.updated", "rate_limits": [
            {"name": "requests", "limit": 1000, "remaining": 999, "reset_seconds": 0.06},
            {"name": "tokens", "limit": 50000, "remaining": 49580, "reset_seconds": 0.5}]},
    ]  # fmt: skip
    return [json.dumps({"event_id": f"event_{i}", **e}) for i, e in enumerate(events)]


def live_cycle() -> list[str]:
    """One caller turn and one agent turn on GPT-Live's primary socket: the caller's
    transcript deltas, 3 s of audio in 20 ms deltas with an agent transcript delta every
    300 ms, and the session's usage (which no handler reads)."""
    events: list[dict[str, Any]] = [
        {"type": "session.input_transcript.delta", "delta": word}
        for word in ("A table ", "for two ", "tonight")
    ]
    for n in range(150):
        events.append({"type": "session.output_audio.delta", "delta": AUDIO})
        if n % 15 == 14:
            events.append({"type": "session.output_transcript.delta", "delta": "booked "})
    events.append(
        {"type": "session.usage.updated", "usage": {"input_tokens": 300, "output_tokens": 120}}
    )
    return [json.dumps({"event_id": f"event_{i}", **e}) for i, e in enumerate(events)]


SERVER = """
import asyncio, json, sys
from websockets.asyncio.server import serve
frames = json.loads(sys.stdin.read())
cycles = int(sys.argv[1])

async def handle(ws):
    if "realtime" in ws.request.path:
        await ws.send(json.dumps({"type": "session.created", "event_id": "e0",
                                  "session": {"id": "sess_bench", "object": "realtime.session"}}))
    async for raw in ws:
        kind = json.loads(raw).get("type")
        if kind == "session.update":
            await ws.send(json.dumps({"type": "session.updated", "event_id": "e1",
                                      "session": {"id": "sess_bench"}}))
            break
        if kind == "session.start":
            await ws.send(json.dumps({"type": "session.started", "event_id": "e1",
                                      "session": {"id": "sess_bench"}}))
            break
    for _ in range(cycles):
        for frame in frames[kind]:
            await ws.send(frame)
    await ws.close()

async def main():
    async with serve(handle, "127.0.0.1", 0, compression=None) as server:
        print(next(iter(server.sockets)).getsockname()[1], flush=True)
        await asyncio.Future()

asyncio.run(main())
"""

MODES = {
    "realtime": (
        ("sdk", "SDK `async for` (baseline)"),
        ("all", "`read`, no handled set"),
        ("handled", "`read`, the bridge's handled set"),
    ),
    "live": (
        ("sdk", "SDK `async for` (baseline; as `read` before: every frame parsed)"),
        ("handled", "`read`, the bridge's handled set"),
    ),
}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _read_once(base_url: str, model: str, mode: str) -> tuple[float, int]:
    """One connection's read of every cycle: (CPU seconds, frames read)."""
    from openai import AsyncOpenAI

    from telephony.bridge import BridgeConfig
    from telephony.bridge.bridge import LIVE_EVENTS_READ, REALTIME_EVENTS_HANDLED
    from telephony.bridge.live_link import LIVE_SOCKET_OPTIONS, LiveLink
    from telephony.bridge.port import Port
    from telephony.bridge.realtime_link import REALTIME_SOCKET_OPTIONS, RealtimeLink

    client = AsyncOpenAI(api_key="sk-bench", base_url=base_url)
    frames = 0
    try:
        if mode == "sdk":
            conn: Any
            if model == "realtime":
                manager: Any = client.realtime.connect(
                    model="gpt-realtime", websocket_connection_options=REALTIME_SOCKET_OPTIONS
                )
            else:
                manager = client.live.connect(websocket_connection_options=LIVE_SOCKET_OPTIONS)
            async with manager as conn:
                if model == "realtime":
                    await conn.session.update(session={"type": "realtime"})
                    skip = 2  # session.created, session.updated
                else:
                    await conn.send({"type": "session.start", "session": {}})
                    skip = 1  # session.started
                t0 = _cpu()
                async for _event in conn:
                    frames += 1
                return _cpu() - t0, frames - skip

        port = Port(
            call_id="bench",
            emit=lambda kind, **data: None,
            spawn=lambda coro, name, tool=False: asyncio.create_task(coro, name=name),
            finish=lambda reason: None,
            ended=lambda: False,
        )
        link: Any
        if model == "realtime":
            link = RealtimeLink(port, BridgeConfig(), client, "audio/pcmu", lambda: [], deque())
            handles = REALTIME_EVENTS_HANDLED if mode == "handled" else None
        else:
            link = LiveLink(port, BridgeConfig(), client, "audio/pcmu", lambda: [])
            handles = LIVE_EVENTS_READ
        session, _, error = await link.connect(resumed=False)
        assert session is not None, error
        counted = [0]

        async def on_delta(_session: Any, _delta: Any) -> None:
            counted[0] += 1

        async def on_event(_session: Any, _event: Any) -> str | None:
            counted[0] += 1
            return None

        t0 = _cpu()
        await link.read(session, on_delta, on_event, handles)
        spent = _cpu() - t0
        return spent, counted[0] + link.events_dropped
    finally:
        await client.close()


async def main_async(base_url: str, frames: dict[str, list[str]], cycles: int, rounds: int) -> None:
    results = {model: {mode: [] for mode, _ in MODES[model]} for model in MODES}
    for model in MODES:
        await _read_once(base_url, model, "handled")  # warm-up: imports, the SDK's caches
    for r in range(rounds):
        for model, modes in MODES.items():
            for mode, _ in modes:
                spent, seen = await _read_once(base_url, model, mode)
                assert seen == len(frames[model]) * cycles, (model, mode, seen)
                results[model][mode].append(spent * 1e6 / seen)
                print(f"round {r + 1} {model:8} {mode:8} {spent * 1e6 / seen:6.1f} us a frame",
                      flush=True)  # fmt: skip
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for model, modes in MODES.items():
        per_cycle = len(frames[model])
        audio = sum(1 for f in frames[model] if "output_audio.delta" in f)
        base = min(results[model]["sdk"])
        print(
            f"\n{model}: {cycles} cycles of {per_cycle} frames ({audio} audio deltas, "
            f"{per_cycle - audio} other events), {rounds} rounds; load {load}, "
            f"{os.cpu_count()} CPUs\n"
        )
        print("| read | CPU us a frame (each round) | a cycle (best) | vs the SDK's read |")
        print("|---|---|---|---|")
        for mode, label in modes:
            values = results[model][mode]
            best = min(values)
            print(
                f"| {label} | {' / '.join(f'{v:.1f}' for v in values)} | "
                f"{best * per_cycle / 1000:.2f} ms | {best / base:.2f}x |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    started = time.monotonic()
    frames = {"realtime": cycle(), "live": live_cycle()}
    by_start = {"session.update": frames["realtime"], "session.start": frames["live"]}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(args.cycles)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps(by_start))
        server.stdin.close()
        base_url = f"http://127.0.0.1:{int(server.stdout.readline())}/v1"
        asyncio.run(main_async(base_url, frames, args.cycles, args.rounds))
    finally:
        server.terminate()
        server.wait(10)
    print(f"\n({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
