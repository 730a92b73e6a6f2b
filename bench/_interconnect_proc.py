"""The SIP interconnect stand-in in its own process, driven over stdin for bench/openai_sip_held.py.

Usage: python bench/_interconnect_proc.py WEBHOOK_URL SECRET. Prints one JSON line with its
base URL when ready, then answers each command line on stdin with one JSON line:

  place N RATE   announce N calls (signed webhooks) at RATE per second, then wait until each
                 has its sideband and its greeting is done
  new N          N ringing calls, not announced (a bare client accepts them): their ids
  greeted        wait until every call made so far has a sideband and its greeting is done
  count          totals so far: events sent on every sideband, responses done, client events
  accept_body    the accept body of the first accepted call
  hangup         every live call hangs up on OpenAI's side (the sidebands close)

Every call runs the long scenario below with the simulated caller on (`auto_caller`): the
caller speaks each scripted turn 0.4 s after the agent stops, the model answers with ~3 s of
audio (transcript deltas as it goes, output_audio_buffer.started / stopped around what the
caller hears): a response every 4-5 s, for longer than any measuring window.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from telephony.sim.interconnect import SimCall, SipInterconnect
from telephony.sim.scenario import Scenario

TURNS = 200
SCENARIO = Scenario.model_validate(
    {
        "name": "bench-openai-sip-held",
        "greeting": {"text": "Thanks for calling the benchmark line, how can I help?",
                     "audio_ms": 2500},
        "steps": [
            {
                "caller_transcript": f"I would like to ask about item number {i}.",
                "reply": {
                    "text": f"Item {i} is in stock, it costs twelve euros, and it can be "
                            "delivered tomorrow morning; shall I reserve it for you?",
                    "audio_ms": 3000,
                },
            }
            for i in range(TURNS)
        ],
    }
)  # fmt: skip


def reply(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


async def greeted(sim: SipInterconnect, calls: list[SimCall], within: float) -> int:
    async def one(call: SimCall) -> bool:
        try:
            session = await sim.wait_for_session(call.call_id, within=within)
            await session.wait_for_sent("output_audio_buffer.started", within=within)
        except (TimeoutError, ConnectionError):
            return False
        return True

    return sum(await asyncio.gather(*(one(c) for c in calls)))


async def main() -> None:
    webhook_url, secret = sys.argv[1], sys.argv[2]
    sim = SipInterconnect(SCENARIO, webhook_secret=secret, auto_caller=True, record=True)
    sim.webhook_url = webhook_url
    await sim.start()
    reply({"url": sim.base_url})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    made: list[SimCall] = []
    try:
        while line := (await reader.readline()).decode().split():
            command, args = line[0], line[1:]
            if command == "place":
                n, rate = int(args[0]), float(args[1])
                calls: list[SimCall] = []
                tasks = []
                began = loop.time()
                for i in range(n):
                    await asyncio.sleep(max(0.0, began + i / rate - loop.time()))
                    call = sim.new_call(to_number="+15557654321")
                    calls.append(call)
                    tasks.append(asyncio.create_task(sim.deliver(call)))
                statuses = await asyncio.gather(*tasks, return_exceptions=True)
                made += calls
                ok = await greeted(sim, calls, 30.0)
                bad = [repr(s) for s in statuses if s != 200]
                reply({"placed": n, "greeted": ok, "webhook_failures": bad[:3]})
            elif command == "new":
                calls = [sim.new_call() for _ in range(int(args[0]))]
                made += calls
                reply({"ids": [c.call_id for c in calls]})
            elif command == "greeted":
                reply({"greeted": await greeted(sim, made, 30.0)})
            elif command == "count":
                sessions = [s for c in sim.calls.values() for s in c.sessions]
                reply(
                    {
                        "sent": sum(len(s.sent) for s in sessions),
                        "received": sum(len(s.received) for s in sessions),
                        "responses": sum(
                            1 for s in sessions for _, e in s.sent if e["type"] == "response.done"
                        ),
                    }
                )
            elif command == "accept_body":
                body = next((c.accept_body for c in made if c.accept_body is not None), None)
                reply({"body": body})
            elif command == "hangup":
                live = [c for c in sim.calls.values() if c.state == "accepted"]
                await asyncio.gather(*(sim.remote_hangup(c.call_id) for c in live))
                reply({"hung_up": len(live)})
            else:
                reply({"error": f"unknown command {command}"})
    finally:
        await sim.stop()


if __name__ == "__main__":
    asyncio.run(main())
