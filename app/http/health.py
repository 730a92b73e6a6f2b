"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.exc import DBAPIError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from app.deps import RuntimeDep
from app.runtime import Runtime
from telephony.call_events import CallEventKind

router = APIRouter()

READY_TIMEOUT_S = 2.0
# The classic text format, which every Prometheus (2.x too) reads.
EXPOSITION_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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


class RuntimeCollector(Collector):
    """This process's call counters (read from the runtime at each scrape), beside the
    engine's and the audio path's measures in prometheus-client's own registry."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        runtime = self._runtime
        registry, events = runtime.registry, runtime.events
        kinds = events.kind_counts
        samples: list[tuple[str, str, str, float]] = [
            ("voice_agent_live_calls", "gauge", "Calls whose media stream runs here.",
             registry.live_count()),
            ("voice_agent_calls", "counter", "Calls answered by this process.",
             registry.answered_total),
            ("voice_agent_calls_rejected_busy", "counter", "Calls refused at capacity.",
             registry.rejected_busy_total),
            ("voice_agent_calls_rejected_overloaded", "counter",
             "Calls refused because the event loop could not keep up (BUSY_LOOP_LAG_MS).",
             registry.rejected_overloaded_total),
            ("voice_agent_calls_rejected_draining", "counter",
             "Calls refused while stopping.", registry.rejected_draining_total),
            ("voice_agent_draining", "gauge", "1 while the process is stopping.",
             int(registry.draining)),
            ("voice_agent_barge_ins", "counter", "Barge-ins (caller interrupted the agent).",
             kinds[str(CallEventKind.BARGE_IN)]),
            ("voice_agent_results_heard", "counter", "Late results heard in full in a call.",
             kinds[str(CallEventKind.RESULT_HEARD)]),
            ("voice_agent_results_cut", "counter", "Late results cut before the end.",
             kinds[str(CallEventKind.RESULT_CUT)]),
            ("voice_agent_results_offered", "counter", "Late results handed to a call here.",
             runtime.delivery.offered if runtime.delivery is not None else 0),
            ("voice_agent_sms_sends", "counter", "SMS create requests made by this process.",
             runtime.sms.sent if runtime.sms is not None else 0),
            ("voice_agent_streams_rejected", "counter",
             "Media streams refused for their token.", runtime.streams_rejected),
            ("voice_agent_event_queue_depth", "gauge", "Call events waiting to be written.",
             events.queue_depth),
            ("voice_agent_events_written", "counter", "Call events written.", events.written),
            ("voice_agent_events_dropped", "counter",
             "Call events that could not be written.", events.dropped),
        ]  # fmt: skip
        interconnect = runtime.openai_sip
        if interconnect is not None:
            samples += [
                ("voice_agent_openai_webhooks_bad_signature", "counter",
                 "OpenAI webhooks refused for their signature.", interconnect.bad_signatures),
                ("voice_agent_openai_webhooks_duplicate", "counter",
                 "OpenAI webhook deliveries seen before (answered 200, nothing done).",
                 interconnect.duplicates),
                ("voice_agent_openai_sip_accepted", "counter",
                 "OpenAI SIP interconnect calls accepted.", interconnect.accepted),
                ("voice_agent_openai_sip_rejected", "counter",
                 "OpenAI SIP interconnect calls rejected (busy, not ours, draining).",
                 sum(interconnect.rejected.values())),
            ]  # fmt: skip
        sip = runtime.sip
        if sip is not None:
            samples.append(
                ("voice_agent_sip_rtp_foreign_dropped", "counter",
                 "RTP packets dropped from sources the signalling did not name (strict RTP).",
                 sip.media_stats.foreign_packets)
            )  # fmt: skip
        for name, kind, help_text, value in samples:
            family: Metric = (
                CounterMetricFamily(name, help_text, value=value)
                if kind == "counter"
                else GaugeMetricFamily(name, help_text, value=value)
            )
            yield family
        by_leg = GaugeMetricFamily(
            "voice_agent_live_calls_by_leg", "Calls whose media stream runs here, by leg.",
            labels=["leg"],
        )  # fmt: skip
        for leg, count in sorted(registry.live_by_leg().items()):
            by_leg.add_metric([leg], count)
        yield by_leg


def render_metrics(runtime: Runtime) -> Response:
    """The exposition text of this process: its call counters, and the engine's and the
    audio path's measures (prometheus-client's registry: histograms, labels)."""
    own = CollectorRegistry(auto_describe=False)
    own.register(RuntimeCollector(runtime))
    body = generate_latest(own) + generate_latest(REGISTRY)
    return Response(body, media_type=EXPOSITION_TYPE)
