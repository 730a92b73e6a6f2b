"""The seam between a call and the tool layer. `telephony` defines it; `app` fills it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class CallContext:
    """Who is on the call, as the tool layer needs to know it."""

    call_id: str
    call_sid: str
    tenant_id: str
    from_number: str | None
    to_number: str | None


@dataclass(frozen=True, slots=True)
class FunctionCallRequest:
    """A completed function call from the model (never a cancelled response's arguments)."""

    call_id: str  # the provider's call_id of the function call
    name: str
    arguments: str  # raw JSON text as the model produced it
    item_id: str
    response_id: str
    turn_id: int


@dataclass(frozen=True, slots=True)
class ToolReply:
    """What goes back to the model as `function_call_output`."""

    output: dict[str, Any]
    # Whether a response should follow now (when the turn is still current and nothing is
    # active). A mutation's final outcome arrives later through `LiveCall.deliver_result`.
    wants_response: bool = True
    operation_id: str | None = None


@dataclass(frozen=True, slots=True)
class LateResult:
    """An outcome that arrived after the function call was answered."""

    operation_id: str
    text: str  # compact, speakable statement of the outcome
    data: dict[str, Any] = field(default_factory=dict)


class ToolGateway(Protocol):
    """What the bridge asks of the tool layer."""

    def definitions(self) -> list[dict[str, Any]]:
        """Realtime `function` tool definitions for session.update."""
        ...

    async def handle(self, ctx: CallContext, request: FunctionCallRequest) -> ToolReply:
        """Run a function call through policy; answer reads inline, mutations at once."""
        ...

    async def on_dtmf(self, ctx: CallContext, digit: str) -> None:
        """A keypad digit from the caller (PIN entry)."""
        ...

    async def on_call_end(self, ctx: CallContext) -> None:
        """The call is over; pending results must now go another way."""
        ...


class LiveCall(Protocol):
    """What the rest of the process may ask of a live call."""

    async def deliver_result(self, result: LateResult) -> bool:
        """Speak a late result at the next safe moment; False if the call cannot take it."""
        ...

    async def end(self, reason: str) -> None:
        """End the call from outside (status callback, shutdown)."""
        ...
