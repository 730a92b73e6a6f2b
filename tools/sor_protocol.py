"""The wire protocol between the service and the system of record (SOR).

Both sides import it: the demo SOR (`tools.sor`) produces these messages, the client
(`tools.sor_client`) and the callback route consume them.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import date as Date
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

IDEMPOTENCY_HEADER = "Idempotency-Key"
CALLBACK_URL_HEADER = "X-Callback-Url"
SIGNATURE_HEADER = "X-Signature"
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


class CallbackReport(BaseModel):
    """What the SOR POSTs to a callback URL when an asynchronous request completes."""

    idempotency_key: str
    status: Literal["committed", "failed", "pending"]
    # Per-key, increasing: lets the receiver ignore reports older than one it applied.
    sequence: int = Field(ge=0)
    booking: Booking | None = None
    error: str | None = None


def sign(secret: str | bytes, body: bytes) -> str:
    """The X-Signature header value for `body`: `sha256=<hex HMAC>`."""
    key = secret.encode() if isinstance(secret, str) else secret
    return "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()


def verify(secret: str | bytes, body: bytes, header: str | None) -> bool:
    """Whether `header` is a valid signature of `body` (constant-time compare)."""
    if not header:
        return False
    # Bytes, not str: compare_digest raises TypeError for a non-ASCII str, and the header is
    # whatever the sender put there (a 500 instead of a clean 403).
    return hmac.compare_digest(
        sign(secret, body).encode(), header.strip().encode("utf-8", "surrogatepass")
    )
