"""The Realtime simulator in its own process for benchmarks; dumps timings on request.

Usage: python bench/_simproc.py PORT_FILE DUMP_FILE. Writes the base URL to PORT_FILE when
ready; on SIGUSR1 writes per-session timings (appends with their frame markers, audio
deltas, speech_started) to DUMP_FILE; exits on SIGTERM.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import sys
from pathlib import Path

from telephony.sim.scenario import Scenario
from telephony.sim.simulator import RealtimeSimulator

SCENARIO = Scenario.model_validate(
    {
        "name": "bench",
        "greeting": {"text": "Thanks for calling, this is the benchmark line.", "audio_ms": 3000},
        "steps": [
            {"caller_transcript": "interrupting", "reply": {"text": "Sure.", "audio_ms": 1200}},
        ],
        "fallback": {"text": "Anything else?", "audio_ms": 1000},
    }
)


def dump(sim: RealtimeSimulator, path: Path) -> None:
    sessions = []
    for session in sim.sessions:
        appends: list[tuple[float, str]] = []
        truncates: list[tuple[float, str, int]] = []
        for t, event in session.received:
            if event.get("type") == "input_audio_buffer.append":
                marker = base64.b64decode(event.get("audio", ""))[:8]
                appends.append((t, marker.hex()))
            elif event.get("type") == "conversation.item.truncate":
                truncates.append((t, str(event.get("item_id")), int(event["audio_end_ms"])))
        deltas: list[tuple[float, str, int]] = []
        speech: list[float] = []
        for t, event in session.sent:
            kind = event.get("type")
            if kind == "response.output_audio.delta":
                deltas.append((t, event["response_id"], len(base64.b64decode(event["delta"]))))
            elif kind == "input_audio_buffer.speech_started":
                speech.append(t)
        sessions.append(
            {"appends": appends, "deltas": deltas, "speech_started": speech, "truncates": truncates}
        )
    path.write_text(json.dumps(sessions))


async def main() -> None:
    port_file, dump_file = Path(sys.argv[1]), Path(sys.argv[2])
    sim = RealtimeSimulator(SCENARIO, host="127.0.0.1", port=0)
    await sim.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: dump(sim, dump_file))
    loop.add_signal_handler(signal.SIGUSR2, sim.sessions.clear)
    await asyncio.to_thread(port_file.write_text, sim.base_url)
    await stop.wait()
    await sim.stop()


if __name__ == "__main__":
    asyncio.run(main())
