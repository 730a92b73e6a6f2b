"""A stand-in for the Responses API (`POST /v1/responses`) as the backend agent of GPT-Live's
client delegation, driven by the simulator's Live sessions.

Under `delegation: client` the Live model hands work to the application with only an id
(`session.delegation.created`, target `client`); the service's backend agent
(telephony/bridge/live_backend.py) then asks a Responses model what to do. This stand-in plays
that model from the same scenario as the Live session: the request names the delegation in its
`metadata`, and

- a request without a `function_call_output` is answered with the scenario step's function call
  (the `function_call` item, with the call id the Live session expects), if the request declares
  that tool; else with a message that nothing can be done;
- a request carrying the `function_call_output` of that call is answered with a message that
  relays it (the text the service then appends as the delegation's commentary), and the output
  is recorded on the Live session (`function_outputs`), as a Responses delegation's would be.

Every request is checked against the SDK's `ResponseCreateParamsNonStreaming` and refused with a
400 error body when it does not fit; every answer is built as the SDK's `Response`.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web
from openai.types.responses import Response
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming
from pydantic import TypeAdapter, ValidationError

from telephony.sim.live_session import LiveSimulatedSession

log = logging.getLogger(__name__)

_PARAMS: TypeAdapter[ResponseCreateParamsNonStreaming] = TypeAdapter(
    ResponseCreateParamsNonStreaming
)
MAX_BODY = 1024 * 1024


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class ResponsesStandIn:
    """`POST /v1/responses` on its own port; `sessions` gives the Live sessions to serve."""

    def __init__(
        self, sessions: Callable[[], Iterable[LiveSimulatedSession]], host: str = "127.0.0.1"
    ) -> None:
        self._sessions = sessions
        self.host = host
        self.requests: list[dict[str, Any]] = []
        self.refused: list[tuple[dict[str, Any], str]] = []
        self.failing = 0  # the next this many requests get a 500 (a backend outage)
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def base_url(self) -> str:
        assert self._port is not None, "not started"
        return f"http://{self.host}:{self._port}/v1"

    async def __aenter__(self) -> ResponsesStandIn:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/responses", self._create)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        server = site._server  # aiohttp names no bound port otherwise
        assert server is not None
        self._port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _create(self, request: web.Request) -> web.Response:
        if not request.headers.get("Authorization", "").startswith("Bearer "):
            return _error(401, "Missing bearer authentication.", "invalid_api_key")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "The body is not JSON.", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "The body must be an object.", "invalid_json")
        self.requests.append(body)
        if self.failing > 0:
            self.failing -= 1
            return _error(500, "The server had an error processing your request.", "server_error")
        try:
            _PARAMS.validate_python(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            self.refused.append((body, f"{where}: {first['msg']}"))
            return _error(400, f"Invalid {where}: {first['msg']}", "invalid_value")
        metadata = body.get("metadata") or {}
        delegation_id = metadata.get("delegation_id")
        found = next(
            (
                (session, pending)
                for session in self._sessions()
                if (pending := session.client_task(str(delegation_id))) is not None
            ),
            None,
        )
        if found is None:
            self.refused.append((body, "no client delegation named in metadata"))
            return _error(400, f"No client delegation {delegation_id!r}.", "invalid_value")
        session, pending = found
        outputs = [
            item
            for item in body.get("input") or []
            if isinstance(item, dict)
            and item.get("type") == "function_call_output"
            and item.get("call_id") == pending.call_id
        ]
        declared = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
        output: list[dict[str, Any]]
        if outputs:
            text = str(outputs[-1].get("output") or "")
            session.backend_output(pending, text)
            output = [_message(text)]
        elif pending.name in declared:
            output = [
                {
                    "type": "function_call",
                    "id": _id("fc"),
                    "call_id": pending.call_id,
                    "name": pending.name,
                    "arguments": pending.arguments,
                    "status": "completed",
                }
            ]
        else:
            output = [_message("I cannot do that from here.")]
        response = Response.model_validate(
            {
                "id": _id("resp"),
                "object": "response",
                "created_at": time.time(),
                "model": str(body.get("model")),
                "status": "completed",
                "output": output,
                "parallel_tool_calls": True,
                "tool_choice": "auto",
                "tools": body.get("tools") or [],
                "metadata": metadata,
                "previous_response_id": body.get("previous_response_id"),
            }
        )
        return web.json_response(response.model_dump(mode="json", exclude_none=True))


def _message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": _id("msg"),
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=status)
