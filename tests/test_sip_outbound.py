"""Outbound calls over our own SIP leg, end to end: POST /api/calls with OUTBOUND_VIA=sip, the
worker's place_call, our INVITE through SIP_OUTBOUND_PROXY (sipp, in UAS mode), the agent on
the answered call (RTP toward the answer's port), and the row, timeline and operation; busy
recorded as on Twilio; and what the reconciler decides for a placing whose answer was lost."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from app.ops.outbound import SipCalls, request_call
from tests.console_support import bearer
from tests.e2e_support import event_kinds, event_rows, make_settings, wait_until
from tests.rtp_voice import GREETING, beep, needs_espeak, open_ear, quiet, speech
from tests.sipp_support import SCENARIOS, needs_sipp
from tests.sipp_uas import sipp_uas
from tests.test_e2e_booking import heard_text
from tests.test_outbound import CALLEE, PURPOSE, call_row, operation, outbound_stack, place
from tools import ledger

pytestmark = needs_sipp
WAIT_S = 20.0


def _sip_stack(engine: AsyncEngine, clean_db: str, proxy_port: int, **extra: Any) -> Any:
    return outbound_stack(
        engine,
        clean_db,
        sip_bind="127.0.0.1:0",
        sip_rtp_ports="0",
        sip_t1_s=0.1,
        outbound_via="sip",
        sip_outbound_proxy=f"127.0.0.1:{proxy_port}",
        outbound_ring_timeout_s=5,
        **extra,
    )


@needs_espeak
async def test_an_answered_sip_call_hears_the_purpose_over_rtp_and_is_recorded(
    engine: AsyncEngine, clean_db: str, tmp_path: Path
) -> None:
    transport, rtp, rtp_port = await open_ear()
    # sipp hangs up once the agent had time to say its first sentence (after the callee's
    # "Hello?" and the detector's 800 ms of silence after it).
    scenario = tmp_path / "uac_answer_long.xml"
    text = (SCENARIOS / "uac_answer.xml").read_text()
    scenario.write_text(
        text.replace('<pause milliseconds="3000" />', '<pause milliseconds="10000" />')
    )
    try:
        async with (
            sipp_uas(str(scenario), tmp_path, rtp_port=rtp_port) as far,
            _sip_stack(engine, clean_db, far.port) as stack,
        ):
            headers = await bearer(engine, Role.OPERATOR)
            answer = await place(stack, {"to": CALLEE, "purpose": PURPOSE}, headers)
            assert answer.status_code == 202, answer.text
            call_id, op_id = answer.json()["call_id"], answer.json()["operation_id"]
            await rtp.say(far.seen, speech("Hello?"))  # a person picks up and waits

            async def first_words() -> bool:
                return bool(await heard_text(engine, call_id)) and len(rtp.packets) > 10

            await wait_until(first_words, WAIT_S, "the agent's first words over RTP")
            run = await far.finish()  # sipp hangs up (BYE) a few seconds after answering

            async def ended() -> bool:
                await stack.service.runtime.events.flush()
                return "call_ended" in await event_kinds(engine, call_id)

            await wait_until(ended, WAIT_S, "the call's end on its timeline")
            row = await call_row(engine, call_id)
            op, _ = await operation(engine, op_id)
            kinds = await event_kinds(engine, call_id)
            said = (await heard_text(engine, call_id))[0]
    finally:
        transport.close()
    assert run.returncode == 0, run.explain()
    seen = far.seen()
    # The INVITE went to the proxy, for the number at the proxy's host, with a loose Route.
    assert f"INVITE sip:{CALLEE}@127.0.0.1;user=phone SIP/2.0" in seen
    assert f"Route: <sip:127.0.0.1:{far.port};lr>" in seen
    [sip_call_id] = set(re.findall(r"Call-ID: (\S+)", seen))
    # The agent said the purpose first; RTP (PCMU) went to the port of sipp's answer.
    assert PURPOSE in said, said
    assert all(p[1] & 0x7F in (0, 101) for _, p in rtp.packets)
    # The row is the SIP call, named by its Call-ID; placing it is a committed operation.
    assert row["leg"] == "sip" and row["direction"] == "outbound"
    assert row["call_sid"] == sip_call_id and row["status"] == "completed"
    assert row["outbound"]["sip_status"] in (180, 200)
    assert op["tool"] == "place_call" and op["status"] == "committed"
    assert op["provider_ref"] == sip_call_id
    order = ["call_started", "outbound_requested", "outbound_answered", "stream_started",
             "call_ended"]  # fmt: skip
    assert [k for k in kinds if k in order] == order, kinds
    # Taken for a person by what they said, and told so on the timeline.
    [amd] = [e["data"] for e in await event_rows(engine, call_id) if e["kind"] == "amd_result"]
    assert amd["answered_by"] == "human" and "then silence" in amd["reason"], amd
    assert "voicemail_left" not in kinds


@needs_espeak
async def test_an_answering_machine_on_sip_gets_the_short_message_after_its_beep_then_we_hang_up(
    engine: AsyncEngine, clean_db: str, tmp_path: Path
) -> None:
    loop = asyncio.get_running_loop()
    transport, rtp, rtp_port = await open_ear()
    try:
        async with (
            sipp_uas("uac_answer_await_bye.xml", tmp_path, rtp_port=rtp_port) as far,
            _sip_stack(engine, clean_db, far.port) as stack,
        ):
            headers = await bearer(engine, Role.OPERATOR)
            answer = await place(stack, {"to": CALLEE, "purpose": PURPOSE}, headers)
            call_id, op_id = answer.json()["call_id"], answer.json()["operation_id"]
            beep_ended = -1.0

            async def greet() -> None:
                nonlocal beep_ended
                await rtp.say(far.seen, speech(GREETING))
                await rtp.say(far.seen, beep(600), first=False)
                beep_ended = loop.time()
                await rtp.say(far.seen, quiet(6000), first=False)

            greeting_task = asyncio.create_task(greet())
            run = await far.finish(40.0)  # sipp waits for our BYE
            greeting_task.cancel()

            async def ended() -> bool:
                await stack.service.runtime.events.flush()
                return "call_ended" in await event_kinds(engine, call_id)

            await wait_until(ended, WAIT_S, "the call's end on its timeline")
            rows = await event_rows(engine, call_id)
            said = await heard_text(engine, call_id)
            _op, op_events = await operation(engine, op_id)
    finally:
        transport.close()
    assert run.returncode == 0, run.explain()  # our BYE came and was answered
    kinds = [e["kind"] for e in rows]
    [amd] = [e["data"] for e in rows if e["kind"] == "amd_result"]
    # The greeting's end was its beep, and the message was said after it, once, in full:
    # the purpose but nothing more than a voicemail may hear.
    assert amd["answered_by"] == "machine_end_beep", amd
    voiced_at = rtp.voiced_at()
    assert voiced_at is not None and beep_ended > 0 and voiced_at > beep_ended
    assert len(said) == 1 and "automated message about" in said[0] and PURPOSE in said[0], said
    order = ["outbound_answered", "amd_result", "voicemail_left", "call_ended"]
    assert [k for k in kinds if k in order] == order, kinds
    assert "a voicemail message was left" in [e["reason"] for e in op_events]
    assert f"BYE sip:far@127.0.0.1:{far.port}" in far.seen()


async def test_a_busy_sip_callee_is_recorded_on_the_row_the_timeline_and_the_operation(
    engine: AsyncEngine, clean_db: str, tmp_path: Path
) -> None:
    async with (
        sipp_uas("uac_busy.xml", tmp_path) as far,
        _sip_stack(engine, clean_db, far.port) as stack,
    ):
        headers = await bearer(engine, Role.OPERATOR)
        answer = await place(stack, {"to": CALLEE, "purpose": PURPOSE}, headers)
        call_id, op_id = answer.json()["call_id"], answer.json()["operation_id"]
        run = await far.finish()

        async def ended() -> bool:
            await stack.service.runtime.events.flush()
            recorded = (await call_row(engine, call_id))["status"] == "busy"
            # The placing operation commits in its own step, after the call's end.
            committed = (await operation(engine, op_id))[0]["status"] == "committed"
            return recorded and committed and "call_ended" in await event_kinds(engine, call_id)

        await wait_until(ended, WAIT_S, "the call recorded busy and its operation committed")
        row = await call_row(engine, call_id)
        kinds = await event_kinds(engine, call_id)
        [started] = [e for e in await event_rows(engine, call_id) if e["kind"] == "call_started"]
        op, op_events = await operation(engine, op_id)
    assert run.returncode == 0, run.explain()  # the 486 was ACKed
    assert started["data"]["leg"] == "sip" and row["leg"] == "sip"
    assert row["end_reason"].startswith("sip 486") and row["answered_at"] is None
    assert op["status"] == "committed"
    assert [k for k in kinds if k.startswith(("outbound", "call_"))] == [
        "call_started", "outbound_requested", "outbound_unanswered", "call_ended"
    ], kinds  # fmt: skip
    assert "the call ended: busy" in [e["reason"] for e in op_events]


async def _no_enqueue(conn: Any, operation_id: uuid.UUID) -> None:
    return None


@pytest.mark.parametrize(("recorded", "state"), [(None, "not_found"), (180, "applied")])
async def test_a_lost_placing_is_placed_only_if_the_far_side_ever_answered_the_invite(
    engine: AsyncEngine, recorded: int | None, state: str
) -> None:
    import sqlalchemy as sa

    from app.calls.store import calls

    settings = make_settings(1, outbound_via="sip")
    placed = await request_call(
        engine, settings, _no_enqueue, to=CALLEE, purpose=PURPOSE, about_operation_id=None, by="t"
    )
    if recorded is not None:
        async with engine.begin() as conn:
            await conn.execute(
                sa.update(calls)
                .where(calls.c.id == uuid.UUID(placed.call_id))
                .values(call_sid="abc@127.0.0.1", outbound={"sip_status": recorded})
            )
    async with engine.connect() as conn:
        op = await ledger.get_operation(conn, uuid.UUID(placed.operation_id))
    assert op is not None
    finding = await SipCalls(engine).lookup(op, None)  # type: ignore[arg-type]
    assert finding.state == state
    row = await call_row(engine, placed.call_id)
    assert row["leg"] == "sip"


def test_sip_uri_and_numbers_are_checked_before_anything_is_placed() -> None:
    from app.ops.outbound import OutboundRefused, check_request

    assert check_request("sip:alice@pbx.example", "x", None)[0] == "sip:alice@pbx.example"
    for bad in ("sip:nohost", "sip:a b@x", "sip:<a>@x"):
        with pytest.raises(OutboundRefused):
            check_request(bad, "x", None)
