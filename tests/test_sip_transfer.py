"""Cold transfer on our own SIP leg (`transfer_call` -> REFER, RFC 3515), judged by the real
sipp playing the caller's phone, with the Realtime simulator and PostgreSQL behind the bridge.

The caller asks for a person; the agent says its sentence; we REFER the caller's side to the
target. Our side ends the call (BYE) only after the NOTIFY whose sipfrag is `SIP/2.0 200`; a
refused REFER, a failed sipfrag (486) or no final NOTIFY within TRANSFER_RING_TIMEOUT_S leave
the caller with the agent, who is told why, and we send no BYE (sipp fails on one it does not
expect).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from tests.e2e_support import Stack, call_row, event_rows, wait_until
from tests.sipp_support import SippRun, count_in_trace, needs_sipp, run_sipp, sip_stack
from tests.test_sip_sipp import settled, sip_rows, speech_pcap
from tests.test_transfer import TARGETS, tool_call, transfer_scenario

pytestmark = needs_sipp

WAIT_S = 30.0


async def sipp_in_background(
    stack: Stack, scenario: str, tmp: Path, **keys: str
) -> asyncio.Task[SippRun]:
    speech_pcap(tmp)
    extra = ["-trace_msg"]
    for name, value in keys.items():
        extra += ["-key", name, value]
    sip = stack.service.runtime.sip
    assert sip is not None
    return asyncio.create_task(run_sipp(sip.port, scenario, tmp, extra=extra, timeout_s=75))


async def live_row(engine: AsyncEngine, task: asyncio.Task[SippRun]) -> dict[str, Any]:
    async def one_row() -> bool:
        if task.done():  # sipp gave up before the call began
            raise AssertionError(task.result().explain())
        return len(await sip_rows(engine)) == 1

    await wait_until(one_row, WAIT_S, "the SIP call's row")
    (row,) = await sip_rows(engine)
    return row


async def kinds(stack: Stack, call_id: str) -> list[str]:
    await stack.service.runtime.events.flush()
    return [e["kind"] for e in await event_rows(stack.engine, call_id)]


def told(stack: Stack, needle: str) -> bool:
    """Whether the model got a note (or output) holding `needle`."""
    session = stack.sim.sessions[0]
    return any(needle in json.dumps(e) for e in session.received_events("conversation.item.create"))


async def stays_with_the_agent(
    stack: Stack, task: asyncio.Task[SippRun], status: str, said: str
) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """While the caller is still on: the failure is on the timeline and the row, the model was
    told, a response followed; the row is in progress. Then the caller hangs up."""
    engine = stack.engine
    row = await live_row(engine, task)
    call_id = str(row["id"])

    async def failed() -> bool:
        if task.done() and task.result().returncode != 0:
            raise AssertionError(task.result().explain())
        return "transfer_failed" in await kinds(stack, call_id)

    await wait_until(failed, WAIT_S, "transfer_failed on the timeline")

    def model_told() -> bool:
        if told(stack, said):
            return True
        if task.done():  # the caller's sipp hung up (its pause is the time it stays on)
            items = stack.sim.sessions[0].received_events("conversation.item.create")
            raise AssertionError(f"the caller left before the model was told {said!r}: {items}")
        return False

    await wait_until(model_told, WAIT_S, "the model is told")
    session = stack.sim.sessions[0]
    await wait_until(
        lambda: len(session.sent_events("response.created")) >= 3, WAIT_S, "the agent speaks"
    )
    during = await call_row(engine, str(row["call_sid"]))
    assert during is not None and during["status"] == "in_progress"  # the caller stays
    run = await task
    assert run.returncode == 0, run.explain()
    await settled(stack)
    tc = await tool_call(engine, call_id)
    assert tc["decision"] == "transfer_failed", tc
    assert tc["output"]["outcome"]["status"] == status, tc["output"]
    return row, await kinds(stack, call_id), tc


async def test_a_refer_taken_and_answered_ends_our_side_with_bye_after_the_200_sipfrag(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine, transfer_scenario(), transfer_targets=TARGETS) as stack:
        task = await sipp_in_background(stack, "refer_transferred.xml", tmp_path)
        run = await task
        assert run.returncode == 0, run.explain()
        await settled(stack)
        (row,) = await sip_rows(engine)
        call_id = str(row["id"])
        tc = await tool_call(engine, call_id)
        seen = await kinds(stack, call_id)
        said = stack.sim.sessions[0].function_outputs
    assert row["status"] == "completed" and row["end_reason"] == "transferred to front_desk"
    assert tc["decision"] == "transferred" and tc["output"]["outcome"]["status"] == "answered"
    order = ["function_call", "transfer_requested", "transfer_started", "transfer_answered",
             "call_ended"]  # fmt: skip
    assert [k for k in seen if k in order] == order, seen
    assert "transfer_failed" not in seen
    # The model heard "putting you through", never "transferred", before the outcome.
    [(_, output)] = said
    assert "putting them through" in output
    assert count_in_trace(tmp_path, "REFER sip:") >= 1
    assert count_in_trace(tmp_path, "BYE sip:") == 1  # ours, once: after the 200 sipfrag


async def test_a_refused_refer_leaves_the_caller_with_the_agent_who_is_told(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine, transfer_scenario(), transfer_targets=TARGETS) as stack:
        task = await sipp_in_background(stack, "refer_refused.xml", tmp_path)
        row, seen, _ = await stays_with_the_agent(
            stack, task, "refused", "the phone system refused the transfer (SIP 403)"
        )
        ended = await call_row(engine, str(row["call_sid"]))
    assert "transfer_started" not in seen and "transfer_answered" not in seen
    assert ended is not None and ended["status"] == "completed"
    assert "bye" in ended["end_reason"] and "transferred" not in ended["end_reason"]


async def test_a_busy_target_leaves_the_caller_with_the_agent_who_says_the_line_was_busy(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(engine, transfer_scenario(), transfer_targets=TARGETS) as stack:
        task = await sipp_in_background(
            stack, "refer_failed.xml", tmp_path, final_status="486 Busy Here"
        )
        row, seen, _ = await stays_with_the_agent(stack, task, "busy", "the line was busy")
        ended = await call_row(engine, str(row["call_sid"]))
    order = ["transfer_requested", "transfer_started", "transfer_failed"]
    assert [k for k in seen if k in order] == order, seen
    assert "transfer_answered" not in seen
    assert ended is not None and "bye" in ended["end_reason"], ended["end_reason"]


async def test_no_final_notify_within_the_ring_timeout_keeps_the_caller_with_the_agent(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with sip_stack(
        engine, transfer_scenario(), transfer_targets=TARGETS, transfer_ring_timeout_s=5
    ) as stack:
        task = await sipp_in_background(stack, "refer_silent.xml", tmp_path, silence_ms="9000")
        row, seen, _ = await stays_with_the_agent(stack, task, "no-answer", "no answer within 5 s")
        ended = await call_row(engine, str(row["call_sid"]))
    order = ["transfer_requested", "transfer_started", "transfer_failed"]
    assert [k for k in seen if k in order] == order, seen
    # The NOTIFY 200 that came after the timeout got 481 (sipp checked it) and changed nothing.
    assert ended is not None and "bye" in ended["end_reason"], ended["end_reason"]


async def test_staff_transfer_a_call_on_our_sip_leg_from_the_console_api(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    """Staff put a SIP call through to a target: the same REFER as the tool's, after the agent's
    sentence; our side ends only after the 200 sipfrag; who asked is on the timeline."""
    import httpx

    from app.access.staff import Role
    from telephony.sim.scenario import Scenario
    from tests.console_support import bearer
    from tests.test_transfer import SENTENCE, SENTENCE_MS

    staffed = Scenario.model_validate(
        {
            "name": "sip-staff-transfer",
            "greeting": {"text": "Hello, how can I help?", "audio_ms": 800},
            "steps": [],
            "fallback": {"text": SENTENCE, "audio_ms": SENTENCE_MS},
        }
    )
    async with sip_stack(engine, staffed, transfer_targets=TARGETS) as stack:
        operator = await bearer(engine, Role.OPERATOR, "olga")
        task = await sipp_in_background(stack, "refer_transferred.xml", tmp_path)
        row = await live_row(engine, task)
        call_id = str(row["id"])
        session = await stack.sim.wait_for_session(0, within=WAIT_S)
        await session.wait_for_sent("response.done", within=WAIT_S)  # the greeting is out
        async with httpx.AsyncClient(base_url=stack.service.url) as http:
            moved = await http.post(
                f"/api/calls/{call_id}/actions/transfer",
                json={"target": "front_desk", "why": "asked for the desk"},
                headers=operator,
            )
        run = await task
        assert run.returncode == 0, run.explain()
        await settled(stack)
        events = await event_rows(engine, call_id)
        ended = await call_row(engine, str(row["call_sid"]))
    assert moved.status_code == 202, moved.text
    assert ended is not None and ended["end_reason"] == "transferred to front_desk"
    [asked] = [e["data"] for e in events if e["kind"] == "transfer_requested"]
    assert asked["target"] == "front_desk" and asked["reason"].startswith("staff: olga")
    seen = [e["kind"] for e in events]
    order = ["transfer_requested", "transfer_started", "transfer_answered", "call_ended"]
    assert [k for k in seen if k in order] == order, seen
    assert count_in_trace(tmp_path, "REFER sip:") >= 1
    assert count_in_trace(tmp_path, "BYE sip:") == 1
