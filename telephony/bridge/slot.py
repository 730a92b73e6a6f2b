"""The model's response slot on one connection, and the response request that fills it.

At most one response may be active on a model connection. The slot is per connection (a
reconnect starts with an empty one); what is waiting for it lives in the utterance handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from telephony.errors import TelephonyError
from telephony.tool_gateway import LateResult


class IllegalTransition(TelephonyError):
    """A bridge state change that the state machine does not allow."""


class ResponseState(StrEnum):
    """The model's response slot: at most one response may be active."""

    IDLE = "idle"
    REQUESTED = "requested"  # we sent response.create, response.created not yet seen
    ACTIVE = "active"


# We may only ask for a response from IDLE; the server's own facts (created, done) always apply.
_RESPONSE_TRANSITIONS: dict[ResponseState, frozenset[ResponseState]] = {
    ResponseState.IDLE: frozenset({ResponseState.REQUESTED, ResponseState.ACTIVE}),
    ResponseState.REQUESTED: frozenset({ResponseState.ACTIVE, ResponseState.IDLE}),
    ResponseState.ACTIVE: frozenset({ResponseState.ACTIVE, ResponseState.IDLE}),
}


@dataclass(slots=True)
class CreateRequest:
    """A response.create waiting for a safe moment."""

    reason: str
    turn_id: int | None = None  # None: valid whatever the caller said since
    operation_ids: tuple[str, ...] = ()
    instructions: str | None = None
    late: tuple[LateResult, ...] = ()  # the late results this response announces


@dataclass(slots=True)
class ResponseSlot:
    """One connection's response slot: its state, the active response, our pending request."""

    state: ResponseState = ResponseState.IDLE
    active_response_id: str | None = None
    requested: CreateRequest | None = None
    requested_event_id: str | None = None

    def move(self, new: ResponseState) -> None:
        """Apply a response-slot transition; asking while a response is active is refused."""
        if new not in _RESPONSE_TRANSITIONS[self.state]:
            raise IllegalTransition(f"response slot cannot go from {self.state} to {new}")
        self.state = new

    def forget_request(self) -> None:
        self.requested = None
        self.requested_event_id = None
