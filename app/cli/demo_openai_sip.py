"""`voice-agent demo --leg openai-sip`: the booking call through OpenAI's SIP interconnect, offline.

The interconnect stand-in plays OpenAI's side: a signed `realtime.call.incoming` webhook to
the service, then accept, the sideband WebSocket (scripted speech events, function calls and
output-buffer events, no audio), and the caller's turns. With MODEL_API=live it plays GPT-Live's:
`live.transport.incoming`, the Live accept, the Live sideband (delegated function calls,
transcript spans), the caller speaking each scripted turn. The service verifies the webhook,
accepts with its session, attaches over the sideband and runs the same agent, tools, policy,
ledger and late results as on the other legs. Then the call's timeline is printed.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import sys
import time
from typing import Any

from pydantic import SecretStr

from app.calls.store import find_by_sid
from app.calls.timeline import format_table, load_timeline, terminal_width
from app.cli.demo_harness import WAIT_S, Say, demo_caller_number, free_socket, start_demo_sor
from app.main import create_app
from app.server import ServiceServer, prepare_database, uvicorn_config
from app.settings import Settings
from telephony.sim.interconnect import SidebandSession, SimCall, SipInterconnect
from telephony.sim.scenario import Scenario, load_scenario
from tools.restaurant.sor import SystemOfRecord

STOPPED = "output_audio_buffer.stopped"


async def _stopped(session: SidebandSession, count: int, timeout: float = WAIT_S) -> None:  # noqa: ASYNC109
    """Until the server has finished playing `count` agent utterances to the caller."""
    await session.wait_for_sent(STOPPED, count=count, within=timeout)


async def _script(sim: SipInterconnect, call: SimCall, scenario: Scenario, say: Say) -> None:
    """The caller's side of the booking, as OpenAI's SIP leg would carry it."""
    steps = scenario.steps
    session = await sim.wait_for_session(call.call_id)
    say(f"  OpenAI sent realtime.call.incoming; the service accepted {call.call_id}")
    await _stopped(session, 1)
    say("  agent greets the caller")
    say(f'  caller: "{steps[0].caller_transcript}"')
    await session.caller_says(1800)
    await _stopped(session, 2)  # the preamble; the long answer follows the availability read
    await session.wait_for_sent("output_audio_buffer.started", count=3, within=WAIT_S)
    await asyncio.sleep(1.5 * sim.realtime_factor)
    say(f'  caller interrupts the agent: "{steps[2].caller_transcript}"')
    await session.caller_says(1600)
    await session.wait_for_received("output_audio_buffer.clear", within=WAIT_S)
    say("  the service sent response.cancel and output_audio_buffer.clear")
    await _stopped(session, 4)  # preamble, readback
    say("  agent read the booking back and asked for a yes")
    say(f'  caller: "{steps[4].caller_transcript}"')
    await session.caller_says(1000)
    await _stopped(session, 6)  # "thank you", "requested, not yet confirmed"
    say("  agent said the booking is requested, not yet confirmed; a worker sends it")
    await _stopped(session, 7, timeout=30)
    say("  agent announced the confirmed booking (a late result, over the sideband)")
    say(f'  caller: "{steps[7].caller_transcript}"')
    await session.caller_says(1200)
    await _stopped(session, 8)
    await sim.remote_hangup(call.call_id)
    say("  caller hung up (OpenAI closed the sideband; the re-attach is refused)")


async def _live_script(sim: SipInterconnect, call: SimCall, say: Say) -> None:
    """GPT-Live on the interconnect: the stand-in's caller says each scripted turn once the
    agent's utterance ended, and hangs up after the last; the model drives the turns."""
    say(f"  OpenAI sent live.transport.incoming; the service accepted {call.call_id}")
    await sim.wait_for_session(call.call_id)
    say("  the service drives the call over the Live sideband; the caller speaks each turn")
    await sim.wait_for_state(call.call_id, "ended", within=90)
    say("  caller hung up after the last turn")


