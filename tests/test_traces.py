"""One booking call's trace, as an OpenTelemetry collector receives it: `voice-agent serve`
(calls only) and `voice-agent worker` as separate processes export OTLP/HTTP to a receiver in
this test; the call, its tool calls and the operation the worker ran are one trace, the tool
span carries the GenAI conventions and the design's fields, and the request the worker made to
the system of record carried that trace's W3C `traceparent`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from app.settings import Settings
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.simulator import RealtimeSimulator
from tests.console_support import add_staff, logged_in
from tests.domains import RESTAURANT
from tests.e2e_support import CONSOLE, call_stack, wait_until
from tests.server_proc import ROOT, ServerProcess
from tests.sor_support import start_sor
from tests.test_delivery_crash import book_and_confirm, call_id_of, server_env
from tests.test_e2e_booking import (
    ask_to_book_and_confirm,
    booking_scenario,
    wait_for_delivery,
    wait_for_operation,
)

WAIT_S = 45.0


@dataclass(frozen=True)
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict[str, Any]
    events: list[str]


class Collector:
    """An OTLP/HTTP trace receiver (protobuf), as an OpenTelemetry collector is to us."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Collector:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.read())
        for resource_spans in export.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes
                 if a.key == "service.name"),
                "",
            )  # fmt: skip
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    self.spans.append(
                        Span(
                            service,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.name,
                            {a.key: _value(a.value) for a in s.attributes},
                            [e.name for e in s.events],
                        )
                    )
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    found = await Collector().start()
    try:
        yield found
    finally:
        await found.stop()


def otel_env(collector: Collector, service: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within a moment, not every 5 s
    }


async def test_one_booking_is_one_trace_across_serve_and_worker_down_to_the_provider(
    engine: AsyncEngine, clean_db: str, collector: Collector
) -> None:
    async with (
        RealtimeSimulator(booking_scenario(RESTAURANT, requested_ms=800)) as sim,
        FakeTwilioApi(sms_step_delay_s=0.01) as api,
    ):
        sor = await start_sor(clean_db)
        env = server_env(clean_db, sim, api, sor.url)
        server = ServerProcess({**env, **otel_env(collector, "va-serve")}, args=("--no-worker",))
        worker: asyncio.subprocess.Process | None = None
        try:
            await server.start()
            worker = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.cli", "worker",
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), **env,
                     **otel_env(collector, "va-worker")},
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            caller = FakeTwilioCaller(server.url)
            api.attach(caller)
            await book_and_confirm(caller)
            call_id = await call_id_of(engine, caller)
            op = await wait_for_operation(engine, call_id, "committed", within=WAIT_S)
            operation_id = str(op["operation_id"])
            await wait_for_delivery(engine, op["operation_id"], "heard", within=WAIT_S)

            def exported() -> bool:
                names = {(s.service, s.name) for s in collector.spans}
                return ("va-worker", "operation book_table") in names and any(
                    s.service == "va-serve" and s.name.startswith("execute_tool")
                    for s in collector.spans
                )

            await wait_until(exported, WAIT_S, "the operation's span exported by the worker")
            await caller.hangup()
            await wait_until(
                lambda: any(s.name == "call" for s in collector.spans), WAIT_S, "the call span"
            )
            await wait_until(
                lambda: any(s.name == "delivery heard" for s in collector.spans),
                WAIT_S,
                "the delivery's heard step",
            )
            parent = sor.traceparents.get(op["idempotency_key"])
        finally:
            await server.stop()
            if worker is not None and worker.returncode is None:
                worker.terminate()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(20):
                        await worker.wait()
            await sor.stop()

    spans = collector.spans
    [call] = [s for s in spans if s.name == "call"]
    assert call.service == "va-serve" and call.attributes["voice_agent.call_id"] == call_id
    book = next(s for s in spans if s.name == "execute_tool book_table")
    confirm = next(s for s in spans if s.name == "execute_tool confirm_operation")
    [operation] = [s for s in spans if s.name == "operation book_table"]
    # One trace: the call, its turns, the model's responses, its tool calls (each under the
    # caller's turn that led to it) and the worker's operation.
    assert {book.trace_id, confirm.trace_id, operation.trace_id} == {call.trace_id}
    turns = {s.span_id: s for s in spans if s.name.startswith("turn ")}
    assert turns and all(t.parent_id == call.span_id for t in turns.values())
    assert book.parent_id in turns and confirm.parent_id in turns
    turn_of_book = turns[book.parent_id].attributes["voice_agent.turn_id"]
    assert turn_of_book == book.attributes["voice_agent.turn_id"]
    # The response that asked for the booking: a GenAI inference span in the same turn.
    [asked] = [
        s for s in spans
        if s.attributes.get("gen_ai.response.id") == book.attributes["gen_ai.response.id"]
        and s.name.startswith("chat ")
    ]  # fmt: skip
    assert asked.parent_id == book.parent_id
    assert asked.attributes["gen_ai.operation.name"] == "chat"
    assert asked.attributes["gen_ai.request.model"] == "gpt-realtime"
    assert asked.attributes["gen_ai.response.finish_reasons"] == ["completed"]
    # The delivery of the outcome: its steps are spans in the same trace.
    delivery = [s for s in spans if s.name.startswith("delivery ")]
    assert delivery and {s.trace_id for s in delivery} == {call.trace_id}
    assert {s.attributes["voice_agent.operation_id"] for s in delivery} == {operation_id}
    # Heard in the call: the step names the acknowledgement the caller heard.
    [heard] = [s for s in delivery if s.name == "delivery heard"]
    assert heard.attributes["voice_agent.ack_item_id"].startswith("item_")
    assert heard.attributes["gen_ai.response.id"].startswith("resp_")
    assert operation.service == "va-worker"
    # The GenAI conventions and the design's fields on the tool span.
    assert book.attributes["gen_ai.operation.name"] == "execute_tool"
    assert book.attributes["gen_ai.tool.name"] == "book_table"
    assert book.attributes["gen_ai.tool.call.id"].startswith("call_")
    assert book.attributes["gen_ai.response.id"].startswith("resp_")
    assert book.attributes["gen_ai.conversation.id"] == call_id
    assert book.attributes["voice_agent.call_id"] == call_id
    assert book.attributes["voice_agent.operation_id"] == operation_id
    assert isinstance(book.attributes["voice_agent.turn_id"], int)
    assert book.attributes["voice_agent.idempotency_key"] == op["idempotency_key"]
    assert book.attributes["voice_agent.session_id"].startswith("sess_")
    assert asked.attributes is not None
    assert operation.attributes["voice_agent.operation_id"] == operation_id
    assert operation.attributes["voice_agent.idempotency_key"] == op["idempotency_key"]
    assert "committed" in operation.events
    # The provider request: an HTTP client span under the operation, and its traceparent
    # reached the system of record.
    http = [s for s in spans if s.parent_id == operation.span_id and s.name.startswith("POST")]
    assert http and http[0].trace_id == call.trace_id
    assert parent is not None and parent.split("-")[1] == call.trace_id
    # No caller number and no tool arguments in any attribute.
    values = " ".join(str(v) for s in spans for v in s.attributes.values())
    assert caller.from_number not in values and "Alex" not in values
    print(f"one trace {call.trace_id}: {len(spans)} spans from serve and worker; delivery: "
          f"{[s.name for s in delivery]}")  # fmt: skip


