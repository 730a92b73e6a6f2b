"""`voice-agent demo`: one scripted booking call end to end, offline, in one process.

Embedded PostgreSQL (or DATABASE_URL), the Realtime simulator playing the built-in scenario
(telephony/sim/scenarios/default.json), the demo system of record, the service with its
in-process operation worker, and a fake Twilio caller. The caller asks for a table (a read,
answered inline from the system of record), interrupts the agent's long answer to ask for a
booking, hears the readback and confirms; the booking is admitted and enqueued, a worker
commits it at the system of record, and the confirmed outcome is announced in the call. Then
the call's timeline (conversation, tool calls, policy decisions, operation transitions,
delivery) is printed from the database and the call's two-leg recording (caller left, agent
right, as the staff console plays it) is written to a WAV file.

Both sides speak (eSpeak NG, see telephony/sim/speech.py) where it is installed, and the
simulator recognises the caller's words from the audio (PocketSphinx) rather than the script;
without them, synthetic tones, with a notice.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from app.calls.recording_store import get_recording
from app.calls.store import find_by_sid
from app.calls.timeline import format_table, load_timeline, terminal_width
from app.cli.demo_harness import WAIT_S, Say, demo_caller_number, free_socket, start_demo_sor
from app.cli.demo_openai_sip import demo_openai_sip
from app.main import create_app
from app.server import ServiceServer, prepare_database, uvicorn_config
from app.settings import Settings, get_settings
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.scenario import Scenario, Step, load_scenario
from telephony.sim.simulator import RealtimeSimulator
from telephony.sim.speech import speech_setup
from tools.restaurant.sor import SystemOfRecord

FRAME_MS = 20
# How long the agent must send nothing before the caller takes its turn.
QUIET_S = 0.5


def _spoken_ms(step: Step) -> int:
    spoken = step.spoken()
    return spoken.duration_ms() if spoken is not None else 0


def _transcript(step: Step) -> str:
    return step.caller_transcript or "(caller speech)"


async def _heard(caller: FakeTwilioCaller, at_least_ms: float, timeout: float = WAIT_S) -> None:  # noqa: ASYNC109
    """Until the caller has heard `at_least_ms` of agent audio and the agent has gone quiet.

    A spoken line is often longer than the script's `audio_ms` (a minimum), and the playout
    buffer runs dry between two deltas of one line, so "nothing queued" alone can come in the
    middle of the readback; the caller's yes must come after the readback was heard to its end,
    or it is not the caller's answer to it (and the confirmation is refused)."""
    async with asyncio.timeout(timeout):
        await caller.wait_for(lambda c: c.heard_ms >= at_least_ms - 2 * FRAME_MS, timeout)
        while True:
            await caller.wait_for(lambda c: c.buffered_ms == 0, timeout)
            received = caller.media_received_bytes
            await asyncio.sleep(QUIET_S)
            if caller.media_received_bytes == received and caller.buffered_ms == 0:
                return


async def _script(caller: FakeTwilioCaller, scenario: Scenario, say: Say) -> None:
    """What the caller does, turn by turn, following the built-in booking scenario."""
    steps = scenario.steps
    await caller.dial()
    greeting = scenario.greeting.duration_ms() if scenario.greeting else 0
    await caller.wait_for(lambda c: c.media_received_ms >= greeting and c.buffered_ms == 0, WAIT_S)
    say("  agent greets the caller")
    start = caller.heard_ms
    say(f'  caller: "{_transcript(steps[0])}"')
    await caller.say(_transcript(steps[0]), ms=1800)
    # The preamble, then ~1.5 s into the long answer (read from the system of record).
    await caller.wait_for(lambda c: c.heard_ms >= start + _spoken_ms(steps[0]) + 1500, WAIT_S)
    say(f'  caller interrupts the agent: "{_transcript(steps[2])}"')
    await caller.say(_transcript(steps[2]), ms=1600)
    await caller.wait_for(lambda c: len(c.clears) >= 1, WAIT_S)
    say(f"  agent was cut off: {caller.clears[0].dropped_ms:.0f} ms of its audio never played")
    after_clear = caller.heard_ms
    await _heard(caller, after_clear + _spoken_ms(steps[2]) + _spoken_ms(steps[3]))
    say("  agent read the booking back and asked for a yes")
    before_yes = caller.heard_ms
    say(f'  caller: "{_transcript(steps[4])}"')
    await caller.say(_transcript(steps[4]), ms=1000)
    # The announcement may queue right behind this answer, so no "nothing queued" here.
    told = before_yes + _spoken_ms(steps[4]) + _spoken_ms(steps[5])
    await caller.wait_for(lambda c: c.heard_ms >= told - 2 * FRAME_MS, WAIT_S)
    say("  agent said the booking is requested, not yet confirmed; a worker sends it")
    # The late result: spoken once the worker has committed the booking at the SOR.
    await _heard(caller, told + _spoken_ms(steps[6]), timeout=30)
    say("  agent announced the confirmed booking")
    before_bye = caller.heard_ms
    say(f'  caller: "{_transcript(steps[7])}"')
    await caller.say(_transcript(steps[7]), ms=1200)
    await _heard(caller, before_bye + _spoken_ms(steps[7]))
    await caller.hangup()
    say("  caller hung up")


async def _idempotency_keys(engine: Any, call_id: str) -> list[str]:
    """The keys this call's operations sent to the system of record."""
    import sqlalchemy as sa

    from tools.ledger_models import operations_table as operations

    async with engine.connect() as conn:
        rows = await conn.execute(
            sa.select(operations.c.idempotency_key).where(operations.c.call_id == call_id)
        )
        return [str(key) for (key,) in rows]


