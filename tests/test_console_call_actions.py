"""The call page's live actions: an operator ends or transfers a live call from the console's
forms (login session, CSRF token), over real sockets: the fake Twilio caller and REST API, the
service, the Realtime simulator and PostgreSQL. A viewer sees no forms and is refused; a target
nobody configured is refused before anything reaches Twilio; a call that is over offers no
actions and refuses them."""

from __future__ import annotations

import html
import re

from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from telephony.sim.fake_caller import CallerState, FakeTwilioCaller
from telephony.sim.scenario import Scenario
from tests.console_support import add_staff, logged_in
from tests.e2e_support import Stack, call_row, call_stack, wait_until
from tests.test_e2e_call import GREETING_MS, hear_greeting

DESK = "+15550100009"
TARGETS = f"front_desk={DESK},billing=sip:billing@pbx.example"
WAIT_S = 30.0
STAFFED = Scenario.model_validate(
    {
        "name": "console-call-actions",
        "greeting": {"text": "Hello, how can I help?", "audio_ms": GREETING_MS},
        "steps": [],
        "fallback": {"text": "Putting you through now.", "audio_ms": 1200},
    }
)


async def _greeted(stack: Stack) -> tuple[FakeTwilioCaller, str]:
    """A live call that heard its greeting, and its console page."""
    caller = stack.caller()
    stack.api.attach(caller)
    await caller.dial()
    await hear_greeting(caller)
    return caller, f"/console/calls/{await stack.call_id(caller)}"


def flash(response_text: str) -> str:
    found = re.search(r'class="flash[^"]*"[^>]*>([^<]+)<', response_text)
    return html.unescape(found.group(1).strip()) if found else ""


async def test_an_operator_transfers_a_live_call_from_its_page_and_a_viewer_cannot(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "otto", Role.OPERATOR)
    await add_staff(engine, "vera", Role.VIEWER)
    async with call_stack(engine, STAFFED, transfer_targets=TARGETS) as stack:
        caller, page_url = await _greeted(stack)
        async with logged_in(stack.service.url, "vera") as (viewer, token):
            seen_by_viewer = await viewer.get(page_url)
            refused = await viewer.post(
                f"{page_url}/actions/end", data={"why": "x", "csrf_token": token}
            )
        async with logged_in(stack.service.url, "otto") as (operator, token):
            page = await operator.get(page_url)
            unknown = await operator.post(
                f"{page_url}/actions/transfer",
                data={"target": "ceo", "why": "wants the boss", "csrf_token": token},
            )
            unknown_flash = flash((await operator.get(unknown.headers["location"])).text)
            no_csrf = await operator.post(
                f"{page_url}/actions/transfer", data={"target": "front_desk", "why": "x"}
            )
            moved = await operator.post(
                f"{page_url}/actions/transfer",
                data={"target": "front_desk", "why": "billing dispute", "csrf_token": token},
            )
            moved_flash = flash((await operator.get(moved.headers["location"])).text)
            await wait_until(lambda: bool(stack.api.dials), WAIT_S, "Twilio is told to dial")
            await caller.wait_for(lambda c: c.state is CallerState.ENDED, WAIT_S)
            await wait_until(lambda: _ended(engine, caller.call_sid), WAIT_S, "the row ends")
            after = await operator.get(page_url)
            late = await operator.post(
                f"{page_url}/actions/end", data={"why": "too late", "csrf_token": token}
            )
            late_flash = flash((await operator.get(late.headers["location"])).text)
        events = await stack.events(caller)
    # A viewer sees the call but no forms, and cannot act.
    assert seen_by_viewer.status_code == 200 and 'id="viewer-note"' in seen_by_viewer.text
    assert 'action="/console/calls/' not in seen_by_viewer.text
    assert refused.status_code == 403
    # The operator sees both forms and the configured targets to choose from.
    assert f'action="{page_url}/actions/transfer"' in page.text
    assert f'action="{page_url}/actions/end"' in page.text
    assert '<option value="front_desk">' in page.text and '<option value="billing">' in page.text
    # An unknown target is refused with the reason and nothing reaches Twilio for it; a form
    # without the session's CSRF token is refused outright.
    assert unknown.status_code == 303 and unknown_flash.startswith("Refused:"), unknown_flash
    assert "front_desk" in unknown_flash
    assert no_csrf.status_code == 403
    assert moved.status_code == 303 and "transfer it to front_desk" in moved_flash
    assert stack.api.dials == [(caller.call_sid, DESK, "answered")]
    [asked] = [e["data"] for e in events if e["kind"] == "transfer_requested"]
    assert asked["target"] == "front_desk" and "otto: billing dispute" in asked["reason"]
    row = await call_row(engine, caller.call_sid)
    assert row is not None and row["end_reason"] == "transferred to front_desk"
    # Over: no live actions on the page, and one asked for anyway is refused.
    assert 'id="call-actions"' not in after.text
    assert late_flash.startswith("Refused: the call is not live"), late_flash


