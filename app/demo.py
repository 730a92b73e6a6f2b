"""`voice-agent demo`: one scripted call end to end, offline, in one process.

Embedded PostgreSQL (or DATABASE_URL), the Realtime simulator, the service on a free port and
a fake Twilio caller: the caller asks for a table, interrupts the agent's long answer, gets an
answer to the interruption and hangs up. Then the call's timeline is printed from the database
and what the caller heard is written to a WAV file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import socket
import sys
import time
from pathlib import Path

from pydantic import SecretStr

from app.call_store import find_by_sid
from app.main import create_app
from app.server import ServiceServer, prepare_database, uvicorn_config
from app.settings import Settings, get_settings
from app.timeline import format_table, load_timeline
from telephony.fake_caller import FakeTwilioCaller
from telephony.fake_twilio_api import FakeTwilioApi
from telephony.scenario import Scenario
from telephony.simulator import RealtimeSimulator

GREETING_MS = 2600
PREAMBLE_MS = 1300
LONG_REPLY_MS = 7000
DEMO_SCENARIO = Scenario.model_validate(
    {
        "name": "demo-barge-in",
        "greeting": {
            "text": "Thanks for calling Luigi's. How can I help you today?",
            "audio_ms": GREETING_MS,
        },
        "steps": [
            {
                "caller_transcript": "Hi, do you have a table for four tomorrow at eight?",
                "function_call": {
                    "name": "check_availability",
                    "arguments": {"date": "{tomorrow}", "time": "20:00", "party_size": 4},
                    "preamble": {"text": "Let me check that for you.", "audio_ms": PREAMBLE_MS},
                },
            },
            {
                "reply": {
                    "text": (
                        "Good news, we have a table for four tomorrow at eight. We also have "
                        "a lovely terrace, and tomorrow's specials are a wild mushroom risotto, "
                        "grilled sea bass with lemon, and our famous tiramisu."
                    ),
                    "audio_ms": LONG_REPLY_MS,
                }
            },
            {
                "caller_transcript": "Sorry, could we make it half past eight instead?",
                "reply": {
                    "text": "Of course, half past eight works too. Anything else?",
                    "audio_ms": 2800,
                },
            },
            {
                "caller_transcript": "No, that's all. Thank you, bye!",
                "reply": {"text": "Thank you for calling, goodbye!", "audio_ms": 1600},
            },
        ],
        "fallback": {"text": "Is there anything else I can help you with?", "audio_ms": 2000},
    }
)

WAIT_S = 20.0


async def _script(caller: FakeTwilioCaller) -> None:
    """What the caller does: ask, interrupt the long answer, ask again, say goodbye."""
    say = print
    await caller.dial()
    await caller.wait_for(
        lambda c: c.media_received_ms >= GREETING_MS and c.buffered_ms == 0, WAIT_S
    )
    say("  caller heard the greeting; asks for a table")
    start = caller.heard_ms
    await caller.play_speech(1800)
    # The preamble, then ~1.5 s into the long answer: the caller cuts in.
    await caller.wait_for(lambda c: c.heard_ms >= start + PREAMBLE_MS + 1500, WAIT_S)
    say("  caller interrupts the agent mid-sentence")
    await caller.play_speech(1400)
    await caller.wait_for(lambda c: len(c.clears) >= 1, WAIT_S)
    say(f"  agent was cut off: {caller.clears[0].dropped_ms:.0f} ms of its audio never played")
    after_clear = caller.heard_ms
    await caller.wait_for(
        lambda c: c.heard_ms >= after_clear + 2800 - 40 and c.buffered_ms == 0, WAIT_S
    )
    say("  caller heard the answer to the interruption; says goodbye")
    before_bye = caller.heard_ms
    await caller.play_speech(1200)
    await caller.wait_for(
        lambda c: c.heard_ms >= before_bye + 1600 - 40 and c.buffered_ms == 0, WAIT_S
    )
    await caller.hangup()
    say("  caller hung up")


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


async def demo(settings: Settings, out: Path) -> int:
    began = time.monotonic()
    print("voice-agent demo: one simulated call, offline")
    where = (
        "DATABASE_URL" if settings.database_url else f"embedded PostgreSQL in {settings.data_dir}"
    )
    print(f"- database: {where}")
    url = await prepare_database(settings)
    sock = _free_socket()
    port = sock.getsockname()[1]
    async with RealtimeSimulator(DEMO_SCENARIO) as sim, FakeTwilioApi() as twilio_api:
        print(f"- Realtime simulator at {sim.base_url}")
        settings = settings.model_copy(
            update={
                "database_url": url,
                "openai_api_key": None,
                "openai_base_url": sim.base_url,
                "twilio_api_base_url": twilio_api.base_url,
                "twilio_account_sid": twilio_api.account_sid,
                "twilio_auth_token": SecretStr(twilio_api.auth_token),
                "public_base_url": f"http://127.0.0.1:{port}",
                "host": "127.0.0.1",
                "port": port,
                "console_password": SecretStr(secrets.token_urlsafe(12)),
            }
        )
        app = create_app(settings)
        server = ServiceServer(uvicorn_config(app, settings, log_level="warning", access_log=False))
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="demo-server")
        try:
            async with asyncio.timeout(30):
                while not server.started:
                    if serving.done():
                        serving.result()
                        return 1
                    await asyncio.sleep(0.02)
            print(f"- service at {settings.public_base_url}")
            print("- call:")
            caller = FakeTwilioCaller(
                settings.public_base_url,
                auth_token=twilio_api.auth_token,
                account_sid=twilio_api.account_sid,
            )
            twilio_api.attach(caller)
            try:
                await _script(caller)
            finally:
                await caller.aclose()
            runtime = app.state.runtime
            entry = runtime.registry.get(caller.call_sid)
            if entry is not None:
                async with asyncio.timeout(WAIT_S):
                    await entry.done.wait()
            await runtime.events.flush()
            row = await find_by_sid(runtime.engine, caller.call_sid)
            if row is None:
                print("the call was not recorded", file=sys.stderr)
                return 1
            timeline = await load_timeline(runtime.engine, row.id)
            assert timeline is not None
        finally:
            server.should_exit = True
            await serving
            sock.close()
    await caller.write_heard_wav(out)
    call = timeline["call"]
    print()
    print(f"Timeline of call {call['id']} ({call['status']}, ended by: {call['end_reason']})")
    print(format_table(timeline))
    print()
    print(f"What the caller heard: {out} ({caller.heard_ms / 1000:.1f} s of agent audio)")
    print(f"Done in {time.monotonic() - began:.1f} s.")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """Entry point of `voice-agent demo`."""
    for noisy in ("httpx", "websockets", "telephony.simulator", "uvicorn", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("app.db").setLevel(logging.WARNING)
    return asyncio.run(demo(get_settings(), Path(args.out)))
