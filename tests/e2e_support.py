"""Servers for end-to-end tests: the service on an ephemeral port, in the test's own loop."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import sqlalchemy as sa
import uvicorn
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine
from twilio.request_validator import RequestValidator

from app.main import create_app
from app.runtime import Runtime
from app.server import ServiceServer, uvicorn_config
from app.settings import Settings
from telephony.session_config import BridgeConfig
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import RealtimeSimulator
from telephony.tool_gateway import ToolGateway
from tools.catalog import Catalog

AUTH_TOKEN = "dev-auth-token"  # the fake caller's and fake Twilio API's default
CONSOLE = ("admin", "console-test-password")


@dataclass
class Service:
    """The running service: where it listens and what it runs with."""

    settings: Settings
    app: FastAPI
    url: str
    server: uvicorn.Server

    @property
    def runtime(self) -> Runtime:
        runtime: Runtime = self.app.state.runtime
        return runtime


def make_settings(port: int, **overrides: Any) -> Settings:
    """Settings for a test service on `port` (every value explicit, nothing from env)."""
    values: dict[str, Any] = {
        "database_url": None,
        "openai_api_key": None,
        "openai_base_url": None,
        "twilio_auth_token": AUTH_TOKEN,
        "twilio_api_base_url": "http://127.0.0.1:9",  # nothing listens: never api.twilio.com
        "public_base_url": f"http://127.0.0.1:{port}",
        "host": "127.0.0.1",
        "port": port,
        "stream_token_secret": "stream-secret-for-tests",
        "console_user": CONSOLE[0],
        "console_password": CONSOLE[1],
        # The older tests read the JSON API with the first admin's name and password.
        "console_http_basic": True,
        "realtime_reconnect_budget_s": 3.0,
        # The test's event loop also runs its callers and simulators: its lateness is not the
        # service's alone (test_twilio_webhooks sets the overload guard where it tests it).
        "busy_loop_lag_ms": 0,
        **overrides,
    }
    return Settings(**values)


@asynccontextmanager
async def running_service(
    engine: AsyncEngine,
    *,
    bridge_config: BridgeConfig | None = None,
    with_worker: bool = False,
    catalog: Catalog | None = None,
    gateway: ToolGateway | None = None,
    **overrides: Any,
) -> AsyncIterator[Service]:
    """create_app(...) served by uvicorn on a free port until the block exits (`catalog`:
    the tools, else the ones `overrides` configure; the caller owns a catalog it passes)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = make_settings(port, **overrides)
    app = create_app(
        settings,
        engine=engine,
        bridge_config=bridge_config,
        with_worker=with_worker,
        catalog=catalog,
        gateway=gateway,
    )
    server = ServiceServer(
        uvicorn_config(app, settings, log_level="warning", access_log=False,
                       timeout_graceful_shutdown=10)
    )  # fmt: skip
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"service-{port}")
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("service stopped before it started")
                await asyncio.sleep(0.01)
        yield Service(settings, app, f"http://127.0.0.1:{port}", server)
    finally:
        server.should_exit = True
        try:
            async with asyncio.timeout(20):
                await asyncio.shield(task)
        except TimeoutError:
            server.force_exit = True
            await task
        sock.close()


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,  # noqa: ASYNC109
    what: str = "condition",
) -> None:
    """Poll an observable condition until it holds; TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.02)


async def post_signed(
    service: Service,
    path: str,
    params: dict[str, str],
    *,
    signature: str | None = None,
    content: bytes | None = None,
) -> httpx.Response:
    """POST a form the way Twilio does, signed over the service's public URL."""
    public = service.settings.public_base_url + path
    if signature is None:
        signature = RequestValidator(AUTH_TOKEN).compute_signature(public, params)
    headers = {"X-Twilio-Signature": signature}
    async with httpx.AsyncClient(timeout=10) as client:
        if content is not None:
            headers["Content-Type"] = "application/x-www-form-urlencoded"
            return await client.post(service.url + path, content=content, headers=headers)
        return await client.post(service.url + path, data=params, headers=headers)


async def call_row(engine: AsyncEngine, call_sid: str) -> dict[str, Any] | None:
    """The `calls` row of `call_sid` as a dict."""
    async with engine.connect() as conn:
        row = (
            (
                await conn.execute(
                    sa.text("SELECT * FROM calls WHERE call_sid = :s"), {"s": call_sid}
                )
            )
            .mappings()
            .first()
        )
    return dict(row) if row else None


async def event_rows(engine: AsyncEngine, call_id: str | uuid.UUID) -> list[dict[str, Any]]:
    """The call's events in seq order."""
    async with engine.connect() as conn:
        rows = (
            (
                await conn.execute(
                    sa.text(
                        "SELECT seq, kind, data, mono_ns FROM call_events "
                        "WHERE call_id = :c ORDER BY seq"
                    ),
                    {"c": uuid.UUID(str(call_id))},
                )
            )
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


async def event_kinds(engine: AsyncEngine, call_id: str | uuid.UUID) -> list[str]:
    return [r["kind"] for r in await event_rows(engine, call_id)]


@dataclass
class Stack:
    """Simulator, fake Twilio REST API and the service, wired to each other."""

    sim: RealtimeSimulator
    api: FakeTwilioApi
    service: Service
    engine: AsyncEngine

    def caller(self, **kwargs: Any) -> FakeTwilioCaller:
        """A fake caller for this service, known to the fake Twilio API."""
        caller = FakeTwilioCaller(self.service.url, **kwargs)
        self.api.attach(caller)
        return caller

    async def call_id(self, caller: FakeTwilioCaller) -> str:
        row = await call_row(self.engine, caller.call_sid)
        assert row is not None, "no call row"
        return str(row["id"])

    async def events(self, caller: FakeTwilioCaller) -> list[dict[str, Any]]:
        """The caller's call events as persisted, once the call has wound down here."""
        registry = self.service.runtime.registry
        await wait_until(lambda: registry.get(caller.call_sid) is None, 15, "call ended")
        await self.service.runtime.events.flush()
        return await event_rows(self.engine, await self.call_id(caller))


@asynccontextmanager
async def call_stack(
    engine: AsyncEngine,
    scenario: Scenario | None = None,
    *,
    bridge_config: BridgeConfig | None = None,
    with_worker: bool = False,
    catalog: Catalog | None = None,
    gateway: ToolGateway | None = None,
    simulator: dict[str, Any] | None = None,
    **overrides: Any,
) -> AsyncIterator[Stack]:
    """Everything a simulated call needs, in this loop, torn down in order (`simulator`:
    options of the RealtimeSimulator, such as its voice)."""
    async with (
        RealtimeSimulator(scenario, **(simulator or {})) as sim,
        FakeTwilioApi() as api,
        running_service(
            engine,
            bridge_config=bridge_config,
            with_worker=with_worker,
            catalog=catalog,
            gateway=gateway,
            openai_base_url=sim.base_url,
            twilio_api_base_url=api.base_url,
            **overrides,
        ) as service,
    ):
        yield Stack(sim, api, service, engine)
