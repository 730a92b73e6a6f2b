"""Transfers to a person on a Twilio call (`transfer_call`), end to end over real sockets: the
fake Twilio caller and REST API, the service, the Realtime simulator and PostgreSQL.

The model asks for the transfer; the engine checks the target (TRANSFER_TARGETS) and records
it; the agent says its sentence and the caller hears it to its end; only then does the call
get `<Dial>` through Twilio's REST API. Answered: our part of the call ends "transferred".
Busy: the caller comes back to an agent on a new stream, who says what happened. An unknown
target is refused and nothing reaches Twilio.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.settings import Settings
from telephony.sim.fake_caller import CallerState, FakeTwilioCaller, parse_twiml
from telephony.sim.scenario import Scenario
from tests.e2e_support import Stack, call_row, call_stack, wait_until
from tests.test_e2e_booking import heard_text
from tests.test_e2e_call import GREETING_MS, hear_greeting
from tools.transfers import parse_targets

DESK = "+15550100009"
TARGETS = f"front_desk={DESK},billing=sip:billing@pbx.example"
SENTENCE = "Putting you through to the front desk now."
SENTENCE_MS = 1500
WAIT_S = 30.0


def transfer_scenario(target: str = "front_desk") -> Scenario:
    return Scenario.model_validate(
        {
            "name": "transfer",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Can I talk to a person please?",
                    "function_call": {
                        "name": "transfer_call",
                        "arguments": {"target": target, "reason": "the caller asked"},
                    },
                },
                {"reply": {"text": SENTENCE, "audio_ms": SENTENCE_MS}},
            ],
            "fallback": {"text": "Anything else?", "audio_ms": 800},
        }
    )


def transfers_ended(outcome: str) -> float:
    """`voice_agent_transfers_total{outcome}` in this process (the service runs in it)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("voice_agent_transfers_total", {"outcome": outcome}) or 0.0


async def ask_for_a_person(stack: Stack) -> tuple[FakeTwilioCaller, str]:
    caller = stack.caller()
    stack.api.attach(caller)
    await caller.dial()
    await hear_greeting(caller)
    await caller.say("Can I talk to a person please?", ms=700)
    return caller, await stack.call_id(caller)


