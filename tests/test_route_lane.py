"""The route lane (app/http/route_lane.py): the routes it takes skip FastAPI's router and
dependency solving; the middleware, the exception handlers and every other route stay."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, WebSocket
from fastapi.responses import PlainTextResponse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.testclient import TestClient

from app.http.route_lane import RouteLane, install_route_lane
from app.server import fast_paths
from tests.e2e_support import call_row, post_signed, running_service


def _solved(seen: list[str]) -> Any:
    def dependency() -> str:
        seen.append("solved")
        return "by the router"

    return dependency


def _app(
    seen: list[str],
    *,
    prefix: str = "",
    route_dependencies: bool = False,
    telemetry: dict[str, Any] | None = None,
) -> FastAPI:
    app = FastAPI(telemetry=telemetry)  # type: ignore[arg-type]
    router = APIRouter()
    given_by = Depends(_solved(seen))
    extra = [Depends(_solved(seen))] if route_dependencies else []

    @router.post("/hook", dependencies=extra)
    async def hook(request: Request, given: str = given_by) -> PlainTextResponse:
        body = (await request.body()).decode()
        if body == "refuse":
            raise HTTPException(403, "refused")
        return PlainTextResponse(f"{given}: {body} ({request.scope['route'].path})")

    @router.websocket("/socket")
    async def socket(ws: WebSocket, given: str = given_by) -> None:
        await ws.accept()
        await ws.send_text(given)
        await ws.close()

    @router.post("/other")
    async def other(given: str = given_by) -> PlainTextResponse:
        return PlainTextResponse(given)

    app.include_router(router, prefix=prefix)

    @app.middleware("http")
    async def mark(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers["x-outer"] = "yes"
        return response

    async def hook_lane(request: Request) -> Any:
        return await hook(request, "by the lane")

    async def socket_lane(ws: WebSocket) -> None:
        await socket(ws, "by the lane")

    why = install_route_lane(
        app, {("POST", f"{prefix}/hook"): hook_lane, ("WEBSOCKET", f"{prefix}/socket"): socket_lane}
    )
    app.state.why = why
    return app


def _innermost(app: FastAPI) -> Any:
    layer: Any = app.middleware_stack
    while getattr(layer, "app", None) is not None:
        layer = layer.app
        if isinstance(layer, RouteLane):
            return layer
    return layer


def test_the_lane_serves_its_routes_inside_the_middleware_and_the_handlers() -> None:
    seen: list[str] = []
    app = _app(seen)
    assert app.state.why == ""
    with TestClient(app) as client:
        answer = client.post("/hook", content=b"hello")
        refused = client.post("/hook", content=b"refuse")
        with client.websocket_connect("/socket") as ws:
            sent = ws.receive_text()
        other = client.post("/other")
        missing = client.post("/nowhere")
        wrong_method = client.get("/hook")
    assert isinstance(_innermost(app), RouteLane)
    # The lane's handler ran (no dependency solved), the middleware around it too, and the
    # scope holds the route as a router's match would.
    assert answer.status_code == 200
    assert answer.text == "by the lane: hello (/hook)"
    assert answer.headers["x-outer"] == "yes"
    # An exception from the handler reaches the app's exception handlers.
    assert refused.status_code == 403
    assert refused.json() == {"detail": "refused"}
    assert sent == "by the lane"
    # Everything else is the router's: its dependencies solved, its 404 and 405.
    assert other.text == "by the router"
    assert seen == ["solved"]
    assert missing.status_code == 404
    assert wrong_method.status_code == 405


def test_dependency_overrides_send_the_lane_routes_to_the_router() -> None:
    seen: list[str] = []
    app = _app(seen)
    with TestClient(app) as client:
        app.dependency_overrides[_solved] = lambda: "unused"  # any override at all
        answer = client.post("/hook", content=b"hello")
    assert answer.text == "by the router: hello (/hook)"
    assert seen == ["solved"]


def test_requests_fastapis_telemetry_follows_go_by_the_router() -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    seen: list[str] = []
    app = _app(seen, telemetry={"tracer_provider": provider, "metrics": False, "logs": False})
    with TestClient(app) as client:
        answer = client.post("/hook", content=b"hello")
    # The router matched it, so the span names its route.
    assert answer.text == "by the router: hello (/hook)"
    server = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert [s.attributes.get("http.route") for s in server if s.attributes] == ["/hook"]


@pytest.mark.parametrize("variant", ["prefix", "route_dependencies"])
def test_routes_the_lane_cannot_take_leave_the_app_as_it_was(variant: str) -> None:
    seen: list[str] = []
    if variant == "prefix":
        app = _app(seen, prefix="/v1")
    else:
        app = _app(seen, route_dependencies=True)
    assert app.state.why.startswith("no route POST")
    assert "build_middleware_stack" not in app.__dict__
    with TestClient(app) as client:
        path = "/v1/hook" if variant == "prefix" else "/hook"
        answer = client.post(path, content=b"hello")
    assert answer.text.startswith("by the router: hello")
    assert not isinstance(_innermost(app), RouteLane)


async def test_the_service_takes_every_calls_webhook_and_media_socket_by_the_lane(
    engine: AsyncEngine,
) -> None:
    params = {"CallSid": "CAlane", "From": "+15551230000", "To": "+15550000000"}
    async with running_service(engine) as service:
        assert service.app.state.route_lane == ""
        described = {p.name: p.active for p in fast_paths(service.server.config)}
        unsigned = await post_signed(service, "/twilio/voice", params, signature="")
        answer = await post_signed(service, "/twilio/voice", params)
        lane = _innermost(service.app)
    # Said at start-up with the media path's other shortcuts.
    assert described["route lane"] is True
    assert isinstance(lane, RouteLane)
    assert set(lane._lanes) == {("POST", "/twilio/voice"), ("WEBSOCKET", "/twilio/media")}
    # Refused by the app's handler through the lane; answered with its stream.
    assert unsigned.status_code == 403
    assert answer.status_code == 200
    assert "<Stream" in answer.text
    assert await call_row(engine, "CAlane") is not None
