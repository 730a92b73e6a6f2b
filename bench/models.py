"""The two voice models side by side: the Realtime API (the established path, the baseline) and
GPT-Live, on the same Twilio leg, service and engine.

For each model, N calls one after another, each measured from the caller's side of its Twilio
media stream:

- webhook -> first audio: from the caller's `POST /twilio/voice` to the first agent audio frame
  on its stream (TwiML, WebSocket, stream token, call rows, the model session opened; on
  Realtime our `response.create` for the greeting, on Live the server greeting unasked);
- barge-in -> clear: from the caller's first frame of speech over the agent to the `clear` that
  stops its playback (Realtime: our clear on the server's `speech_started`; Live: our clear when
  the caller's transcript starts while the leg still plays), and the agent audio heard after
  the caller began;
- commit -> first announcement audio: a running operation of the call committed in the ledger,
  to the first frame of the announcement on the caller's stream (delivery row, NOTIFY, gate,
  durable offer; Realtime: a note and our `response.create`; Live: `session.commentary.append`,
  said by the model when it sees fit — the simulator says it at once).

Both models are the local simulator (one process, both protocols), at real-time pace with
energy VAD, so the figures are of this service's paths and the simulator's turn-taking, not of
OpenAI's servers; they compare the two front ends on equal ground.

    .venv/bin/python bench/models.py [--calls 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _stats import pct  # bench/ is on sys.path when run as a script
from delivery import _commit, _running_ops, _server_url, _wait, service, table

from app.db import create_database, drop_database, make_engine, upgrade
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import RealtimeSimulator

SCENARIO = Scenario.model_validate(
    {
        "name": "bench-models",
        "greeting": {"text": "Hello and welcome, here is a long greeting.", "audio_ms": 4000},
        "steps": [
            {"caller_transcript": "Wait a moment.", "reply": {"text": "Sure.", "audio_ms": 600}}
        ],
        "fallback": {"text": "{note}", "audio_ms": 600},
    }
)
LISTEN_MS = 1000  # of the greeting heard before the caller talks over it
SPEECH_MS = 800


def _first(caller: FakeTwilioCaller, event: str, after: float) -> float | None:
    for message in caller.received:
        if message.t >= after and message.event == event:
            return message.t
    return None


async def _one_call(
    app: Any, engine: Any, api: FakeTwilioApi, index: int, out: dict[str, list[float]]
) -> None:
    runtime = app.state.runtime
    caller = FakeTwilioCaller(runtime.settings.public_base_url, from_number=f"+1555{index:07d}")
    api.attach(caller)
    t0 = time.monotonic()
    await caller.dial()
    await _wait(lambda: _first(caller, "media", t0) is not None, 30)
    out["webhook -> first audio"].append(_first(caller, "media", t0) - t0)  # type: ignore[operator]
    await _wait(lambda: caller.heard_ms >= LISTEN_MS, 30)
    onset = time.monotonic()
    talking = asyncio.create_task(caller.play_speech(SPEECH_MS))
    await _wait(lambda: bool(caller.clears), 30)
    out["barge-in -> clear"].append(caller.clears[0].t - onset)
    out["agent heard after barge-in"].append(
        (caller.heard_ms_after(onset) - caller.heard_ms_after(caller.clears[0].t)) / 1000
    )
    await talking
    await caller.play_silence(700)  # the caller's turn ends; the agent answers "Sure."
    await _wait(lambda: caller.buffered_ms == 0, 30)
    await asyncio.sleep(2.5)  # past the bridge's wait for the server's own answer
    call_id = runtime.registry.get(caller.call_sid).call_id
    [op] = await _running_ops(engine, [(call_id, caller.from_number)])
    committed = await _commit(engine, op)
    await _wait(lambda: _first(caller, "media", committed) is not None, 30)
    out["commit -> announcement audio"].append(_first(caller, "media", committed) - committed)  # type: ignore[operator]
    await _wait(lambda: caller.buffered_ms == 0, 30)
    await caller.hangup()
    await _wait(lambda: runtime.registry.get(caller.call_sid) is None, 30)


async def run_model(engine: Any, model_api: str, calls: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {
        "webhook -> first audio": [],
        "barge-in -> clear": [],
        "agent heard after barge-in": [],
        "commit -> announcement audio": [],
    }
    async with (
        RealtimeSimulator(SCENARIO, record=False) as sim,
        FakeTwilioApi() as api,
        service(
            engine, openai_base_url=sim.base_url, twilio_api_base_url=api.base_url,
            model_api=model_api,
        ) as (app, _settings),
    ):  # fmt: skip
        for index in range(calls):
            await _one_call(app, engine, api, index, out)
    return out


async def main(calls: int) -> None:
    server = _server_url()
    name = f"va_bench_models_{os.getpid()}"
    url = create_database(server, name)
    try:
        await asyncio.to_thread(upgrade, url)
        engine = make_engine(url, pool_size=10, max_overflow=5)
        try:
            t0 = time.perf_counter()
            results = {api: await run_model(engine, api, calls) for api in ("realtime", "live")}
            took = time.perf_counter() - t0
        finally:
            await engine.dispose()
    finally:
        drop_database(server, name)
    print(
        f"models benchmark ({calls} calls per model, one at a time; {os.cpu_count()} CPUs; "
        f"took {took:.0f} s; run {uuid.uuid4().hex[:6]})"
    )
    rows = []
    for what in results["realtime"]:
        base, live = results["realtime"][what], results["live"][what]
        rows.append(
            (
                what,
                str(len(live)),
                f"{pct(base, 50) * 1000:.0f}",
                f"{pct(base, 99) * 1000:.0f}",
                f"{pct(live, 50) * 1000:.0f}",
                f"{pct(live, 99) * 1000:.0f}",
                f"{(pct(live, 50) - pct(base, 50)) * 1000:+.0f}",
            )
        )
    table(
        "Realtime (baseline) and GPT-Live on the same Twilio leg, simulator at real time (ms)",
        (
            "path",
            "n",
            "realtime p50",
            "realtime p99",
            "live p50",
            "live p99",
            "live - realtime p50",
        ),
        rows,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10, help="calls per model")
    asyncio.run(main(parser.parse_args().calls))