async def tool_call(engine: AsyncEngine, call_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        row = (
            (
                await conn.execute(
                    sa.text(
                        "SELECT * FROM tool_calls WHERE call_id = :c AND tool = 'transfer_call'"
                    ),
                    {"c": call_id},
                )
            )
            .mappings()
            .one()
        )
    return dict(row)


async def kinds_of(stack: Stack, caller: FakeTwilioCaller) -> list[str]:
    return [e["kind"] for e in await stack.events(caller)]


async def test_a_transfer_is_dialled_after_the_agents_sentence_and_ends_our_part_when_answered(
    engine: AsyncEngine,
) -> None:
    put_through = transfers_ended("transferred")
    async with call_stack(engine, transfer_scenario(), transfer_targets=TARGETS) as stack:
        caller, call_id = await ask_for_a_person(stack)
        await wait_until(lambda: bool(stack.api.dials), WAIT_S, "Twilio is told to dial")
        heard_at_dial = caller.heard_ms
        await caller.wait_for(lambda c: c.state is CallerState.ENDED, WAIT_S)
        await wait_until(
            lambda: _ended(engine, caller), WAIT_S, "the row ends when the person answers"
        )
        row = await call_row(engine, caller.call_sid)
        kinds = await kinds_of(stack, caller)
        said = await heard_text(engine, call_id)
        tc = await tool_call(engine, call_id)
        offered = stack.sim.sessions[0].received_events("session.update")[0]["session"]["tools"]
        update = stack.api.requests_to(f"/Calls/{caller.call_sid}.json")[0]
    # The model was offered exactly the configured targets.
    [tool] = [t for t in offered if t["name"] == "transfer_call"]
    assert tool["parameters"]["properties"]["target"]["enum"] == ["billing", "front_desk"]
    # The agent's sentence was heard to its end before Twilio got the new instructions.
    assert SENTENCE in said, said
    assert heard_at_dial >= GREETING_MS + SENTENCE_MS - 60, heard_at_dial
    dial = parse_twiml(update.form["Twiml"]).dial
    assert dial is not None and dial.destination == DESK and dial.timeout_s == 30
    assert dial.action_url is not None and "/twilio/transfer-ended?" in dial.action_url
    assert dial.answered_url is not None and "/twilio/transfer-answered?" in dial.answered_url
    assert stack.api.dials == [(caller.call_sid, DESK, "answered")]
    # Our part ended when the person answered; the ledger row says how it went.
    assert row is not None and row["status"] == "completed"
    assert row["end_reason"] == "transferred to front_desk"
    order = ["function_call", "transfer_requested", "transfer_started", "transfer_answered",
             "call_ended"]  # fmt: skip
    assert [k for k in kinds if k in order] == order, kinds
    assert tc["decision"] == "transferred" and tc["output"]["outcome"]["status"] == "answered"
    assert caller.closed_by == "twilio-api"
    assert transfers_ended("transferred") == put_through + 1  # once, however often told


async def _ended(engine: AsyncEngine, caller: FakeTwilioCaller) -> bool:
    row = await call_row(engine, caller.call_sid)
    return row is not None and row["status"] != "in_progress"


async def test_a_busy_line_brings_the_caller_back_to_an_agent_who_says_so(
    engine: AsyncEngine,
) -> None:
    failed = transfers_ended("failed")
    async with call_stack(engine, transfer_scenario(), transfer_targets=TARGETS) as stack:
        stack.api.dial_outcomes[DESK] = "busy"
        caller, call_id = await ask_for_a_person(stack)
        await caller.wait_for(lambda c: len(c.stream_sids) == 2, WAIT_S)
        await wait_until(lambda: len(stack.sim.sessions) == 2, WAIT_S, "a new session")
        back = "I'm sorry, I couldn't put you through to front desk: the line was busy."

        async def told() -> bool:
            return any(back in line for line in await heard_text(engine, call_id))

        await wait_until(told, WAIT_S, "the caller hears why")
        instructions = next(
            e["session"]["instructions"]
            for e in stack.sim.sessions[1].received_events("session.update")
        )
        tc = await tool_call(engine, call_id)
        row = await call_row(engine, caller.call_sid)
        await caller.hangup()
        kinds = await kinds_of(stack, caller)
        ended = await call_row(engine, caller.call_sid)
        # The transfer's end was written beside this process's event writer, which knew to
        # read the call's last seq again: no batch met a seq already taken.
        conflicts = stack.service.runtime.events.conflicts
    assert conflicts == 0
    assert stack.api.dials == [(caller.call_sid, DESK, "busy")]
    assert "put this caller through to front desk, but the line was busy" in instructions
    assert row is not None and row["status"] == "in_progress"  # the caller is still with us
    assert tc["decision"] == "transfer_failed" and tc["output"]["outcome"]["status"] == "busy"
    order = ["transfer_requested", "transfer_started", "transfer_failed", "stream_resumed"]
    assert [k for k in kinds if k in order] == order, kinds
    assert kinds.count("call_ended") == 1
    assert ended is not None and ended["status"] == "completed"
    assert transfers_ended("failed") == failed + 1


async def test_an_unknown_target_is_refused_and_nothing_reaches_twilio(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, transfer_scenario("ceo"), transfer_targets=TARGETS) as stack:
        caller, call_id = await ask_for_a_person(stack)

        async def answered() -> bool:
            return bool(stack.sim.sessions[0].function_outputs)

        await wait_until(answered, WAIT_S, "the model is answered")
        await caller.wait_for(lambda c: c.heard_ms > GREETING_MS + SENTENCE_MS - 100, WAIT_S)
        tc = await tool_call(engine, call_id)
        await caller.hangup()
        kinds = await kinds_of(stack, caller)
    [(_, output)] = stack.sim.sessions[0].function_outputs
    assert "no transfer target called ceo" in output
    assert tc["decision"] == "deny"
    assert not stack.api.requests_to(f"/Calls/{caller.call_sid}.json")
    assert not stack.api.dials
    assert "transfer_requested" not in kinds


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("front_desk", "is not name=destination"),
        ("Front=+15550100009", "use lowercase letters"),
        ("desk=5550100", "neither an E.164 number"),
        ("desk=+15550100009,desk=+15550100008", "named twice"),
    ],
)
def test_transfer_targets_that_cannot_work_are_refused_at_start(text: str, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        Settings(transfer_targets=text)
    targets = parse_targets(TARGETS)
    assert targets["front_desk"].masked() == "+*******0009"
    assert targets["billing"].is_sip and parse_targets(" ") == {}


async def test_staff_transfer_a_twilio_call_from_the_console_after_the_agents_sentence(
    engine: AsyncEngine,
) -> None:
    from app.access.staff import Role
    from tests.console_support import bearer

    staffed = Scenario.model_validate(
        {
            "name": "staff-transfer",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": GREETING_MS},
            "steps": [],
            "fallback": {"text": SENTENCE, "audio_ms": SENTENCE_MS},
        }
    )
    async with call_stack(engine, staffed, transfer_targets=TARGETS) as stack:
        operator = await bearer(engine, Role.OPERATOR, "olga")
        caller = stack.caller()
        stack.api.attach(caller)
        await caller.dial()
        await hear_greeting(caller)
        call_id = await stack.call_id(caller)
        async with httpx.AsyncClient(base_url=stack.service.url) as http:
            api = f"/api/calls/{call_id}/actions/transfer"
            bad = await http.post(api, json={"target": "ceo", "why": "x"}, headers=operator)
            moved = await http.post(
                api, json={"target": "front_desk", "why": "billing dispute"}, headers=operator
            )
        await wait_until(lambda: bool(stack.api.dials), WAIT_S, "Twilio is told to dial")
        heard_at_dial = caller.heard_ms
        await caller.wait_for(lambda c: c.state is CallerState.ENDED, WAIT_S)
        await wait_until(lambda: _ended(engine, caller), WAIT_S, "the row ends")
        row = await call_row(engine, caller.call_sid)
        events = await stack.events(caller)
    assert bad.status_code == 400 and moved.status_code == 202
    assert stack.api.dials == [(caller.call_sid, DESK, "answered")]
    # The agent told the caller first (a whole sentence after the greeting).
    assert heard_at_dial >= GREETING_MS + SENTENCE_MS - 60, heard_at_dial
    [asked] = [e["data"] for e in events if e["kind"] == "transfer_requested"]
    assert asked["target"] == "front_desk" and asked["reason"].startswith("staff: olga")
    assert row is not None and row["end_reason"] == "transferred to front_desk"


async def test_a_caller_who_hangs_up_while_the_transfer_rings_ends_the_released_row(
    engine: AsyncEngine,
) -> None:
    from app.calls import takeover
    from tests.delivery_support import make_call
    from tests.e2e_support import post_signed

    async with call_stack(engine, transfer_scenario(), transfer_targets=TARGETS) as stack:
        call_id = await make_call(engine)
        assert await takeover.release(engine, call_id, "test-holder", hold_for_s=60)
        sid = "CA" + call_id.replace("-", "")
        query = f"?call_id={call_id}&target=front_desk&fc=call_1"
        ended = await post_signed(
            stack.service, "/twilio/transfer-ended" + query,
            {"CallSid": sid, "CallStatus": "completed", "DialCallStatus": "no-answer"},
        )  # fmt: skip
        status = await post_signed(
            stack.service, "/twilio/status", {"CallSid": sid, "CallStatus": "completed"}
        )
        forged = await post_signed(
            stack.service, "/twilio/transfer-ended" + query.replace(call_id, str(uuid.uuid4())),
            {"CallSid": sid, "CallStatus": "in-progress", "DialCallStatus": "busy"},
        )  # fmt: skip
        await stack.service.runtime.events.flush()
        row = await call_row(engine, sid)
        async with engine.connect() as conn:
            kinds = (
                (
                    await conn.execute(
                        sa.text("SELECT kind FROM call_events WHERE call_id = :c ORDER BY seq"),
                        {"c": call_id},
                    )
                )
                .scalars()
                .all()
            )
    assert ended.status_code == 200 and parse_twiml(ended.text).kind == "hangup"
    assert status.status_code == 204
    assert forged.status_code == 400  # a call id that is not this CallSid's
    # Nobody held the released row: the status callback ended it and wrote its end.
    assert row is not None and row["status"] == "completed"
    assert kinds == ["call_ended"]
