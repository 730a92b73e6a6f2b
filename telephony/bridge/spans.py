"""A call's turns and model responses as OpenTelemetry spans (no-ops until a process sets up an
SDK: see app/tracing.py).

The call's span (opened by the call session before the bridge) is the parent of one span per
caller turn (`turn N`, from the VAD's speech start to the next turn or the call's end); each
model response is a span under the turn it answers (`chat MODEL`, the GenAI conventions'
inference span: `gen_ai.operation.name` = `chat`, the response id, its status and usage), and
each tool call's `execute_tool` span (tools.gateway) is opened in its turn's context, so a trace
reads call -> turn -> response / tool call -> operation -> provider request -> delivery.
Attributes hold ids and counts, never what was said.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

tracer = trace.get_tracer("voice_agent.bridge")

# Responses whose response.done never came (a dropped session) are ended with the call; a
# misbehaving model cannot make this grow past a bound.
MAX_OPEN_RESPONSES = 64


class CallSpans:
    """The open turn span and response spans of one call."""

    __slots__ = ("_call_context", "_call_id", "_model", "_responses", "_turn", "_turn_id")

    def __init__(self, call_id: str, model: str) -> None:
        # The context current when the bridge is built: the call's span.
        self._call_context = otel_context.get_current()
        self._call_id = call_id
        self._model = model
        self._turn: trace.Span | None = None
        self._turn_id = 0
        self._responses: dict[str, trace.Span] = {}

    def turn(self, turn_id: int) -> None:
        """The caller's turn `turn_id` began (a new one ends the one before)."""
        if turn_id == self._turn_id and self._turn is not None:
            return
        self._end_turn()
        self._turn_id = turn_id
        self._turn = tracer.start_span(
            f"turn {turn_id}",
            context=self._call_context,
            attributes={"voice_agent.call_id": self._call_id, "voice_agent.turn_id": turn_id},
        )

    def context_of(self, turn_id: int | None) -> otel_context.Context:
        """Where a tool call of turn `turn_id` belongs: that turn's span while it is the open
        one, else the call's."""
        if self._turn is not None and turn_id == self._turn_id:
            return trace.set_span_in_context(self._turn, self._call_context)
        return self._call_context

    def response_created(self, response_id: str, turn_id: int | None, agent: str | None) -> None:
        if not response_id or response_id in self._responses:
            return
        if len(self._responses) >= MAX_OPEN_RESPONSES:
            oldest = next(iter(self._responses))
            self._responses.pop(oldest).end()
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": self._model,
            "gen_ai.response.id": response_id,
            "gen_ai.conversation.id": self._call_id,
            "voice_agent.call_id": self._call_id,
        }
        if turn_id is not None:
            attributes["voice_agent.turn_id"] = turn_id
        if agent:
            attributes["voice_agent.agent"] = agent
        self._responses[response_id] = tracer.start_span(
            f"chat {self._model}", context=self.context_of(turn_id), attributes=attributes
        )

    def response_done(self, response_id: str | None, status: str | None, usage: Any) -> None:
        span = self._responses.pop(response_id or "", None)
        if span is None:
            return
        if status:
            span.set_attribute("gen_ai.response.finish_reasons", [status])
        for ours, theirs in (
            ("gen_ai.usage.input_tokens", "input_tokens"),
            ("gen_ai.usage.output_tokens", "output_tokens"),
        ):
            value = getattr(usage, theirs, None)
            if isinstance(value, int):
                span.set_attribute(ours, value)
        span.end()

    def close(self) -> None:
        """The call ended: what is still open ends with it."""
        for span in self._responses.values():
            span.set_attribute("gen_ai.response.finish_reasons", ["call_ended"])
            span.end()
        self._responses.clear()
        self._end_turn()

    def _end_turn(self) -> None:
        if self._turn is not None:
            self._turn.end()
            self._turn = None