async def demo_openai_sip(settings: Settings, *, wide: bool = False) -> int:
    began = time.monotonic()
    live = settings.model_api == "live"
    model = "GPT-Live" if live else "Realtime"
    print(
        "voice-agent demo --leg openai-sip: one booking call through the SIP interconnect "
        f"({model})"
    )
    where = (
        "DATABASE_URL" if settings.database_url else f"embedded PostgreSQL in {settings.data_dir}"
    )
    print(f"- database: {where}")
    url = await prepare_database(settings)
    scenario = load_scenario(None)
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    sock = free_socket()
    port = sock.getsockname()[1]
    sor: SystemOfRecord | None = None
    timeline: dict[str, Any] | None = None
    failure: str | None = None
    async with SipInterconnect(scenario, auto_caller=False, webhook_secret=secret) as sim:
        print(f"- OpenAI SIP interconnect stand-in at {sim.base_url} (scenario {scenario.name!r})")
        sor, sor_url = await start_demo_sor(settings, url)
        settings = settings.model_copy(
            update={
                "database_url": url,
                "openai_api_key": None,
                "openai_base_url": sim.base_url,
                "openai_webhook_secret": SecretStr(secret),
                "public_base_url": f"http://127.0.0.1:{port}",
                "host": "127.0.0.1",
                "port": port,
                "sor_base_url": sor_url,
                "tools": None,
                "tools_file": None,
            }
        )
        sim.webhook_url = f"{settings.public_base_url}/openai/webhook"
        app = create_app(settings, with_worker=True)
        server = ServiceServer(uvicorn_config(app, settings, log_level="warning", access_log=False))
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="demo-server")
        call: SimCall | None = None
        try:
            async with asyncio.timeout(30):
                while not server.started:
                    if serving.done():
                        serving.result()
                        return 1
                    await asyncio.sleep(0.02)
            print(f"- service at {settings.public_base_url}, webhook {sim.webhook_url}")
            print("- call:")
            sim.auto_caller = live  # on Live the stand-in's caller speaks each turn itself
            call = await sim.place_call(
                from_number=demo_caller_number(), to_number="+15557654321", live=live
            )
            try:
                if live:
                    await _live_script(sim, call, print)
                else:
                    await _script(sim, call, scenario, print)
            except TimeoutError:
                failure = "the call did not go as scripted (timed out waiting for the agent)"
                await sim.remote_hangup(call.call_id)
            runtime = app.state.runtime
            entry = runtime.registry.get(call.call_id)
            if entry is not None:
                # Detached once the end is persisted.
                async with asyncio.timeout(WAIT_S):
                    await entry.done.wait()
            await runtime.events.flush()
            row = await find_by_sid(runtime.engine, call.session_id if live else call.call_id)
            if row is None:
                print("the call was not recorded", file=sys.stderr)
                return 1
            timeline = await load_timeline(runtime.engine, row.id)
        finally:
            server.should_exit = True
            await serving
            sock.close()
            if sor is not None:
                await sor.stop()
    assert timeline is not None and call is not None
    info = timeline["call"]
    print()
    print(f"Timeline of call {info['id']} (OpenAI call {info['call_sid']}, leg openai_sip)")
    print(f"{info['status']}, ended by: {info['end_reason']}")
    print(format_table(timeline, width=None if wide else terminal_width()))
    print()
    for op in timeline["operations"]:
        ref = f", reference {op['reference']}" if op["reference"] else ""
        print(f"Operation {op['tool']} {op['operation_id']}: {op['status']}{ref}")
    requests = sim.live_requests_for if live else sim.requests_for
    accepts = len(requests(call.call_id, "accept"))
    print(f"Interconnect: {accepts} accept, {len(call.sessions)} sideband connection(s)")
    print(f"Done in {time.monotonic() - began:.1f} s.")
    if failure is not None:
        print(failure, file=sys.stderr)
        return 1
    return 0
