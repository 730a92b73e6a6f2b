"""The FastAPI application: routes plus the services one process runs (see `create_app`)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from openai import AsyncOpenAI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.control import CallControl
from app.calls.events import EventWriter
from app.calls.holders import HolderLock
from app.calls.liveness import CallHeartbeat
from app.calls.registry import CallRegistry
from app.console.install import install_console
from app.console.services import start_console
from app.db import PING_AFTER_IDLE_S, make_engine, plain_url, resolve_database_url
from app.errors import install_error_handlers
from app.http import health as routes_health
from app.http.body_limits import BodyLimit
from app.http.route_lane import install_route_lane
from app.http.slots import SlotPool
from app.legs.openai_sip import routes as routes_openai
from app.legs.twilio import routes as routes_twilio
from app.legs.twilio.stream_token import StreamTokens
from app.ops import routes_deliveries, routes_operations, routes_sms
from app.ops.delivery import ResultDelivery
from app.ops.outbound import with_place_call
from app.ops.sms import SmsChannel
from app.ops.sms_resend import LedgerSmsDeliveries
from app.ops.twilio_rest import close_twilio_client, make_twilio_client
from app.pg_listener import PgListener
from app.runtime import Runtime
from app.settings import Settings
from app.tool_wiring import build_tools, load_configured_catalog
from telephony.session_config import BASE_INSTRUCTIONS, BridgeConfig
from telephony.tool_gateway import ToolGateway
from tools.autocommit import hold_autocommit, release_autocommit
from tools.catalog import Catalog
from tools.outage import quiet_library_outages

log = logging.getLogger(__name__)

# How long shutdown waits for live calls to wind down before giving up on them.
SHUTDOWN_CALLS_WAIT_S = 15.0


def bridge_config_from(settings: Settings, catalog: Catalog | None = None) -> BridgeConfig:
    """The bridge's per-deployment knobs, from the settings (the persona from the catalog)."""
    return BridgeConfig(
        model=settings.openai_realtime_model,
        voice=settings.realtime_voice,
        instructions=(catalog.instructions if catalog else None) or BASE_INSTRUCTIONS,
        vad_eagerness=settings.vad_eagerness,
        reconnect_budget_s=settings.realtime_reconnect_budget_s,
        max_tool_calls_per_response=settings.max_tool_calls_per_response,
        max_tool_calls_in_flight=settings.max_tool_calls_in_flight,
        model_api=settings.model_api,
        live_model=settings.live_model,
        live_delegation_model=settings.live_delegation_model,
        live_delegation=settings.live_delegation,
        live_backend_base_url=settings.live_backend_base_url,
    )


def make_openai_client(settings: Settings) -> AsyncOpenAI:
    """The Realtime client: OPENAI_BASE_URL (the simulator, offline) or the real API."""
    key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else "simulator"
    return AsyncOpenAI(api_key=key, base_url=settings.openai_base_url, max_retries=0)


def _make_twilio_client(settings: Settings) -> Any:
    return make_twilio_client(
        settings.twilio_account_sid,
        settings.twilio_auth_token.get_secret_value(),
        settings.twilio_api_base_url,
    )


