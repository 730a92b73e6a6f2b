"""OpenTelemetry for a process: off unless the standard `OTEL_*` variables say where to send.

`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns traces on;
`OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf`, the default, or `grpc`) picks the exporter;
`OTEL_SERVICE_NAME` names the process (default `voice-agent`); `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` keeps them off. Outgoing HTTP requests (the providers, Twilio's
REST API) carry the W3C `traceparent` through the HTTP client's own instrumentation.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger(__name__)


def tracing_requested(env: dict[str, str] | None = None) -> bool:
    """Whether the environment asks for traces to be exported."""
    env = dict(os.environ) if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _exporter() -> SpanExporter:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter()


def configure_tracing(default_service: str = "voice-agent") -> TracerProvider | None:
    """Export this process's spans when the environment asks for it; None when it does not.
    Call once per process (`serve`, `worker`), then `shutdown` the provider on the way out."""
    if not tracing_requested():
        return None
    name = os.environ.get("OTEL_SERVICE_NAME") or default_service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(_exporter()))
    trace.set_tracer_provider(provider)
    HTTPXClientInstrumentor().instrument()
    log.info("traces exported over OTLP (service.name %s)", name)
    return provider
