"""The wire protocol between the service and the system of record (SOR).

Both sides import it: the demo SOR (`tools.restaurant.sor`) produces these messages, the client
(`tools.restaurant.client`) and the callback route consume them.
"""

from __future__ import annotations

from datetime import date as Date
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

IDEMPOTENCY_HEADER = "Idempotency-Key"
CALLBACK_URL_HEADER = "X-Callback-Url"
REPLAYED_HEADER = "Idempotent-Replayed"


class BookingRequest(BaseModel):
    """Body of POST /bookings."""

    model_config = ConfigDict(extra="forbid")

    date: Date
    time: str = Field(pattern=r"^([01]\d|2[0-3]):[0-5]\d$")
    party_size: int = Field(ge=1, le=50)
    name: str = Field(min_length=1, max_length=120)


class Booking(BaseModel):
    """A booking as the SOR reports it."""

    id: str
    date: Date
    time: str
    party_size: int
    name: str
    status: Literal["confirmed", "cancelled"]


class Availability(BaseModel):
    """Answer of GET /availability."""

    date: Date
    time: str
    party_size: int
    available: bool
    seats_left: int


class ErrorBody(BaseModel):
    """Every non-2xx answer of the SOR. `code` tells conflicts apart from work in flight."""

    code: Literal[
        "idempotency_conflict",
        "in_progress",
        "injected_failure",
        "not_found",
        "no_availability",
        "missing_idempotency_key",
        "invalid",
    ]
    message: str = ""


class PendingBody(BaseModel):
    """A 202 answer: the SOR accepted the request and will report the outcome later."""

    status: Literal["pending"] = "pending"
    idempotency_key: str


class KeyStatus(BaseModel):
    """Answer of GET /idempotency/{key}: what happened to the request sent with key K.

    `completed`: the SOR answered it for good (`status_code` 2xx with `result`, or 4xx with
    `error`); `in_progress`: accepted and not finished (it may still apply); `not_found`:
    never applied and not in flight, so sending it again cannot double anything.
    """

    key: str
    state: Literal["completed", "in_progress", "not_found"]
    status_code: int | None = None
    result: Booking | None = None
    error: ErrorBody | None = None