def holder_id() -> str:
    """This process, as written into the calls it holds: host, pid and a random tail."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"[:128]


async def _start_worker(
    settings: Settings, engine: AsyncEngine, url: str | None, catalog: Catalog, runtime: Runtime
) -> Any:
    """The in-process operation worker; calls still run (tools queue up) if it cannot start.
    It places SIP outbound calls on this process's SIP listener (it takes them once the
    listener started: `take_sip_jobs`)."""
    from app.ops.worker import start_inprocess_worker

    def sip() -> Any:
        return runtime.sip.outbound if runtime.sip is not None else None

    try:
        return await start_inprocess_worker(
            settings,
            engine,
            database_url=plain_url(url) if url else None,
            catalog=catalog,
            sip=sip,
        )
    except Exception:
        log.exception("the in-process operation worker did not start")
        return None


def create_app(
    settings: Settings,
    *,
    engine: AsyncEngine | None = None,
    openai_client: AsyncOpenAI | None = None,
    gateway: ToolGateway | None = None,
    bridge_config: BridgeConfig | None = None,
    with_worker: bool = False,
    catalog: Catalog | None = None,
) -> FastAPI:
    """The service. Anything not passed in is built from `settings` and owned by the app.

    The database must already be migrated (`app.server.run_server` does it on start), and
    `catalog` checked (`app.server` loads it before serving, so a bad one never starts).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        quiet_library_outages()
        own_catalog = catalog is None
        tool_catalog = catalog if catalog is not None else load_configured_catalog(settings)
        own_engine = engine is None
        url = settings.database_url
        if engine is None:
            url = await asyncio.to_thread(
                resolve_database_url, settings.database_url, settings.data_dir
            )
            db = make_engine(url)
        else:
            db = engine
        db_url = plain_url(url) if url else db.url.render_as_string(hide_password=False)
        own_client = openai_client is None
        client = openai_client or make_openai_client(settings)
        events = EventWriter(db)
        events.start()
        calls = CallRegistry(settings.max_live_calls, settings.stream_token_ttl_s)
        tools = (
            build_tools(settings, db, plain_url(db_url), tool_catalog) if gateway is None else None
        )
        # Outbound calls' placing operations are shown and settled like any other (never
        # offered to the model: the pipeline keeps its own registry).
        registry = with_place_call(
            tools.registry if tools is not None else tool_catalog.registry,
            settings.outbound_create_timeout_s,
        )
        holder = holder_id()
        sms = SmsChannel.from_settings(settings, db, registry, actor=f"replica:{holder}")
        delivery = ResultDelivery(
            db,
            registry,
            calls.entry_by_call_id,
            calls.live_call_ids,
            holder=holder,
            max_reoffers=settings.announce_max_reoffers,
            sms=sms,
            agents=tools.agents if tools is not None else None,
        )
        if tools is not None:
            tools.pipeline.pending_results = delivery.call_ended
            tools.pipeline.events = events  # a caller's verification lockout, on the timeline
        control = CallControl(calls)
        listener = PgListener(plain_url(db_url))
        delivery.subscribe(listener)
        control.subscribe(listener)
        console = await start_console(
            settings,
            db,
            plain_url(db_url),
            registry=registry,
            provider=tool_catalog.router,
            listener=listener,
            sms=LedgerSmsDeliveries(db, sms) if sms is not None else None,
        )
        await listener.start()
        # Held for this process's life: another replica knows at once when it is gone.
        holder_lock = HolderLock(db, holder, check_s=settings.call_heartbeat_s)
        await holder_lock.start()
        heartbeat = CallHeartbeat(db, calls, holder=holder, interval_s=settings.call_heartbeat_s)
        heartbeat.start()
        try:
            from app.ops.worker import sync_webhooks

            await sync_webhooks(settings, db)
        except Exception:
            log.exception("the configured webhooks (WEBHOOKS) could not be applied")
        runtime = Runtime(
            settings=settings,
            engine=db,
            events=events,
            registry=calls,
            tokens=StreamTokens(settings.stream_secret(), settings.stream_token_ttl_s),
            gateway=tools.pipeline if tools is not None else gateway,  # type: ignore[arg-type]
            openai=client,
            bridge_config=bridge_config or bridge_config_from(settings, tool_catalog),
            twilio=_make_twilio_client(settings),
            tools=tools,
            console=console,
            delivery=delivery,
            sms=sms,
            holder=holder,
            pending_streams=SlotPool(
                per_key=settings.media_max_pending_per_source,
                total=settings.media_max_pending_streams,
            ),
        )
        app.state.runtime = runtime
        worker = (
            await _start_worker(settings, db, url, tool_catalog, runtime) if with_worker else None
        )
        from app.legs.openai_sip.calls import OpenAISipService

        runtime.openai_sip = OpenAISipService(runtime)
        from app.legs.staff_transfer import transfer_call

        async def staff_transfer(call_sid: str, target: str, by: str) -> None:
            await transfer_call(runtime, call_sid, target, by)

        control.transfer = staff_transfer
        from app.legs.twilio.outbound import answered_by_here

        async def amd(call_sid: str, answered_by: str) -> None:
            await answered_by_here(runtime, call_sid, answered_by)

        control.amd = amd
        from app.legs.twilio.warm import act_here

        async def warm(call_sid: str, step: str, fc: str, status: str) -> None:
            await act_here(runtime, call_sid, step, fc, status)

        control.warm = warm
        if settings.sip_bind:
            from app.legs.sip import SipService

            runtime.sip = SipService(runtime)
            await runtime.sip.start()
            if worker is not None:
                # SIP placings only now: a worker takes them only beside a live listener.
                await worker.take_sip_jobs()
        hold_autocommit(db, idle_s=PING_AFTER_IDLE_S)
        try:
            yield
        finally:
            await runtime.registry.end_all("server shutdown", SHUTDOWN_CALLS_WAIT_S)
            await runtime.openai_sip.stop()
            await heartbeat.stop()
            await holder_lock.stop()
            if runtime.sip is not None:
                if worker is not None:
                    await worker.leave_sip_jobs()  # placings in hand end before the listener
                await runtime.sip.stop()
            await console.aclose()
            await listener.stop()
            await delivery.stop()
            await sms.aclose()
            await control.stop()
            if worker is not None:
                await worker.stop()
            if own_catalog:
                await tool_catalog.aclose()
            await events.close()
            await close_twilio_client(runtime.twilio)
            if own_client:
                await client.close()
            await release_autocommit(db)
            if own_engine:
                await db.dispose()

    # The OpenAPI schema is served behind authentication by the console (/api/openapi.json).
    app = FastAPI(
        title="voice-agent", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    install_error_handlers(app)
    # Before routing, so no route or dependency (FastAPI reads a JSON body before it checks
    # credentials) can read more than its limit.
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.http_max_body_bytes,
        webhook_max_bytes=settings.webhook_max_body_bytes,
    )
    app.include_router(routes_twilio.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_health.router)
    app.include_router(routes_operations.router)
    app.include_router(routes_sms.router)
    app.include_router(routes_deliveries.router)
    install_console(app)
    # Every call's webhook and media socket skip the router (app/http/route_lane.py).
    install_route_lane(app, routes_twilio.LANE_ROUTES)
    return app