@pytest.fixture
def spans_in_process() -> InMemorySpanExporter:
    """This test process exports its spans to memory (the SDK's provider is set once per
    process; a later test reuses it)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def test_the_console_links_a_call_and_its_operation_to_their_trace(
    engine: AsyncEngine, clean_db: str, spans_in_process: InMemorySpanExporter
) -> None:
    template = "https://traces.example/trace/{trace_id}"
    async with RESTAURANT.start(clean_db) as backend:
        catalog = backend.catalog()
        async with call_stack(
            engine,
            booking_scenario(RESTAURANT),
            with_worker=True,
            catalog=catalog,
            database_url=clean_db,
            trace_url_template=template,
        ) as stack:
            caller = stack.caller()
            call_id = await ask_to_book_and_confirm(stack, caller)
            op = await wait_for_operation(engine, call_id, "committed")
            await caller.hangup()
            await stack.events(caller)
            async with httpx.AsyncClient(base_url=stack.service.url, auth=CONSOLE) as http:
                timeline = (await http.get(f"/api/calls/{call_id}/timeline")).json()
            await add_staff(engine, "tracer", Role.VIEWER)
            async with logged_in(stack.service.url, "tracer") as (http, _csrf):
                call_page = (await http.get(f"/console/calls/{call_id}")).text
                op_page = (await http.get(f"/console/operations/{op['operation_id']}")).text
    tools = [s for s in spans_in_process.get_finished_spans() if s.name.startswith("execute_tool")]
    ours = {
        f"{s.context.trace_id:032x}"
        for s in tools
        if s.attributes.get("voice_agent.call_id") == call_id
    }
    trace_id = timeline["call"]["trace_id"]
    assert ours == {trace_id}
    link = template.replace("{trace_id}", trace_id)
    assert f'href="{link}"' in call_page
    assert f'href="{link}"' in op_page  # the operation is in the call's trace


def test_trace_url_template_must_say_where_the_id_goes() -> None:
    with pytest.raises(ValidationError, match="trace_id"):
        Settings(trace_url_template="https://traces.example/trace/")