async def _recording(runtime: Any, call_id: str) -> bytes | None:
    """The call's stored two-leg recording, or None (recording off, or it failed).

    It is stored before the call leaves the registry, which the demo waited for."""
    info = await get_recording(runtime.engine, call_id)
    if info is None:
        return None
    data: bytes = await runtime.console.recordings.read(info, 0, info.bytes)
    return data


async def demo(settings: Settings, out: Path, *, wide: bool = False) -> int:
    began = time.monotonic()
    console_url = f"http://{settings.host}:{settings.port}/console/calls"
    print("voice-agent demo: one simulated booking call, offline")
    where = (
        "DATABASE_URL" if settings.database_url else f"embedded PostgreSQL in {settings.data_dir}"
    )
    print(f"- database: {where}")
    url = await prepare_database(settings)
    scenario = load_scenario(None)
    speech = speech_setup(
        settings.sim_voice,
        piper_model=settings.sim_piper_voice,
        cache_dir=settings.speech_cache_path(),
        recognition=settings.sim_recognition,
        vad=settings.sim_vad,
    )
    for notice in speech.notices:
        print(f"- {notice}")
    recording: bytes | None = None
    sock = free_socket()
    port = sock.getsockname()[1]
    sor: SystemOfRecord | None = None
    timeline: dict[str, Any] | None = None
    failure: str | None = None
    effects: Any = None
    async with (
        RealtimeSimulator(
            scenario, voice=speech.agent, recognize=speech.recognize, vad=speech.vad
        ) as sim,
        FakeTwilioApi() as twilio_api,
    ):
        print(f"- Realtime simulator at {sim.base_url} (scenario {scenario.name!r})")
        print(f"- {speech.describe()}")
        sor, sor_url = await start_demo_sor(settings, url)
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
                "sor_base_url": sor_url,
                # The scripted call books a table: the demo always runs the restaurant.
                "tools": None,
                "tools_file": None,
            }
        )
        app = create_app(settings, with_worker=True)
        server = ServiceServer(uvicorn_config(app, settings, log_level="warning", access_log=False))
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="demo-server")
        caller: FakeTwilioCaller | None = None
        try:
            async with asyncio.timeout(30):
                while not server.started:
                    if serving.done():
                        serving.result()
                        return 1
                    await asyncio.sleep(0.02)
            print(f"- service at {settings.public_base_url}, with an in-process operation worker")
            print("- call:")
            caller = FakeTwilioCaller(
                settings.public_base_url,
                auth_token=twilio_api.auth_token,
                account_sid=twilio_api.account_sid,
                from_number=demo_caller_number(),
                voice=speech.caller,
            )
            twilio_api.attach(caller)
            try:
                await _script(caller, scenario, print)
            except TimeoutError:
                failure = "the call did not go as scripted (timed out waiting for the agent)"
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
            recording = await _recording(runtime, row.id)
            if sor is not None:
                # This call's effects only: the data directory keeps earlier demos' bookings.
                keys = await _idempotency_keys(runtime.engine, row.id)
                effects = await sor.side_effects(idempotency_keys=keys)
        finally:
            server.should_exit = True
            await serving
            sock.close()
            if sor is not None:
                await sor.stop()
    assert timeline is not None and caller is not None
    if recording is not None:
        await asyncio.to_thread(out.write_bytes, recording)
    else:
        await caller.write_heard_wav(out)
    call = timeline["call"]
    print()
    print(f"Timeline of call {call['id']} (Twilio CallSid {call['call_sid']})")
    print(f"{call['status']}, ended by: {call['end_reason']}")
    print(format_table(timeline, width=None if wide else terminal_width()))
    print()
    for op in timeline["operations"]:
        ref = f", reference {op['reference']}" if op["reference"] else ""
        print(f"Operation {op['tool']} {op['operation_id']}: {op['status']}{ref}")
    if effects is not None:
        made = effects.bookings_inserted
        print(f"System of record: {made} booking{'' if made == 1 else 's'} made by this call")
    for heard in sim.sessions[0].recognitions if sim.sessions else []:
        print(f'Recognised from the caller\'s audio: "{heard.heard}" -> {heard.phrase!r}')
    if recording is not None:
        print(f"The call's recording (caller left, agent right): {out}; listen: aplay {out}")
    else:
        print(f"What the caller heard: {out} ({caller.heard_ms / 1000:.1f} s of agent audio)")
    print(f"See it in the staff console: `voice-agent serve`, then {console_url}/{call['id']}")
    print(f"Done in {time.monotonic() - began:.1f} s.")
    if failure is None and effects is not None and effects.bookings_inserted != 1:
        # The agent follows the tool outputs, so a refused yes no longer reads as "sent"; the
        # demo must not pass on a call that booked nothing (or twice).
        made = effects.bookings_inserted
        failure = f"the call did not go as scripted ({made} bookings made, not 1)"
    if failure is not None:
        print(failure, file=sys.stderr)
        return 1
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """Entry point of `voice-agent demo`."""
    for noisy in (
        "httpx",
        "websockets",
        "telephony.sim.simulator",
        "uvicorn",
        "alembic",
        "procrastinate",
        "app.ops.worker",
        "tools",
    ):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("app.db").setLevel(logging.WARNING)
    logging.getLogger("app.embedded_db").setLevel(logging.WARNING)
    if getattr(args, "leg", "twilio") == "openai-sip":
        logging.getLogger("telephony.sim.interconnect").setLevel(logging.WARNING)
        logging.getLogger("aiohttp").setLevel(logging.WARNING)
        logging.getLogger("httpx2").setLevel(logging.WARNING)
        return asyncio.run(demo_openai_sip(get_settings(), wide=args.wide))
    return asyncio.run(demo(get_settings(), Path(args.out), wide=args.wide))