async def test_an_operator_ends_a_live_call_from_its_page(engine: AsyncEngine) -> None:
    await add_staff(engine, "otto", Role.OPERATOR)
    async with call_stack(engine, STAFFED) as stack:
        caller, page_url = await _greeted(stack)
        async with logged_in(stack.service.url, "otto") as (operator, token):
            page = await operator.get(page_url)
            blank = await operator.post(
                f"{page_url}/actions/end", data={"why": " ", "csrf_token": token}
            )
            blank_flash = flash((await operator.get(blank.headers["location"])).text)
            ended = await operator.post(
                f"{page_url}/actions/end", data={"why": "abusive caller", "csrf_token": token}
            )
            await caller.wait_for(lambda c: c.state is CallerState.ENDED, WAIT_S)
            await wait_until(lambda: _ended(engine, caller.call_sid), WAIT_S, "the row ends")
        row = await call_row(engine, caller.call_sid)
    # No transfer targets configured: the transfer form still takes a number or URI.
    assert '<datalist id="transfer-targets"></datalist>' in page.text
    assert blank_flash == "Refused: say why (it is recorded on the call's timeline)"
    assert ended.status_code == 303
    assert row is not None and row["end_reason"] == "ended by staff (otto): abusive caller"


async def _ended(engine: AsyncEngine, call_sid: str) -> bool:
    row = await call_row(engine, call_sid)
    return row is not None and row["ended_at"] is not None


async def test_an_operator_places_a_call_from_the_calls_page_once_however_often_sent(
    engine: AsyncEngine, clean_db: str
) -> None:
    from tests.test_outbound import CALLEE, PURPOSE, outbound_stack

    await add_staff(engine, "otto", Role.OPERATOR)
    await add_staff(engine, "vera", Role.VIEWER)
    async with outbound_stack(engine, clean_db) as stack:
        async with logged_in(stack.service.url, "vera") as (viewer, token):
            seen = await viewer.get("/console/calls")
            refused = await viewer.post(
                "/console/calls/new", data={"to": CALLEE, "purpose": PURPOSE, "csrf_token": token}
            )
        async with logged_in(stack.service.url, "otto") as (operator, token):
            page = await operator.get("/console/calls")
            key = re.search(r'name="idempotency_key" value="([^"]+)"', page.text)
            assert key is not None
            form = {"to": CALLEE, "purpose": PURPOSE, "csrf_token": token,
                    "idempotency_key": key.group(1)}  # fmt: skip
            first = await operator.post("/console/calls/new", data=form)
            call_page = await operator.get(first.headers["location"])
            again = await operator.post("/console/calls/new", data=form)  # sent twice
            bad = await operator.post(
                "/console/calls/new", data={**form, "to": "12", "idempotency_key": "other"}
            )
            bad_flash = flash((await operator.get(bad.headers["location"])).text)
            await wait_until(lambda: bool(stack.api.created_calls(CALLEE)), WAIT_S, "placed")
            placed = stack.api.created_calls(CALLEE)
            await wait_until(
                lambda: placed[0].sid in stack.api.outbound_callers, WAIT_S, "the callee answers"
            )
            callee = stack.api.outbound_callers[placed[0].sid]
            await callee.hangup()
            await stack.events(callee)
    assert 'id="place-call"' not in seen.text and refused.status_code == 403
    assert 'id="place-call"' in page.text
    assert first.status_code == again.status_code == 303
    assert first.headers["location"] == again.headers["location"]
    assert first.headers["location"].startswith("/console/calls/")
    assert "Placing the call" in flash(call_page.text)
    assert bad_flash.startswith("Refused:") and "to" in bad_flash
    assert len(placed) == 1  # one call however often the form was sent
