"""Traces of the engine's work (OpenTelemetry API: a no-op until a process configures an SDK).

A tool call is a span that follows the OpenTelemetry GenAI conventions (`execute_tool`); an
admitted operation carries its trace context on its ledger row (the `traceparent` in the data
of its first event), so the worker that runs it later, in another process, continues the same
trace, and the provider request it makes carries a W3C `traceparent` (the HTTP client's
instrumentation). Attributes hold ids, never a caller's number or a tool's arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

tracer = trace.get_tracer("voice_agent")
_PROPAGATOR = TraceContextTextMapPropagator()

# The design's correlation fields, as span attributes.
CALL_ID = "voice_agent.call_id"
TURN_ID = "voice_agent.turn_id"
OPERATION_ID = "voice_agent.operation_id"
IDEMPOTENCY_KEY = "voice_agent.idempotency_key"
AGENT = "voice_agent.agent"


DELIVERY_ID = "voice_agent.delivery_id"
SESSION_ID = "voice_agent.session_id"
ACK_ITEM_ID = "voice_agent.ack_item_id"


def recording() -> bool:
    """Whether this process exports spans (an SDK provider is set): work that only feeds a span
    (a lookup of a stored context) is skipped when it does not."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def carrier() -> dict[str, str]:
    """The current trace context as headers to store (`traceparent`); empty when none."""
    out: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        _PROPAGATOR.inject(out)
    return out


def context_from(data: Mapping[str, Any] | None) -> context.Context | None:
    """The trace context stored by `carrier` (None when there is none)."""
    if not data or not isinstance(data.get("traceparent"), str):
        return None
    return _PROPAGATOR.extract({"traceparent": data["traceparent"]})
