"""Warm transfer on a Twilio call (`transfer_call` with mode warm), end to end over real
sockets: the fake Twilio caller and REST API (Calls.create with TwiML, `<Redirect>`, conferences,
signed status callbacks), the service, the Realtime simulator and PostgreSQL.

The caller stays with the agent while the person is rung and hears a briefing (who calls, what
they want, what is still open); only once the briefing was heard to its end does the agent say
one sentence, and then the caller's call joins the person's conference. Nobody answering leaves
the caller with the agent, who is told and offers a callback or a text; a repeated webhook
joins once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import CallerState, FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeCall
from telephony.sim.scenario import Scenario
from tests.console_support import seed_operation
from tests.e2e_support import Stack, call_row, call_stack, post_signed, wait_until
from tests.test_e2e_booking import heard_text
from tests.test_e2e_call import GREETING_MS, hear_greeting
from tests.test_gateway import Harness, ctx, jobs_table  # noqa: F401 (a fixture)
from tests.test_transfer import DESK, TARGETS, kinds_of, tool_call
from tools.states import OperationStatus
from tools.transfers import parse_targets

STAY = "I'm calling the front desk for you now, please stay on the line."
STAY_MS = 1500
JOIN = "They're here, connecting you now."
JOIN_MS = 900
NOBODY = "Sorry, nobody answered. Shall we call you back later?"
REASON = "billing dispute about a double charge"
WAIT_S = 30.0


def warm_scenario(last: str) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "warm-transfer",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": GREETING_MS},
            "steps": [
                {
                    "caller_transcript": "Can I talk to a person please?",
                    "function_call": {
                        "name": "transfer_call",
                        "arguments": {"target": "front_desk", "reason": REASON, "mode": "warm"},
                    },
                },
                {"reply": {"text": STAY, "audio_ms": STAY_MS}},
            ],
            "fallback": {"text": last, "audio_ms": JOIN_MS},
        }
    )


async def ask_for_a_person(stack: Stack, *, open_operation: bool = False) -> tuple[Any, str]:
    caller = stack.caller()
    await caller.dial()
    await hear_greeting(caller)
    call_id = await stack.call_id(caller)
    if open_operation:
        await seed_operation(
            stack.engine, call_id, OperationStatus.AWAITING_CONFIRMATION, caller=caller.from_number
        )
    await caller.say("Can I talk to a person please?", ms=700)
    return caller, call_id


async def the_person(stack: Stack) -> FakeCall:
    await wait_until(lambda: bool(stack.api.created_calls(DESK)), WAIT_S, "the person is called")
    [person] = stack.api.created_calls(DESK)
    return person


def notes_to_model(stack: Stack) -> list[str]:
    texts = []
    for event in stack.sim.sessions[0].received_events("conversation.item.create"):
        item = event.get("item") or {}
        if item.get("role") == "system":
            texts += [c.get("text", "") for c in item.get("content", [])]
    return texts


async def _ended(engine: AsyncEngine, caller: FakeTwilioCaller) -> bool:
    row = await call_row(engine, caller.call_sid)
    return row is not None and row["status"] != "in_progress"


async def test_a_warm_transfer_briefs_the_person_then_joins_the_caller_to_their_conference(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, warm_scenario(JOIN), transfer_targets=TARGETS) as stack:
        caller, call_id = await ask_for_a_person(stack, open_operation=True)
        person = await the_person(stack)
        await caller.wait_for(lambda c: c.state is CallerState.IN_CONFERENCE, WAIT_S)
        heard_at_join = caller.heard_ms
        await wait_until(lambda: _ended(engine, caller), WAIT_S, "our part ends at the join")
        row = await call_row(engine, caller.call_sid)
        said = await heard_text(engine, call_id)
        tc = await tool_call(engine, call_id)
        kinds = await kinds_of(stack, caller)
        output = stack.sim.sessions[0].function_outputs[0][1]
        room = stack.api.conferences[f"warm-{call_id}"]
        updates = stack.api.requests_to(f"/Calls/{caller.call_sid}.json")
        await stack.api.hang_up(person.sid)  # the person hangs up: the conference ends
        await caller.wait_for(lambda c: c.state is CallerState.ENDED, WAIT_S)
    # The model was told to keep the caller company, never that they were connected.
    assert '"status":"calling_person"' in output and "Never say they are connected" in output
    # The person was called within the ring timeout, reporting to us, with Twilio's
    # answering-machine detection answered before the briefing.
    assert (
        person.params["Timeout"] == "30"
        and "/twilio/warm-status?" in person.params["StatusCallback"]
        and person.params["MachineDetection"] == "Enable"
    )
    [briefing] = person.said
    assert REASON in briefing
    assert "Still open: a table for 2" in briefing and "waiting for the caller's yes" in briefing
    assert "ends 0 0 0 0" in briefing  # the caller's number, masked: its last digits only
    assert caller.from_number not in briefing and "123" not in briefing
    # Both in one room; the caller entered after the person had heard the briefing.
    assert room.call_sids == [person.sid, caller.call_sid]
    assert all(attrs["endConferenceOnExit"] == "true" for _, attrs in room.participants)
    assert len(updates) == 1  # one join
    # The caller heard "stay on the line", then the join sentence to its end, then was joined.
    assert STAY in said and JOIN in said
    assert heard_at_join >= GREETING_MS + STAY_MS + JOIN_MS - 100, heard_at_join
    assert row is not None and row["status"] == "completed"
    assert row["end_reason"] == "transferred to front_desk (warm)"
    assert tc["decision"] == "transferred" and tc["output"]["outcome"]["status"] == "answered"
    assert tc["output"]["warm"]["person_call_sid"] == person.sid
    assert tc["output"]["warm"]["state"] == "joined"
    order = ["function_call", "transfer_requested", "transfer_briefing", "transfer_answered",
             "call_ended"]  # fmt: skip
    assert [k for k in kinds if k in order] == order, kinds
    assert caller.closed_by == "twilio-api"  # the conference ended with the person's hang-up


@pytest.mark.parametrize(
    ("answer", "person_status", "status", "said"),
    [
        ("no-answer", "no-answer", "no-answer", "nobody answered"),
        # A voicemail picks up: it hears nothing of the caller's business and is hung up on.
        ("machine_start", "completed", "voicemail", "a voicemail answered, not a person"),
    ],
)
async def test_no_answer_or_a_voicemail_leaves_the_caller_with_the_agent_who_offers_a_callback(
    engine: AsyncEngine, answer: str, person_status: str, status: str, said: str
) -> None:
    async with call_stack(engine, warm_scenario(NOBODY), transfer_targets=TARGETS) as stack:
        stack.api.call_outcomes[DESK] = answer
        caller, call_id = await ask_for_a_person(stack)
        person = await the_person(stack)

        async def told() -> bool:
            return NOBODY in await heard_text(engine, call_id)

        await wait_until(told, WAIT_S, "the caller hears nobody answered")
        row = await call_row(engine, caller.call_sid)
        tc = await tool_call(engine, call_id)
        notes = notes_to_model(stack)
        state = caller.state
        await caller.hangup()
        kinds = await kinds_of(stack, caller)
    assert person.status == person_status and person.said == []  # never briefed
    assert state is CallerState.STREAMING  # still with the agent
    assert row is not None and row["status"] == "in_progress"
    assert not stack.api.conferences
    assert not stack.api.requests_to(f"/Calls/{caller.call_sid}.json")
    [note] = [n for n in notes if "did not go through" in n]
    assert said in note and "arrange a call back (schedule_callback)" in note
    assert tc["decision"] == "transfer_failed" and tc["output"]["outcome"]["status"] == status
    warm = tc["output"]["warm"]
    assert (warm["state"], warm["status"], warm["person_call_sid"]) == (
        "failed", status, person.sid
    )  # fmt: skip
    order = ["transfer_requested", "transfer_briefing", "transfer_failed", "call_ended"]
    assert [k for k in kinds if k in order] == order, kinds
    assert "transfer_answered" not in kinds


async def test_repeated_briefing_and_status_webhooks_join_the_caller_once(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, warm_scenario(JOIN), transfer_targets=TARGETS) as stack:
        stack.api.say_s = 1.0  # time to repeat the briefing's webhook before Twilio asks
        stack.api.duplicate_callbacks = 2
        caller, call_id = await ask_for_a_person(stack)
        person = await the_person(stack)
        await wait_until(lambda: bool(person.said), WAIT_S, "the briefing plays")
        redirect = person.params["Twiml"].split('<Redirect method="POST">')[1]
        path = redirect.split("</Redirect>")[0].replace("&amp;", "&")
        path = path.removeprefix(stack.service.settings.public_base_url)
        # The created call asks warm-answered first; the briefing's redirect, the same query.
        assert path.startswith("/twilio/warm-answered?")
        path = path.replace("/twilio/warm-answered?", "/twilio/warm-briefed?")
        form = {
            "CallSid": person.sid,
            "AccountSid": person.account_sid,
            "CallStatus": "in-progress",
        }
        answers = await asyncio.gather(*(post_signed(stack.service, path, form) for _ in range(3)))
        forged = await post_signed(stack.service, path.replace("k=", "k=0"), form)
        await caller.wait_for(lambda c: c.state is CallerState.IN_CONFERENCE, WAIT_S)
        await wait_until(lambda: person.conference is not None, WAIT_S, "the person enters")
        await wait_until(lambda: _ended(engine, caller), WAIT_S, "our part ends at the join")
        await stack.api.hang_up(person.sid)  # its final status comes three times
        await caller.wait_for(lambda c: c.state is CallerState.ENDED, WAIT_S)
        await wait_until(
            lambda: sum(cb.params.get("CallStatus") == "completed" and cb.params["CallSid"]
                        == person.sid for cb in stack.api.callbacks) == 3,
            WAIT_S, "the repeated final status",
        )  # fmt: skip
        tc = await tool_call(engine, call_id)
        kinds = await kinds_of(stack, caller)
    assert all(a.status_code == 200 and "<Conference" in a.text for a in answers)
    assert forged.status_code == 400
    assert len(stack.api.requests_to(f"/Calls/{caller.call_sid}.json")) == 1
    assert sorted(stack.api.conferences[f"warm-{call_id}"].call_sids) == sorted(
        [caller.call_sid, person.sid]
    )
    assert kinds.count("transfer_answered") == 1
    assert tc["decision"] == "transferred" and tc["output"]["warm"]["state"] == "joined"


@pytest.mark.usefixtures("jobs_table")
async def test_warm_is_refused_where_the_leg_cannot_brief_and_admitted_with_a_briefing_where_it_can(
    engine: AsyncEngine,
) -> None:
    h = Harness(engine)
    h.pipe.transfers = parse_targets(TARGETS)
    args = {"target": "front_desk", "reason": REASON, "mode": "warm"}
    sip = ctx("warm-sip-" + uuid.uuid4().hex[:8], phone="+15550009876")
    refused = await h.call(sip, "transfer_call", args)
    twilio = dataclasses.replace(sip, call_id="warm-tw-" + uuid.uuid4().hex[:8], warm_transfer=True)
    admitted = await h.call(twilio, "transfer_call", args)
    # Our own SIP leg and the interconnect: the existing speakable refusal, nothing sent.
    assert refused.transfer is None and "not available on this line" in str(refused.output)
    assert admitted.transfer is not None and admitted.transfer.mode == "warm"
    briefing = admitted.transfer.briefing
    assert REASON in briefing and "ends 9 8 7 6" in briefing and "+1555" not in briefing
    assert "Nothing was booked or changed on this call." in briefing
