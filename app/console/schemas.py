"""Request parameters and response bodies of the console's JSON API (its OpenAPI schema).

Query parameters are models that forbid unknown fields, so a typo or a parameter this API does
not have (`offset`: pages are keyset) is a 422 naming it, never silently ignored.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from app.access.staff import Role
from app.calls.query import Cursor, phone_digits
from app.calls.store import CallStatus
from app.ops.operation_actions import ManualOutcome
from app.ops.operation_query import ConsoleState, OpCursor
from tools.states import OperationStatus

MAX_LIMIT = 200


def _utc(value: datetime | None) -> datetime | None:
    """A time without a zone is read as UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


UtcDatetime = Annotated[datetime, AfterValidator(_utc)]
Leg = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,15}$")]


class _Query(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CallListQuery(_Query):
    """Filters and page of `GET /api/calls`."""

    phone: str | None = Field(
        None,
        max_length=32,
        pattern=r"^[0-9+()\-.\s]*$",
        description="Digits of a phone number; matches calls whose from or to number ends "
        "with them (`0000`, `5551230000`, `+1 555 123 0000`). Viewers (numbers masked) search "
        "by a full number with its country code only, matched whole. Distinct numbers searched "
        "are rate-limited per staff member or token (CALL_SEARCH_MAX_NUMBERS).",
    )
    since: UtcDatetime | None = Field(None, description="Calls created at or after (ISO 8601).")
    until: UtcDatetime | None = Field(None, description="Calls created before (ISO 8601).")
    status: list[CallStatus] = Field(default_factory=list, description="Any of these statuses.")
    leg: list[Leg] = Field(default_factory=list, description="Any of these legs (twilio, sip…).")
    unsettled: bool = Field(False, description="Only calls with operations not settled yet.")
    limit: int = Field(50, ge=1, le=MAX_LIMIT)
    cursor: str | None = Field(None, max_length=200, description="`next_cursor` of a page.")

    @field_validator("phone")
    @classmethod
    def _digits(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        digits = phone_digits(value)
        if not digits:
            raise ValueError("a phone search needs at least one digit")
        return digits

    @field_validator("cursor")
    @classmethod
    def _cursor(cls, value: str | None) -> str | None:
        if value:
            Cursor.decode(value)  # raises ValueError for a cursor we did not make
        return value or None


class OperationListQuery(_Query):
    """Filters and page of `GET /api/operations`."""

    state: list[ConsoleState] = Field(
        default_factory=list,
        description="Console states (awaiting_person, unknown, stuck, in_flight, "
        "awaiting_caller, settled); default: all, open ones first.",
    )
    status: list[OperationStatus] = Field(default_factory=list)
    tool: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    call_id: uuid.UUID | None = None
    limit: int = Field(50, ge=1, le=MAX_LIMIT)
    cursor: str | None = Field(None, max_length=300)

    @field_validator("cursor")
    @classmethod
    def _cursor(cls, value: str | None) -> str | None:
        if value:
            OpCursor.decode(value)
        return value or None


class NoQuery(_Query):
    """A route without query parameters."""


# --- responses ---------------------------------------------------------------------------


class Problem(BaseModel):
    """An error: what went wrong, in a sentence (422s list each bad parameter instead)."""

    detail: str


class CallOut(BaseModel):
    id: str
    call_sid: str
    tenant_id: str
    leg: str
    direction: str
    from_: str | None = Field(None, alias="from")
    to: str | None
    status: str
    stream_sid: str | None
    end_reason: str | None
    created_at: str | None
    answered_at: str | None
    ended_at: str | None
    trace_id: str | None = Field(
        None, description="The call's OpenTelemetry trace id, when traces are exported."
    )

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


class CallListItem(CallOut):
    operations: int = Field(description="Operations the call asked for.")
    unsettled: int = Field(description="Of those, not settled yet.")


class CallList(BaseModel):
    calls: list[CallListItem]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null at the end."
    )
    limit: int


class TimelineEntry(BaseModel):
    source: Literal["call", "tool_call", "operation", "delivery"]
    seq: int | None
    kind: str
    at: str
    t_ms: float = Field(description="Milliseconds since the call's first event.")
    data: dict[str, Any]


class OperationSummary(BaseModel):
    operation_id: str
    tool: str
    status: str
    arguments: dict[str, Any]
    attempts: int
    reference: str | None
    error: str | None
    compensates_operation_id: str | None
    created_at: str | None
    committed_at: str | None
    finished_at: str | None


class RecordingOut(BaseModel):
    url: str
    content_type: str
    bytes: int
    duration_ms: int
    channels: int = Field(description="2: caller on the left, agent on the right.")
    sample_rate: int
    started_at: str
    truncated: bool
    offset_ms: float | None = Field(description="Where the recording starts on the timeline.")


class DeliverySummary(BaseModel):
    """How one outcome reached the caller: its channel, state, offers, cuts and SMS."""

    id: str
    operation_id: str
    tool: str
    outcome: str
    state: str
    channel: str
    offers: int
    cuts: int
    response_id: str | None
    reason: str | None
    heard_at: str | None
    finished_at: str | None
    sms: list[dict[str, Any]]


class Timeline(BaseModel):
    call: CallOut
    events: list[TimelineEntry]
    operations: list[OperationSummary]
    deliveries: list[DeliverySummary] = Field(default_factory=list)
    recording: RecordingOut | None


class OperationOut(BaseModel):
    operation_id: str
    tenant_id: str
    idempotency_key: str
    call_id: str | None
    turn_id: int | None
    caller: str | None
    tool: str
    args: dict[str, Any]
    status: OperationStatus
    console_state: ConsoleState | None = None
    cancel_requested: bool
    attempts: int
    deadline: str | None
    expires_at: str | None
    next_attempt_at: str | None
    result: dict[str, Any] | None
    error: str | None
    provider_ref: str | None
    compensates_operation_id: str | None
    readback: str | None
    created_at: str | None
    updated_at: str | None
    committed_at: str | None
    finished_at: str | None


class OperationEventOut(BaseModel):
    id: int
    at: str | None
    kind: str
    from_status: str | None
    to_status: str | None
    actor: str
    reason: str | None
    data: dict[str, Any]


class ToolCallOut(BaseModel):
    id: int
    call_id: str
    provider_call_id: str
    turn_id: int | None
    response_id: str | None
    tool: str
    decision: str
    reason: str | None
    arguments: dict[str, Any] | None
    created_at: str | None


class ActionAvailability(BaseModel):
    allowed: bool
    why: str


class SmsOut(BaseModel):
    delivery_id: str
    state: str
    to: str | None
    resendable: bool
    why_not: str | None


class OperationDetailOut(BaseModel):
    operation: OperationOut
    events: list[OperationEventOut]
    tool_calls: list[ToolCallOut] = Field(description="The model's function calls that map here.")
    compensations: list[OperationOut]
    compensates: OperationOut | None
    actions: dict[str, ActionAvailability] = Field(
        description="What may be done now: reconcile, retry, record_outcome, compensate, "
        "resend_sms (each with why or why not)."
    )
    sms: SmsOut | None


class OperationList(BaseModel):
    operations: list[OperationOut]
    counts: dict[str, int] = Field(description="Operations per console state.")
    next_cursor: str | None
    limit: int


class ActionBody(BaseModel):
    """Why (recorded in the operation's history with who asked)."""

    model_config = ConfigDict(extra="forbid")

    why: str = Field(min_length=1, max_length=500)


class RecordOutcomeBody(ActionBody):
    outcome: ManualOutcome = Field(description="committed (it happened) or failed_final.")
    reference: str | None = Field(
        None, max_length=200, description="The system of record's reference, if it happened."
    )


class TransferBody(ActionBody):
    target: str = Field(
        min_length=1,
        max_length=256,
        description="Where to: an E.164 number (`+15551234567`), `tel:+…`, or a `sip:` URI.",
    )


class OutboundCallBody(BaseModel):
    """An outbound call to place (checked by the handler: a bad field is a 400 naming it)."""

    model_config = ConfigDict(extra="forbid")

    to: str = Field("", max_length=64, description="The number to call, E.164 (`+15551234567`).")
    purpose: str = Field(
        "",
        max_length=2000,
        description="What the call is for, in a few words: the agent says it first to a "
        "person, and it is all a voicemail message says.",
    )
    operation_id: str | None = Field(
        None,
        max_length=64,
        description="An operation the call is about: a person who answers hears where it stands.",
    )


class OutboundCallCreated(BaseModel):
    call_id: str
    operation_id: str = Field(description="The operation that places the call.")


class CallActionResult(BaseModel):
    message: str
    call_id: str


class ActionResult(BaseModel):
    message: str
    status: str = Field(description="The operation's status afterwards.")
    new_operation_id: str | None = Field(None, description="A compensation's operation.")


class WhoAmI(BaseModel):
    name: str
    role: Role
    kind: Literal["session", "token", "basic"]


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    role: Role = Role.VIEWER


class TokenOut(BaseModel):
    id: int
    name: str
    prefix: str
    role: Role
    created_by: str | None
    created_at: str | None
    last_used_at: str | None
    revoked_at: str | None


class TokenCreated(TokenOut):
    token: str = Field(description="The secret: shown this once, stored only as a hash.")


class TokenList(BaseModel):
    tokens: list[TokenOut]


class StaffOut(BaseModel):
    username: str
    role: Role
    created_at: str | None
    last_login_at: str | None
    disabled: bool


class StaffList(BaseModel):
    staff: list[StaffOut]
