"""Live updates: server-sent events say `changed` when what a page shows changed, whichever
process changed it (Postgres notifications), and end when the server shuts down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from telephony.call_events import CallEvent, CallEventKind
from tests.console_support import bearer, seed_call, seed_operation
from tests.e2e_support import running_service, wait_until
from tools import ledger
from tools.states import OperationStatus

S = OperationStatus


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """(event, data) of each server-sent event; comments are skipped."""
    event, data = "message", ""
    async for line in response.aiter_lines():
        if line.startswith(":"):
            continue
        if line == "":
            if data or event != "message":
                yield event, data
            event, data = "message", ""
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()


async def next_event(events: AsyncIterator[tuple[str, str]], name: str) -> str:
    async with asyncio.timeout(15):
        async for event, data in events:
            if event == name:
                return data
    raise AssertionError(f"stream ended before {name!r}")


async def test_an_operations_stream_says_changed_when_someone_else_acts_on_it(
    engine: AsyncEngine,
) -> None:
    op_id = await seed_operation(engine, None, S.UNKNOWN, tool="no_such_tool")
    async with running_service(engine) as svc:
        viewer = await bearer(engine, Role.VIEWER)
        operator = await bearer(engine, Role.OPERATOR)
        async with httpx.AsyncClient(base_url=svc.url, timeout=30) as http:
            async with http.stream(
                "GET", f"/api/operations/{op_id}/stream", headers=viewer
            ) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                events = sse_events(stream)
                ready = await next_event(events, "ready")
                acted = await http.post(
                    f"/api/operations/{op_id}/actions/record-outcome",
                    headers=operator,
                    json={"why": "checked", "outcome": "failed_final"},
                )
                changed = await next_event(events, "changed")
    assert acted.status_code == 200
    assert ready != changed and "failed_final" in changed


async def test_a_calls_stream_follows_events_written_by_any_process(engine: AsyncEngine) -> None:
    call_id = await seed_call(engine, status="in_progress")
    async with running_service(engine) as svc:
        headers = await bearer(engine, Role.VIEWER)
        async with httpx.AsyncClient(base_url=svc.url, timeout=30) as http:
            async with http.stream("GET", f"/api/calls/{call_id}/stream", headers=headers) as s:
                events = sse_events(s)
                await next_event(events, "ready")
                # Another replica's writer (here: this process's) writes an event of the call.
                svc.runtime.events.emit(
                    CallEvent(call_id, CallEventKind.CALLER_TRANSCRIPT, {"text": "hello"})
                )
                first = await next_event(events, "changed")
                # A note on one of its operations, added straight in the ledger (as a worker
                # elsewhere would), counts too.
                op_id = await seed_operation(engine, call_id, S.RUNNING)
                second = await next_event(events, "changed")
                async with engine.begin() as conn:
                    await ledger.record_event(
                        conn, op_id, kind="note", actor="worker:x", reason="still going"
                    )
                third = await next_event(events, "changed")
    assert len({first, second, third}) == 3


async def test_open_streams_end_when_the_server_shuts_down_and_watchers_are_released(
    engine: AsyncEngine,
) -> None:
    call_id = await seed_call(engine)
    async with running_service(engine) as svc:
        headers = await bearer(engine, Role.VIEWER)
        hub = svc.runtime.console.live
        http = httpx.AsyncClient(base_url=svc.url, timeout=30)
        request = http.build_request("GET", f"/api/calls/{call_id}/stream", headers=headers)
        response = await http.send(request, stream=True)
        events = sse_events(response)
        await next_event(events, "ready")
        await wait_until(lambda: hub.watcher_count() == 1, 5, "the stream watching")
        svc.server.should_exit = True  # shutdown starts while the stream is open

        async def drain() -> None:
            async for _ in events:
                pass

        async with asyncio.timeout(10):
            await drain()  # the server ends the stream instead of waiting it out
        await response.aclose()
        await http.aclose()
        released = hub.watcher_count()
    assert released == 0
