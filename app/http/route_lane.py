"""A short way to a few hot routes: Twilio's voice webhook and media socket skip FastAPI's
router and dependency solving.

Every call starts with two requests, the voice webhook and the media WebSocket, and each
went through the router's matching (across the included routers), FastAPI's dependency
solving (a sub-response, the query string, the headers, its caches) and its endpoint
wrappers before our handler ran: about a third of a millisecond of CPU per request on this
project's machines, more than the handler's own work apart from its statement. `RouteLane`
sits where the router sits, inside every middleware and the exception handlers, and sends
the requests of the routes it was given straight to a handler: the same endpoint function,
called with what its dependencies would have resolved to. Everything else, and these same
routes when the lane cannot take them, goes to the router unchanged:

- a path under a `root_path` (an app mounted below a prefix): the router resolves it;
- a request FastAPI's own telemetry follows (its record in the scope's `fastapi.telemetry`,
  when a tracer, meter or logger provider is configured): its span and metrics name the
  route the router matched;
- an application whose dependencies are overridden (`app.dependency_overrides`, in tests):
  the lane would not see the overrides.

The scope gets what a router match sets (`endpoint`, `route`, `path_params`), so code
that reads those downstream sees the same request either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

log = logging.getLogger(__name__)

HttpHandler = Callable[[Request], Awaitable[Response]]
SocketHandler = Callable[[WebSocket], Awaitable[None]]


@dataclass(frozen=True)
class LaneRoute:
    """One route the lane takes (its method and path are the lane's key): `handler`, and
    the router's route for the same path with its endpoint (what the scope records)."""

    handler: HttpHandler | SocketHandler
    route: BaseRoute
    endpoint: Callable[..., Any]


class RouteLane:
    """ASGI app in the router's place: `lanes` by (method, path), the rest to `router`."""

    def __init__(
        self, router: ASGIApp, lanes: Mapping[tuple[str, str], LaneRoute], app: Any
    ) -> None:
        self.router = router
        self._lanes = dict(lanes)
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            lane = self._lanes.get((scope["method"], scope["path"]))
        elif kind == "websocket":
            lane = self._lanes.get(("WEBSOCKET", scope["path"]))
        else:
            lane = None
        if (
            lane is None
            or scope.get("root_path")
            or scope.get("fastapi.telemetry") is not None
            or self._app.dependency_overrides
        ):
            await self.router(scope, receive, send)
            return
        scope["endpoint"] = lane.endpoint
        scope["route"] = lane.route
        scope["path_params"] = {}
        if kind == "http":
            request = Request(scope, receive, send)
            response = await cast(HttpHandler, lane.handler)(request)
            await response(scope, receive, send)
        else:
            await cast(SocketHandler, lane.handler)(WebSocket(scope, receive, send))


def install_route_lane(app: Any, handlers: Mapping[tuple[str, str], Callable[..., Any]]) -> str:
    """Put a `RouteLane` in `app`'s router's place for `handlers` ((method, path) -> the
    handler; method `"WEBSOCKET"` for a socket), each path's route found among the app's
    routes. Returns "" when installed, else why not (a path without a route of that method
    that the lane may take: the app is left as it was). Kept as `app.state.route_lane`."""
    routes: dict[tuple[str, str], LaneRoute] = {}
    for (method, path), handler in handlers.items():
        found = _route_for(app, method, path)
        if found is None:
            app.state.route_lane = f"no route {method} {path} without dependencies"
            return app.state.route_lane
        endpoint = getattr(found, "endpoint", handler)
        routes[(method, path)] = LaneRoute(handler, found, endpoint)
    build = app.build_middleware_stack

    def build_with_lane() -> ASGIApp:
        stack = build()
        # The innermost middleware is the one whose app is the router: it gets the lane.
        router: ASGIApp = app.router
        layer: Any = stack
        while layer is not None:
            inner = getattr(layer, "app", None)
            if inner is router:
                layer.app = RouteLane(router, routes, app)
                return stack
            layer = inner
        log.warning("route lane off: the middleware stack does not end in the app's router")
        app.state.route_lane = "the middleware stack does not end in the app's router"
        return stack

    app.build_middleware_stack = build_with_lane
    app.state.route_lane = ""
    return ""


def _route_for(app: Any, method: str, path: str) -> BaseRoute | None:
    """The route for `method` and `path` among `app`'s routes and those of the routers it
    included with no prefix and no dependencies (FastAPI keeps an included router whole, as
    `original_router`); None if it has dependencies of its own or of its router."""
    pending = list(app.routes)
    while pending:
        route = pending.pop(0)
        included = getattr(route, "original_router", None)
        if included is not None:
            context = getattr(route, "include_context", None)
            if not getattr(context, "prefix", "x") and not getattr(context, "dependencies", [1]):
                pending.extend(included.routes)
            continue
        if getattr(route, "path", None) != path or getattr(route, "dependencies", None):
            continue  # dependencies of its router or its own: the router solves them
        methods = getattr(route, "methods", None)
        if method == "WEBSOCKET":
            if methods is None and type(route).__name__.endswith("WebSocketRoute"):
                return route
        elif methods is not None and method in methods:
            return route
    return None
