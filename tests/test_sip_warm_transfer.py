"""Warm transfer on our own SIP leg (`transfer_call` with mode warm), judged by two real sipp
processes: the caller's phone (UAC, calling the service) and the person (UAS, standing as
SIP_OUTBOUND_PROXY), with the Realtime simulator and PostgreSQL behind the bridge.

The caller asks for a person; the agent says "stay on the line"; the service INVITEs the person,
whose leg hears the briefing (RTP from the agent's voice on that leg) to its end; then the agent
tells the caller it is connecting them, and only then the caller's side gets a REFER whose
Refer-To is the person's Contact with Replaces naming our dialog with the person (RFC 3891).
Our side ends both dialogs after the 200 sipfrag. A busy person or a declined REFER leave the
caller with the agent, who is told, and the person's leg is hung up.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.caller_evidence import READBACK_TOLERANCE_MS
from telephony.sim.scenario import Scenario
from tests.e2e_support import call_row, wait_until
from tests.rtp_voice import GREETING, Ear, needs_espeak, open_ear
from tests.rtp_voice import speech as voice
from tests.sipp_support import SCENARIOS, count_in_trace, needs_sipp, sip_stack
from tests.sipp_uas import SippUas, sipp_uas
from tests.test_e2e_booking import heard_text
from tests.test_sip_sipp import settled, sip_rows
from tests.test_sip_transfer import kinds, sipp_in_background, stays_with_the_agent
from tests.test_transfer import DESK, TARGETS, tool_call, transfers_ended
from tests.test_transfer_warm import JOIN, JOIN_MS, NOBODY, REASON, STAY, warm_scenario

pytestmark = needs_sipp

WAIT_S = 40.0
FRAME_MS = 20


def received_at(trace: str, method: str) -> list[float]:
    """When sipp received each `method` request (its -trace_msg timestamps)."""
    found = []
    for block in re.split(r"^-{20,} ", trace, flags=re.M)[1:]:
        stamp, _, rest = block.partition("\n")
        kind, _, message = rest.partition("\n")
        if "message received" not in kind or not message.lstrip().startswith(f"{method} "):
            continue
        when = datetime.fromisoformat(" ".join(stamp.split())).replace(tzinfo=UTC)
        found.append(when.timestamp())
    return found


def heard_to_its_end(events: list[dict[str, Any]], text: str) -> float:
    """When the caller had heard the agent's `text` to its end, in wall-clock time: its
    playout's start (monotonic, on the transcript) placed on the event's own clock."""
    [event] = [e for e in events if e["kind"] == "agent_transcript" and e["data"]["text"] == text]
    data = event["data"]
    assert data["heard_ms"] >= data["audio_ms"] - 1, data  # not cut
    started = event["at"].timestamp() - (event["mono_ns"] - data["started_mono_ns"]) / 1e9
    return float(started + data["audio_ms"] / 1000)


async def timeline(engine: AsyncEngine, call_id: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            sa.text("SELECT kind, at, mono_ns, data FROM call_events WHERE call_id = :c"),
            {"c": uuid.UUID(call_id)},
        )
        return [dict(r) for r in rows.mappings()]


def caller_trace(tmp: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in tmp.glob("*_messages.log"))


def joined_then(last: str) -> Scenario:
    """The warm scenario whose agent says JOIN when told the person was briefed, then `last`."""
    scenario = warm_scenario(last).model_dump(mode="json", exclude_none=True)
    scenario["steps"].append({"reply": {"text": JOIN, "audio_ms": JOIN_MS}})
    return Scenario.model_validate(scenario)


def _warm_stack(
    engine: AsyncEngine, person: SippUas, scenario: Scenario, *, sip_amd: bool = False, **extra: Any
) -> Any:
    # Who answers the person's line (answering-machine detection) is judged only where a test
    # gives the person a voice; sipp alone sends none, which would read as nobody.
    return sip_stack(
        engine,
        scenario,
        transfer_targets=TARGETS,
        sip_outbound_proxy=f"127.0.0.1:{person.port}",
        sip_amd=sip_amd,
        **extra,
    )


async def _ear() -> tuple[asyncio.DatagramTransport, Ear, int]:
    return await open_ear()


async def test_a_briefed_person_gets_the_caller_by_refer_with_replaces_after_the_join_sentence(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    transport, rtp, rtp_port = await _ear()
    answered_before = transfers_ended("transferred")
    try:
        async with (
            sipp_uas("warm_person.xml", tmp_path, rtp_port=rtp_port) as person,
            _warm_stack(engine, person, warm_scenario(JOIN), sip_amd=True) as stack,
        ):
            task = await sipp_in_background(stack, "warm_refer_replaced.xml", tmp_path)
            hello = asyncio.create_task(rtp.say(person.seen, voice("Hello?")))
            run = await task
            await hello
            assert run.returncode == 0, run.explain()
            far = await person.finish()
            assert far.returncode == 0, far.explain()
            await settled(stack)
            (row,) = await sip_rows(engine)
            call_id = str(row["id"])
            tc = await tool_call(engine, call_id)
            seen = await kinds(stack, call_id)
            said = await heard_text(engine, call_id)
            events = await timeline(engine, call_id)
            person_sessions = stack.sim.sessions[1:]
    finally:
        transport.close()
    person_seen = person.seen()
    caller_seen = caller_trace(tmp_path)
    # One INVITE to the person (through the proxy, the number at its host), one REFER.
    assert person_seen.count(f"INVITE sip:{DESK}@127.0.0.1;user=phone SIP/2.0") == 1
    assert count_in_trace(tmp_path, "REFER sip:") == 1
    # The Refer-To names our dialog with the person: its Call-ID, their tag, ours.
    [person_call_id] = set(re.findall(r"Call-ID: (\S+)", person_seen))
    [our_tag] = set(re.findall(r"From: <sip:voice-agent@[^>]+>;tag=(\S+)", person_seen))
    [their_tag] = set(re.findall(r"To: <sip:[^>]+>;tag=(\S+)", person_seen))
    [refer_to] = re.findall(r"Refer-To: <([^>]+)>", caller_seen)
    contact, _, replaces = refer_to.partition("?Replaces=")
    assert contact.startswith("sip:far@127.0.0.1:")
    assert unquote(replaces) == f"{person_call_id};to-tag={their_tag};from-tag={our_tag}"
    # The person heard the briefing (RTP with sound) before the REFER; the caller heard the
    # join sentence to its end before it too.
    [refer_at] = received_at(caller_seen, "REFER")
    speech = rtp.speech()
    assert len(speech) > 25, len(rtp.packets)  # > 0.5 s of the briefing's audio
    assert speech[-1] < refer_at
    join_end = heard_to_its_end(events, JOIN)
    # Its end is where its last 20 ms frame ends; that frame goes out 20 ms before, and the
    # bridge counts a sentence heard within one frame of its end (READBACK_TOLERANCE_MS).
    assert join_end - (READBACK_TOLERANCE_MS + FRAME_MS) / 1000 < refer_at
    print(
        f"briefing: {len(speech) * 20} ms of sound to the person, its last packet "
        f"{refer_at - speech[-1]:.2f} s before the REFER; REFER minus the join sentence's "
        f"end {(refer_at - join_end) * 1000:+.0f} ms"
    )
    assert STAY in said and JOIN in said
    # The briefing was said on the person's own model session, with the reason in it.
    [briefing_session] = person_sessions
    instructions = [
        (e.get("response") or {}).get("instructions") or ""
        for e in briefing_session.received_events("response.create")
    ]
    assert any(REASON in text and "Say exactly" in text for text in instructions)
    # Our side ended both dialogs after the 200 sipfrag: BYE to each, once.
    assert count_in_trace(tmp_path, "BYE sip:") == 1
    assert len(received_at(person_seen, "BYE")) == 1
    assert row["status"] == "completed"
    assert row["end_reason"] == "transferred to front_desk (warm)"
    assert tc["decision"] == "transferred" and tc["output"]["outcome"]["status"] == "answered"
    assert tc["output"]["warm"] == {"state": "joined", "person_call_sid": person_call_id}
    order = ["function_call", "transfer_requested", "transfer_briefing", "amd_result",
             "transfer_started", "transfer_answered", "call_ended"]  # fmt: skip
    [amd] = [e["data"] for e in events if e["kind"] == "amd_result"]
    assert amd["answered_by"] == "human" and amd["target"] == "front_desk", amd
    assert [k for k in seen if k in order] == order, seen
    assert "transfer_failed" not in seen
    assert transfers_ended("transferred") == answered_before + 1


async def test_a_busy_person_leaves_the_caller_with_the_agent_who_says_so(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    failed_before = transfers_ended("failed")
    async with (
        sipp_uas("uac_busy.xml", tmp_path) as person,
        _warm_stack(engine, person, warm_scenario(NOBODY)) as stack,
    ):
        task = await sipp_in_background(stack, "warm_caller_stays.xml", tmp_path)
        row, seen, tc = await stays_with_the_agent(stack, task, "busy", "the line was busy")
        far = await person.finish()
        said = await heard_text(engine, str(row["id"]))
        ended = await call_row(engine, str(row["call_sid"]))
    assert far.returncode == 0, far.explain()
    person_seen = person.seen()
    assert person_seen.count(f"INVITE sip:{DESK}@127.0.0.1;user=phone SIP/2.0") == 1
    assert count_in_trace(tmp_path, "REFER sip:") == 0  # sipp also fails on one
    assert tc["output"]["warm"]["state"] == "failed" and tc["output"]["warm"]["status"] == "busy"
    order = ["transfer_requested", "transfer_briefing", "transfer_failed"]
    assert [k for k in seen if k in order] == order, seen
    assert "transfer_answered" not in seen and "transfer_started" not in seen
    assert STAY in said and NOBODY in said  # what the caller heard: told, still with the agent
    assert ended is not None and "bye" in ended["end_reason"], ended["end_reason"]
    assert transfers_ended("failed") == failed_before + 1


@needs_espeak
async def test_a_voicemail_on_the_persons_line_is_never_briefed_and_the_caller_stays_told(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    transport, rtp, rtp_port = await _ear()
    try:
        async with (
            sipp_uas("warm_person.xml", tmp_path, rtp_port=rtp_port) as person,
            _warm_stack(engine, person, warm_scenario(NOBODY), sip_amd=True) as stack,
        ):
            task = await sipp_in_background(stack, "warm_caller_stays.xml", tmp_path)
            greeting = asyncio.create_task(rtp.say(person.seen, voice(GREETING)))
            row, seen, tc = await stays_with_the_agent(
                stack, task, "voicemail", "a voicemail answered, not a person"
            )
            greeting.cancel()
            far = await person.finish()
            said = await heard_text(engine, str(row["id"]))
            events = await timeline(engine, str(row["id"]))
            person_sessions = stack.sim.sessions[1:]
    finally:
        transport.close()
    assert far.returncode == 0, far.explain()  # it got our BYE
    # Hung up as soon as it was known to be a machine: no briefing, no REFER, no session.
    assert rtp.speech() == [] and person_sessions == []
    assert count_in_trace(tmp_path, "REFER sip:") == 0
    [amd] = [e["data"] for e in events if e["kind"] == "amd_result"]
    assert amd["answered_by"] == "machine_start", amd
    assert tc["output"]["warm"]["state"] == "failed"
    assert tc["output"]["warm"]["status"] == "voicemail"
    assert "transfer_answered" not in seen and "transfer_started" not in seen
    assert STAY in said and NOBODY in said


async def test_a_declined_refer_hangs_up_the_person_and_keeps_the_caller_with_the_agent(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    transport, rtp, rtp_port = await _ear()
    try:
        async with (
            sipp_uas("warm_person.xml", tmp_path, rtp_port=rtp_port) as person,
            _warm_stack(engine, person, joined_then(NOBODY)) as stack,
        ):
            task = await sipp_in_background(stack, "warm_refer_declined.xml", tmp_path)
            row, seen, tc = await stays_with_the_agent(
                stack, task, "refused", "the phone system refused the transfer (SIP 603)"
            )
            far = await person.finish()
            said = await heard_text(engine, str(row["id"]))
    finally:
        transport.close()
    assert far.returncode == 0, far.explain()  # it got our BYE
    person_seen = person.seen()
    caller_seen = caller_trace(tmp_path)
    [refer_at] = received_at(caller_seen, "REFER")
    [bye_at] = received_at(person_seen, "BYE")
    assert refer_at < bye_at  # the person was hung up after the REFER failed
    assert rtp.speech() and rtp.speech()[-1] < refer_at
    assert count_in_trace(tmp_path, "REFER sip:") == 1
    assert tc["output"]["warm"]["state"] == "failed"
    assert tc["output"]["warm"]["status"] == "refused"
    assert "transfer_answered" not in seen and "transfer_started" not in seen
    assert JOIN in said and NOBODY in said


async def test_a_person_who_hangs_up_during_the_briefing_is_never_joined_and_the_caller_is_told(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    transport, _, rtp_port = await _ear()
    # The person answers, hears a second of the briefing and hangs up (BYE).
    scenario = tmp_path / "person_hangs_up.xml"
    text = (SCENARIOS / "uac_answer.xml").read_text()
    scenario.write_text(
        text.replace('<pause milliseconds="3000" />', '<pause milliseconds="1000" />')
    )
    try:
        async with (
            sipp_uas(str(scenario), tmp_path, rtp_port=rtp_port) as person,
            _warm_stack(engine, person, warm_scenario(NOBODY)) as stack,
        ):
            task = await sipp_in_background(stack, "warm_caller_stays.xml", tmp_path)
            row, seen, tc = await stays_with_the_agent(
                stack, task, "person-hung-up", "they hung up before the caller could be joined"
            )
            far = await person.finish()
            said = await heard_text(engine, str(row["id"]))
    finally:
        transport.close()
    assert far.returncode == 0, far.explain()  # their BYE got its 200; nothing else came
    assert person.seen().count("INVITE sip:") == 1
    assert count_in_trace(tmp_path, "REFER sip:") == 0
    assert tc["output"]["warm"]["state"] == "failed"
    assert tc["output"]["warm"]["status"] == "person-hung-up"
    assert "transfer_answered" not in seen and "transfer_started" not in seen
    assert STAY in said and NOBODY in said and JOIN not in said  # never "connecting you now"


async def test_a_caller_gone_during_the_briefing_hangs_up_the_person_and_is_never_referred(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    """Staff end the caller's call while the person hears the briefing (the caller's call ends
    as when they hang up): the person's leg gets our BYE, no REFER goes out, and the row says
    the caller left."""
    import httpx

    from app.access.staff import Role
    from tests.console_support import bearer

    transport, rtp, rtp_port = await _ear()
    caller = tmp_path / "caller_ended.xml"
    text = (SCENARIOS / "warm_caller_stays.xml").read_text()
    head = text[: text.index('  <pause milliseconds="20000"/>')]
    caller.write_text(
        head
        + """  <recv request="BYE" timeout="40000"/>
  <send>
    <![CDATA[

      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:]
      [last_Call-ID:]
      [last_CSeq:]
      Content-Length: 0

    ]]>
  </send>
