"""Keys the agent presses on the line (`send_dtmf`, DTMF_OUT=true), e.g. to get through an
automated menu on the far side: in-band tones on a Twilio media stream, heard (and decoded) by
the fake caller; the model hears back once they have gone out."""

from __future__ import annotations

import json

from sqlalchemy.ext.asyncio import AsyncEngine

from telephony import dtmf_out
from telephony.sim.scenario import Scenario
from tests.e2e_support import call_stack, wait_until
from tests.test_e2e_call import GREETING_MS, hear_greeting


def keys_scenario(digits: str) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "keys",
            "greeting": {"text": "Hello.", "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Press one then hash for me.",
                    "function_call": {"name": "send_dtmf", "arguments": {"digits": digits}},
                },
                {"reply": {"text": "Done.", "audio_ms": 600}},
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 600},
        }
    )


def test_tones_are_the_keys_and_only_the_keys() -> None:
    for digits in ("1", "12#", "*0,9D", "5555"):
        assert dtmf_out.detect(dtmf_out.tones(digits)) == digits.replace(",", "")
        assert dtmf_out.detect(dtmf_out.tones(digits, "audio/pcma"), "audio/pcma") == (
            digits.replace(",", "")
        )
    assert dtmf_out.duration_ms("12,") == 2 * 180 + 500
    assert dtmf_out.detect(bytes([0xFF]) * 8000) == ""  # silence has no keys


async def test_the_agent_presses_keys_on_a_twilio_call_as_tones_the_far_side_hears(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, keys_scenario("1#"), dtmf_out=True) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        await caller.say("Press one then hash for me.", ms=700)
        session = stack.sim.sessions[0]
        await wait_until(lambda: bool(session.function_outputs), 20, "the model is answered")
        await caller.wait_for(lambda c: c.buffered_ms == 0 and c.heard_ms > GREETING_MS + 300, 10)
        heard = caller.heard_audio()
        offered = session.received_events("session.update")[0]["session"]["tools"]
        await caller.hangup()
        events = await stack.events(caller)
    [(_, output)] = session.function_outputs
    assert json.loads(output)["status"] == "sent"
    assert dtmf_out.detect(heard) == "1#"
    assert "send_dtmf" in {t["name"] for t in offered}
    [sent] = [e["data"] for e in events if e["kind"] == "dtmf_sent"]
    assert sent == {"digits": "1#", "how": "inband", "sent": True}


async def test_without_dtmf_out_the_tool_is_not_offered(engine: AsyncEngine) -> None:
    async with call_stack(engine, keys_scenario("1")) as stack:
        caller = stack.caller()
        await caller.dial()
        await hear_greeting(caller)
        offered = stack.sim.sessions[0].received_events("session.update")[0]["session"]["tools"]
        await caller.hangup()
    assert "send_dtmf" not in {t["name"] for t in offered}
