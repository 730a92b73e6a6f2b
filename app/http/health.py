"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from sqlalchemy.exc import DBAPIError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from app.deps import RuntimeDep
from app.runtime import Runtime
from telephony.call_events import CallEventKind

router = APIRouter()

READY_TIMEOUT_S = 2.0


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(runtime: RuntimeDep) -> Response:
    """The process can serve calls: it is not stopping and the database answers."""
    if runtime.registry.draining:
        return PlainTextResponse("draining: stopping, no new calls", status_code=503)
    try:
        async with asyncio.timeout(READY_TIMEOUT_S), runtime.engine.connect() as conn:
            await conn.execute(sa.text("SELECT 1"))
    except (TimeoutError, DBAPIError, OSError):
        return PlainTextResponse("database unreachable", status_code=503)
    return PlainTextResponse("ready")


@router.get("/metrics")
async def metrics(runtime: RuntimeDep) -> Response:
    """Prometheus text exposition of this process's call counters (here unless METRICS_BIND
    moves them to their own address)."""
    if runtime.settings.metrics_bind:
        return PlainTextResponse("Not Found", status_code=404)
    return render_metrics(runtime)


def metrics_app(main: Any) -> Starlette:
    """`/metrics` alone, for METRICS_BIND: a private address of its own (the main port faces
    Twilio and the internet; counters say how busy the service is)."""

    async def endpoint(request: Request) -> Response:
        runtime = getattr(main.state, "runtime", None)
        if runtime is None:
            return PlainTextResponse("starting", status_code=503)
        return render_metrics(runtime)

    return Starlette(routes=[Route("/metrics", endpoint)])


def render_metrics(runtime: Runtime) -> Response:
    """The exposition text of this process's counters."""
    registry, events = runtime.registry, runtime.events
    samples = [
        ("voice_agent_live_calls", "gauge", "Calls whose media stream runs here.",
         registry.live_count()),
        ("voice_agent_calls_total", "counter", "Calls answered by this process.",
         registry.answered_total),
        ("voice_agent_calls_rejected_busy_total", "counter", "Calls refused at capacity.",
         registry.rejected_busy_total),
        ("voice_agent_calls_rejected_draining_total", "counter",
         "Calls refused while stopping.", registry.rejected_draining_total),
        ("voice_agent_draining", "gauge", "1 while the process is stopping.",
         int(registry.draining)),
        ("voice_agent_barge_ins_total", "counter", "Barge-ins (caller interrupted the agent).",
         events.kind_counts[str(CallEventKind.BARGE_IN)]),
        ("voice_agent_results_heard_total", "counter", "Late results heard in full in a call.",
         events.kind_counts[str(CallEventKind.RESULT_HEARD)]),
        ("voice_agent_results_cut_total", "counter", "Late results cut before the end.",
         events.kind_counts[str(CallEventKind.RESULT_CUT)]),
        ("voice_agent_results_offered_total", "counter", "Late results handed to a call here.",
         runtime.delivery.offered if runtime.delivery is not None else 0),
        ("voice_agent_sms_sends_total", "counter", "SMS create requests made by this process.",
         runtime.sms.sent if runtime.sms is not None else 0),
        ("voice_agent_streams_rejected_total", "counter",
         "Media streams refused for their token.", runtime.streams_rejected),
        ("voice_agent_event_queue_depth", "gauge", "Call events waiting to be written.",
         events.queue_depth),
        ("voice_agent_events_written_total", "counter", "Call events written.", events.written),
        ("voice_agent_events_dropped_total", "counter", "Call events that could not be written.",
         events.dropped),
    ]  # fmt: skip
    interconnect = runtime.openai_sip
    if interconnect is not None:
        samples += [
            ("voice_agent_openai_webhooks_bad_signature_total", "counter",
             "OpenAI webhooks refused for their signature.", interconnect.bad_signatures),
            ("voice_agent_openai_webhooks_duplicate_total", "counter",
             "OpenAI webhook deliveries seen before (answered 200, nothing done).",
             interconnect.duplicates),
            ("voice_agent_openai_sip_accepted_total", "counter",
             "OpenAI SIP interconnect calls accepted.", interconnect.accepted),
            ("voice_agent_openai_sip_rejected_total", "counter",
             "OpenAI SIP interconnect calls rejected (busy, not ours, draining).",
             sum(interconnect.rejected.values())),
        ]  # fmt: skip
    sip = runtime.sip
    if sip is not None:
        samples.append(
            ("voice_agent_sip_rtp_foreign_dropped_total", "counter",
             "RTP packets dropped from sources the signalling did not name (strict RTP).",
             sip.media_stats.foreign_packets)
        )  # fmt: skip
    lines: list[str] = []
    for name, kind, help_text, value in samples:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