</scenario>
"""
    )
    try:
        async with (
            sipp_uas("warm_person.xml", tmp_path, rtp_port=rtp_port) as person,
            _warm_stack(engine, person, warm_scenario(JOIN)) as stack,
        ):
            operator = await bearer(engine, Role.OPERATOR)
            task = await sipp_in_background(stack, str(caller), tmp_path)
            await wait_until(lambda: len(rtp.speech()) > 5, WAIT_S, "the briefing plays")
            (row,) = await sip_rows(engine)
            call_id = str(row["id"])
            async with httpx.AsyncClient(base_url=stack.service.url) as http:
                ended = await http.post(
                    f"/api/calls/{call_id}/actions/end", json={"why": "test"}, headers=operator
                )
            assert ended.status_code in (200, 202), ended.text
            run = await task
            far = await person.finish()
            await settled(stack)
            tc = await tool_call(engine, call_id)
            seen = await kinds(stack, call_id)
            said = await heard_text(engine, call_id)
    finally:
        transport.close()
    assert run.returncode == 0, run.explain()
    assert far.returncode == 0, far.explain()  # the person got our BYE
    assert count_in_trace(tmp_path, "REFER sip:") == 0
    assert tc["output"]["warm"]["state"] == "failed"
    assert tc["output"]["warm"]["status"] == "caller-gone"
    assert tc["decision"] == "transfer_failed"
    assert "transfer_answered" not in seen and JOIN not in said
